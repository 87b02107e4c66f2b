"""translate --workers (s2s.workers), --device, and a start-up that imports no torch."""

import io
import os
import signal
import subprocess
import sys
from multiprocessing import active_children

import pytest

from s2s.config import ModelConfig
from s2s.errors import S2SError
from s2s.params import parameter_count
from s2s.workers import (
    CHUNKS_HELD,
    TASKS_PER_CHUNK,
    TranslatorPool,
    TranslatorSpec,
    auto_workers,
    sorted_batches,
    task_planner,
    threads_per_worker,
    translate_stream,
)
from tests.conftest import untrained_model_dir


@pytest.fixture(scope="module")
def model_dir(prepared, tmp_path_factory):
    """An untrained model directory of the tiny config (its outputs: whatever the random weights say)."""
    return untrained_model_dir(prepared, tmp_path_factory.mktemp("workers") / "model")


HOSTILE = [b"Clipboard management", b"", b"   ", b"a\x00b NUL bytes", b"x " * 1500, b"\xff\xfe broken",
           "émoji 🙂 and עברית".encode(), b"port scanner for discovering services", b"", b"last one"]


def decoded(errors="replace"):
    return [line.decode("utf-8", errors=errors) for line in HOSTILE]


def run_stream(spec, lines, workers, chunk_lines=3):
    out = io.StringIO()
    used = translate_stream(spec, lines, out, workers=workers, chunk_lines=chunk_lines)
    return out.getvalue(), used


def same_rows(got: str, want: str) -> bool:
    """The same output rows, except that an n-best row's score (`LINE ||| TEXT ||| SCORE ...`) may
    differ in its last printed digit: a sentence's batch (which differs between one process and
    the workers' tasks) changes the order of floating-point sums, not the translation."""
    got_rows, want_rows = got.split("\n"), want.split("\n")
    if len(got_rows) != len(want_rows):
        return False
    for g, w in zip(got_rows, want_rows):
        g_f, w_f = g.split(" ||| "), w.split(" ||| ")
        if len(g_f) < 3 or len(g_f) != len(w_f):
            if g != w:
                return False
        elif g_f[:2] != w_f[:2] or g_f[3:] != w_f[3:] or abs(float(g_f[2]) - float(w_f[2])) > 2e-4:
            return False
    return True


@pytest.mark.parametrize("settings", [{}, {"overrides": {"nbest": 2, "beam": 2}, "alignments": True,
                                           "nbest_rows": True}])
def test_two_workers_write_what_one_process_writes(model_dir, settings):
    """Chunks of 3 lines over 2 workers: the same text, line for line, as one process."""
    spec = TranslatorSpec((str(model_dir),), device="cpu", threads=1, **settings)
    lines = decoded() * 2  # 20 lines, 7 chunks
    one, used_one = run_stream(spec, lines, workers=1)
    two, used_two = run_stream(spec, lines, workers=2)
    assert (used_one, used_two) == (1, 2)
    assert same_rows(two, one)
    if not settings:
        assert two.count("\n") == len(lines)
        rows = two.split("\n")
        assert rows[1] == rows[2] == ""  # empty and blank lines give empty lines
    else:
        numbers = {int(row.split(" ||| ")[0]) for row in two.splitlines()}
        assert numbers == set(range(len(lines)))  # n-best rows numbered across chunks
        assert all(row.count(" ||| ") == 3 for row in two.splitlines())  # ... with alignments


def test_two_workers_read_at_most_two_chunks_ahead_of_the_output(model_dir):
    """Memory stays bounded: when a chunk is written, at most CHUNKS_HELD chunks have been read past
    the lines written before it (the reading waits for the writing, however long the input)."""
    spec = TranslatorSpec((str(model_dir),), device="cpu", threads=1)
    read, ahead, written = [0], [], [0]

    def lines():
        for i in range(60):
            read[0] += 1
            yield f"line {i} " + "word " * (i % 7)

    def on_chunk(n_lines):
        ahead.append(read[0] - written[0])
        written[0] += n_lines

    out = io.StringIO()
    translate_stream(spec, lines(), out, workers=2, chunk_lines=5, on_chunk=on_chunk)
    assert out.getvalue().count("\n") == 60 and written[0] == 60 and len(ahead) == 12
    assert max(ahead) <= CHUNKS_HELD * 5


def test_a_bad_line_stops_after_the_chunks_before_it(model_dir, tmp_path):
    """--errors strict: the chunks before the bad line are written, then the error with file:line."""
    from s2s.textio import read_lines

    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\n".join([b"one", b"two", b"three", b"four", b"\xff five", b"six"]) + b"\n")
    spec = TranslatorSpec((str(model_dir),), device="cpu", threads=1)
    outs = []
    for workers in (1, 2):
        out = io.StringIO()
        with pytest.raises(S2SError, match=rf"{bad}:5: invalid UTF-8"):
            translate_stream(spec, read_lines(bad), out, workers=workers, chunk_lines=2)
        outs.append(out.getvalue())
    assert outs[1].count("\n") == 4  # lines 1-4: the two chunks before the one with line 5
    assert outs[0] == ""  # one process reads its first chunk (1000 lines) before translating any


def test_a_pool_translates_many_inputs_with_the_models_loaded_once(model_dir):
    """TranslatorPool: wait_ready, then two inputs, each the text translate_stream writes; the
    same workers (pids) translate both; closed, it refuses to translate."""
    spec = TranslatorSpec((str(model_dir),), device="cpu", threads=1)
    lines = decoded()
    want, _ = run_stream(spec, lines, workers=2)
    with TranslatorPool(spec, workers=2) as pool:
        pool.wait_ready()
        pids = [p.pid for p in pool._procs]
        outs = [io.StringIO(), io.StringIO()]
        pool.translate(lines, outs[0], chunk_lines=3)
        pool.translate(iter(lines[::-1]), outs[1], chunk_lines=4)
        assert [p.pid for p in pool._procs] == pids and all(p.is_alive() for p in pool._procs)
    assert outs[0].getvalue() == want
    assert outs[1].getvalue().split("\n")[:-1] == want.split("\n")[:-1][::-1]
    assert not any(p.is_alive() for p in pool._procs)
    with pytest.raises(S2SError, match="stopped"):
        pool.translate(["one more"], io.StringIO())


def test_a_pool_stops_after_a_bad_line(model_dir, tmp_path):
    """A bad line: the chunks before it are written, the error names file:line, the workers are
    ended and the pool refuses to go on; a pool of no workers is refused."""
    from s2s.textio import read_lines

    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"one\ntwo\n\xff three\nfour\n")
    spec = TranslatorSpec((str(model_dir),), device="cpu", threads=1)
    out = io.StringIO()
    with TranslatorPool(spec, workers=2) as pool:
        with pytest.raises(S2SError, match=rf"{bad}:3: invalid UTF-8"):
            pool.translate(read_lines(bad), out, chunk_lines=2)
        assert not any(p.is_alive() for p in pool._procs)  # at once, though the caller goes on
        with pytest.raises(S2SError, match="stopped"):
            pool.translate(["again"], io.StringIO())
    assert out.getvalue().count("\n") == 2
    with pytest.raises(S2SError, match="at least one worker"):
        TranslatorPool(spec, workers=0)


def test_a_pool_raises_a_workers_error_and_ends_at_an_error_of_the_caller(model_dir):
    """wait_ready raises what a worker's start raised (a bad decode key) and ends the workers;
    an exception inside the with block ends them at once."""
    bad = TranslatorSpec((str(model_dir),), device="cpu", threads=1, overrides={"beam": 0})
    with TranslatorPool(bad, workers=2) as pool:
        with pytest.raises(S2SError, match="beam"):
            pool.wait_ready()
        assert not any(p.is_alive() for p in pool._procs)
    spec = TranslatorSpec((str(model_dir),), device="cpu", threads=1)
    with pytest.raises(KeyError):
        with TranslatorPool(spec, workers=2) as pool:
            pool.wait_ready()
            raise KeyError("the caller's own error")
    assert not any(p.is_alive() for p in pool._procs)


@pytest.mark.slow  # under heavy load it once ran past 3 minutes in a fresh clone (a SIGKILL mid-queue-write?)
def test_a_dead_worker_is_one_error(model_dir):
    spec = TranslatorSpec((str(model_dir),), device="cpu", threads=1)

    def lines():
        for i in range(100_000):
            if i == 30:
                os.kill(active_children()[0].pid, signal.SIGKILL)
            yield f"line {i}"

    with pytest.raises(S2SError, match=r"translate worker \d of 2 died \(killed by SIGKILL"):
        run_stream(spec, lines(), workers=2, chunk_lines=5)
    assert not active_children()  # the other worker is gone too


def test_a_bad_option_in_a_worker_is_the_one_line_error(model_dir):
    spec = TranslatorSpec((str(model_dir),), {"beam": 0}, device="cpu", threads=1)
    with pytest.raises(S2SError, match="translate options: decode.beam"):
        run_stream(spec, decoded() * 2, workers=2)
    assert not active_children()


def test_sorted_batches_are_a_translators_batches():
    """Longest first, ties in input order; at most batch_size sentences and batch_tokens padded
    tokens (the longest times the sentences); a sentence longer than batch_tokens alone."""
    assert sorted_batches([3, 9, 3, 5], 0, 100) == [[1, 3, 0, 2]]
    assert sorted_batches([3, 9, 3, 5], 2, 100) == [[1, 3], [0, 2]]
    assert sorted_batches([3, 9, 3, 5], 0, 18) == [[1, 3], [0, 2]]  # 9 * 3 = 27 > 18
    assert sorted_batches([3, 30, 3], 0, 10) == [[1], [0, 2]] and sorted_batches([], 4, 10) == []


def test_the_search_decodes_the_batches_the_parent_plans(model_dir):
    """Translator.search_sorted runs sorted_batches: the batches the parent's tasks follow."""
    from s2s.translate import Translator

    tr = Translator.from_dirs([str(model_dir)], "cpu", decode={"batch_size": 2, "batch_tokens": 40})
    seen = []
    search_ids = tr.search_ids
    tr.search_ids = lambda batch, *a: seen.append([len(x) for x in batch]) or search_ids(batch, *a)
    src = [[5] * n for n in (3, 12, 7, 3, 7)]
    tr.search_sorted(src)
    assert seen == [[len(src[i]) for i in rows] for rows in sorted_batches([3, 12, 7, 3, 7], 2, 40)]
    assert seen == [[12, 7], [7, 3], [3]]


@pytest.mark.parametrize("decode", [
    {"batch_size": 4},
    {"batch_tokens": 60},
    {"batch_tokens": 60, "max_input_tokens": 8},  # long lines cut to 8 tokens, as the worker cuts them
])
def test_each_task_is_one_batch_of_the_worker(model_dir, decode):
    """A worker decodes each task the parent plans as one batch of its non-empty lines, and
    the tasks are the batches it makes of the whole chunk (with the cap of 1/8 of the chunk's
    lines), also where it cuts over-long lines and drops empty ones."""
    from s2s.translate import Translator

    lines = [("port scanner for services " * (i % 13)).strip() for i in range(40)] + ["", "  "] * 3
    cap = -(-len(lines) // TASKS_PER_CHUNK)
    seen = []

    def translator(**more):
        tr = Translator.from_dirs([str(model_dir)], "cpu", decode={**decode, "beam": 1, "max_len_b": 3, **more})
        search_ids = tr.search_ids
        tr.search_ids = lambda batch, *a: seen.append(len(batch)) or search_ids(batch, *a)
        return tr

    tasks = task_planner(TranslatorSpec((str(model_dir),), {**decode, "beam": 1, "max_len_b": 3}))(lines)
    tr = translator()
    real = [sum(1 for i in rows if lines[i].strip()) for rows in tasks]
    for rows, n in zip(tasks, real):
        seen.clear()
        tr.translate_chunk([lines[i] for i in rows])
        assert seen == ([n] if n else [])
    seen.clear()
    translator(batch_size=min(decode.get("batch_size", 0) or cap, cap)).translate_chunk(lines)
    assert seen == [n for n in real if n]  # as full as the worker's own batches
    assert sorted(i for rows in tasks for i in rows) == list(range(len(lines)))


def test_a_chunk_is_cut_into_a_workers_batches_by_source_pieces(model_dir, tmp_path):
    """The parent cuts a chunk by the first model's tokenizer and decode settings (torch-free),
    one task per batch, each at most 1/TASKS_PER_CHUNK of the chunk's lines; where the model
    cannot be read, by characters."""
    from s2s.modeldir import load_spec
    from s2s.workers import _plan

    tok = load_spec(model_dir)[1]
    lines = [("port scanner " * (i % 9)).strip() or "a" for i in range(90)] + ["q" * (20 + i) for i in range(10)]
    pieces = [len(ids) for ids in tok.encode_src(lines)]
    assert sorted_batches(pieces, 5, 4096) != sorted_batches([len(line) for line in lines], 5, 4096)
    plan = task_planner(TranslatorSpec((str(model_dir),), {"batch_size": 5, "batch_tokens": 4096}))
    assert plan(lines) == sorted_batches(pieces, 5, 4096)  # batches of 5: within 100 / 8
    assert sorted(i for run in plan(lines) for i in run) == list(range(100))  # every line once
    assert TASKS_PER_CHUNK == 8
    wide = task_planner(TranslatorSpec((str(model_dir),), {"batch_size": 0, "batch_tokens": 10**6}))
    assert wide(lines) == sorted_batches(pieces, 13, 10**6)  # at most ceil(100 / 8) lines a task
    narrow = task_planner(TranslatorSpec((str(model_dir),), {"batch_tokens": 30}))
    assert narrow(lines) == sorted_batches(pieces, 13, 30) and max(map(len, narrow(lines))) < 13
    _, tasks = _plan(0, 1, lines, None, plan)  # what the parent sends
    assert [rows for (_, _, rows), *_ in tasks] == plan(lines)
    assert [nos for _, nos, *_ in tasks][0] == [1 + i for i in plan(lines)[0]]
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000001"  # a checkpoint: its run's model
    checkpoint.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.is_file():
            (tmp_path / "run" / f.name).write_bytes(f.read_bytes())
    assert task_planner(TranslatorSpec((str(checkpoint),), {"batch_size": 5}))(lines) == plan(lines)
    cut = tmp_path / "cut"  # a model trained on sources cut to 6 tokens (summarization's data.max_src_tokens)
    cut.mkdir()
    for f in model_dir.iterdir():
        if f.is_file():
            (cut / f.name).write_bytes(f.read_bytes())
    config = (cut / "config.yaml").read_text()
    assert "max_src_tokens: 0\n" in config
    (cut / "config.yaml").write_text(config.replace("max_src_tokens: 0\n", "max_src_tokens: 6\n"))
    assert task_planner(TranslatorSpec((str(cut),), {"batch_tokens": 60}))(lines) == \
        sorted_batches([min(n, 6) for n in pieces], 13, 60)
    by_chars = sorted_batches([len(line) for line in lines], 13, 4096)
    assert task_planner(TranslatorSpec((str(tmp_path / "missing"),)))(lines) == by_chars
    (tmp_path / "run" / "config.yaml").write_text("model: [")  # unreadable: the workers will say so
    assert task_planner(TranslatorSpec((str(tmp_path / "run"),)))(lines) == by_chars


def test_auto_workers_and_threads():
    assert auto_workers("cpu", 8) == 8 and auto_workers("cuda", 8) == 1 and auto_workers("mps", 8) == 1
    assert threads_per_worker(2, 8) == 4 and threads_per_worker(8, 2) == 1 and threads_per_worker(2, 8, 3) == 3


def test_auto_runs_a_short_input_in_this_process(model_dir):
    spec = TranslatorSpec((str(model_dir),), device="cpu", threads=1)
    text, used = run_stream(spec, decoded(), workers=0, chunk_lines=len(HOSTILE))
    assert used == 1 and text.count("\n") == len(HOSTILE)


def s2s(*args, input=None):
    return subprocess.run([sys.executable, "-m", "s2s", *map(str, args)], input=input,
                          capture_output=True, timeout=300)


def test_cli_workers_hostile_input_and_summarize(model_dir, tmp_path):
    """Through the command line: --workers 2 vs 1 on hostile bytes (--errors replace), -o complete;
    summarize too; --errors strict names file:line and leaves no output file."""
    src = tmp_path / "in.txt"
    src.write_bytes(b"\n".join(HOSTILE) + b"\n")
    for command in ("translate", "summarize"):
        got = []
        for workers in (1, 2):
            out = tmp_path / f"{command}{workers}.txt"
            r = s2s(command, "-m", model_dir, "-i", src, "-o", out, "--errors", "replace",
                    "--workers", workers, "--device", "cpu", "--threads", 1,
                    "--max-len-a", 0, "--max-len-b", 12)  # random weights never stop: cap them
            assert r.returncode == 0, r.stderr.decode()
            got.append(out.read_bytes())
        assert got[0] == got[1] and got[0].count(b"\n") == len(HOSTILE)
    out = tmp_path / "strict.txt"
    r = s2s("translate", "-m", model_dir, "-i", src, "-o", out, "--workers", "2")
    assert r.returncode == 1
    assert r.stderr.decode().strip().splitlines()[-1] == f"s2s: error: {src}:6: invalid UTF-8 (byte 1 of the line)"
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_cli_unbuffered_uses_one_process_and_says_so(model_dir):
    r = s2s("translate", "-m", model_dir, "--unbuffered", "--workers", "2", "--beam", "1", "--max-len-b", 5,
            input=b"hello\n\n")
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.count(b"\n") == 2
    assert "--unbuffered: translating line by line in one process (--workers 2 not used)" in r.stderr.decode()


def test_cli_device(model_dir, device):
    import torch

    r = s2s("translate", "-m", model_dir, "--device", "cpu", "--workers", "1", "--max-len-b", 5, input=b"hello\n")
    assert r.returncode == 0 and r.stdout.count(b"\n") == 1, r.stderr.decode()
    on_device = s2s("translate", "-m", model_dir, "--device", str(device), "--workers", "1", "--max-len-b", 5,
                    "--beam", 2, input=b"hello\nsee you\n")  # S2S_TEST_DEVICE (benchmarks/gpu_check.sh: cuda)
    assert on_device.returncode == 0 and on_device.stdout.count(b"\n") == 2, on_device.stderr.decode()
    r = s2s("translate", "-m", model_dir, "--device", "tpu", input=b"hello\n")
    assert r.returncode == 1 and r.stderr.decode() == (
        "s2s: error: --device: 'tpu' is not one of auto, cpu, cuda, mps (or cuda:N)\n")
    if not torch.cuda.is_available():
        r = s2s("translate", "-m", model_dir, "--device", "cuda", "--workers", "1", input=b"hello\n")
        err = r.stderr.decode()
        assert r.returncode == 1 and err.startswith("s2s: error: --device: cuda: torch sees no CUDA GPU")
        assert err.count("\n") == 1 and r.stdout == b""


def test_cuda_n_becomes_the_current_device(monkeypatch):
    """--device cuda:1 on a machine with two GPUs: the process that computes there makes GPU 1
    torch's current device as well (its cache, page-locked memory and bf16 query act on the
    current one); resolving the name alone (a launcher's check) and plain cuda leave it."""
    import torch

    from s2s.device import resolve_device, use_device

    made_current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
    one = resolve_device("cuda:1")
    assert one == torch.device("cuda", 1) and made_current == []
    use_device(one)
    assert made_current == [one]
    use_device(resolve_device("cuda"))
    use_device(torch.device("cpu"))
    assert made_current == [one]
    with pytest.raises(S2SError, match="--device: cuda:2: there are only 2 CUDA devices"):
        resolve_device("cuda:2")


def test_train_device_is_checked():
    from s2s.config import TrainConfig
    from s2s.errors import ConfigError

    assert TrainConfig(max_steps=1, device="cuda:1").device == "cuda:1"
    with pytest.raises(ConfigError, match="train.device: 'gpu' is not one of auto, cpu, cuda, mps"):
        TrainConfig(max_steps=1, device="gpu")


# --------------------------------------------------------------------------- #
# Start-up: the parameter count from the config, and no torch where none is needed
# --------------------------------------------------------------------------- #
CONFIGS = [
    {},
    {"norm": "post", "positions": "learned", "max_positions": 40, "position_offset": 2, "embed_norm": True,
     "tie_output": False, "output_bias": True},
    {"positions": "t5_bias", "rel_buckets": 8, "norm_type": "rmsnorm", "bias": False, "gated_ffn": True,
     "activation": "gelu", "share_embeddings": False, "head_dim": 12},
    {"copy": True, "coverage": True, "dec_layers": 3},
    {"arch": "prefix_lm", "positions": "learned", "max_positions": 64, "embed_norm": True},
    {"arch": "decoder_only", "tie_output": False, "norm_type": "rmsnorm", "gated_ffn": True},
]


@pytest.mark.parametrize("overrides", CONFIGS)
def test_parameter_count_from_the_config_is_the_models(overrides):
    from s2s.model import count_parameters, make_model

    cfg = ModelConfig(**{"d_model": 32, "heads": 4, "enc_layers": 2, "dec_layers": 1, "d_ff": 48, **overrides})
    src_v, tgt_v = (50, 70) if not cfg.share_embeddings else (60, 60)
    assert parameter_count(cfg, src_v, tgt_v) == count_parameters(make_model(cfg, src_v, tgt_v, 0))


@pytest.mark.parametrize("argv, cores, gpu, want", [
    (["translate", "-m", "M"], 2, False, True),
    (["-q", "--debug", "summarize", "-m", "M"], 4, False, True),
    (["translate", "-m", "M"], 1, False, False),  # auto on one core: one process
    (["translate", "-m", "M"], 2, True, False),  # auto where a GPU may be: one process
    (["translate", "-m", "M", "--device", "cpu"], 2, True, True),
    (["translate", "-m", "M", "--device=cuda"], 8, True, False),
    (["translate", "-m", "M", "--workers", "2"], 1, True, True),
    (["translate", "-m", "M", "--workers=1"], 8, False, False),
    (["translate", "-m", "M", "--workers", "two"], 8, False, False),
    (["translate", "-m", "M", "--unbuffered"], 8, False, False),
    (["translate", "--help"], 8, False, False),
    (["score", "h", "r"], 8, False, False),
    (["--version"], 8, False, False),
    ([], 8, False, False),
])
def test_launch_guesses_from_the_words_whether_workers_will_decode(argv, cores, gpu, want):
    from s2s.launch import decodes_in_workers

    assert decodes_in_workers(argv, cores, gpu) is want


ZEN4 = frozenset({"avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"})


@pytest.mark.parametrize("argv, flags, want", [
    (["translate", "-m", "M", "--precision", "auto"], ZEN4, True),
    (["-q", "summarize", "-m", "M", "--precision=bf16"], ZEN4, True),
    (["translate", "-m", "M", "--quantize", "int8"], frozenset({"avx2", "fma"}), True),
    (["translate", "-m", "M"], ZEN4, False),  # fp32, the default: torch's
    (["translate", "-m", "M", "--precision", "auto"], frozenset({"avx", "sse4_2"}), False),  # no products
    (["translate", "-m", "M", "--precision", "auto", "--sampling"], ZEN4, True),
    (["translate", "-m", "M", "--precision", "auto", "--glossary=g.tsv"], ZEN4, False),
    (["translate", "-m", "M", "--precision", "auto", "--prefix-file", "p.txt"], ZEN4, True),  # (it forces them)
    (["translate", "-m", "M", "--precision", "auto", "--split-sentences"], ZEN4, True),
    (["translate", "-m", "M", "--precision", "auto", "--markup"], ZEN4, False),
    (["translate", "-m", "A", "-m", "B", "--precision", "auto"], ZEN4, False),  # an ensemble
    (["translate", "-m", "M", "--precision", "auto", "--device", "cuda"], ZEN4, False),
    (["translate", "-m", "M", "--precision", "auto", "--device=cpu", "gpu driver"], ZEN4, True),
    (["translate", "-m", "M", "--precision", "auto", "gpu driver"], ZEN4, False),  # auto: the GPU
])
def test_launch_asks_no_server_for_the_torch_free_search(argv, flags, want, monkeypatch):
    """A translate whose words pick the torch-free search decodes in threads of its own process:
    s2s.launch starts no workers' server for it; any word naming an option that search lacks, a
    device other than the CPU, or S2S_NATIVE_SEARCH=0, leaves the guess to decodes_in_workers.
    ("gpu driver": on a machine with one.)"""
    from s2s import native_search, workerserver
    from s2s.launch import searches_without_torch

    gpu = "gpu driver" in argv
    argv = [a for a in argv if a != "gpu driver"]
    monkeypatch.setattr(workerserver, "gpu_driver_present", lambda: gpu)
    monkeypatch.delenv(native_search.DISABLE, raising=False)
    assert searches_without_torch(argv, flags) is want
    monkeypatch.setenv(native_search.DISABLE, "0")
    assert searches_without_torch(argv, flags) is False


def early_server_head(model_dir) -> str:
    """A fresh interpreter's set-up for the early-server probes: workerserver, a TranslatorSpec
    ``spec`` of the test model and translate_stream at hand; no forkserver: prints so and ends."""
    return f"""
import io, os, sys
from multiprocessing import forkserver
from s2s import workerserver
from s2s.workers import TranslatorSpec, translate_stream
if workerserver.worker_context().get_start_method() != "forkserver":
    print("no forkserver"); sys.exit(0)
spec = TranslatorSpec(({str(model_dir)!r},), device="cpu", threads=1, overrides={{"max_len_b": 4, "max_len_a": 0.0}})
"""


def early_server_run(model_dir, body: str) -> subprocess.CompletedProcess:
    """Run ``body`` after :func:`early_server_head` in a fresh interpreter (its forkserver its own)."""
    return subprocess.run([sys.executable, "-c", early_server_head(model_dir) + body], capture_output=True,
                          text=True, timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def early_server_probe(model_dir, body: str) -> str:
    """What ``body`` printed, having exited 0 (see :func:`early_server_run`)."""
    r = early_server_run(model_dir, body)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_a_server_started_early_and_not_used_is_killed_a_used_one_kept(model_dir):
    """s2s.launch asks for the workers' server before parsing; translate_stream kills it when
    one process decodes after all, and a later use of workers starts a new one; a server the
    workers forked from is kept, and one that ran before is never claimed."""
    probe = """
killed = []
release = workerserver.release_early
workerserver.release_early = lambda: killed.append(release())
assert workerserver.start_early()
pid = workerserver._early["pid"]
os.kill(pid, 0)  # running
out = io.StringIO()
assert translate_stream(spec, ["hello", "world"], out) == 1  # auto, a short input: this process
assert killed == [pid], killed
try:
    os.kill(pid, 0)
    raise AssertionError("the server asked for early still runs")
except ProcessLookupError:
    pass
assert translate_stream(spec, ["hello", "world"], out, workers=2) == 2  # a new server
assert not workerserver.start_early() and workerserver._early["pid"] is None  # one runs: not claimed
print(out.getvalue().count("\\n"))
"""
    assert early_server_probe(model_dir, probe) in ("4", "no forkserver")
    # SIGCHLD ignored (kept across exec from a caller): the kernel reaps the server, not waitpid
    assert early_server_probe(model_dir, "import signal\nsignal.signal(signal.SIGCHLD, signal.SIG_IGN)\n"
                              + probe) in ("4", "no forkserver")


def test_an_early_server_is_killed_on_an_error_exit_and_on_sigterm(model_dir):
    """An exit before any decoding (an error, SIGTERM while the command line is imported) kills
    the server started early (atexit), so it holds no copy of stdout for a pipeline to wait on."""
    check = """
import atexit, signal
import s2s.launch
seen = {}
def check():
    try:
        os.kill(seen["pid"], 0)
        print("alive")
    except ProcessLookupError:
        print("gone")
atexit.register(check)  # before start_early's: runs after it
"""
    error_exit = check + """
assert workerserver.start_early()
seen["pid"] = workerserver._early["pid"]
sys.exit(3)
"""
    r = early_server_run(model_dir, error_exit)
    assert (r.returncode, r.stdout.strip()) in ((3, "gone"), (0, "no forkserver")), r.stderr
    sigterm = check + f"""
start_early = workerserver.start_early
def start_then_sigterm():
    started = start_early()
    seen["pid"] = workerserver._early["pid"]
    os.kill(os.getpid(), signal.SIGTERM)  # while s2s.launch waits for nothing but the CLI's import
    return started
workerserver.start_early = start_then_sigterm
sys.argv = ["s2s", "translate", "-m", {str(model_dir)!r}, "--workers", "2"]
s2s.launch.main()
"""
    r = early_server_run(model_dir, sigterm)
    if r.stdout.strip() != "no forkserver":
        assert (r.returncode, r.stdout.strip(), r.stderr) == (128 + 15, "gone", "s2s: terminated by SIGTERM\n")


def test_workers_fork_from_a_server_started_early(model_dir):
    """Once a worker is forked from the early server it is never killed: the workers' exit codes
    reach the parent through it."""
    probe = """
assert workerserver.start_early()
pid = workerserver._early["pid"]
out = io.StringIO()
assert translate_stream(spec, ["a", "b", "c"], out, workers=2, chunk_lines=1) == 2
assert workerserver.release_early() is None
os.kill(pid, 0)
print(out.getvalue().count("\\n"))
"""
    assert early_server_probe(model_dir, probe) in ("3", "no forkserver")


def test_help_score_and_info_import_no_torch(tmp_path, model_dir):
    (tmp_path / "h.txt").write_text("a b c\n")
    probe = (
        "import sys\n"
        "from s2s.launch import main as run\n"
        "for args in (['--help'], ['score', '{h}', '{h}'], ['info', 'recipes/quickstart.yaml'],"
        " ['info', '{m}']):\n"
        "    sys.argv = ['s2s', *args]\n"
        "    try:\n"
        "        run()\n"
        "    except SystemExit as e:\n"
        "        assert not e.code, (args, e.code)\n"
        "    assert 'torch' not in sys.modules, args\n"
        "print('no torch')\n"
    ).format(h=tmp_path / "h.txt", m=model_dir)
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("no torch")


def test_a_ctrl_c_while_the_workers_server_starts_is_kept_for_after():
    """Inside sigint_ignored (the forkserver's start), a process started keeps SIGINT ignored;
    a SIGINT that comes meanwhile is not lost: it raises KeyboardInterrupt once the block ends
    (it was lost before, and a Ctrl-C then let the whole input be translated).  In a fresh
    interpreter, one thread, as `s2s translate` starts its workers."""
    script = """
import os, signal, subprocess, sys
from s2s.workerserver import sigint_ignored
probe = "import signal; print(signal.getsignal(signal.SIGINT) == signal.SIG_IGN)"
try:
    with sigint_ignored():
        os.kill(os.getpid(), signal.SIGINT)
        child = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
        print("child ignores:", child.stdout.strip())
    print("lost")
except KeyboardInterrupt:
    print("KeyboardInterrupt after the block;", signal.getsignal(signal.SIGINT) is signal.default_int_handler,
          signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.stdout.splitlines() == ["child ignores: True", "KeyboardInterrupt after the block; True False"], \
        done.stderr
