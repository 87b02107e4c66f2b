"""The interface every s2s model offers: what training, search and translation call.

Two classes implement it, :class:`~s2s.model.transformer.Seq2SeqTransformer`
(encoder_decoder) and :class:`~s2s.model.lm.DecoderOnlyLM` (prefix_lm,
decoder_only); :func:`~s2s.model.make_model` returns one of them.  Callers are
typed against :class:`S2SModel` and never ask which:

    enc   = model.encode(src)                   EncoderState: the source x, read once
    cache = model.start_decoding(enc)           DecoderCache owned by the search
    z, A  = model.decode_step(y_prev, cache)    scores (B, V) for the next position
    z     = model(src, tgt_in)                  teacher forcing: scores (B, T, V)

Scores are logits, or with ``model.copy`` the pointer-generator's log P (a
softmax leaves either unchanged).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Protocol

import torch
from torch import Tensor, nn

from s2s.config import ModelConfig
from s2s.model.base import VocabSubset
from s2s.model.cache import DecoderCache, LayerCache


@dataclass
class EncoderState:
    """What decoding reads from the source x, computed once by ``encode``."""

    src: Tensor  # (B, S) source ids (copying reads them; an LM's y starts after the real ones)
    src_mask: Tensor  # (B, 1, 1, S) additive padding mask
    h_enc: Optional[Tensor] = None  # (B, S, d_model) the encoder's output H_enc (encoder_decoder)
    prefix: Optional[list[LayerCache]] = None  # every block's self-attention K/V of x (one stack over [x; y])


class S2SModel(Protocol):
    """A sequence-to-sequence model: P(y_t | y_<t, x) by teacher forcing or one step at a time."""

    cfg: ModelConfig
    pad_id: int
    beam_slot_dtype: Optional[torch.dtype]  # a beam search's self-attention K/V dtype, if not the model's
    greedy_kv_dtype: Optional[torch.dtype]  # a greedy search's attention K/V dtype, if not the model's

    @property
    def device(self) -> torch.device:
        """Where the parameters are."""

    @property
    def needs_attention(self) -> bool:
        """True when the scores read the last decoder layer's cross-attention (copy, coverage)."""

    def __call__(self, src: Tensor, tgt_in: Tensor, return_attention: bool = False,
                 keep: Optional[Tensor] = None, head: bool = True):
        """Teacher forcing: src (B, S), tgt_in (B, T) -> scores (B, T, V) (with ``keep`` (B, T)
        bool, only those positions': (n, V); with ``head`` False, for a model without copy,
        their last decoder states h (n, d_model) instead); with ``return_attention`` also the
        last decoder layer's cross-attention averaged over heads (B, T, S), for the coverage loss."""

    def encode(self, src: Tensor) -> EncoderState:
        """src (B, S) token ids -> the source's state, computed once."""

    def start_decoding(self, enc: EncoderState) -> DecoderCache:
        """The decoding state before the first target token."""

    def decode_step(self, y_prev: Tensor, cache: DecoderCache, need_weights: bool = False,
                    need_last: bool = False) -> tuple[Tensor, list[Optional[Tensor]]]:
        """y_prev (B, 1) at position t = cache.step -> scores (B, V) for t + 1 and the
        cross-attention weights [(B, heads, 1, S)] per decoder layer (every layer's with
        ``need_weights``, the last one's with ``need_last``; None where not asked)."""

    def logits(self, h: Tensor, subset: Optional[VocabSubset] = None) -> Tensor:
        """Decoder states (..., d_model) -> logits (..., V), or with a ``subset`` only its
        ids' (..., V')."""

    def head_nll(self, h: Tensor, target: Tensor, epsilon: float, pad_id: int) -> Tensor:
        """The label-smoothed NLL (fp32 sum) of logits(h) for h (n, d_model) and target (n,),
        in one pass without the (n, V) scores where it can (s2s.loss.output_nll)."""

    def vocab_subset(self, ids: Tensor) -> VocabSubset:
        """The output head's rows for target ids (V',); set as ``cache.vocab_subset``,
        ``decode_step`` scores only those ids (in that order)."""

    # the nn.Module methods callers use
    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def train(self, mode: bool = True) -> S2SModel: ...

    def eval(self) -> S2SModel: ...

    def to(self, *args, **kwargs) -> S2SModel: ...

    def state_dict(self, *args, **kwargs) -> dict[str, Tensor]: ...

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False): ...
