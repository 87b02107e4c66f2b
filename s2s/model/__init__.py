"""The encoder-decoder transformer of docs/model.md (1)-(21): attention and masks,
positions, blocks, the model, and its incremental-decoding cache."""

from s2s.model.attention import MultiHeadAttention, attention, causal_mask, padding_mask
from s2s.model.cache import DecoderCache, LayerCache
from s2s.model.lm import DecoderOnlyLM
from s2s.model.transformer import Seq2SeqTransformer, count_parameters, parameter_budget


def make_model(cfg, src_vocab: int, tgt_vocab: int, pad_id: int = 0):
    """The model of ``cfg.arch``: the encoder-decoder, or one stack over [x; y] (prefix_lm,
    decoder_only), with the same entry points for training and search."""
    if cfg.arch == "encoder_decoder":
        return Seq2SeqTransformer(cfg, src_vocab, tgt_vocab, pad_id)
    return DecoderOnlyLM(cfg, tgt_vocab, pad_id)

__all__ = [
    "MultiHeadAttention", "attention", "causal_mask", "padding_mask",
    "DecoderCache", "LayerCache", "Seq2SeqTransformer", "DecoderOnlyLM", "make_model", "count_parameters",
    "parameter_budget",
]
