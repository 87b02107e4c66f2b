"""The models of docs/model.md (1)-(21): attention and masks, positions, blocks, the
encoder-decoder and the one-stack LM, their incremental-decoding cache, and the
interface both implement (:class:`S2SModel`, in interface.py)."""

from s2s.model.attention import MultiHeadAttention, attention, causal_mask, padding_mask
from s2s.model.cache import DecoderCache, LayerCache
from s2s.model.interface import EncoderState, S2SModel
from s2s.model.lm import DecoderOnlyLM
from s2s.model.transformer import Seq2SeqTransformer, count_parameters, parameter_budget


def make_model(cfg, src_vocab: int, tgt_vocab: int, pad_id: int = 0) -> S2SModel:
    """The model of ``cfg.arch``: the encoder-decoder, or one stack over [x; y] (prefix_lm,
    decoder_only), both with the entry points of :class:`S2SModel`."""
    if cfg.arch == "encoder_decoder":
        return Seq2SeqTransformer(cfg, src_vocab, tgt_vocab, pad_id)
    return DecoderOnlyLM(cfg, tgt_vocab, pad_id)

__all__ = [
    "MultiHeadAttention", "attention", "causal_mask", "padding_mask",
    "DecoderCache", "LayerCache", "EncoderState", "S2SModel", "Seq2SeqTransformer", "DecoderOnlyLM", "make_model",
    "count_parameters", "parameter_budget",
]
