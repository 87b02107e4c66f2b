"""The incremental-decoding state: one explicit object, owned by the search.

Per decoder layer it holds
  * the self-attention K/V of every position decoded so far, which grow by
    one position per step (the prefix is never recomputed), and
  * the cross-attention K/V, computed once from H_enc and fixed for all steps
    (docs/model.md (28)),
plus the source padding mask.  A coverage model's last layer also holds the
coverage c^t = sum_{t' < t} A_t' of its cross-attention, which grows by one
step's attention per step.  ``select(index)`` reorders (or shrinks) every
tensor along the batch dimension at once: beams that survive a step, or
sentences that are still being decoded.

The beams of one sentence share its cross-attention K/V, so those are kept
once per sentence: the decoding rows come in ``group``s of consecutive rows
(the K beams of a sentence), and the cross-attention reads the beams of a
sentence as K queries against that sentence's K/V (no copy per beam, and no
reordering when beams are reordered within their sentence).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from s2s.model.base import VocabSubset


@dataclass
class LayerCache:
    cross_k: Optional[Tensor]  # (B / group, heads, S, d_head): one per sentence; None in a decoder-only stack
    cross_v: Optional[Tensor]  # (B / group, heads, S, d_head)
    self_k: Optional[Tensor] = None  # (B, heads, t, d_head)
    self_v: Optional[Tensor] = None  # (B, heads, t, d_head)
    coverage: Optional[Tensor] = None  # (B, S) c^t, fp32: the last layer of a model.coverage model

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Add these positions' self-attention K/V (B, heads, n, d_head); return all of them."""
        if self.self_k is None:
            self.self_k, self.self_v = k, v
        else:
            self.self_k = torch.cat([self.self_k, k], dim=2)  # (B, heads, t+1, d_head)
            self.self_v = torch.cat([self.self_v, v], dim=2)
        return self.self_k, self.self_v


@dataclass
class DecoderCache:
    layers: list[LayerCache]
    src_mask: Tensor  # (B, 1, 1, S) additive
    step: int = 0  # number of target positions already decoded
    src: Optional[Tensor] = None  # (B, S) source ids, for copying (model.copy)
    h_enc: Optional[Tensor] = None  # (B, S, d_model), for the copy context vector (model.copy)
    src_len: Optional[Tensor] = None  # (B,) real prefix lengths (one stack over [x; y]: y's positions)
    group: int = 1  # consecutive rows per sentence (its beams); the cross K/V have B / group rows
    vocab_subset: Optional[VocabSubset] = None  # score only these target ids (a shortlist); all rows share it

    @property
    def batch_size(self) -> int:
        return self.src_mask.size(0)

    def select(self, index: Tensor, group: Optional[int] = None) -> None:
        """Keep rows ``index`` (1-D LongTensor) of every cached tensor, in that order.

        ``group`` G (default: unchanged) makes the rows groups of G consecutive
        rows of one sentence; rows index[g*G : (g+1)*G] must all come from one
        sentence (the beams that survive a step; a sentence's beams made from
        its one row).  The cross-attention K/V keep sentences index[::G] // G_old,
        and are not touched when those are the same sentences in the same order.
        """
        G_old = self.group
        self.group = G_old if group is None else group
        sentences = index[::self.group] // G_old
        n_sent = self.batch_size // G_old
        same = sentences.numel() == n_sent and bool(
            (sentences == torch.arange(n_sent, device=index.device)).all())
        self.src_mask = self.src_mask.index_select(0, index)
        if self.src is not None:
            self.src = self.src.index_select(0, index)
            self.h_enc = self.h_enc.index_select(0, index)
        if self.src_len is not None:
            self.src_len = self.src_len.index_select(0, index)
        for layer in self.layers:
            if layer.cross_k is not None and not same:
                layer.cross_k = layer.cross_k.index_select(0, sentences)
                layer.cross_v = layer.cross_v.index_select(0, sentences)
            if layer.self_k is not None:
                layer.self_k = layer.self_k.index_select(0, index)
                layer.self_v = layer.self_v.index_select(0, index)
            if layer.coverage is not None:
                layer.coverage = layer.coverage.index_select(0, index)
