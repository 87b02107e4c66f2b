"""Denoising objectives (docs/model.md (47), (48)): information kept, rates respected, deterministic per seed."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from s2s.noise import BartNoise, bart_noise, fill_spans, infill, span_corruption, split_sentences

SENTINELS = list(range(4, 104))  # <extra_id_0..99>
MASK = 4


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(200, 300), min_size=1, max_size=80), st.integers(0, 2**32 - 1))
def test_span_corruption_targets_reconstruct_the_input(x, seed):
    src, tgt = span_corruption(x, np.random.default_rng(seed), SENTINELS)
    assert fill_spans(src, tgt, SENTINELS) == x
    assert tgt[-1] in SENTINELS  # the closing sentinel


def test_span_corruption_rates_on_average():
    rng = np.random.default_rng(0)
    x = list(range(200, 300))  # L = 100
    noise, spans = [], []
    for _ in range(500):
        src, tgt = span_corruption(x, rng, SENTINELS, noise_density=0.15, mean_span=3.0)
        noise.append(sum(t not in SENTINELS for t in tgt) / len(x))
        spans.append(sum(t in SENTINELS for t in src))
    assert abs(np.mean(noise) - 0.15) < 0.01
    assert abs(100 * 0.15 / np.mean(spans) - 3.0) < 0.2  # mean span length


def test_span_corruption_is_deterministic_per_seed():
    x = list(range(200, 260))
    a = span_corruption(x, np.random.default_rng([1, 7]), SENTINELS)
    b = span_corruption(x, np.random.default_rng([1, 7]), SENTINELS)
    c = span_corruption(x, np.random.default_rng([2, 7]), SENTINELS)
    assert a == b and a != c


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(200, 300), min_size=1, max_size=80), st.integers(0, 2**32 - 1))
def test_bart_target_is_the_original_and_permutation_keeps_the_tokens(x, seed):
    stops = {250}
    src, tgt = bart_noise(x, np.random.default_rng(seed), MASK, BartNoise(infill_rate=0, permute_rate=1.0),
                          stops)
    assert tgt == x
    assert sorted(src) == sorted(x)  # permuting sentences moves tokens, never loses them
    assert sorted(map(tuple, split_sentences(src, stops))) == sorted(map(tuple, split_sentences(x, stops))) \
        or not x or x[-1] not in stops


def test_bart_rates_on_average():
    rng = np.random.default_rng(0)
    x = list(range(200, 300))
    masked = deleted = covered = 0
    n = 400
    for _ in range(n):
        src, _ = bart_noise(x, rng, MASK, BartNoise(mask_rate=0.2, infill_rate=0, permute_rate=0))
        masked += src.count(MASK)
        src, _ = bart_noise(x, rng, MASK, BartNoise(delete_rate=0.1, infill_rate=0, permute_rate=0))
        deleted += len(x) - len(src)
        src = infill(x, rng, MASK, 0.3, 3.0)
        covered += len(x) - (len(src) - src.count(MASK))  # original tokens that became masks
    assert abs(masked / (n * 100) - 0.2) < 0.01
    assert abs(deleted / (n * 100) - 0.1) < 0.01
    assert abs(covered / (n * 100) - 0.3) < 0.02


def test_rotation_is_a_rotation():
    x = list(range(200, 230))
    src, tgt = bart_noise(x, np.random.default_rng(3), MASK, BartNoise(infill_rate=0, permute_rate=0,
                                                                        rotate_rate=1.0))
    k = src.index(x[0])
    assert src[k:] + src[:k] == x and src != x


def test_bart_noise_is_deterministic_per_seed():
    x = list(range(200, 260))
    noise = BartNoise(mask_rate=0.1, delete_rate=0.1, infill_rate=0.3, permute_rate=1.0, rotate_rate=0.5)
    a = bart_noise(x, np.random.default_rng(5), MASK, noise, {220, 240})
    assert a == bart_noise(x, np.random.default_rng(5), MASK, noise, {220, 240})
    assert a != bart_noise(x, np.random.default_rng(6), MASK, noise, {220, 240})
