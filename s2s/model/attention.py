"""Attention: masks, the reference scaled dot-product, multi-head attention.

Glossary (used in every shape comment of s2s.model):
    B        batch size (sentences, or sentences x beams while searching)
    S        source length (encoder positions, keys of cross-attention)
    T        target length (decoder positions)
    d_model  model width d;  heads h;  d_head = d_model / heads (d_k = d_v)
    V        vocabulary size

Masks are *additive* float tensors: 0 where attention is allowed, -inf where
it is blocked, broadcast against the scores (B, heads, T_q, T_k).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import s2s.model.native  # noqa: F401  (defines torch.ops.s2s.few_query_attention)

NEG_INF = float("-inf")


# --------------------------------------------------------------------------- #
# Masks (docs/model.md (5)-(8))
# --------------------------------------------------------------------------- #

def causal_mask(T: int, device: Optional[torch.device] = None, T_k: Optional[int] = None,
                start: int = 0) -> Tensor:
    """M^causal_ij = 0 if j <= i else -inf.   Shape (T, T).

    With ``T_k`` and ``start``: queries are positions start..start+T-1 and keys
    0..T_k-1 (the decoder resuming from a cache); shape (T, T_k).
    """
    T_k = T if T_k is None else T_k
    i = torch.arange(start, start + T, device=device)[:, None]
    j = torch.arange(T_k, device=device)[None, :]
    return torch.zeros(T, T_k, device=device).masked_fill(j > i, NEG_INF)


def padding_mask(tokens: Tensor, pad_id: int) -> Tensor:
    """M^pad_j = -inf where key j is padding, else 0.

    tokens (B, S) -> mask (B, 1, 1, S), broadcast over heads and query rows.
    """
    return torch.zeros(tokens.shape, device=tokens.device).masked_fill(
        tokens == pad_id, NEG_INF)[:, None, None, :]


# --------------------------------------------------------------------------- #
# Scaled dot-product attention
# --------------------------------------------------------------------------- #

def attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None,
              scale: bool = True, dropout_p: float = 0.0, return_weights: bool = True
              ) -> tuple[Tensor, Optional[Tensor]]:
    """The reference path: A = softmax(Q K^T / sqrt(d_k) + M),  out = A V.

    q (..., T_q, d_k), k (..., T_k, d_k), v (..., T_k, d_v), mask broadcastable
    to (..., T_q, T_k).  Returns (out (..., T_q, d_v), A (..., T_q, T_k)), A None
    with ``return_weights=False`` (in bf16 that spares casting A back).
    ``scale=False`` drops the 1/sqrt(d_k) (docs/model.md (3); worked example 5's "unscaled").
    Each row of A sums to 1 over the unmasked keys (before any dropout,
    which is applied to A only for the product with V).

    In bf16 the two products multiply bf16 (summing in fp32, rounding the result to bf16),
    as autocast runs them, and the softmax runs in fp32 (an fp32 mask makes the masked
    scores fp32); fp16 inputs are computed in fp32 throughout (fp16 scores can overflow).
    """
    dtype = v.dtype
    if dtype == torch.float16:
        q, k, v = q.float(), k.float(), v.float()
    scores = q @ k.transpose(-2, -1)  # (..., T_q, T_k)
    if scale:
        scores = scores / math.sqrt(q.size(-1))
    if mask is not None:
        scores = scores + mask
    A = torch.softmax(scores, dim=-1, dtype=torch.float32 if scores.dtype == torch.bfloat16 else None).to(v.dtype)
    out = F.dropout(A, dropout_p) @ v if dropout_p else A @ v
    return out.to(dtype), A.to(dtype) if return_weights else None


FEW_QUERIES = 16  # up to this many queries per key set (a decoding step: 1, or a sentence's beams)
# Training on the CPU, up to this many keys, attention runs as the reference path's two matmuls
# (bf16 products for bf16 inputs, the softmax in fp32), forward and backward.  torch's CPU flash
# kernel is slow backward in bf16: the reference model trained in bf16 at 9,600 tokens/s with it
# against 14,400 with the two matmuls in bf16 and 15,000 with them in fp32 (an Intel Xeon with AMX,
# rounds of separate processes, whose spread is larger than that difference).  Measured paired (each
# of 30 batches timed both ways in turn in one process; 2 cores of an AMD EPYC Zen 5), a bf16
# update with the products in bf16 took 0.89-0.91 of its time with them in fp32.  From about 256
# keys on, the flash kernel wins (it never holds the T_q x T_k weights).
MATH_KEYS = 128


def few_query_attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None,
                        scale: bool = True) -> Tensor:
    """out = softmax(Q K^T / sqrt(d_k) + M) V for a few queries, as two batched matmuls.

    q (B, heads, T_q, d_k), k (B, heads, T_k, d_k), v (B, heads, T_k, d_v), mask
    broadcastable to (B, heads, T_q, T_k) -> out (B, heads, T_q, d_v).  The same
    function as :func:`attention`; on the CPU, with the one query of a decoding step
    (or a sentence's beams), two ``bmm`` over the B x heads pairs read the K/V cache
    about 1.2-1.4x faster than torch's flash kernel, which tiles for many queries.
    k and v may be views of a preallocated cache (strided along T_k): folding B and
    heads into one batch dimension keeps them views.

    k and v in a narrower dtype than q (bf16 beam slots, s2s.model.cache): the products
    multiply in theirs (q rounded to it, sums in fp32 inside the kernel, the scores
    rounded to it), the softmax runs in q's dtype (an fp32 mask promotes the scores), and
    the output comes back in q's.
    """
    B, H, T_q, d_k = q.shape
    T_k = k.size(-2)
    narrow = k.dtype != q.dtype  # (a decoder step calls this 6 times: no conversions that do nothing)
    if scale:
        q = q * (1.0 / math.sqrt(d_k))
    scores = torch.bmm((q.to(k.dtype) if narrow else q).reshape(B * H, T_q, d_k),
                       k.flatten(0, 1).transpose(1, 2))  # (B*heads, T_q, T_k)
    if mask is not None:
        scores = scores.view(B, H, T_q, T_k) + mask
    A = torch.softmax(scores, dim=-1, dtype=q.dtype)
    out = torch.bmm((A.to(v.dtype) if narrow else A).view(B * H, T_q, T_k), v.flatten(0, 1))
    return out.view(B, H, T_q, v.size(-1)).to(q.dtype) if narrow else out.view(B, H, T_q, v.size(-1))


def inference_attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: bool,
                        few_queries: int = FEW_QUERIES, native: bool = False) -> Tensor:
    """out = softmax(Q K^T / sqrt(d_k) + M) V without weights or dropout (decoding), by the route
    measured fastest: with ``native`` (s2s.model.native: compiled, and chosen for a model that
    decodes on one CPU thread), up to ``few_queries`` fp32 queries against fp32 or bf16 K/V, or
    bf16 queries against bf16 K/V (a bf16 model), through the C kernel; else
    :func:`few_query_attention` for K/V in a dtype of their own (bf16 beam slots) and for up
    to ``few_queries`` fp32 queries on the CPU; else torch's scaled_dot_product_attention.
    q (B, heads, T_q, d_k), k, v (B, heads, T_k, d_k) -> (B, heads, T_q, d_v).  Scriptable:
    the scripted decoder step (s2s.model.step_script) takes the same route."""
    if (native and q.size(-2) <= few_queries and (q.dtype == torch.float32 or q.dtype == torch.bfloat16)
            and v.dtype == k.dtype and (k.dtype == q.dtype or k.dtype == torch.bfloat16) and q.device.type == "cpu"
            and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
            and (mask is None or ((mask.dtype == q.dtype or mask.dtype == torch.float32)
                                  and mask.size(-1) == k.size(-2)))):
        return torch.ops.s2s.few_query_attention(q, k, v, mask, scale)
    if k.dtype != q.dtype or (q.size(-2) <= few_queries and q.dtype == torch.float32 and q.device.type == "cpu"):
        return few_query_attention(q, k, v, mask, scale)
    if mask is not None:
        mask = mask.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=None if scale else 1.0)


def slot_attention(q: Tensor, k: Tensor, v: Tensor, columns: Tensor, scale: bool) -> Tensor:
    """A beam search's self-attention over its slots through the C kernel (s2s.model.native),
    each beam reading only its own ancestors' keys: q (B, heads, 1, d_k) fp32 or bf16 (widened,
    the output rounded back), k, v a sentence's slots (B / K, heads, >= (t + 1) K, d_k), and
    ``columns`` (B, t + 1) long, the columns t' K + a_{t'} of row b's ancestors
    (s2s.model.cache.DecoderCache.self_columns) -> (B, heads, 1, d_k).  The same function as
    the ancestry's mask over all (t + 1) K columns, reading 1/K of them.  Scriptable."""
    return torch.ops.s2s.few_query_attention(q, k, v, None, scale, columns)


class MultiHeadAttention(nn.Module):
    """MHA(X, Y) = concat_h(attention(X W_Q^h, Y W_K^h, Y W_V^h)) W_O.

    Self-attention (``cross=False``) projects Q, K, V with one fused (d, 3d)
    matmul; cross-attention projects Q from the decoder and K, V with one
    fused (d, 2d) matmul over H_enc, so the K/V cache can be built once.
    """

    def __init__(self, d_model: int, heads: int, dropout: float = 0.0, cross: bool = False,
                 d_head: Optional[int] = None, bias: bool = True, scale: bool = True):
        super().__init__()
        self.heads = heads
        self.d_head = d_head or d_model // heads
        self.cross = cross
        self.dropout = dropout
        # scale=False: scores q.k without 1/sqrt(d_head) (T5 folds the scale into W_Q)
        self.scale = scale
        self.native = False  # decoding's few-query attention in C (s2s.model.native.use_native_attention)
        inner = heads * self.d_head  # d_model unless model.head_dim says otherwise
        if cross:
            self.q_proj = nn.Linear(d_model, inner, bias=bias)
            self.kv_proj = nn.Linear(d_model, 2 * inner, bias=bias)
        else:
            self.qkv_proj = nn.Linear(d_model, 3 * inner, bias=bias)
        self.out_proj = nn.Linear(inner, d_model, bias=bias)

    # ---- shape helpers --------------------------------------------------- #
    def split_heads(self, x: Tensor) -> Tensor:
        B, L, _ = x.shape
        return x.view(B, L, self.heads, self.d_head).transpose(1, 2)  # (B, heads, L, d_head)

    def merge_heads(self, x: Tensor) -> Tensor:
        B, _, L, _ = x.shape
        return x.transpose(1, 2).reshape(B, L, self.heads * self.d_head)  # (B, L, d_model)

    # ---- projections ----------------------------------------------------- #
    def project_qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Self-attention Q, K, V, each (B, heads, L, d_head)."""
        return self.split_qkv(self.qkv_proj(x))

    def split_qkv(self, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """X [W_Q W_K W_V] (B, L, 3 d_model) -> Q, K, V, each (B, heads, L, d_head)."""
        q, k, v = qkv.chunk(3, dim=-1)  # 3 x (B, L, d_model)
        return self.split_heads(q), self.split_heads(k), self.split_heads(v)

    def project_kv(self, h_enc: Tensor) -> tuple[Tensor, Tensor]:
        """Cross-attention K = H_enc W_K^c, V = H_enc W_V^c, each (B, heads, S, d_head),
        contiguous: computed once and read at every decoding step."""
        k, v = self.kv_proj(h_enc).chunk(2, dim=-1)  # 2 x (B, S, d_model)
        return self.split_heads(k).contiguous(), self.split_heads(v).contiguous()

    def project_q(self, x: Tensor) -> Tensor:
        return self.split_heads(self.q_proj(x))  # (B, heads, T, d_head)

    # ---- attention ------------------------------------------------------- #
    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor],
               need_weights: bool = False, group: int = 1) -> tuple[Tensor, Optional[Tensor]]:
        """Heads attend and are merged and projected: (B, T_q, d_model).

        The fast path is torch's ``scaled_dot_product_attention``; with
        ``need_weights`` the reference :func:`attention` runs instead and the
        weights A (B, heads, T_q, T_k) are returned too.  With ``group`` G the
        B query rows are B / G sentences of G beams each, and k, v and mask
        hold one row per sentence (the shared cross-attention K/V).
        """
        if group > 1:
            out, A = self.attend_heads(beams_as_queries(q, group), k, v, mask, need_weights)
            out = queries_as_beams(out, group)
            A = None if A is None else queries_as_beams(A, group)
        else:
            out, A = self.attend_heads(q, k, v, mask, need_weights)
        return self.out_proj(self.merge_heads(out)), A

    def attend_heads(self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor],
                     need_weights: bool) -> tuple[Tensor, Optional[Tensor]]:
        """Every head's attention output (B, heads, T_q, d_head), and A with ``need_weights``.
        K/V in a dtype of their own (bf16 beam slots) take :func:`few_query_attention`,
        which multiplies in theirs, or with ``need_weights`` are widened to q's."""
        p = self.dropout if self.training else 0.0
        if k.dtype != q.dtype and (need_weights or p or q.device.type != "cpu" or torch.is_grad_enabled()):
            k, v = k.to(q.dtype), v.to(q.dtype)
        if need_weights:
            out, A = attention(q, k, v, mask, scale=self.scale, dropout_p=p)
        elif q.device.type == "cpu" and torch.is_grad_enabled() and k.size(-2) <= MATH_KEYS:
            out, A = attention(q, k, v, mask, scale=self.scale, dropout_p=p, return_weights=False)
        elif not p:
            native = self.native and not torch.is_grad_enabled()  # (the kernel has no gradient)
            out, A = inference_attention(q, k, v, mask, self.scale, native=native), None
        else:
            if mask is not None:
                mask = mask.to(q.dtype)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p,
                                                 scale=None if self.scale else 1.0)
            A = None
        return out, A


def beams_as_queries(x: Tensor, group: int) -> Tensor:
    """(N*G, heads, T, e) rows, G beams per sentence -> (N, heads, G*T, e): a
    sentence's beams become query positions against its one K/V."""
    NG, H, T, e = x.shape
    return x.view(NG // group, group, H, T, e).transpose(1, 2).reshape(NG // group, H, group * T, e)


def queries_as_beams(x: Tensor, group: int) -> Tensor:
    """The inverse of :func:`beams_as_queries`: (N, heads, G*T, e) -> (N*G, heads, T, e)."""
    N, H, GT, e = x.shape
    return x.view(N, H, group, GT // group, e).transpose(1, 2).reshape(N * group, H, GT // group, e)
