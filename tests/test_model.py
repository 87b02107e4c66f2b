"""Properties of the encoder-decoder transformer (s2s.model).

Tiny models (d_model 32, 2+2 layers), float64, eval mode (dropout off),
parametrized over the position scheme and pre-/post-norm where cheap.
"""

from __future__ import annotations

import math

import pytest
import torch

from s2s.config import ModelConfig
from s2s.model import (
    EncoderState,
    MultiHeadAttention,
    Seq2SeqTransformer,
    attention,
    causal_mask,
    count_parameters,
    padding_mask,
    parameter_budget,
)
from s2s.model.positions import SinusoidalPositions, relative_position_bucket, sinusoidal_table

PAD = 0
VOCAB = 23
POSITIONS = ["sinusoidal", "learned", "t5_bias"]
NORMS = ["pre", "post"]
ATOL = 1e-5

both = pytest.mark.parametrize("norm", NORMS)
every_position = pytest.mark.parametrize("positions", POSITIONS)


def make_model(positions: str = "sinusoidal", norm: str = "pre", seed: int = 0,
               **overrides) -> Seq2SeqTransformer:
    torch.manual_seed(seed)
    kw = dict(d_model=32, heads=4, enc_layers=2, dec_layers=2, d_ff=64, activation="gelu",
              norm=norm, positions=positions, max_positions=64, rel_buckets=8,
              rel_max_distance=16, dropout=0.1, attention_dropout=0.1)
    kw.update(overrides)
    model = Seq2SeqTransformer(ModelConfig(**kw), VOCAB, VOCAB, pad_id=PAD)
    return model.double().eval()


def tokens(*shape: int, seed: int = 1) -> torch.Tensor:
    """Random non-pad token ids."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, shape, generator=g)


def right_pad(rows: list[torch.Tensor]) -> torch.Tensor:
    L = max(r.numel() for r in rows)
    out = torch.full((len(rows), L), PAD, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : r.numel()] = r
    return out


# --------------------------------------------------------------------------- #
# No future leakage
# --------------------------------------------------------------------------- #

@every_position
@both
@torch.no_grad()
def test_no_future_leakage(positions, norm):
    model = make_model(positions, norm)
    src = tokens(2, 6, seed=1)
    tgt = tokens(2, 7, seed=2)
    base = model(src, tgt)  # (B, T, V)
    T = tgt.size(1)
    g = torch.Generator().manual_seed(3)
    for t in range(T - 1):
        changed = tgt.clone()
        # every token after t replaced by a different one
        changed[:, t + 1:] = (tgt[:, t + 1:] + torch.randint(1, VOCAB - 1, tgt[:, t + 1:].shape,
                                                             generator=g) - 1) % (VOCAB - 1) + 1
        assert torch.all(changed[:, t + 1:] != tgt[:, t + 1:])
        out = model(src, changed)
        torch.testing.assert_close(out[:, : t + 1], base[:, : t + 1], atol=1e-12, rtol=0)
        # not vacuous: position t+1 does see its own (changed) input token
        assert not torch.allclose(out[:, t + 1], base[:, t + 1], atol=1e-6)


@every_position
@torch.no_grad()
def test_source_change_reaches_every_target_position(positions):
    """The decoder sees the whole source (no causal mask in cross-attention):
    changing only the *last* source token moves the logits at target position 0."""
    model = make_model(positions)
    src = tokens(1, 6, seed=4)
    tgt = tokens(1, 3, seed=5)
    changed = src.clone()
    changed[0, -1] = src[0, -1] % (VOCAB - 1) + 1
    a, b = model(src, tgt), model(changed, tgt)
    assert not torch.allclose(a[:, 0], b[:, 0], atol=1e-6)


# --------------------------------------------------------------------------- #
# Padding invariance
# --------------------------------------------------------------------------- #

@every_position
@both
@torch.no_grad()
def test_padding_invariance(positions, norm):
    model = make_model(positions, norm)
    src_a, tgt_a = tokens(4, seed=10), tokens(3, seed=11)  # short: padded in the batch
    src_b, tgt_b = tokens(9, seed=12), tokens(7, seed=13)
    alone_a = model(src_a[None], tgt_a[None])[0]  # (3, V)
    alone_b = model(src_b[None], tgt_b[None])[0]  # (7, V)
    for order in ((0, 1), (1, 0)):
        srcs, tgts = [src_a, src_b], [tgt_a, tgt_b]
        src = right_pad([srcs[i] for i in order])
        tgt = right_pad([tgts[i] for i in order])
        assert (src == PAD).any() and (tgt == PAD).any()
        batch = model(src, tgt)
        ia, ib = order.index(0), order.index(1)
        torch.testing.assert_close(batch[ia, : tgt_a.numel()], alone_a, atol=ATOL, rtol=0)
        torch.testing.assert_close(batch[ib], alone_b, atol=ATOL, rtol=0)


@every_position
@torch.no_grad()
def test_padding_invariance_float32_default_dtype(positions):
    """Same property in the default float32 (SDPA fast path with -inf masks)."""
    model = make_model(positions).float()
    src_a, tgt_a = tokens(3, seed=20), tokens(2, seed=21)
    src_b, tgt_b = tokens(8, seed=22), tokens(6, seed=23)
    alone = model(src_a[None], tgt_a[None])[0]
    batch = model(right_pad([src_a, src_b]), right_pad([tgt_a, tgt_b]))
    assert torch.isfinite(batch).all()
    torch.testing.assert_close(batch[0, :2], alone, atol=ATOL, rtol=0)


# --------------------------------------------------------------------------- #
# Cross-attention weights
# --------------------------------------------------------------------------- #

@every_position
@both
@torch.no_grad()
def test_cross_attention_rows_sum_to_one_and_ignore_padding(positions, norm):
    model = make_model(positions, norm)
    src = right_pad([tokens(3, seed=30), tokens(8, seed=31), tokens(5, seed=32)])  # (3, 8)
    tgt = tokens(3, 6, seed=33)
    enc = model.encode(src)
    assert enc.src_mask.shape == (3, 1, 1, 8)
    assert torch.equal(torch.isinf(enc.src_mask[:, 0, 0]), src == PAD)
    logits, weights = model.decode(tgt, enc, need_weights=True)
    assert len(weights) == model.cfg.dec_layers
    real = (src != PAD)[:, None, None, :]  # (B, 1, 1, S)
    for A in weights:
        assert A.shape == (3, model.cfg.heads, 6, 8)
        assert torch.all(A[~real.expand_as(A)] == 0)  # exactly zero on pads
        assert torch.all(A >= 0)
        torch.testing.assert_close(A.sum(-1), torch.ones(3, model.cfg.heads, 6, dtype=A.dtype),
                                   atol=1e-6, rtol=0)
        # real source positions get positive weight (nothing else is masked)
        assert torch.all(A[real.expand_as(A)] > 0)
    # need_weights only adds the weights: the logits are the fast path's
    torch.testing.assert_close(logits, model(src, tgt), atol=ATOL, rtol=0)
    assert model.decode(tgt, enc)[1] == [None] * model.cfg.dec_layers


@pytest.mark.parametrize("coverage", [False, True])
@torch.no_grad()
def test_decoder_layer_returns_the_same_type_whatever_it_is_asked(coverage):
    """DecoderLayer.forward -> (x, A): A (B, heads, T, S) with need_weights, else None; a
    coverage layer too (its coverage goes to its cache entry, not to the caller)."""
    model = make_model(coverage=coverage)
    src = right_pad([tokens(5, seed=70), tokens(3, seed=71)])  # (2, 5)
    tgt = tokens(2, 4, seed=72)
    x = model._embed(tgt, model.tgt_embed, model.dec_positions, model.dec_embed_norm)
    mask = model._self_mask(4, 4, 0, None)
    enc = model.encode(src)
    layer = model.decoder_layers[-1]
    for need in (False, True):
        cache = model.start_decoding(enc)
        out = layer(x, mask, enc.src_mask, cache.layers[-1], need_weights=need)
        assert isinstance(out, tuple) and len(out) == 2 and out[0].shape == (2, 4, 32)
        assert (out[1] is None) != need and (not need or out[1].shape == (2, 4, 4, 5))
        assert (cache.layers[-1].coverage is not None) == coverage


# --------------------------------------------------------------------------- #
# Incremental decoding with the cache
# --------------------------------------------------------------------------- #

@every_position
@both
@torch.no_grad()
def test_incremental_decoding_matches_teacher_forcing(positions, norm, device):
    model = make_model(positions, norm).to(device)
    src = right_pad([tokens(5, seed=40), tokens(9, seed=41), tokens(2, seed=42)]).to(device)  # (3, 9)
    tgt = tokens(3, 8, seed=43).to(device)
    full = model(src, tgt)  # (3, 8, V)
    _, full_w = model.decode(tgt, model.encode(src), need_weights=True)

    cache = model.start_decoding(model.encode(src))
    assert cache.batch_size == 3 and cache.step == 0
    for t in range(tgt.size(1)):
        logits, w = model.decode_step(tgt[:, t: t + 1], cache, need_weights=True)
        assert logits.shape == (3, VOCAB)
        torch.testing.assert_close(logits, full[:, t], atol=ATOL, rtol=0)
        for A_step, A_full in zip(w, full_w):  # (B, heads, 1, S) vs row t of (B, heads, T, S)
            torch.testing.assert_close(A_step[:, :, 0], A_full[:, :, t], atol=ATOL, rtol=0)
        assert cache.step == t + 1
        for lc in cache.layers:
            assert lc.self_k.shape[2] == t + 1  # the self-attention cache grows by one


@every_position
@both
@torch.no_grad()
def test_incremental_decoding_after_cache_select(positions, norm, device):
    """Reorder and duplicate rows mid-way (as beam search does): the continued
    decode equals teacher forcing of the selected rows."""
    model = make_model(positions, norm).to(device)
    src = right_pad([tokens(5, seed=50), tokens(9, seed=51), tokens(3, seed=52)]).to(device)  # (3, 9)
    tgt = tokens(3, 7, seed=53).to(device)
    full = model(src, tgt)

    cache = model.start_decoding(model.encode(src))
    split = 3
    for t in range(split):
        torch.testing.assert_close(model.decode_step(tgt[:, t: t + 1], cache)[0], full[:, t],
                                   atol=ATOL, rtol=0)
    index = torch.tensor([2, 0, 0, 1, 2], device=device)  # reorder + duplicate (+ grow the batch)
    cache.select(index)
    assert cache.batch_size == 5 and cache.step == split
    sel_tgt, sel_full = tgt[index], full[index]
    for t in range(split, 5):
        torch.testing.assert_close(model.decode_step(sel_tgt[:, t: t + 1], cache)[0],
                                   sel_full[:, t], atol=ATOL, rtol=0)
    index = torch.tensor([3, 1], device=device)  # shrink (sentences leaving the batch)
    cache.select(index)
    sel_tgt, sel_full = sel_tgt[index], sel_full[index]
    for t in range(5, tgt.size(1)):
        torch.testing.assert_close(model.decode_step(sel_tgt[:, t: t + 1], cache)[0],
                                   sel_full[:, t], atol=ATOL, rtol=0)


@every_position
@both
@torch.no_grad()
def test_incremental_decoding_with_beams_sharing_the_cross_kv(positions, norm):
    """Rows grouped as beams (the search's select(..., group=K)): the cross K/V stay
    one per sentence, beams reorder within their sentence, sentences leave; every
    step still equals teacher forcing of the rows, weights included."""
    model = make_model(positions, norm)
    src = right_pad([tokens(5, seed=60), tokens(9, seed=61), tokens(3, seed=62)])  # (3, 9)
    tgt = tokens(6, 7, seed=63)  # one target per beam row
    enc = model.encode(src)
    cache = model.start_decoding(enc)
    cache.select(torch.arange(3).repeat_interleave(2), group=2)  # 3 sentences x 2 beams
    assert cache.group == 2 and cache.layers[0].cross_k.size(0) == 3
    sentence = torch.arange(3).repeat_interleave(2)  # of each row
    rows_tgt = tgt.clone()

    def check(steps):
        rows = EncoderState(src=src[sentence], src_mask=enc.src_mask[sentence], h_enc=enc.h_enc[sentence])
        full, weights = model.decode(rows_tgt, rows, need_weights=True)
        for t in steps:
            got, A = model.decode_step(rows_tgt[:, t: t + 1], cache, need_weights=True)
            torch.testing.assert_close(got, full[:, t], atol=ATOL, rtol=0)
            torch.testing.assert_close(A[-1][:, :, 0], weights[-1][:, :, t], atol=ATOL, rtol=0)

    check(range(3))
    index = torch.tensor([1, 1, 2, 3, 5, 4])  # beams reordered/duplicated within their sentence
    cache.select(index)
    rows_tgt = torch.cat([rows_tgt[index, :3], rows_tgt[:, 3:]], dim=1)
    check(range(3, 5))
    index = torch.tensor([0, 1, 4, 5])  # the second sentence finished
    cache.select(index)
    assert cache.layers[0].cross_k.size(0) == 2
    rows_tgt, sentence = rows_tgt[index], sentence[index]
    check(range(5, 7))


@pytest.mark.parametrize("copy", [False, True])
@torch.no_grad()
def test_scores_of_kept_positions_only(copy):
    """forward(..., keep=mask) (training's padding-free output layer) = forward(...)[mask]."""
    model = make_model(copy=copy)
    src = right_pad([tokens(5, seed=70), tokens(9, seed=71), tokens(3, seed=72)])
    tgt = right_pad([tokens(6, seed=73), tokens(2, seed=74), tokens(8, seed=75)])
    keep = tgt != PAD
    torch.testing.assert_close(model(src, tgt, keep=keep), model(src, tgt)[keep], atol=ATOL, rtol=0)


# --------------------------------------------------------------------------- #
# MultiHeadAttention: fast (SDPA) path == reference path
# --------------------------------------------------------------------------- #

def _mha(cross: bool, dtype) -> MultiHeadAttention:
    torch.manual_seed(7)
    mha = MultiHeadAttention(32, heads=4, dropout=0.3, cross=cross).to(dtype).eval()
    for p in mha.parameters():  # non-zero biases too
        torch.nn.init.normal_(p, std=0.3)
    return mha


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@torch.no_grad()
def test_mha_fast_path_equals_reference_self_attention(dtype):
    mha = _mha(False, dtype)
    x = torch.randn(3, 6, 32, dtype=dtype, generator=torch.Generator().manual_seed(8))
    src = right_pad([tokens(6, seed=1), tokens(4, seed=2), tokens(2, seed=3)])
    q, k, v = mha.project_qkv(x)
    assert q.shape == (3, 4, 6, 8)
    masks = {
        "none": None,
        "causal": causal_mask(6),  # (T, T)
        "padding": padding_mask(src, PAD),  # (B, 1, 1, T)
        "causal+padding": causal_mask(6) + padding_mask(src, PAD),  # (B, 1, T, T)
        "bias": torch.randn(1, 4, 6, 6, generator=torch.Generator().manual_seed(9)),
    }
    for name, mask in masks.items():
        fast, none = mha.attend(q, k, v, mask, need_weights=False)
        ref, A = mha.attend(q, k, v, mask, need_weights=True)
        assert none is None and A.shape == (3, 4, 6, 6)
        assert torch.isfinite(fast).all(), name
        torch.testing.assert_close(fast, ref, atol=ATOL, rtol=0, msg=name)
    # the reference path is attention() per head, merged and projected
    mask = masks["causal+padding"]
    out_heads, _ = attention(q, k, v, mask)
    torch.testing.assert_close(mha.attend(q, k, v, mask, True)[0],
                               mha.out_proj(mha.merge_heads(out_heads)), atol=ATOL, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@torch.no_grad()
def test_mha_fast_path_equals_reference_cross_attention(dtype):
    mha = _mha(True, dtype)
    g = torch.Generator().manual_seed(11)
    x_dec = torch.randn(3, 5, 32, dtype=dtype, generator=g)
    h_enc = torch.randn(3, 7, 32, dtype=dtype, generator=g)
    src = right_pad([tokens(7, seed=4), tokens(3, seed=5), tokens(1, seed=6)])  # (3, 7)
    q = mha.project_q(x_dec)
    k, v = mha.project_kv(h_enc)
    assert q.shape == (3, 4, 5, 8) and k.shape == v.shape == (3, 4, 7, 8)
    for mask in (None, padding_mask(src, PAD)):
        fast, _ = mha.attend(q, k, v, mask, need_weights=False)
        ref, A = mha.attend(q, k, v, mask, need_weights=True)
        assert A.shape == (3, 4, 5, 7)
        torch.testing.assert_close(fast, ref, atol=ATOL, rtol=0)
    # with the padding mask, pads get exactly zero weight
    assert torch.all(A[(src == PAD)[:, None, None, :].expand_as(A)] == 0)


# --------------------------------------------------------------------------- #
# Parameter count vs the budget of docs/model.md (20)
# --------------------------------------------------------------------------- #

def expected_parameters(cfg: ModelConfig, vocab: int) -> int:
    """Counted by hand from the architecture (src_vocab == tgt_vocab == vocab)."""
    d, f = cfg.d_model, cfg.d_ff
    attn = 4 * d * d + 4 * d  # Q, K, V, O with biases (fused or not, same count)
    ffn = 2 * d * f + f + d  # W_1, b_1, W_2, b_2
    norm = 2 * d  # LayerNorm gain + bias
    enc_layer = attn + ffn + 2 * norm
    dec_layer = 2 * attn + ffn + 3 * norm  # self + cross attention, three norms
    final_norms = 2 * norm if cfg.norm == "pre" else 0  # post-norm stacks have none
    embeddings = vocab * d * (1 if cfg.share_embeddings else 2)
    output = 0 if cfg.tie_output else vocab * d  # bias-free W_U
    positions = {"sinusoidal": 0, "learned": 2 * cfg.max_positions * d,
                 "t5_bias": 2 * cfg.rel_buckets * cfg.heads}[cfg.positions]
    return (cfg.enc_layers * enc_layer + cfg.dec_layers * dec_layer + final_norms + embeddings
            + output + positions)


@pytest.mark.parametrize("layers", [(2, 2), (3, 1), (1, 3)])
@both
def test_parameter_count_vs_budget(layers, norm):
    d, vocab = 64, 1000
    cfg = ModelConfig(d_model=d, heads=4, enc_layers=layers[0], dec_layers=layers[1], d_ff=4 * d,
                      norm=norm, positions="sinusoidal", tie_output=True, share_embeddings=True)
    model = Seq2SeqTransformer(cfg, vocab, vocab, pad_id=PAD)
    actual = count_parameters(model)
    budget = parameter_budget(cfg, vocab)
    assert budget == 12 * layers[0] * d * d + 16 * layers[1] * d * d + vocab * d
    assert actual == expected_parameters(cfg, vocab)
    # the budget ignores biases and layer norms only: a little below the truth
    assert budget < actual
    assert (actual - budget) / actual < 0.05
    # ... and exactly those: the remainder is the bias/norm vectors
    enc_extra = 4 * d + 4 * d + d + 4 * d  # attn biases, b_1 (d_ff = 4d), b_2, 2 norms
    dec_extra = 8 * d + 4 * d + d + 6 * d
    final = 4 * d if norm == "pre" else 0
    assert actual - budget == layers[0] * enc_extra + layers[1] * dec_extra + final


@pytest.mark.parametrize("positions", POSITIONS)
@pytest.mark.parametrize("tie,share", [(True, True), (True, False), (False, True), (False, False)])
def test_parameter_count_exact_other_configs(positions, tie, share):
    cfg = ModelConfig(d_model=32, heads=4, enc_layers=2, dec_layers=1, d_ff=48, positions=positions,
                      max_positions=40, rel_buckets=8, tie_output=tie, share_embeddings=share)
    model = Seq2SeqTransformer(cfg, 50, 50, pad_id=PAD)
    assert count_parameters(model) == expected_parameters(cfg, 50)
    # tied/shared matrices are counted once
    assert count_parameters(model) <= sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------- #
# T5 relative-position buckets
# --------------------------------------------------------------------------- #

def t5_bucket_reference(distance: int, bidirectional: bool, num_buckets: int,
                        max_distance: int) -> int:
    """T5's _relative_position_bucket, in plain Python, for distance = i - j."""
    relative_position = -distance  # T5's convention: memory (j) - query (i)
    ret = 0
    n = -relative_position
    if bidirectional:
        num_buckets //= 2
        ret += num_buckets if n < 0 else 0
        n = abs(n)
    else:
        n = max(n, 0)
    max_exact = num_buckets // 2
    if n < max_exact:
        return ret + n
    val = max_exact + int(math.log(n / max_exact) / math.log(max_distance / max_exact)
                          * (num_buckets - max_exact))
    return ret + min(val, num_buckets - 1)


def buckets(distances, bidirectional, num_buckets=32, max_distance=128) -> list[int]:
    return relative_position_bucket(torch.tensor(distances), bidirectional, num_buckets,
                                    max_distance).tolist()


def test_relative_bucket_small_distances_are_distinct():
    # bidirectional, 32 buckets: 16 per side, exact below 8
    left = buckets(list(range(8)), True)
    right = buckets([-d for d in range(1, 8)], True)
    assert left == list(range(8))
    assert right == list(range(17, 24))
    assert len(set(left + right)) == 15
    # unidirectional, 32 buckets: exact below 16
    assert buckets(list(range(16)), False) == list(range(16))


def test_relative_bucket_bidirectional_upper_half_for_keys_to_the_right():
    d = torch.arange(-200, 201)
    b = relative_position_bucket(d, True, 32, 128)
    assert torch.all(b[d < 0] >= 16) and torch.all(b[d < 0] <= 31)  # key j > i
    assert torch.all(b[d >= 0] < 16)  # key at or before the query
    # mirror images: distance -n sits n's bucket + 16 (for n > 0)
    pos = torch.arange(1, 201)
    assert torch.equal(relative_position_bucket(-pos, True, 32, 128),
                       relative_position_bucket(pos, True, 32, 128) + 16)


def test_relative_bucket_unidirectional_future_keys_share_bucket_0():
    assert buckets([-1, -2, -7, -50, -1000], False) == [0] * 5
    assert buckets([0], False) == [0]  # the query itself is bucket 0 too (T5's convention)


def test_relative_bucket_large_distances_capped():
    assert buckets([127, 128, 129, 500, 10_000], True) == [15] * 5
    assert buckets([-128, -500, -10_000], True) == [31] * 3
    assert buckets([127, 128, 500, 10_000], False) == [31] * 4
    d = torch.arange(-20_000, 20_001)
    for bidir in (True, False):
        b = relative_position_bucket(d, bidir, 32, 128)
        assert int(b.min()) == 0 and int(b.max()) == 31
        # monotone in |distance| on each side
        right_side = b[d >= 0]
        assert torch.all(right_side[1:] >= right_side[:-1])


def test_relative_bucket_hand_computed_t5_values():
    # bidirectional, 32 buckets, max_distance 128: half 16, max_exact 8
    #   n = 20:  8 + floor(log(20/8) / log(128/8) * 8) = 8 + floor(2.644) = 10
    #   n = 64:  8 + floor(log(8) / log(16) * 8)       = 8 + 6 = 14
    #   n = 127: 8 + floor(7.977)                       = 15
    #   j > i by 20: 16 + 10 = 26
    assert buckets([20, 64, 127, -20, -64], True) == [10, 14, 15, 26, 30]
    # unidirectional, 32 buckets, max_distance 128: max_exact 16
    #   n = 20: 16 + floor(log(20/16) / log(8) * 16) = 16 + floor(1.717) = 17
    #   n = 64: 16 + floor(log(4) / log(8) * 16)     = 16 + 10 = 26
    assert buckets([20, 64], False) == [17, 26]
    # the model's default-ish small setting: 8 buckets, max_distance 16
    #   bidirectional: half 4, max_exact 2; n = 5: 2 + floor(log(2.5)/log(8) * 2) = 2
    #   unidirectional: max_exact 4; n = 10: 4 + floor(log(2.5)/log(4) * 4) = 6
    assert buckets([5, -5], True, 8, 16) == [2, 6]
    assert buckets([10], False, 8, 16) == [6]


@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (8, 16), (10, 50), (16, 32)])
@pytest.mark.parametrize("bidirectional", [True, False])
def test_relative_bucket_matches_t5_reference(num_buckets, max_distance, bidirectional):
    d = list(range(-300, 301))
    want = [t5_bucket_reference(x, bidirectional, num_buckets, max_distance) for x in d]
    assert buckets(d, bidirectional, num_buckets, max_distance) == want


# --------------------------------------------------------------------------- #
# Sinusoidal positions
# --------------------------------------------------------------------------- #

def test_sinusoidal_table_values():
    d = 16
    positions = torch.tensor([0, 1, 5, 37])
    table = sinusoidal_table(positions, d)
    assert table.shape == (4, d)
    # position 0: sines 0, cosines 1
    assert table[0].tolist() == [0.0] * 8 + [1.0] * 8
    for row, pos in enumerate(positions.tolist()):
        for i in range(d // 2):
            w = 10000.0 ** (-2 * i / d)
            assert float(table[row, i]) == pytest.approx(math.sin(pos * w), abs=ATOL)
            assert float(table[row, d // 2 + i]) == pytest.approx(math.cos(pos * w), abs=ATOL)
    # hand values: pos 1, i = 0 (w = 1) and i = 1 (w = 10000^(-1/8))
    assert float(table[1, 0]) == pytest.approx(0.84147, abs=ATOL)  # sin 1
    assert float(table[1, 8]) == pytest.approx(0.54030, abs=ATOL)  # cos 1
    assert float(table[2, 1]) == pytest.approx(math.sin(5 * 10 ** -0.5), abs=ATOL)
    # sin^2 + cos^2 = 1 pairwise
    torch.testing.assert_close(table[:, :8] ** 2 + table[:, 8:] ** 2, torch.ones(4, 8),
                               atol=ATOL, rtol=0)


def test_sinusoidal_table_odd_width_and_offsets():
    table = sinusoidal_table(torch.tensor([3]), 7)  # half = 3, one zero column of padding
    assert table.shape == (1, 7)
    for i in range(3):
        w = 10000.0 ** (-2 * i / 7)
        assert float(table[0, i]) == pytest.approx(math.sin(3 * w), abs=ATOL)
        assert float(table[0, 3 + i]) == pytest.approx(math.cos(3 * w), abs=ATOL)
    assert float(table[0, 6]) == 0.0
    # the module's start offset (used by decode_step) reads the same rows
    pe = SinusoidalPositions(16)
    torch.testing.assert_close(pe(3, start=4), sinusoidal_table(torch.arange(4, 7), 16))
    torch.testing.assert_close(pe(10)[4:7], pe(3, start=4), atol=1e-6, rtol=0)


def test_each_dropout_setting_reaches_its_place():
    """model.dropout: embeddings and sublayer outputs; attention_dropout: A; activation_dropout:
    inside the FFN (0 by default, as fairseq's --activation-dropout)."""
    model = make_model(dropout=0.1, attention_dropout=0.2, activation_dropout=0.3)
    layer = model.encoder_layers[0]
    assert layer.ffn.dropout.p == 0.3
    assert layer.dropout.p == 0.1
    assert layer.self_attn.dropout == 0.2
    assert make_model().encoder_layers[0].ffn.dropout.p == 0.0


def test_sinusoidal_positions_table_rows_equal_the_formula_bit_for_bit():
    """The decoder reads PE(t) from the module's table: the very values computed for t alone."""
    pe = SinusoidalPositions(256)
    for t in range(0, 300, 7):
        assert torch.equal(pe(1, start=t), sinusoidal_table(torch.arange(t, t + 1), 256))
    assert torch.equal(pe(5, start=1000), sinusoidal_table(torch.arange(1000, 1005), 256))  # grown


@pytest.mark.parametrize("activation,gated", [("relu", False), ("silu", True), ("gelu", False)])
def test_a_decoding_ffn_overwrites_its_hidden_layer_to_the_same_result(activation, gated):
    """Without autograd the activation runs in place (ACTIVATIONS_IN_PLACE): same FFN(x), and the
    training path, with autograd, still gets its gradients."""
    from s2s.model.layers import FeedForward

    torch.manual_seed(0)
    ffn = FeedForward(8, 32, activation, dropout=0.0, gated=gated).eval()
    x = torch.randn(3, 5, 8, requires_grad=True)
    trained = ffn(x)
    trained.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    with torch.inference_mode():
        decoded = ffn(x.detach())
    assert torch.equal(decoded, trained.detach())


@pytest.mark.parametrize("p", [0.1, 0.3])
def test_dropout_zeroes_a_fraction_p_and_scales_the_rest(p):
    """Dropout(x) = x * m / (1 - p), m_i ~ Bernoulli(1 - p): on 10^6 entries the fraction zeroed is p
    within 5 standard deviations, every kept entry is x_i / (1 - p), the gradient is m / (1 - p),
    and outside training (or with p = 0) it is x itself."""
    from s2s.model.dropout import Dropout

    torch.manual_seed(0)
    n = 1_000_000
    x = (torch.rand(n) + 0.5).requires_grad_()  # no zeros of its own
    y = Dropout(p).train()(x)
    dropped = (y == 0).float().mean().item()
    assert abs(dropped - p) < 5 * math.sqrt(p * (1 - p) / n)
    kept = y != 0
    torch.testing.assert_close(y[kept], x[kept] / (1 - p))
    y.sum().backward()
    torch.testing.assert_close(x.grad, kept.float() / (1 - p))
    assert Dropout(p).eval()(x) is x and Dropout(0.0).train()(x) is x
    with pytest.raises(ValueError, match="not in"):
        Dropout(1.0)
