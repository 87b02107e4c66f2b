"""Cleaning, binarizing, token batching and the teacher-forcing shift."""

import numpy as np
import pytest

from s2s.data import Batch, clean_pairs, read_parallel, token_batches
from s2s.errors import S2SError
from s2s.tokenizer import BOS_ID, EOS_ID, PAD_ID


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
