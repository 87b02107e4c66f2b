"""Encoder and decoder blocks (docs/model.md (11)-(13)).

pre-norm (the default):      x <- x + Dropout(Sublayer(Norm(x)))
post-norm (the 2017 paper):  x <- Norm(x + Dropout(Sublayer(x)))
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from s2s.config import ModelConfig
from s2s.model import gemm
from s2s.model.attention import MultiHeadAttention, attention, slot_attention
from s2s.model.cache import LayerCache
from s2s.model.dropout import Dropout
from s2s.model.int8 import Int8Linear
from s2s.model.packing import Packing

ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,  # exact: x Phi(x)
    "gelu_tanh": partial(F.gelu, approximate="tanh"),  # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
    "silu": F.silu,  # x sigmoid(x), "swish"
}
# the same functions overwriting their input: without autograd (decoding) the (B, L, d_ff)
# hidden layer is written once, not copied into a second fresh tensor
ACTIVATIONS_IN_PLACE = {"relu": torch.relu_, "silu": partial(F.silu, inplace=True)}


def identity(x: Tensor) -> Tensor:
    """Dropout outside training: x itself, without a module call per sub-layer while decoding."""
    return x


def make_norm(cfg: ModelConfig) -> nn.Module:
    """LayerNorm(x) = (x - mean) / sqrt(var + eps) * g + b,  or  RMSNorm(x) = x / sqrt(mean(x^2) + eps) * g."""
    if cfg.norm_type == "rmsnorm":
        return nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)


class FeedForward(nn.Module):
    """FFN(x) = W_2 act(W_1 x + b_1) + b_2,   or gated (``model.gated_ffn``):
    FFN(x) = W_2 (act(W_1 x) * W_3 x)   (GLU variants; T5 v1.1's gated-GELU)."""

    def __init__(self, d_model: int, d_ff: int, activation: str, dropout: float, bias: bool = True,
                 gated: bool = False):
        super().__init__()
        self.w_1 = nn.Linear(d_model, d_ff, bias=bias)
        self.w_3 = nn.Linear(d_model, d_ff, bias=bias) if gated else None
        self.w_2 = nn.Linear(d_ff, d_model, bias=bias)
        self.act = ACTIVATIONS[activation]
        self.act_in_place = ACTIVATIONS_IN_PLACE.get(activation)
        self.post_op = activation if activation in gemm.POST_OPS else None  # fused into a packed W_1
        self.dropout = Dropout(dropout)

        self.w_13: Optional[nn.Linear] = None  # [W_1; W_3] in one matrix: see fuse_matmuls
        self.fused_from: dict[str, tuple[str, ...]] = {}

    def forward(self, x: Tensor) -> Tensor:
        if self.w_13 is not None:
            a, g = self.w_13(x).chunk(2, dim=-1)  # 2 x (B, L, d_ff)
            h = self.act(a) * g
        elif self.post_op == "relu" and isinstance(self.w_1, Int8Linear) and self.w_1.pays(x):
            h = self.w_1.int8(x, relu=True)  # the ReLU inside the int8 product
            if self.w_3 is not None:
                h = h.mul_(self.w_3(x))
        elif self.post_op is not None and isinstance(self.w_1, gemm.PackedLinear) and gemm.takes_packed(
                x, self.w_1.packed):
            h = gemm.packed_linear(x, self.w_1.weight, self.w_1.packed, self.w_1.bias, self.post_op)
            if self.w_3 is not None:
                h = h.mul_(self.w_3(x))
        else:
            in_place = self.act_in_place is not None and not torch.is_grad_enabled()
            h = (self.act_in_place if in_place else self.act)(self.w_1(x))
            if self.w_3 is not None:
                h = h.mul_(self.w_3(x)) if in_place else h * self.w_3(x)
        return self.w_2(self.dropout(h) if self.training else h)

    def fuse_matmuls(self) -> None:
        """Gated: W_1 x and W_3 x as one matmul, [W_1; W_3] x (2 d_ff outputs), for a training
        copy of the model (s2s.precision.Bf16Copy, which keeps ``fused_from`` in step with the
        model's w_1 and w_3).  The model itself, and its state-dict keys, keep w_1 and w_3."""
        if self.w_3 is None or self.w_13 is not None:
            return
        w_1, w_3 = self.w_1, self.w_3
        fused = nn.Linear(w_1.in_features, 2 * w_1.out_features, bias=w_1.bias is not None,
                          device=w_1.weight.device, dtype=w_1.weight.dtype)
        with torch.no_grad():
            fused.weight.copy_(torch.cat([w_1.weight, w_3.weight]))  # (2 d_ff, d_model)
            if w_1.bias is not None:
                fused.bias.copy_(torch.cat([w_1.bias, w_3.bias]))
        self.w_13, self.w_1, self.w_3 = fused, None, None
        self.fused_from = {"w_13.weight": ("w_1.weight", "w_3.weight")}
        if fused.bias is not None:
            self.fused_from["w_13.bias"] = ("w_1.bias", "w_3.bias")


def _attention(cfg: ModelConfig, cross: bool = False) -> MultiHeadAttention:
    return MultiHeadAttention(cfg.d_model, cfg.heads, cfg.attention_dropout, cross=cross,
                              d_head=cfg.d_head, bias=cfg.bias, scale=cfg.attention_scale)


def _ffn(cfg: ModelConfig) -> FeedForward:
    return FeedForward(cfg.d_model, cfg.d_ff, cfg.activation, cfg.activation_dropout, cfg.bias, cfg.gated_ffn)


def packed_self_attention(mha: MultiHeadAttention, x: Tensor, mask: Optional[Tensor], packing: Packing) -> Tensor:
    """Self-attention of a packed batch (s2s.model.packing): x (N, d_model) the real rows; the
    projections run on them, the attention on the padded (B, L) layout -> (N, d_model)."""
    q, k, v = mha.split_qkv(packing.pad(mha.qkv_proj(x)))  # (B, heads, L, d_head)
    out = mha.attend_heads(q, k, v, mask, need_weights=False)[0]
    return mha.out_proj(packing.pack(mha.merge_heads(out)))  # (N, d_model)


class EncoderLayer(nn.Module):
    """H' = H + MHA_bidir(Norm(H));  H_out = H' + FFN(Norm(H'))   (pre-norm form)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.pre_norm = cfg.norm == "pre"
        self.self_attn = _attention(cfg)
        self.norm1 = make_norm(cfg)
        self.ffn = _ffn(cfg)
        self.norm2 = make_norm(cfg)
        self.dropout = Dropout(cfg.dropout)

    def _self_attn(self, x: Tensor, mask: Optional[Tensor], cache: Optional[LayerCache],
                   packing: Optional[Packing]) -> Tensor:
        mha = self.self_attn
        if packing is not None:
            return packed_self_attention(mha, x, mask, packing)
        q, k, v = mha.project_qkv(x)  # (B, heads, S, d_head)
        if cache is not None:
            k, v = cache.append(k, v)  # the keys so far and these (a decoder-only stack's cache)
        return mha.attend(q, k, v, mask)[0]

    def forward(self, x: Tensor, mask: Optional[Tensor], cache: Optional[LayerCache] = None,
                packing: Optional[Packing] = None) -> Tensor:
        """x (B, S, d_model); mask: padding (+ relative bias), broadcast to (B, heads, S, S).
        With ``cache`` (one stack over [x; y]) x's K/V are appended to the cached ones first.
        With ``packing`` x is the batch's real positions only (N, d_model) (s2s.model.packing):
        everything but the attention runs on them (an encoder's pass: no ``cache``)."""
        if packing is not None and cache is not None:
            raise ValueError("a packed batch has no cache: packing is for an encoder's one pass")
        drop = self.dropout if self.training else identity
        if self.pre_norm:
            # 1. self-attention (bidirectional in an encoder: padding mask only)
            x = x + drop(self._self_attn(self.norm1(x), mask, cache, packing))
            # 2. position-wise feed-forward
            x = x + drop(self.ffn(self.norm2(x)))
        else:
            x = self.norm1(x + drop(self._self_attn(x, mask, cache, packing)))
            x = self.norm2(x + drop(self.ffn(x)))
        return x


class DecoderLayer(nn.Module):
    """H1 = H + SelfAttn_causal(Norm(H))
    H2 = H1 + CrossAttn(Norm(H1), H_enc)
    H3 = H2 + FFN(Norm(H2))                    (pre-norm form)."""

    def __init__(self, cfg: ModelConfig, coverage: bool = False):
        super().__init__()
        self.pre_norm = cfg.norm == "pre"
        self.self_attn = _attention(cfg)
        self.norm1 = make_norm(cfg)
        self.cross_attn = _attention(cfg, cross=True)
        # coverage-aware cross-attention: w_cov[h] * c^t_j added to head h's scores (0 at the start)
        self.w_cov = nn.Parameter(torch.zeros(cfg.heads)) if coverage else None
        self.norm2 = make_norm(cfg)
        self.ffn = _ffn(cfg)
        self.norm3 = make_norm(cfg)
        self.dropout = Dropout(cfg.dropout)

    def _self_attn(self, x: Tensor, self_mask: Optional[Tensor], cache: LayerCache,
                   packing: Optional[Packing] = None) -> Tensor:
        if packing is not None:  # teacher forcing from t = 0: no K/V kept for later steps
            return packed_self_attention(self.self_attn, x, self_mask, packing)
        q, k, v = self.self_attn.project_qkv(x)  # (B, heads, T, d_head)
        k, v = cache.append(k, v)  # (B, heads, t+T, d_head): the prefix is reused
        if cache.columns is not None:  # each beam its own ancestors' slots, through the kernel
            mha = self.self_attn
            return mha.out_proj(mha.merge_heads(slot_attention(q, k, v, cache.columns, mha.scale)))
        # with beam slots: (B / K, heads, (t+1) K, d_head), a sentence's beams as K queries
        return self.self_attn.attend(q, k, v, self_mask, group=cache.slots)[0]

    def _cross_attn(self, x: Tensor, src_mask: Tensor, cache: LayerCache, group: int,
                    need_weights: bool, packing: Optional[Packing] = None) -> tuple[Tensor, Optional[Tensor]]:
        """Q from x, K/V from the cache (one per sentence: ``group`` G rows of x, a sentence's
        beams, share them; src_mask has one row per row of x).  A coverage layer also
        advances the cache's coverage c^t over these T positions.  With ``packing``, x (N,
        d_model) is the real rows (s2s.model.packing): Q and the output projected on them."""
        mha = self.cross_attn
        if packing is not None:
            q = mha.split_heads(packing.pad(mha.q_proj(x)))  # (B, heads, T, d_head)
            out, A = mha.attend_heads(q, cache.cross_k, cache.cross_v, src_mask, need_weights)
            return mha.out_proj(packing.pack(mha.merge_heads(out))), A  # (N, d_model)
        q = mha.project_q(x)  # (B, heads, T, d_head)
        if self.w_cov is None:
            return self.cross_attn.attend(q, cache.cross_k, cache.cross_v, src_mask[::group], need_weights,
                                          group)  # A: (B, heads, T, S)
        k, v = cache.cross_k, cache.cross_v
        if group > 1:  # each beam has its own coverage bias: one K/V per row
            k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        h, A, cache.coverage = self._coverage_attn(q, k, v, src_mask, cache.coverage)
        return h, (A if need_weights else None)

    def _coverage_attn(self, q: Tensor, k: Tensor, v: Tensor, src_mask: Tensor, c: Tensor
                       ) -> tuple[Tensor, Tensor, Tensor]:
        """A_t = softmax(q_t K^T / sqrt(d_head) + M + w_cov c^t),  c^{t+1} = c^t + mean_heads(A_t).

        c (B, S) is the coverage before the first query.  Each position's
        attention depends on the coverage of the ones before, so the T
        queries are attended one after another (T is the summary length).
        Returns the merged output (B, T, d_model), A (B, heads, T, S) and c^{T}.
        """
        p = self.cross_attn.dropout if self.training else 0.0
        outs, weights = [], []
        for t in range(q.size(2)):
            bias = self.w_cov[None, :, None, None] * c[:, None, None, :].to(q.dtype)  # (B, heads, 1, S)
            out_t, A_t = attention(q[:, :, t:t + 1], k, v, src_mask + bias, scale=self.cross_attn.scale,
                                   dropout_p=p)
            c = c + A_t.mean(1)[:, 0].to(c.dtype)  # (B, S)
            outs.append(out_t)
            weights.append(A_t)
        out = torch.cat(outs, dim=2)  # (B, heads, T, d_head)
        return self.cross_attn.out_proj(self.cross_attn.merge_heads(out)), torch.cat(weights, dim=2), c

    def forward(self, x: Tensor, self_mask: Optional[Tensor], src_mask: Tensor, cache: LayerCache,
                group: int = 1, need_weights: bool = False,
                packing: Optional[Packing] = None) -> tuple[Tensor, Optional[Tensor]]:
        """x (B, T, d_model) at target positions t..t+T-1; ``cache`` this layer's state
        (cross K/V from H_enc, the self-attention K/V before t, which x's are appended to,
        and a coverage layer's c^t, which advances to c^{t+T}); ``group``: see _cross_attn.
        With ``packing`` (teacher forcing from t = 0, no coverage) x is the real target
        positions only (N, d_model): all but the attention runs on them, and the self-attention
        K/V are not kept in the cache.

        Returns the block output (B, T, d_model) and, with ``need_weights``, the
        cross-attention weights A (B, heads, T, S) (else None).
        """
        if packing is not None and (self.w_cov is not None or group > 1 or cache.length):
            raise ValueError("a packed decoder pass is teacher forcing from t = 0 without coverage")
        drop = self.dropout if self.training else identity
        if self.pre_norm:
            # 1. target-target causal self-attention
            x = x + drop(self._self_attn(self.norm1(x), self_mask, cache, packing))
            # 2. target-source cross-attention: Q from the decoder, K/V from H_enc
            h, A = self._cross_attn(self.norm2(x), src_mask, cache, group, need_weights, packing)
            x = x + drop(h)
            # 3. position-wise feed-forward
            x = x + drop(self.ffn(self.norm3(x)))
        else:
            x = self.norm1(x + drop(self._self_attn(x, self_mask, cache, packing)))
            h, A = self._cross_attn(x, src_mask, cache, group, need_weights, packing)
            x = self.norm2(x + drop(h))
            x = self.norm3(x + drop(self.ffn(x)))
        return x, A
