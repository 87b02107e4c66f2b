"""Every number of the worked examples (docs/model.md, "Worked examples"),
reproduced through s2s's own attention code.

Each example builds q/k vectors whose dot products are the example's raw
scores for the stated d_k, runs :func:`s2s.model.attention.attention` (the
reference softmax(QK^T/sqrt(d_k) + M) V), and, where the values fit a head,
checks that MultiHeadAttention's fast SDPA path gives the same output as the
reference path.
"""

from __future__ import annotations

import math

import pytest
import torch

from s2s.config import DecodeConfig
from s2s.model.attention import MultiHeadAttention, attention, causal_mask, padding_mask
from s2s.search import SpecialIds, greedy_search
from s2s.trainer import label_smoothed_nll

ABS = 1e-5
DT = torch.float64


def t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=DT)


def keys_for_scores(raw_scores, d_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A query e_1 (1, d_k) and keys (n, d_k) with q . k_j = raw_scores[j]."""
    q = torch.zeros(1, d_k, dtype=DT)
    q[0, 0] = 1.0
    k = torch.zeros(len(raw_scores), d_k, dtype=DT)
    k[:, 0] = t(raw_scores)
    return q, k


def pad_cols(v: torch.Tensor, d: int) -> torch.Tensor:
    """Right-pad value vectors with zero columns up to width d (so they fit a head)."""
    return torch.nn.functional.pad(v, (0, d - v.size(-1)))


def mha_both_paths(q, k, v, mask=None, cross=True):
    """Run MultiHeadAttention.attend with one head and an identity output
    projection, on the fast (SDPA) path and on the reference path.

    q (T_q, d), k (T_k, d), v (T_k, d) -> (out_fast, out_ref, A) with the batch
    and head axes dropped.
    """
    d = q.size(-1)
    mha = MultiHeadAttention(d, heads=1, dropout=0.0, cross=cross).to(DT).eval()
    with torch.no_grad():
        mha.out_proj.weight.copy_(torch.eye(d, dtype=DT))
        mha.out_proj.bias.zero_()
    q4, k4, v4 = (x[None, None] for x in (q, k, v))  # (1, 1, L, d)
    with torch.no_grad():
        fast, A_none = mha.attend(q4, k4, v4, mask, need_weights=False)
        ref, A = mha.attend(q4, k4, v4, mask, need_weights=True)
    assert A_none is None
    return fast[0], ref[0], A[0, 0]


# --------------------------------------------------------------------------- #
# Example 1 - Cell A: full bidirectional softmax (encoder)
# --------------------------------------------------------------------------- #

def test_example1_cell_A_bidirectional_softmax():
    d_k = 4
    q, k = keys_for_scores([2.0, 4.0, 2.0], d_k)
    # step 1: scaled scores (1, 2, 1)
    assert (q @ k.T / math.sqrt(d_k)).squeeze(0).tolist() == pytest.approx([1.0, 2.0, 1.0], abs=ABS)
    # step 3: e^1, e^2, e^1 and their sum
    assert [math.e, math.e ** 2, math.e] == pytest.approx([2.71828, 7.38906, 2.71828], abs=ABS)
    assert 2 * math.e + math.e ** 2 == pytest.approx(12.82562, abs=ABS)

    v = torch.eye(3, dtype=DT)  # one-hot values: the output row *is* the weight row
    out, A = attention(q, k, v)  # no mask: M_ij = 0 everywhere
    assert A.squeeze(0).tolist() == pytest.approx([0.21194, 0.57612, 0.21194], abs=ABS)
    assert out.squeeze(0).tolist() == pytest.approx([0.21194, 0.57612, 0.21194], abs=ABS)
    assert float(A.sum()) == pytest.approx(1.0, abs=ABS)
    assert int(A.argmax()) == 1  # token 2 listens most to k_2
    assert float(A[0, 0]) == float(A[0, 2])  # equal scores -> equal weights

    # an all-zero (nothing blocked) mask and a padding mask without pads change nothing
    _, A0 = attention(q, k, v, mask=torch.zeros(1, 3))
    assert torch.equal(A0, A)
    _, A_pad = attention(q[None, None], k[None, None], v[None, None],
                         mask=padding_mask(torch.tensor([[5, 6, 7]]), pad_id=0))
    assert A_pad.flatten().tolist() == pytest.approx([0.21194, 0.57612, 0.21194], abs=ABS)

    # the same query through MultiHeadAttention: SDPA path == reference path
    fast, ref, A_mha = mha_both_paths(q, k, pad_cols(v, d_k), cross=False)
    assert A_mha.squeeze(0).tolist() == pytest.approx([0.21194, 0.57612, 0.21194], abs=ABS)
    assert ref.squeeze(0).tolist() == pytest.approx([0.21194, 0.57612, 0.21194, 0.0], abs=ABS)
    torch.testing.assert_close(fast, ref, atol=ABS, rtol=0)


# --------------------------------------------------------------------------- #
# Example 2 - Cells B & E: causal mask with a negative score (decoder)
# --------------------------------------------------------------------------- #

def test_example2_cells_B_E_causal_mask_negative_score():
    d_k = 4
    T = 4
    # raw scores of query 3 against keys 1..4: (-2, 0, 2, 6) -> scaled (-1, 0, 1, 3)
    q = torch.zeros(T, d_k, dtype=DT)
    q[:, 0] = 1.0
    k = torch.zeros(T, d_k, dtype=DT)
    k[:, 0] = t([-2.0, 0.0, 2.0, 6.0])
    assert (q[2] @ k.T / math.sqrt(d_k)).tolist() == pytest.approx([-1.0, 0.0, 1.0, 3.0], abs=ABS)

    M = causal_mask(T)
    # row 3 (index 2) of the causal mask: (0, 0, 0, -inf)
    assert M[2].tolist() == [0.0, 0.0, 0.0, float("-inf")]
    assert torch.equal(torch.isinf(M), torch.ones(T, T, dtype=torch.bool).triu(1))

    # step 3: e^-1, e^0, e^1, e^-inf and the sum
    assert [math.exp(-1), 1.0, math.e, math.exp(float("-inf"))] == pytest.approx(
        [0.36788, 1.0, 2.71828, 0.0], abs=ABS)
    assert math.exp(-1) + 1 + math.e == pytest.approx(4.08616, abs=ABS)

    v = torch.eye(T, dtype=DT)
    out, A = attention(q, k, v, mask=M)
    row = A[2].tolist()
    assert row == pytest.approx([0.09003, 0.24473, 0.66524, 0.0], abs=ABS)
    assert row[3] == 0.0  # exactly zero, despite the largest raw score
    assert sum(row) == pytest.approx(1.0, abs=ABS)
    assert out[2].tolist() == pytest.approx([0.09003, 0.24473, 0.66524, 0.0], abs=ABS)
    # every row: zero above the diagonal, sums to one
    assert torch.all(A.triu(1) == 0)
    torch.testing.assert_close(A.sum(-1), torch.ones(T, dtype=DT), atol=ABS, rtol=0)
    assert A[0].tolist() == [1.0, 0.0, 0.0, 0.0]  # the first token only sees itself

    # without the mask token 4 would dominate: the mask overrules it
    _, A_nomask = attention(q, k, v)
    assert int(A_nomask[2].argmax()) == 3

    fast, ref, A_mha = mha_both_paths(q, k, v, mask=M, cross=False)
    assert A_mha[2].tolist() == pytest.approx([0.09003, 0.24473, 0.66524, 0.0], abs=ABS)
    assert ref[2].tolist() == pytest.approx([0.09003, 0.24473, 0.66524, 0.0], abs=ABS)
    torch.testing.assert_close(fast, ref, atol=ABS, rtol=0)


# --------------------------------------------------------------------------- #
# Example 3 - Cell C: degenerate input, sequence length 1
# --------------------------------------------------------------------------- #

def test_example3_cell_C_length_one():
    q, k = keys_for_scores([5.0], d_k=1)
    assert float(q @ k.T / math.sqrt(1)) == 5.0
    M = causal_mask(1)
    assert M.tolist() == [[0.0]]  # j = 1 <= i = 1: allowed
    v = t([[3.0, -1.0]])
    out, A = attention(q, k, v, mask=M)
    assert A.tolist() == [[1.0]]
    assert out.squeeze(0).tolist() == pytest.approx([3.0, -1.0], abs=ABS)

    # the score value is irrelevant
    for score in (-100.0, -5.0, 0.0, 5.0, 100.0):
        q, k = keys_for_scores([score], d_k=1)
        out, A = attention(q, k, v, mask=M)
        assert float(A) == 1.0
        assert out.squeeze(0).tolist() == pytest.approx([3.0, -1.0], abs=ABS)

    # fast path == reference path (d_head 2: the scaled score is 5/sqrt(2), weight still 1)
    q2, k2 = t([[5.0, 0.0]]), t([[1.0, 0.0]])
    fast, ref, A_mha = mha_both_paths(q2, k2, v, mask=M, cross=False)
    assert A_mha.tolist() == [[1.0]]
    assert ref.squeeze(0).tolist() == pytest.approx([3.0, -1.0], abs=ABS)
    assert fast.squeeze(0).tolist() == pytest.approx([3.0, -1.0], abs=ABS)


# --------------------------------------------------------------------------- #
# Example 4 - Cell D: limiting case of two exactly equal scores
# --------------------------------------------------------------------------- #

def test_example4_cell_D_tie_and_epsilon_limit():
    d_k = 1
    v = t([[1.0, 0.0], [0.0, 1.0]])
    q, k = keys_for_scores([3.0, 3.0], d_k)
    out, A = attention(q, k, v)
    assert A.squeeze(0).tolist() == [0.5, 0.5]  # e^3 / (2 e^3), exactly
    assert out.squeeze(0).tolist() == pytest.approx([0.5, 0.5], abs=ABS)
    # the same split at any common score, and unscaled too
    for s in (-7.0, 0.0, 3.0, 40.0):
        q, k = keys_for_scores([s, s], d_k)
        assert attention(q, k, v, scale=False)[1].squeeze(0).tolist() == [0.5, 0.5]

    # nudge the second score by eps: alpha_2 = e^eps / (1 + e^eps) -> 0.5 as eps -> 0
    gaps = []
    for eps in (1.0, 0.1, 1e-2, 1e-3, 1e-4, 0.0):
        q, k = keys_for_scores([3.0, 3.0 + eps], d_k)
        _, A = attention(q, k, v)
        a2 = float(A[0, 1])
        assert a2 == pytest.approx(math.exp(eps) / (1 + math.exp(eps)), abs=ABS)
        assert float(A[0, 0]) + a2 == pytest.approx(1.0, abs=ABS)
        assert a2 >= 0.5  # nudging up never takes weight away
        # smooth, no jump: |alpha_2 - 1/2| <= eps/4 (the slope of e^x/(1+e^x) at 0)
        assert a2 - 0.5 <= eps / 4 + 1e-6
        gaps.append(a2 - 0.5)
    assert gaps == sorted(gaps, reverse=True)  # shrinks monotonically
    assert gaps[-1] == 0.0  # and the limit is the tie, 0.5
    assert 0.5 + gaps[-2] == pytest.approx(0.5, abs=1e-4)
    # symmetric from below
    q, k = keys_for_scores([3.0, 3.0 - 1e-3], d_k)
    a2_below = float(attention(q, k, v)[1][0, 1])
    assert a2_below == pytest.approx(math.exp(-1e-3) / (1 + math.exp(-1e-3)), abs=ABS)
    assert 0.5 - 1e-3 / 4 - 1e-6 <= a2_below < 0.5

    fast, ref, A_mha = mha_both_paths(*keys_for_scores([3.0, 3.0], 2), v, cross=False)
    assert A_mha.squeeze(0).tolist() == [0.5, 0.5]
    torch.testing.assert_close(fast, ref, atol=ABS, rtol=0)


# --------------------------------------------------------------------------- #
# Example 5 - Cell H: the sqrt(d_k) scale changes the answer
# --------------------------------------------------------------------------- #

def test_example5_cell_H_scaling_changes_the_answer():
    d_k = 16  # sqrt(d_k) = 4
    q, k = keys_for_scores([8.0, 4.0], d_k)
    v = t([[1.0, 0.0], [0.0, 1.0]])

    # step 1: unscaled
    assert [math.exp(8), math.exp(4)] == pytest.approx([2980.958, 54.598], abs=1e-3)
    assert math.exp(8) + math.exp(4) == pytest.approx(3035.556, abs=1e-3)
    _, A_un = attention(q, k, v, scale=False)
    assert A_un.squeeze(0).tolist() == pytest.approx([0.98201, 0.01799], abs=ABS)

    # step 2: scaled, 8/4 = 2 and 4/4 = 1
    assert (q @ k.T / math.sqrt(d_k)).squeeze(0).tolist() == pytest.approx([2.0, 1.0], abs=ABS)
    assert math.exp(2) + math.exp(1) == pytest.approx(10.10734, abs=ABS)
    out, A_sc = attention(q, k, v)  # scale=True is the default
    assert A_sc.squeeze(0).tolist() == pytest.approx([0.73106, 0.26894], abs=ABS)
    assert out.squeeze(0).tolist() == pytest.approx([0.73106, 0.26894], abs=ABS)

    # step 3: both sum to one, and the alpha_1 values differ
    assert float(A_un.sum()) == pytest.approx(1.0, abs=ABS)
    assert float(A_sc.sum()) == pytest.approx(1.0, abs=ABS)
    assert float(A_un[0, 0]) - float(A_sc[0, 0]) == pytest.approx(0.98201 - 0.73106, abs=ABS)
    # scale=True is exactly the unscaled attention of q / sqrt(d_k)
    torch.testing.assert_close(attention(q / 4, k, v, scale=False)[1], A_sc, atol=ABS, rtol=0)

    # MultiHeadAttention's SDPA path uses the scaled form, like the reference
    fast, ref, A_mha = mha_both_paths(q, k, pad_cols(v, d_k), cross=False)
    assert A_mha.squeeze(0).tolist() == pytest.approx([0.73106, 0.26894], abs=ABS)
    assert fast.squeeze(0)[:2].tolist() == pytest.approx([0.73106, 0.26894], abs=ABS)
    torch.testing.assert_close(fast, ref, atol=ABS, rtol=0)


# --------------------------------------------------------------------------- #
# Example 6 - Cell F: cross-attention, the decoder queries the encoder
# --------------------------------------------------------------------------- #

def test_example6_cell_F_cross_attention():
    d_k = 4
    # decoder query 1 against the 3 encoder keys: raw (6, 2, 2) -> scaled (3, 1, 1)
    q, k = keys_for_scores([6.0, 2.0, 2.0], d_k)
    assert (q @ k.T / math.sqrt(d_k)).squeeze(0).tolist() == pytest.approx([3.0, 1.0, 1.0], abs=ABS)
    assert math.exp(3) + 2 * math.e == pytest.approx(25.52210, abs=ABS)
    v = t([[1.0, 0.0], [0.0, 1.0], [0.0, -1.0]])  # encoder values

    out, A = attention(q, k, v)  # no causal mask over the source
    assert A.squeeze(0).tolist() == pytest.approx([0.78698, 0.10651, 0.10651], abs=ABS)
    assert float(A.sum()) == pytest.approx(1.0, abs=ABS)
    assert out.squeeze(0).tolist() == pytest.approx([0.78698, 0.0], abs=ABS)
    assert float(A[0, 1]) == float(A[0, 2])  # v_2 and v_3 cancel exactly
    assert float(out[0, 1]) == pytest.approx(0.0, abs=1e-12)

    # Inside a causal decoder, decoder position 1 still sees *all* source
    # positions (2 and 3 included): the cross-attention mask is the source
    # padding mask only, here with no pads.
    src = torch.tensor([[7, 8, 9]])
    src_mask = padding_mask(src, pad_id=0)  # (1, 1, 1, 3), all zeros
    assert src_mask.tolist() == [[[[0.0, 0.0, 0.0]]]]
    fast, ref, A_mha = mha_both_paths(q, k, pad_cols(v, d_k), mask=src_mask, cross=True)
    assert A_mha.squeeze(0).tolist() == pytest.approx([0.78698, 0.10651, 0.10651], abs=ABS)
    assert ref.squeeze(0).tolist() == pytest.approx([0.78698, 0.0, 0.0, 0.0], abs=ABS)
    torch.testing.assert_close(fast, ref, atol=ABS, rtol=0)

    # A causal mask would (wrongly) hide source positions 2 and 3 from query 1
    _, A_causal = attention(q, k, v, mask=causal_mask(3)[:1])
    assert A_causal.squeeze(0).tolist() == [1.0, 0.0, 0.0]

    # a padded source position gets weight exactly 0; the rest renormalize
    src_padded = torch.tensor([[7, 8, 0]])
    _, A_pad = attention(q[None, None], k[None, None], v[None, None],
                         mask=padding_mask(src_padded, pad_id=0))
    w = A_pad.flatten().tolist()
    assert w[2] == 0.0
    e3, e1 = math.exp(3), math.e
    assert w[:2] == pytest.approx([e3 / (e3 + e1), e1 / (e3 + e1)], abs=ABS)


# --------------------------------------------------------------------------- #
# Example 7 - Cell G: translation alignment ("chat" -> "the cat")
# --------------------------------------------------------------------------- #

def test_example7_cell_G_translation_alignment():
    # the softmax inputs are (0, 4): raw dot products (0, 8) with d_k = 4
    d_k = 4
    q, k = keys_for_scores([0.0, 8.0], d_k)
    v = t([[1.0, 0.0], [0.0, 1.0]])  # "the", "cat"
    assert math.exp(0) + math.exp(4) == pytest.approx(55.598, abs=1e-3)
    out, A = attention(q, k, v)
    a_the, a_cat = A.squeeze(0).tolist()
    assert a_the == pytest.approx(0.01799, abs=ABS)
    assert a_cat == pytest.approx(0.98201, abs=ABS)
    assert a_the + a_cat == pytest.approx(1.0, abs=ABS)
    assert out.squeeze(0).tolist() == pytest.approx([0.01799, 0.98201], abs=ABS)
    assert int(A.argmax()) == 1  # the noun aligns to the noun

    # the same numbers with d_k = 1 and the scores fed unscaled
    q1, k1 = keys_for_scores([0.0, 4.0], 1)
    out1, A1 = attention(q1, k1, v, scale=False)
    assert A1.squeeze(0).tolist() == pytest.approx([0.01799, 0.98201], abs=ABS)
    assert out1.squeeze(0).tolist() == pytest.approx([0.01799, 0.98201], abs=ABS)

    fast, ref, A_mha = mha_both_paths(q, k, pad_cols(v, d_k), cross=True)
    assert A_mha.squeeze(0).tolist() == pytest.approx([0.01799, 0.98201], abs=ABS)
    assert fast.squeeze(0).tolist() == pytest.approx([0.01799, 0.98201, 0.0, 0.0], abs=ABS)
    torch.testing.assert_close(fast, ref, atol=ABS, rtol=0)


# --------------------------------------------------------------------------- #
# Example 8 - Cell B (full picture): the chain rule of an autoregressive product
# --------------------------------------------------------------------------- #

class ScriptedDecoder:
    """A StepDecoder whose step t returns fixed next-token probabilities."""

    def __init__(self, probs_per_step: list[list[float]]):
        self.logp = [torch.tensor(p, dtype=torch.float64).log() for p in probs_per_step]
        self.t = 0

    def step(self, y_prev: torch.Tensor) -> torch.Tensor:
        lp = self.logp[self.t].float().expand(y_prev.size(0), -1).clone()
        self.t += 1
        return lp

    def select(self, index: torch.Tensor, group=None) -> None:
        pass


def test_example8_cell_B_chain_rule_product():
    factors = [0.5, 0.4, 0.25]
    assert math.prod(factors) == pytest.approx(0.05, abs=ABS)
    assert all(math.prod(factors) < f for f in factors)

    # summing log-probabilities and exponentiating gives the same product
    log_sum = float(torch.log(torch.tensor(factors, dtype=DT)).sum())
    assert math.exp(log_sum) == pytest.approx(0.05, abs=ABS)
    assert log_sum == pytest.approx(math.log(0.05), abs=ABS)

    # three decoder steps (vocabulary of 8; pad 0, bos 2, eos 3): the chosen
    # token has probability 0.5, 0.4, 0.25 and is the argmax of its step
    rest = lambda p, n: (1 - p) / n  # noqa: E731
    step1 = [rest(0.5, 7)] * 8
    step1[4] = 0.5  # x_1 = 4
    step2 = [rest(0.4, 7)] * 8
    step2[5] = 0.4  # x_2 = 5
    step3 = [rest(0.25, 7)] * 8
    step3[3] = 0.25  # x_3 = </s>
    steps = [step1, step2, step3]
    for s in steps:
        assert sum(s) == pytest.approx(1.0, abs=1e-12)

    # teacher-forced NLL (s2s.trainer.label_smoothed_nll, eps = 0) of the sequence
    logits = torch.log(torch.tensor(steps, dtype=DT))[None]  # (1, 3, 8)
    target = torch.tensor([[4, 5, 3]])
    nll = float(label_smoothed_nll(logits, target, epsilon=0.0, pad_id=0))
    assert nll == pytest.approx(-math.log(0.05), abs=ABS)
    assert math.exp(-nll) == pytest.approx(0.05, abs=ABS)

    # greedy search sums the per-step log-probs into the hypothesis' log_prob
    settings = DecodeConfig(beam=1, length_penalty="none")
    hyps = greedy_search(ScriptedDecoder(steps), torch.tensor([10]), settings, SpecialIds(bos_id=2, eos_id=3, pad_id=0))
    (hyp,) = hyps[0]
    assert hyp.tokens == [4, 5]
    assert hyp.log_prob == pytest.approx(math.log(0.05), abs=ABS)
    assert math.exp(hyp.log_prob) == pytest.approx(0.05, abs=ABS)
    assert hyp.score == pytest.approx(hyp.log_prob, abs=ABS)  # lp(m) = 1
