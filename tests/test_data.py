"""Cleaning, binarizing, token batching and the teacher-forcing shift."""

import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from s2s.config import load_config
from s2s.data import DROP_REASONS, Batch, DigestSet, NpyAppender, clean_pairs, prepare, read_parallel, token_batches
from s2s.errors import S2SError
from s2s.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer


def test_batch_shift_happens_once():
    b = Batch.from_ids([[10, 11, EOS_ID], [12, EOS_ID]], [[20, 21, 22, EOS_ID], [23, EOS_ID]])
    # decoder input (<s>, y_1..y_{m-1}), targets (y_1..y_m)
    assert b.tgt_in.tolist() == [[BOS_ID, 20, 21, 22], [BOS_ID, 23, PAD_ID, PAD_ID]]
    assert b.tgt_out.tolist() == [[20, 21, 22, EOS_ID], [23, EOS_ID, PAD_ID, PAD_ID]]
    assert b.src.tolist() == [[10, 11, EOS_ID], [12, EOS_ID, PAD_ID]]
    assert b.n_tgt_tokens == 6 and b.n_src_tokens == 5


def test_clean_pairs_reasons():
    pairs = [("a", "b"), ("", "x"), ("long", "y"), ("r", "s"), ("a", "b"), ("ok", "fine")]
    src = [[1], [], [1] * 10, [1], [1], [1, 2]]
    tgt = [[1], [1], [1], [1] * 5, [1], [1, 2, 3]]
    keep, stats = clean_pairs(pairs, src, tgt, max_len=8, max_ratio=3.0, dedupe=True)
    assert keep == [0, 5]
    assert stats.read == 6 and stats.kept == 2
    assert dict(stats.dropped) == {"empty": 1, "too_long": 1, "length_ratio": 1, "duplicate": 1}


def test_mismatched_line_counts_name_both_files(tmp_path):
    a, b = tmp_path / "x.en", tmp_path / "x.de"
    a.write_text("1\n2\n3\n")
    b.write_text("1\n2\n")
    with pytest.raises(S2SError, match=r"x.en has 3 lines but .*x.de has 2"):
        list(read_parallel(a, b))


def test_invalid_utf8_names_line(tmp_path):
    a, b = tmp_path / "x.en", tmp_path / "x.de"
    a.write_bytes(b"fine\n\xff\xfebad\n")
    b.write_text("1\n2\n")
    with pytest.raises(S2SError, match=r"x.en:2: invalid UTF-8"):
        list(read_parallel(a, b))


def test_token_batches_cover_every_pair_once_within_budget():
    rng = np.random.default_rng(0)
    src = rng.integers(1, 60, size=500)
    tgt = rng.integers(1, 60, size=500)
    batches = token_batches(src, tgt, 256, np.random.default_rng(1))
    flat = np.concatenate(batches)
    assert sorted(flat.tolist()) == list(range(500))
    for b in batches:
        assert len(b) * max(src[b].max(), tgt[b].max()) <= 256 or len(b) == 1
    # similar lengths: padding is small compared with a random batching
    pad = sum(len(b) * src[b].max() - src[b].sum() for b in batches)
    assert pad < 0.2 * src.sum()


def test_token_batches_deterministic_per_seed():
    src = np.arange(1, 101)
    tgt = np.arange(100, 0, -1)
    one = token_batches(src, tgt, 300, np.random.default_rng([1, 0]))
    two = token_batches(src, tgt, 300, np.random.default_rng([1, 0]))
    assert all((x == y).all() for x, y in zip(one, two))


# --------------------------------------------------------------------------- #
# Streaming prepare: the same files as a straightforward in-memory version
# --------------------------------------------------------------------------- #

def test_digest_set_marks_first_occurrences_like_a_python_set():
    rng = np.random.default_rng(0)
    seen, reference = DigestSet(), set()
    for _ in range(40):  # many chunks: runs get merged along the way
        keys = rng.integers(0, 300, size=int(rng.integers(0, 30))).astype(np.uint64)
        expected = []
        for k in keys.tolist():
            expected.append(k not in reference)
            reference.add(k)
        assert seen.add_new(keys).tolist() == expected
    assert len(seen) == len(reference)
    assert len(seen.runs) <= 1 + int(np.log2(len(reference)))


@pytest.mark.parametrize("values", [np.zeros(0, np.uint16), np.arange(70000, dtype=np.int64) ** 2,
                                    np.array([5, 1, 65535], np.uint16)], ids=["empty", "int64", "uint16"])
def test_npy_appender_writes_what_np_save_writes(tmp_path, values):
    with open(tmp_path / "a.npy", "wb") as f:
        w = NpyAppender(f, values.dtype)
        for piece in np.array_split(values, 3):
            w.append(piece)
        w.finish()
    np.save(tmp_path / "b.npy", values)
    assert (tmp_path / "a.npy").read_bytes() == (tmp_path / "b.npy").read_bytes()


def reference_prepare(cfg, out: Path) -> dict:
    """Today's algorithm written the plain way: whole corpus in lists, a set of pairs."""
    tok = Tokenizer.load(cfg.data.dir, cfg.tokenizer, cfg.data)
    stats = {}
    for split in ("train", "dev"):
        prefix = getattr(cfg.data, split)
        src = [s.strip() for s in Path(f"{prefix}.en").read_text(encoding="utf-8").splitlines()]
        tgt = [t.strip() for t in Path(f"{prefix}.de").read_text(encoding="utf-8").splitlines()]
        xs, ys = tok.encode_src(src), tok.encode_tgt(tgt)
        keep, dropped, seen = [], Counter(), set()
        for i, (s, t, x, y) in enumerate(zip(src, tgt, xs, ys)):
            longest = max(len(x), len(y))
            if not s or not t:
                dropped["empty"] += 1
            elif split == "train" and longest > cfg.data.max_tokens_per_sentence:
                dropped["too_long"] += 1
            elif split == "train" and longest / min(len(x), len(y)) > cfg.data.max_length_ratio:
                dropped["length_ratio"] += 1
            elif split == "train" and (s, t) in seen:
                dropped["duplicate"] += 1
            else:
                seen.add((s, t))
                keep.append(i)
        for side, lines, ids in (("src", src, xs), ("tgt", tgt, ys)):
            kept = [ids[i] for i in keep]
            np.save(out / f"{split}.{side}.ids.npy", np.array([v for s in kept for v in s], np.uint16))
            np.save(out / f"{split}.{side}.idx.npy", np.cumsum([0] + [len(s) for s in kept]))
            (out / f"{split}.{side}.txt").write_text("".join(lines[i] + "\n" for i in keep), encoding="utf-8")
        stats[split] = (len(src), len(keep), dict(dropped))
    return stats


def test_prepare_streams_the_same_files_for_any_worker_count(prepared, tmp_path, monkeypatch):
    """Chunks of 7 pairs (duplicates across chunks), 1 and 2 workers, and the reference:
    the same bytes in every file and the same counts."""
    import s2s.data

    corpus = Path(prepared).parent
    lines = {lang: (corpus / f"train.{lang}").read_text(encoding="utf-8").splitlines()[:120]
             for lang in ("en", "de")}
    extra = {"en": ["", "  padded  ", "x", "word " * 200, *lines["en"][:30]],
             "de": ["leer", "padded", "ein sehr langer satz mit vielen woertern", "y", *lines["de"][:30]]}
    for lang in ("en", "de"):
        (tmp_path / f"train.{lang}").write_text("\n".join(lines[lang] + extra[lang]) + "\n", encoding="utf-8")
        shutil.copy(corpus / f"dev.{lang}", tmp_path / f"dev.{lang}")
    monkeypatch.setattr(s2s.data, "CHUNK_PAIRS", 7)
    outs = {}
    for name in ("reference", "j1", "j2"):
        out = tmp_path / name
        shutil.copytree(corpus / "prep", out, ignore=shutil.ignore_patterns("*.npy", "*.txt", "meta.json"))
        cfg = load_config(prepared, [f"data.train={tmp_path}/train", f"data.dev={tmp_path}/dev",
                                     f"data.dir={out}", "data.max_tokens_per_sentence=40"])
        if name == "reference":
            counts = reference_prepare(cfg, out)
        else:
            stats = prepare(cfg, workers=int(name[1:]))
            assert {s: (st.read, st.kept, dict(st.dropped)) for s, st in stats.items()} == counts
            assert (out / "meta.json").is_file()
        outs[name] = out
    assert counts["train"][0] == 154 and set(counts["train"][2]) == set(DROP_REASONS)
    files = sorted(p.name for p in outs["reference"].glob("*.*") if p.suffix in (".npy", ".txt"))
    assert len(files) == 12
    for name in ("j1", "j2"):
        for f in files:
            assert (outs[name] / f).read_bytes() == (outs["reference"] / f).read_bytes(), (name, f)
        assert not [p for p in outs[name].iterdir() if ".tmp-" in p.name]


def test_token_batches_cut_as_the_plain_greedy_loop():
    """The vectorized cut gives exactly the batches of the one-pair-at-a-time greedy loop."""
    rng = np.random.default_rng(3)
    src = rng.integers(1, 300, size=3000)
    tgt = rng.integers(1, 300, size=3000)
    for max_tokens in (1, 100, 2000, 50_000):
        order = np.arange(3000)[np.lexsort((tgt, src))]
        expected, start, longest = [], 0, 0
        for pos, i in enumerate(order):
            width = max(int(src[i]), int(tgt[i]))
            if pos > start and max(longest, width) * (pos - start + 1) > max_tokens:
                expected.append(order[start:pos].tolist())
                start, longest = pos, 0
            longest = max(longest, width)
        expected.append(order[start:].tolist())
        assert [b.tolist() for b in token_batches(src, tgt, max_tokens)] == expected


def test_prepare_on_a_full_disk_names_the_file_and_leaves_nothing(prepared, tmp_path, monkeypatch):
    import errno
    import os

    import s2s.textio

    corpus = Path(prepared).parent
    out = tmp_path / "prep"
    shutil.copytree(corpus / "prep", out, ignore=shutil.ignore_patterns("*.npy", "*.txt", "meta.json"))
    cfg = load_config(prepared, [f"data.dir={out}"])

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(s2s.textio.os, "fsync", full)
    with pytest.raises(S2SError, match=rf"^{out}/train\.\w+\.\w+(\.npy)?: write failed \(No space left on device\)$"):
        prepare(cfg, workers=1)
    assert sorted(p.name for p in out.iterdir()) == ["spm.model", "tokenizer.json"]


def test_prepare_cuts_sources_to_max_src_tokens(prepared, tmp_path):
    from s2s.data import BinDataset

    corpus = Path(prepared).parent
    out = tmp_path / "prep"
    shutil.copytree(corpus / "prep", out, ignore=shutil.ignore_patterns("*.npy", "*.txt", "meta.json"))
    cfg = load_config(prepared, [f"data.dir={out}", "data.max_src_tokens=5"])
    tok = Tokenizer.load(out, cfg.tokenizer, cfg.data)
    prepare(cfg, workers=2)
    data = BinDataset(out, "train")
    lines = (out / "train.src.txt").read_text(encoding="utf-8").splitlines()
    for i in (0, 7, len(data) - 1):
        full = tok.encode_src([lines[i]])[0]
        assert data.pair(i)[0].tolist() == (full if len(full) <= 5 else full[:4] + full[-1:])
    assert data.src_lens.max() == 5


@pytest.mark.parametrize("high", [300, 70_000], ids=["16-bit", "wider"])
def test_sort_by_lengths_is_lexsort(high):
    from s2s.data import sort_by_lengths

    rng = np.random.default_rng(5)
    src, tgt = rng.integers(1, high, size=5000), rng.integers(1, 40, size=5000)
    order = rng.permutation(5000)
    expected = order[np.lexsort((tgt[order], src[order]))]
    assert (sort_by_lengths(order, src, tgt) == expected).all()


def _stop_signal_dispositions(_: int) -> tuple:
    import signal

    return signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP)


def test_encoding_workers_die_on_sigterm_under_the_cli_handler(prepared):
    """The CLI turns SIGTERM into an exception and then ignores further ones; prepare's pool
    workers, forked inside it, must keep the default action, or Pool.terminate() (after a bad
    corpus line) waits forever for a worker that survived its SIGTERM."""
    import signal

    from s2s.cli import _signals_raise_terminated
    from s2s.data import _encoding_pool

    cfg = load_config(prepared)
    with _signals_raise_terminated():
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        with _encoding_pool(2, Path(cfg.data.dir), cfg) as pool:
            assert set(pool.map(_stop_signal_dispositions, range(4))) == {(signal.SIG_DFL, signal.SIG_DFL)}
        assert signal.pthread_sigmask(signal.SIG_BLOCK, set()) & {signal.SIGTERM, signal.SIGHUP} == set()


def test_prepare_after_cuda_starts_its_workers_from_a_forkserver(prepared, tmp_path, monkeypatch):
    """A process that has used CUDA cannot be forked safely: prepare's workers then start from a
    forkserver, and write what one process writes."""
    import multiprocessing

    import torch

    corpus = Path(prepared).parent
    outs = {}
    starts, real_context = [], multiprocessing.get_context
    monkeypatch.setattr(multiprocessing, "get_context", lambda how=None: starts.append(how) or real_context(how))
    for name, cuda in (("one", False), ("forkserver", True)):
        out = outs[name] = tmp_path / name
        shutil.copytree(corpus / "prep", out, ignore=shutil.ignore_patterns("*.npy", "*.txt", "meta.json"))
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda cuda=cuda: cuda)
        prepare(load_config(prepared, [f"data.dir={out}"]), workers=1 if name == "one" else 2)
    assert starts == ["forkserver"]
    files = sorted(p.name for p in outs["one"].iterdir() if p.suffix in (".npy", ".txt"))
    assert files and all((outs["one"] / f).read_bytes() == (outs["forkserver"] / f).read_bytes() for f in files)
