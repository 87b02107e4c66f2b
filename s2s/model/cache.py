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

A beam search's self-attention K/V are kept per sentence too ("slots"): the K
beams' keys of position t' sit in columns t' K .. t' K + K - 1 of their
sentence's buffer, slot j written by the beam in row j at that step, and are
never moved when beams are reordered.  Instead each row carries its ancestry,
the slot a_{t'} of its ancestor at every position t' < t, and attends to all
of its sentence's t K keys through the mask

    M_{(n, j), t' K + i} = 0 if i == a_{t'}(n, j) else -inf,

the same K queries against one K/V as the cross-attention.  That is K times
the attention's multiply-adds, in K times fewer and larger products, and it
spares the gather of every row's t keys and values into their new rows at
every step, which moved three times the bytes the attention reads.

The slots may be kept in a narrower dtype than the model computes in
(``DecoderCache.slot_dtype``: bf16 on a CPU that multiplies bf16 natively).  Those
products are then bf16 and are fast only on a contiguous batch of matrices: torch
copies a strided view of a buffer (its first t K of ``capacity`` columns) before a
bf16 ``bmm`` (924 against 231 us for 64 sentences x 4 heads, 5 beams x 100 keys, on
an AMD EPYC Zen 5).  So such a buffer is read whole: it grows
:data:`WHOLE_BUCKET` positions at a time, starts as zeros (its columns past t K
hold finite numbers), and the mask gives its columns past t K -inf (see
:meth:`DecoderCache.self_attention_mask`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from s2s.model.attention import beams_as_queries
from s2s.model.base import VocabSubset

CACHE_BUCKET = 32  # self-attention buffers hold a multiple of this many positions
WHOLE_BUCKET = 8  # ... and slots read whole (a narrower slot_dtype): fewer unused columns to multiply


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
    k_buf: Optional[Tensor] = None  # (rows >= B, heads, capacity >= t, d_head); slots: (sentences, heads, >= tK, .)
    v_buf: Optional[Tensor] = None
    spare: Optional[tuple[Tensor, Tensor]] = None  # buffers of the same shape, what select writes into
    batch: int = 0  # rows in use (sentences, with slots)
    length: int = 0  # positions in use: t
    slots: int = 1  # K > 1: one buffer row per sentence, K columns per position (see the module doc)
    slot_dtype: Optional[torch.dtype] = None  # with slots: their dtype, buffers read whole (module doc)
    kv_dtype: Optional[torch.dtype] = None  # without slots: the buffers' dtype where not the model's (narrow_kv)
    columns: Optional[Tensor] = None  # with slots, this step's: the columns each row reads (DecoderCache.self_columns)

    @property
    def whole(self) -> bool:
        """Whether the attention reads this layer's buffers whole (slots in a slot_dtype)."""
        return self.slots > 1 and self.slot_dtype is not None

    def columns_after_append(self) -> int:
        """With slots read whole: the columns of the buffers the next step's append returns
        (capacity K :func:`bucketed` (t + 1), or more where a buffer is already wider)."""
        K = self.slots
        if self.k_buf is not None and self.k_buf.size(2) >= (self.length + 1) * K:
            return self.k_buf.size(2)
        return bucketed(self.length + 1, WHOLE_BUCKET) * K

    @property
    def self_k(self) -> Optional[Tensor]:
        """(B, heads, t, d_head), or with K slots (B / K, heads, t K, d_head)."""
        return None if self.k_buf is None else self.k_buf[:self.batch, :, :self.length * self.slots]

    @property
    def self_v(self) -> Optional[Tensor]:
        return None if self.v_buf is None else self.v_buf[:self.batch, :, :self.length * self.slots]

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Add these positions' self-attention K/V (B, heads, n, d_head); return all of them
        (with K slots, n = 1 and the sentences' (B / K, heads, (t + 1) K, d_head); slots
        read whole: the whole buffers, (B / K, heads, columns_after_append(), d_head))."""
        if self.slots > 1:
            if k.size(2) != 1:
                raise ValueError("a cache with beam slots takes one position per step")
            # one position's beams as their sentence's K slots: (B / K, heads, K, d_head), a view
            k, v = beams_as_queries(k, self.slots), beams_as_queries(v, self.slots)
        B, heads, n, d_head = k.shape
        t = self.length * self.slots  # columns in use
        self.reserve(B, n, heads, d_head, k)
        self.k_buf[:B, :, t:t + n] = k
        self.v_buf[:B, :, t:t + n] = v
        self.advance(B, n // self.slots)
        if self.whole:
            return self.k_buf[:B], self.v_buf[:B]
        return self.self_k, self.self_v

    def advance(self, B: int, positions: int = 1) -> None:
        """The buffers' B rows now hold ``positions`` more positions, written in place (by
        :meth:`append`, or a scripted step: s2s.model.step_script)."""
        self.batch = B
        self.length += positions

    def reserve(self, B: int, n: int, heads: int, d_head: int, like: Tensor) -> None:
        """Room in the buffers for n more columns of B rows (sentences, with slots), grown a
        bucket at a time (:func:`bucketed`; read whole: :meth:`columns_after_append`), the
        columns in use copied over; new buffers in ``like``'s dtype (or the slot_dtype, or the
        kv_dtype) and device.  What :meth:`append` writes into, and a scripted step too (s2s.model.step_script)."""
        t, K = self.length * self.slots, self.slots  # columns in use; K columns per position
        if self.k_buf is not None and self.k_buf.size(2) >= t + n and self.k_buf.size(0) >= B:
            return
        if self.whole:  # zeros: the columns past t K are multiplied too (and masked)
            capacity = self.columns_after_append()  # the columns the step's mask was made for
            k_buf = like.new_zeros(max(B, self.batch), heads, capacity, d_head, dtype=self.slot_dtype)
            v_buf = like.new_zeros(max(B, self.batch), heads, capacity, d_head, dtype=self.slot_dtype)
        else:
            capacity = bucketed(self.length + n // K) * K
            k_buf = like.new_empty(max(B, self.batch), heads, capacity, d_head, dtype=self.kv_dtype)
            v_buf = like.new_empty(max(B, self.batch), heads, capacity, d_head, dtype=self.kv_dtype)
        if t:
            k_buf[:self.batch, :, :t] = self.self_k
            v_buf[:self.batch, :, :t] = self.self_v
        self.k_buf, self.v_buf, self.spare = k_buf, v_buf, None

    def select_sentences(self, sentences: Tensor) -> None:
        """With slots: keep the sentences ``sentences`` (their beams' ancestry lives in the
        DecoderCache; the keys themselves never move otherwise).  The buffers keep their
        capacity: the next steps append in place, without growing them again."""
        if self.k_buf is not None:
            used = self.length * self.slots
            make = self.k_buf.new_zeros if self.whole else self.k_buf.new_empty  # whole: finite past t K
            shape = (sentences.numel(), *self.k_buf.shape[1:])
            k_buf, v_buf = make(shape), make(shape)
            gather_rows(self.self_k, sentences, k_buf[:, :, :used])
            gather_rows(self.self_v, sentences, v_buf[:, :, :used])
            self.k_buf, self.v_buf, self.batch = k_buf, v_buf, sentences.numel()

    def slots_to_rows(self, columns: Tensor, dtype: torch.dtype) -> None:
        """Leave the slot layout: row r's keys become columns ``columns[r]`` (B, t) of its
        sentence's (row r // K), one buffer row per decoding row again (in ``dtype``, the
        model's, where the slots had a slot_dtype of their own)."""
        K = self.slots
        self.slots, self.slot_dtype = 1, None
        if self.k_buf is None:
            return
        B, t = columns.shape
        sentence = torch.arange(B, device=columns.device) // K
        at = columns[:, None, :, None].expand(B, self.k_buf.size(1), t, self.k_buf.size(3))
        k = self.k_buf.index_select(0, sentence).gather(2, at).to(dtype)  # (B, heads, t, d_head)
        v = self.v_buf.index_select(0, sentence).gather(2, at).to(dtype)
        self.k_buf, self.v_buf, self.spare = self._with_capacity(k), self._with_capacity(v), None
        self.batch = B

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
            gather_rows(self.self_k, index, k_new[:B, :, :t])
            gather_rows(self.self_v, index, v_new[:B, :, :t])
            self.spare = (self.k_buf, self.v_buf)
            self.k_buf, self.v_buf = k_new, v_new
        self.batch = B

    def move_rows(self, targets: Tensor, sources: Tensor, n: int) -> None:
        """Rows ``sources`` (all >= n) copied into rows ``targets``, then the first n rows kept:
        in place, moving only those rows (see :func:`tail_moves`)."""
        if self.k_buf is not None:
            t = self.length * self.slots
            self.k_buf[targets, :, :t] = self.k_buf[sources, :, :t]
            self.v_buf[targets, :, :t] = self.v_buf[sources, :, :t]
        self.batch = n

    @staticmethod
    def _with_capacity(x: Tensor) -> Tensor:
        """x (B, heads, t, d_head) copied into a buffer of capacity bucketed(t)."""
        buf = x.new_empty(x.size(0), x.size(1), bucketed(x.size(2)), x.size(3))
        buf[:, :, :x.size(2)] = x
        return buf


def gather_rows(x: Tensor, index: Tensor, out: Tensor) -> None:
    """out = x[index] (rows along dim 0) written into ``out``, a view of a preallocated buffer:
    index_select's out= without autograd, an indexed copy when x needs gradients (out= has none)."""
    if torch.is_grad_enabled() and x.requires_grad:
        out.copy_(x[index])
    else:
        torch.index_select(x, 0, index, out=out)


def sentence_rows(sentences: Tensor, group: int) -> Tensor:
    """The rows of sentences ``sentences`` (N,), G = ``group`` consecutive rows each:
    sentence n's rows n G .. n G + G - 1, (N G,)."""
    return (sentences[:, None] * group + torch.arange(group, device=sentences.device)).flatten()


def tail_moves(index: Tensor, rows: int, group: int = 1) -> Optional[tuple[Tensor, Tensor]]:
    """For a select of ``index`` from ``rows`` rows, G = ``group`` rows per sentence, that keeps
    whole sentences, sentences 0 .. n - 1 where they are except some, taken from sentences n
    and past (:func:`s2s.search.tail_filled`): (targets, sources), the sentences that move,
    when they are at most half of the n; else None."""
    G = group
    if index.numel() >= rows or index.numel() % G:
        return None
    sentences = index[::G] // G
    if G > 1 and not torch.equal(index, sentence_rows(sentences, G)):
        return None
    n = sentences.numel()
    targets = (sentences != torch.arange(n, device=index.device)).nonzero().flatten()
    sources = sentences[targets]
    if 2 * targets.numel() > n or not bool((sources >= n).all()):
        return None
    return targets, sources


def ancestry_mask(ancestry: Tensor, K: int, dtype: torch.dtype) -> Tensor:
    """M (B / K, 1, K, t K) additive: 0 where slot i of position t' holds row (n, j)'s ancestor,
    M_{(n, j), t' K + i} = 0 if i == ancestry[n K + j, t'] else -inf;  ancestry (B, t) slots."""
    B, t = ancestry.shape
    own = ancestry[:, :, None] == torch.arange(K, device=ancestry.device)  # (B, t, K)
    mask = torch.zeros(own.shape, dtype=dtype, device=ancestry.device).masked_fill_(~own, float("-inf"))
    return mask.view(B // K, 1, K, t * K)


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
    beam_slots: bool = False  # the model's layers take slots: a beam search from an empty cache uses them
    slot_dtype: Optional[torch.dtype] = None  # the slots' dtype where not the model's (module doc)
    ancestry: Optional[Tensor] = None  # (B, t) long: with slots, the slot of each row's ancestor at each t'

    def narrow_kv(self, dtype: torch.dtype) -> None:
        """Keep every layer's attention K/V in ``dtype`` from now on, for a search without slots
        (greedy): the cross-attention K/V rounded once, the self-attention K/V as each step
        writes them (bf16 for an fp32 model: every step reads them all for one query per row,
        and the attention kernel widens them as it reads, s2s.model.native).  Not a coverage
        layer's, whose attention weights are kept."""
        for layer in self.layers:
            if layer.coverage is not None or layer.slots > 1:
                continue
            if layer.cross_k is not None:
                layer.cross_k, layer.cross_v = layer.cross_k.to(dtype), layer.cross_v.to(dtype)
            layer.kv_dtype = dtype

    @property
    def slots(self) -> int:
        """K when the self-attention K/V are kept in beam slots (see the module doc), else 1."""
        return self.layers[0].slots if self.layers else 1

    def record_slots(self) -> Tensor:
        """With slots: record this step's own slots in every row's ancestry (each beam's new
        keys go to its own slot j), once per step, before the layers; the ancestry (B, t + 1)."""
        K = self.slots
        own = torch.arange(K, device=self.src_mask.device).repeat(self.batch_size // K)  # (B,)
        self.ancestry = own[:, None] if self.ancestry is None else torch.cat([self.ancestry, own[:, None]], 1)
        return self.ancestry

    def self_columns(self) -> Tensor:
        """With slots, after :meth:`record_slots`: the self-attention columns each row reads this
        step, (B, t + 1) long, t' K + a_{t'} (its ancestor's slot at every position t' <= t):
        what the mask of :meth:`self_attention_mask` leaves, for the attention kernel to read
        alone (s2s.model.native: one key in K instead of all, masked)."""
        t1 = self.ancestry.size(1)
        return self.ancestry + self.slots * torch.arange(t1, device=self.ancestry.device)

    def self_attention_mask(self, position_mask: Optional[Tensor]) -> Optional[Tensor]:
        """The mask of this step's self-attention, over the t + 1 positions (a relative
        position bias (1, heads, 1, t + 1), or None); with slots also over the ancestry,
        (B / K, 1 or heads, K, (t + 1) K), the position bias repeated over the slots, and
        with slots read whole over the buffers' columns, -inf past (t + 1) K.
        Records this step's own slots, so call it once per step, before the layers."""
        K = self.slots
        if K == 1:
            return position_mask
        mask = ancestry_mask(self.record_slots(), K, self.src_mask.dtype)
        if position_mask is not None:
            mask = mask + position_mask.repeat_interleave(K, dim=-1)
        if self.layers[0].whole:  # every layer's buffers have the same columns
            past = self.layers[0].columns_after_append() - mask.size(-1)
            mask = torch.nn.functional.pad(mask, (0, past), value=float("-inf"))
        return mask

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
        With beam slots, such a reorder moves only the rows' ancestry, not the keys.
        When sentences leave and the last ones fill their places (:func:`tail_moves`), only
        those move, within the cache's tensors: tensors taken from the cache before
        are changed too.
        """
        G_old, rows = self.group, self.batch_size
        if group in (None, G_old) and index.numel() < rows and self._movable_in_place():
            moves = tail_moves(index, rows, G_old)
            if moves is not None:  # sentences leaving, the last ones filling their places: move only those
                self._move_sentences(*moves, index.numel() // G_old)
                return
        self.group = G_old if group is None else group
        if self.slots > 1 and self.group != self.slots:  # beams regrouped: one buffer row per row again
            if self.ancestry is None:  # before the first step: no keys to move
                for layer in self.layers:
                    layer.slots, layer.slot_dtype = 1, None
            else:
                columns = self.ancestry + self.slots * torch.arange(self.ancestry.size(1), device=index.device)
                for layer in self.layers:
                    layer.slots_to_rows(columns, self.src_mask.dtype)  # the model's dtype
                self.ancestry = None
        elif (self.beam_slots and self.group > 1 and G_old == 1 and self.step == 0
              and all(layer.k_buf is None for layer in self.layers)):
            for layer in self.layers:  # a beam search begins: its beams' keys in slots
                layer.slots, layer.slot_dtype = self.group, self.slot_dtype
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
        if self.ancestry is not None:
            self.ancestry = self.ancestry.index_select(0, index)  # a beam takes its parent's ancestry
        for layer in self.layers:
            if layer.cross_k is not None and not same:
                layer.cross_k = layer.cross_k.index_select(0, sentences)
                layer.cross_v = layer.cross_v.index_select(0, sentences)
            if layer.slots == 1:
                layer.select_rows(index)
            elif not same:
                layer.select_sentences(sentences)
            if layer.coverage is not None:
                layer.coverage = layer.coverage.index_select(0, index)

    def _movable_in_place(self) -> bool:
        """Whether a select may move rows within the cache's tensors: not with a copy model's
        source ids and H_enc or a prefix model's cache (which others hold), not under
        autograd, and not for tensors made in inference mode while it is off (torch forbids it)."""
        if self.src is not None or self.src_len is not None or torch.is_grad_enabled():
            return False
        tensors = [self.src_mask] + [x for layer in self.layers for x in (layer.cross_k, layer.k_buf) if x is not None]
        if any(x.requires_grad for x in tensors):
            return False
        return torch.is_inference_mode_enabled() or not any(x.is_inference() for x in tensors)

    def _move_sentences(self, targets: Tensor, sources: Tensor, n: int) -> None:
        """Every per-sentence and per-row tensor's sentences ``sources`` copied into sentences
        ``targets`` (each with its G rows), the first n sentences kept, in place (a cache's own
        tensors: not a copy model's source ids or H_enc, which its caller may hold)."""
        G = self.group
        row_targets, row_sources = sentence_rows(targets, G), sentence_rows(sources, G)

        def move(x: Optional[Tensor], per_row: bool = True) -> Optional[Tensor]:
            if x is None:
                return None
            to, fro = (row_targets, row_sources) if per_row else (targets, sources)
            x[to] = x[fro]
            return x[:n * G if per_row else n]
        self.src_mask, self.ancestry = move(self.src_mask), move(self.ancestry)
        for layer in self.layers:
            layer.cross_k, layer.cross_v = move(layer.cross_k, False), move(layer.cross_v, False)
            layer.coverage = move(layer.coverage)
            if layer.slots > 1:  # a buffer row per sentence
                layer.move_rows(targets, sources, n)
            else:
                layer.move_rows(row_targets, row_sources, n * G)
