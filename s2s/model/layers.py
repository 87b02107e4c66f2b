"""Encoder and decoder blocks (formula sheet, Lessons 2-3; decoder.txt).

pre-norm (formula sheet, the default):   x <- x + Dropout(Sublayer(Norm(x)))
post-norm (decoder.txt, the 2017 paper): x <- Norm(x + Dropout(Sublayer(x)))
"""

from __future__ import annotations

from typing import Optional

import torch.nn.functional as F
from torch import Tensor, nn

from s2s.model.attention import MultiHeadAttention
from s2s.model.cache import LayerCache


class FeedForward(nn.Module):
    """FFN(x) = W_2 act(W_1 x + b_1) + b_2,  act = ReLU or GELU."""

    def __init__(self, d_model: int, d_ff: int, activation: str, dropout: float):
        super().__init__()
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)
        self.act = F.relu if activation == "relu" else F.gelu
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.w_2(self.dropout(self.act(self.w_1(x))))


class EncoderLayer(nn.Module):
    """H' = H + MHA_bidir(Norm(H));  H_out = H' + FFN(Norm(H'))   (pre-norm form)."""

    def __init__(self, d_model: int, heads: int, d_ff: int, activation: str, dropout: float,
                 attention_dropout: float, pre_norm: bool):
        super().__init__()
        self.pre_norm = pre_norm
        self.self_attn = MultiHeadAttention(d_model, heads, attention_dropout)
        self.norm1 = nn.LayerNorm(d_model)
        self.ffn = FeedForward(d_model, d_ff, activation, dropout)
        self.norm2 = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def _self_attn(self, x: Tensor, mask: Optional[Tensor]) -> Tensor:
        q, k, v = self.self_attn.project_qkv(x)  # (B, heads, S, d_head)
        return self.self_attn.attend(q, k, v, mask)[0]

    def forward(self, x: Tensor, mask: Optional[Tensor]) -> Tensor:
        """x (B, S, d_model); mask: padding (+ relative bias), broadcast to (B, heads, S, S)."""
        drop = self.dropout
        if self.pre_norm:
            # 1. bidirectional self-attention (padding mask only)
            x = x + drop(self._self_attn(self.norm1(x), mask))
            # 2. position-wise feed-forward
            x = x + drop(self.ffn(self.norm2(x)))
        else:
            x = self.norm1(x + drop(self._self_attn(x, mask)))
            x = self.norm2(x + drop(self.ffn(x)))
        return x


class DecoderLayer(nn.Module):
    """H1 = H + SelfAttn_causal(Norm(H))
    H2 = H1 + CrossAttn(Norm(H1), H_enc)
    H3 = H2 + FFN(Norm(H2))                    (pre-norm form)."""

    def __init__(self, d_model: int, heads: int, d_ff: int, activation: str, dropout: float,
                 attention_dropout: float, pre_norm: bool):
        super().__init__()
        self.pre_norm = pre_norm
        self.self_attn = MultiHeadAttention(d_model, heads, attention_dropout)
        self.norm1 = nn.LayerNorm(d_model)
        self.cross_attn = MultiHeadAttention(d_model, heads, attention_dropout, cross=True)
        self.norm2 = nn.LayerNorm(d_model)
        self.ffn = FeedForward(d_model, d_ff, activation, dropout)
        self.norm3 = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def _self_attn(self, x: Tensor, self_mask: Optional[Tensor], cache: Optional[LayerCache]) -> Tensor:
        q, k, v = self.self_attn.project_qkv(x)  # (B, heads, T, d_head)
        if cache is not None:
            k, v = cache.append(k, v)  # (B, heads, t+T, d_head): the prefix is reused
        return self.self_attn.attend(q, k, v, self_mask)[0]

    def _cross_attn(self, x: Tensor, cross_k: Tensor, cross_v: Tensor, src_mask: Tensor,
                    need_weights: bool) -> tuple[Tensor, Optional[Tensor]]:
        q = self.cross_attn.project_q(x)  # (B, heads, T, d_head)
        return self.cross_attn.attend(q, cross_k, cross_v, src_mask, need_weights)  # A: (B, heads, T, S)

    def forward(self, x: Tensor, cross_k: Tensor, cross_v: Tensor, self_mask: Optional[Tensor],
                src_mask: Tensor, cache: Optional[LayerCache] = None,
                need_weights: bool = False) -> tuple[Tensor, Optional[Tensor]]:
        """x (B, T, d_model); cross_k/v (B, heads, S, d_head) from H_enc.

        Returns the block output and, with ``need_weights``, the
        cross-attention weights A (B, heads, T, S).
        """
        drop = self.dropout
        if self.pre_norm:
            # 1. target-target causal self-attention
            x = x + drop(self._self_attn(self.norm1(x), self_mask, cache))
            # 2. target-source cross-attention: Q from the decoder, K/V from H_enc
            h, A = self._cross_attn(self.norm2(x), cross_k, cross_v, src_mask, need_weights)
            x = x + drop(h)
            # 3. position-wise feed-forward
            x = x + drop(self.ffn(self.norm3(x)))
        else:
            x = self.norm1(x + drop(self._self_attn(x, self_mask, cache)))
            h, A = self._cross_attn(x, cross_k, cross_v, src_mask, need_weights)
            x = self.norm2(x + drop(h))
            x = self.norm3(x + drop(self.ffn(x)))
        return x, A
