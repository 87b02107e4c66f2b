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

CACHE_BUCKET = 32  # self-attention buffers hold a multiple of this many positions


def bucketed(n: int, bucket: int = CACHE_BUCKET) -> int:
    """The capacity for n positions: n rounded up to a multiple of ``bucket`` (at least one bucket)."""
    return max(bucket, -(-n // bucket) * bucket)


@dataclass
class LayerCache:
    """One layer's state.  The self-attention K/V live in preallocated buffers
    (rows, heads, capacity, d_head) written by index; ``self_k``/``self_v`` are
    views of the ``length`` positions and ``batch`` rows filled so far.  The
    capacity grows a bucket at a time (:func:`bucketed`), so a step copies
    only the new position, not the prefix (torch.cat would copy all t)."""

    cross_k: Optional[Tensor]  # (B / group, heads, S, d_head): one per sentence; None in a decoder-only stack
    cross_v: Optional[Tensor]  # (B / group, heads, S, d_head)
    coverage: Optional[Tensor] = None  # (B, S) c^t, fp32: the last layer of a model.coverage model
    k_buf: Optional[Tensor] = None  # (rows >= B, heads, capacity >= t, d_head)
    v_buf: Optional[Tensor] = None
    spare: Optional[tuple[Tensor, Tensor]] = None  # buffers of the same shape, what select writes into
    batch: int = 0  # rows in use
    length: int = 0  # positions in use: t

    @property
    def self_k(self) -> Optional[Tensor]:
        return None if self.k_buf is None else self.k_buf[:self.batch, :, :self.length]  # (B, heads, t, d_head)

    @property
    def self_v(self) -> Optional[Tensor]:
        return None if self.v_buf is None else self.v_buf[:self.batch, :, :self.length]  # (B, heads, t, d_head)

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Add these positions' self-attention K/V (B, heads, n, d_head); return all of them."""
        B, heads, n, d_head = k.shape
        t = self.length
        if self.k_buf is None or self.k_buf.size(2) < t + n:
            capacity = bucketed(t + n)
            k_buf = k.new_empty(max(B, self.batch), heads, capacity, d_head)
            v_buf = v.new_empty(max(B, self.batch), heads, capacity, d_head)
            if t:
                k_buf[:self.batch, :, :t] = self.self_k
                v_buf[:self.batch, :, :t] = self.self_v
            self.k_buf, self.v_buf, self.spare = k_buf, v_buf, None
        self.batch = B
        self.k_buf[:B, :, t:t + n] = k
        self.v_buf[:B, :, t:t + n] = v
        self.length = t + n
        return self.self_k, self.self_v

    def select_rows(self, index: Tensor) -> None:
        """Keep self-attention rows ``index``: gathered into the spare buffers, which then
        swap places with the live ones (the gathered rows cannot be written in place)."""
        if self.k_buf is None:
            return
        B, t = index.numel(), self.length
        if B > self.k_buf.size(0):  # more rows than ever (beams made from a prefix): new buffers
            self.k_buf = self._with_capacity(self.self_k.index_select(0, index))
            self.v_buf = self._with_capacity(self.self_v.index_select(0, index))
            self.spare = None
        else:
            if self.spare is None:
                self.spare = (torch.empty_like(self.k_buf), torch.empty_like(self.v_buf))
            k_new, v_new = self.spare
            if torch.is_grad_enabled() and self.k_buf.requires_grad:  # out= has no autograd
                k_new[:B, :, :t], v_new[:B, :, :t] = self.self_k[index], self.self_v[index]
            else:
                torch.index_select(self.self_k, 0, index, out=k_new[:B, :, :t])
                torch.index_select(self.self_v, 0, index, out=v_new[:B, :, :t])
            self.spare = (self.k_buf, self.v_buf)
            self.k_buf, self.v_buf = k_new, v_new
        self.batch = B

    @staticmethod
    def _with_capacity(x: Tensor) -> Tensor:
        """x (B, heads, t, d_head) copied into a buffer of capacity bucketed(t)."""
        buf = x.new_empty(x.size(0), x.size(1), bucketed(x.size(2)), x.size(3))
        buf[:, :, :x.size(2)] = x
        return buf


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
        and are not touched when those are the same sentences in the same order; nor
        are the rows kept per sentence (source mask, ids, H_enc, lengths) when, besides,
        each sentence keeps its G rows (beams reordered within their sentences).
        """
        G_old, rows = self.group, self.batch_size
        self.group = G_old if group is None else group
        sentences = index[::self.group] // G_old
        n_sent = self.batch_size // G_old
        same = sentences.numel() == n_sent and bool(
            (sentences == torch.arange(n_sent, device=index.device)).all())
        if not (same and self.group == G_old and index.numel() == rows):
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
            layer.select_rows(index)
            if layer.coverage is not None:
                layer.coverage = layer.coverage.index_select(0, index)
