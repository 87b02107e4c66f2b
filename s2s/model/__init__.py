"""The encoder-decoder transformer of the formula sheet: attention and masks,
positions, blocks, the model, and its incremental-decoding cache."""

from s2s.model.attention import MultiHeadAttention, attention, causal_mask, padding_mask
from s2s.model.cache import DecoderCache, LayerCache
from s2s.model.transformer import Seq2SeqTransformer, count_parameters, parameter_budget

__all__ = [
    "MultiHeadAttention", "attention", "causal_mask", "padding_mask",
    "DecoderCache", "LayerCache", "Seq2SeqTransformer", "count_parameters", "parameter_budget",
]
