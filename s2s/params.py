"""A model's size from its config alone (no torch): the exact parameter count of the
model ``s2s.model.make_model`` builds, and the budget of docs/model.md (20) beside it.

    attention   4 d h d_h (+ 3 h d_h + d biases)                  Q, K, V, O
    FFN         2 d d_ff (+ d_ff + d)   gated: 3 d d_ff (+ 2 d_ff + d)
    norm        2 d (LayerNorm: gain and bias)   d (RMSNorm: gain)
    encoder layer  attention + FFN + 2 norms
    decoder layer  2 attentions + FFN + 3 norms (+ h for the coverage layer's w_cov)
    embeddings  V_src d (+ V_tgt d unless shared) (+ V_tgt d output unless tied)
"""

from __future__ import annotations

from s2s.config import ModelConfig


def norm_parameters(cfg: ModelConfig) -> int:
    """LayerNorm: g and b (2d); RMSNorm: g (d)."""
    return cfg.d_model if cfg.norm_type == "rmsnorm" else 2 * cfg.d_model


def attention_parameters(cfg: ModelConfig) -> int:
    """W_Q, W_K, W_V (d x h d_h) and W_O (h d_h x d), with biases 3 h d_h + d."""
    d, inner = cfg.d_model, cfg.heads * cfg.d_head
    return 4 * d * inner + (3 * inner + d if cfg.bias else 0)


def ffn_parameters(cfg: ModelConfig) -> int:
    """W_1 (d x d_ff), W_2 (d_ff x d), gated also W_3 (d x d_ff); biases d_ff (each of W_1, W_3) + d."""
    d, f = cfg.d_model, cfg.d_ff
    gates = 2 if cfg.gated_ffn else 1
    return (gates + 1) * d * f + (gates * f + d if cfg.bias else 0)


def parameter_count(cfg: ModelConfig, src_vocab: int, tgt_vocab: int) -> int:
    """Distinct parameters (a tied or shared matrix counts once) of ``make_model(cfg, src_vocab, tgt_vocab)``."""
    d = cfg.d_model
    block = attention_parameters(cfg) + ffn_parameters(cfg)
    final_norm = norm_parameters(cfg) if cfg.norm == "pre" else 0
    output = (0 if cfg.tie_output else d * tgt_vocab) + (tgt_vocab if cfg.output_bias else 0)
    learned = (cfg.max_positions + cfg.position_offset) * d if cfg.positions == "learned" else 0
    if cfg.arch != "encoder_decoder":  # one stack over [x; y], one table
        layers = (cfg.enc_layers + cfg.dec_layers) * (block + 2 * norm_parameters(cfg))
        embed_norm = norm_parameters(cfg) if cfg.embed_norm else 0
        return tgt_vocab * d + learned + embed_norm + layers + final_norm + output
    embeddings = src_vocab * d + (0 if cfg.share_embeddings else tgt_vocab * d)
    positions = 2 * learned + (2 * cfg.rel_buckets * cfg.heads if cfg.positions == "t5_bias" else 0)
    embed_norms = 2 * norm_parameters(cfg) if cfg.embed_norm else 0
    encoder = cfg.enc_layers * (block + 2 * norm_parameters(cfg))
    decoder = cfg.dec_layers * (block + attention_parameters(cfg) + 3 * norm_parameters(cfg))
    coverage = cfg.heads if cfg.coverage and cfg.dec_layers else 0
    p_gen = 3 * d + 1 if cfg.copy else 0
    return (embeddings + positions + embed_norms + encoder + decoder + coverage + p_gen
            + 2 * final_norm + output)


def parameter_budget(cfg: ModelConfig, vocab: int) -> int:
    """P ~= 12 N_enc d^2 + 16 N_dec d^2 + V d  (docs/model.md (20); FFN width 4d);
    one stack over [x; y] (prefix_lm, decoder_only): 12 (N_enc + N_dec) d^2 + V d."""
    d = cfg.d_model
    if cfg.arch != "encoder_decoder":
        return 12 * (cfg.enc_layers + cfg.dec_layers) * d * d + vocab * d
    return 12 * cfg.enc_layers * d * d + 16 * cfg.dec_layers * d * d + vocab * d
