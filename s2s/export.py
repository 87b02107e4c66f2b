"""``s2s export ct2``: an s2s model as a CTranslate2 model, through CTranslate2's own spec API.

The mapping is one to one: CTranslate2's Transformer has s2s's blocks
(fused Q/K/V self-attention, Q plus fused K/V cross-attention, the two-layer
FFN, pre- or post-norm with the final norms of a pre-norm stack), embeddings
multiplied by sqrt(d_model), and an explicit position table (s2s's
sinusoidal table or its learned one).  The vocabularies are the
SentencePiece pieces in id order; the source gets </s> appended, as s2s does.

    s2s export ct2 -m exp/qs -o exp/qs-ct2 [--quantization int8]

then, in Python: ``ctranslate2.Translator("exp/qs-ct2").translate_batch(pieces,
suppress_sequences=[["<s>"], ["<pad>"]])`` with the pieces of ``spm.model``
(copied into the output directory); s2s never generates <s> or <pad>, and
suppressing them makes CTranslate2 search the same space.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from s2s.errors import S2SError
from s2s.model.positions import sinusoidal_table
from s2s.modeldir import copy_tokenizer, load_model_dir
from s2s.textio import atomic_dir

QUANTIZATIONS = ("int8", "int8_float32", "int16", "float16", "bfloat16")


def _numpy(t: torch.Tensor):
    return t.detach().float().cpu().contiguous().numpy()


def _linear(spec, layer: torch.nn.Linear) -> None:
    spec.weight = _numpy(layer.weight)
    if layer.bias is not None:
        spec.bias = _numpy(layer.bias)


def _norm(spec, norm: torch.nn.LayerNorm) -> None:
    spec.gamma = _numpy(norm.weight)
    spec.beta = _numpy(norm.bias)


def _ffn(spec, layer, norm) -> None:
    _norm(spec.layer_norm, norm)
    _linear(spec.linear_0, layer.ffn.w_1)
    _linear(spec.linear_1, layer.ffn.w_2)


def export_ct2(model_dir: str | Path, out: str | Path, quantization: Optional[str] = None) -> Path:
    """Write the model of ``model_dir`` as a CTranslate2 model directory ``out``."""
    try:
        import ctranslate2  # noqa: F401  (the spec API lives in ctranslate2.specs)
        from ctranslate2.specs import common_spec, transformer_spec
    except ImportError:
        raise S2SError("export ct2: the ctranslate2 package is not installed (pip install ctranslate2)") from None
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise S2SError(f"--quantization: {quantization!r} is not one of {', '.join(QUANTIZATIONS)}")
    loaded = load_model_dir(model_dir)
    model, cfg = loaded.model, loaded.cfg.model
    unsupported = [name for name, on in (
        (f"model.arch: {cfg.arch}", cfg.arch != "encoder_decoder"),
        ("model.positions: t5_bias", cfg.positions == "t5_bias"), ("model.copy", cfg.copy),
        ("model.coverage", cfg.coverage), (f"model.activation: {cfg.activation}", cfg.activation not in ("relu", "gelu")),
        ("model.gated_ffn", cfg.gated_ffn), ("model.bias: false", not cfg.bias),
        ("model.attention_scale: false", not cfg.attention_scale), ("model.norm_type: rmsnorm", cfg.norm_type == "rmsnorm"),
        ("model.embed_norm", cfg.embed_norm), ("model.output_bias", cfg.output_bias),
        ("model.scale_output", cfg.scale_output), ("model.head_dim", cfg.d_head * cfg.heads != cfg.d_model)) if on]
    if unsupported:
        raise S2SError(f"{model_dir}: {', '.join(unsupported)} has no CTranslate2 counterpart")
    activation = {"relu": common_spec.Activation.RELU, "gelu": common_spec.Activation.GELU}[cfg.activation]
    spec = transformer_spec.TransformerSpec.from_config(
        (cfg.enc_layers, cfg.dec_layers), cfg.heads, pre_norm=cfg.norm == "pre", activation=activation)

    def positions(module) -> object:
        if cfg.positions == "learned":
            return _numpy(module.table.weight[module.offset:])
        return _numpy(sinusoidal_table(torch.arange(cfg.max_positions), cfg.d_model))

    enc, dec = spec.encoder, spec.decoder
    enc.embeddings[0].weight = _numpy(model.src_embed.weight)
    dec.embeddings.weight = _numpy(model.tgt_embed.weight)
    enc.scale_embeddings = dec.scale_embeddings = cfg.scale_embeddings
    enc.position_encodings.encodings = positions(model.enc_positions)
    dec.position_encodings.encodings = positions(model.dec_positions)
    if cfg.norm == "pre":
        _norm(enc.layer_norm, model.enc_final_norm)
        _norm(dec.layer_norm, model.dec_final_norm)
    for s, layer in zip(enc.layer, model.encoder_layers):
        _norm(s.self_attention.layer_norm, layer.norm1)
        _linear(s.self_attention.linear[0], layer.self_attn.qkv_proj)  # fused (3d, d): Q, K, V
        _linear(s.self_attention.linear[1], layer.self_attn.out_proj)
        _ffn(s.ffn, layer, layer.norm2)
    for s, layer in zip(dec.layer, model.decoder_layers):
        _norm(s.self_attention.layer_norm, layer.norm1)
        _linear(s.self_attention.linear[0], layer.self_attn.qkv_proj)
        _linear(s.self_attention.linear[1], layer.self_attn.out_proj)
        _norm(s.attention.layer_norm, layer.norm2)
        _linear(s.attention.linear[0], layer.cross_attn.q_proj)
        _linear(s.attention.linear[1], layer.cross_attn.kv_proj)  # fused (2d, d): K, V
        _linear(s.attention.linear[2], layer.cross_attn.out_proj)
        _ffn(s.ffn, layer, layer.norm3)
    out_weight = model.tgt_embed.weight if model.output_proj is None else model.output_proj.weight
    dec.projection.weight = _numpy(out_weight)

    tok = loaded.tokenizer
    spec.register_source_vocabulary([tok.src.id_to_piece(i) for i in range(tok.src_vocab_size)])
    spec.register_target_vocabulary([tok.tgt.id_to_piece(i) for i in range(tok.tgt_vocab_size)])
    spec.config.add_source_eos = True  # s2s's encoder reads x_1..x_n </s>
    spec.config.layer_norm_epsilon = model.enc_final_norm.eps if cfg.norm == "pre" else 1e-5
    spec.validate()
    spec.optimize(quantization=quantization)
    target = Path(out)
    with atomic_dir(target) as tmp:
        spec.save(str(tmp))
        copy_tokenizer(loaded.cfg, loaded.directory, tmp)  # to cut text into pieces
    return target
