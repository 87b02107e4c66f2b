"""``s2s export ct2``: an s2s model as a CTranslate2 model, through CTranslate2's own spec API.

The mapping is one to one: CTranslate2's Transformer has s2s's blocks
(fused Q/K/V self-attention, Q plus fused K/V cross-attention, the two-layer
FFN, pre- or post-norm with the final norms of a pre-norm stack), embeddings
multiplied by sqrt(d_model) or not, and an explicit position table (s2s's
sinusoidal table or its learned one) or T5's relative bias.  The variants the
imported families bring have their spec settings too: SiLU (swish) and
GELU-tanh FFNs, the gated FFN (linear_0_noact), RMSNorm, no biases, no
1/sqrt(d_head) (queries_scale 1), embedding norms (BART), the final-logits
bias and T5 v1.0's d^-1/2 output rescale.  The vocabularies are the model's
pieces in id order; the source gets </s> appended (and BART's <s> put
before it), and the decoder starts from the model's own start symbol, as
s2s does.

    s2s export ct2 -m exp/qs -o exp/qs-ct2 [--quantization int8]

then, in Python: ``ctranslate2.Translator("exp/qs-ct2").translate_batch(pieces,
suppress_sequences=[["<s>"], ["<pad>"]])`` with the pieces of ``spm.model``
(copied into the output directory); s2s never generates <s> or <pad>, and
suppressing them makes CTranslate2 search the same space.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import torch

from s2s.errors import S2SError
from s2s.model.positions import sinusoidal_table
from s2s.modeldir import copy_tokenizer, load_model_dir
from s2s.outdir import check_output_dir, output_dir

QUANTIZATIONS = ("int8", "int8_float32", "int16", "float16", "bfloat16")


def _numpy(t: torch.Tensor):
    return t.detach().float().cpu().contiguous().numpy()


def _linear(spec, layer: torch.nn.Linear) -> None:
    spec.weight = _numpy(layer.weight)
    if layer.bias is not None:
        spec.bias = _numpy(layer.bias)


def _norm(spec, norm: torch.nn.Module) -> None:
    spec.gamma = _numpy(norm.weight)
    if getattr(norm, "bias", None) is not None:  # RMSNorm has only the gain g
        spec.beta = _numpy(norm.bias)


def _ffn(spec, layer, norm) -> None:
    _norm(spec.layer_norm, norm)
    _linear(spec.linear_0, layer.ffn.w_1)  # act(W_1 x)
    if layer.ffn.w_3 is not None:  # gated: act(W_1 x) * W_3 x
        _linear(spec.linear_0_noact, layer.ffn.w_3)
    _linear(spec.linear_1, layer.ffn.w_2)


def _attention(spec, cfg, rel_bias=None) -> None:
    """The settings of one attention spec: no 1/sqrt(d_head) when model.attention_scale is off
    (T5 folds it into W_Q); with t5_bias, the stack's one relative-bias table (buckets, heads)."""
    if not cfg.attention_scale:
        spec.queries_scale = 1.0
    if rel_bias is not None:
        spec.relative_attention_bias = _numpy(rel_bias.bias.weight)
        spec.relative_attention_max_distance = np.dtype("int32").type(cfg.rel_max_distance)


def ct2_vocabulary(tok, side: str, rows: int) -> list[str]:
    """CTranslate2's token i for model id i < rows (the embedding's rows): the piece the id
    stands for; an id without a piece of its own (rows past an imported vocabulary,
    T5's sentinels past SentencePiece) is ``<s2s_id_i>``, so every token is unique."""
    tokens, seen = [], set()
    for i in range(rows):
        piece = tok.piece(i, side)
        if piece in seen or (piece == "<unk>" and i != tok.unk_id) or piece.startswith("<id "):
            piece = f"<s2s_id_{i}>"
        seen.add(piece)
        tokens.append(piece)
    return tokens


def export_ct2(model_dir: str | Path, out: str | Path, quantization: Optional[str] = None,
               force: bool = False) -> Path:
    """Write the model of ``model_dir`` as a CTranslate2 model directory ``out``
    (``force``: replace an earlier ``export ct2`` output there; see s2s.outdir)."""
    try:
        import ctranslate2  # noqa: F401  (the spec API lives in ctranslate2.specs)
        from ctranslate2.specs import common_spec, transformer_spec
    except ImportError:
        raise S2SError("export ct2: the ctranslate2 package is not installed (pip install ctranslate2)") from None
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise S2SError(f"--quantization: {quantization!r} is not one of {', '.join(QUANTIZATIONS)}")
    check_output_dir(out, "export ct2", force, [model_dir])
    loaded = load_model_dir(model_dir)
    model, cfg = loaded.model, loaded.cfg.model
    unsupported = [name for name, on in (
        (f"model.arch: {cfg.arch}", cfg.arch != "encoder_decoder"),
        ("model.copy", cfg.copy), ("model.coverage", cfg.coverage)) if on]
    if unsupported:
        raise S2SError(f"{model_dir}: {', '.join(unsupported)} has no CTranslate2 counterpart")
    activation = {"relu": common_spec.Activation.RELU, "gelu": common_spec.Activation.GELU,
                  "gelu_tanh": common_spec.Activation.GELUTanh, "silu": common_spec.Activation.SWISH}[cfg.activation]
    t5_bias = cfg.positions == "t5_bias"
    spec = transformer_spec.TransformerSpec.from_config(
        (cfg.enc_layers, cfg.dec_layers), cfg.heads, pre_norm=cfg.norm == "pre", activation=activation,
        layernorm_embedding=cfg.embed_norm, relative_attention_bias=t5_bias, ffn_glu=cfg.gated_ffn,
        rms_norm=cfg.norm_type == "rmsnorm")

    def positions(module) -> object:
        if cfg.positions == "learned":
            return _numpy(module.table.weight[module.offset:])
        return _numpy(sinusoidal_table(torch.arange(cfg.max_positions), cfg.d_model))

    enc, dec = spec.encoder, spec.decoder
    enc.embeddings[0].weight = _numpy(model.src_embed.weight)
    dec.embeddings.weight = _numpy(model.tgt_embed.weight)
    enc.scale_embeddings = dec.scale_embeddings = cfg.scale_embeddings
    if not t5_bias:
        enc.position_encodings.encodings = positions(model.enc_positions)
        dec.position_encodings.encodings = positions(model.dec_positions)
    if cfg.embed_norm:
        _norm(enc.layernorm_embedding, model.enc_embed_norm)
        _norm(dec.layernorm_embedding, model.dec_embed_norm)
    if cfg.norm == "pre":
        _norm(enc.layer_norm, model.enc_final_norm)
        _norm(dec.layer_norm, model.dec_final_norm)
    for s, layer in zip(enc.layer, model.encoder_layers):
        _norm(s.self_attention.layer_norm, layer.norm1)
        _linear(s.self_attention.linear[0], layer.self_attn.qkv_proj)  # fused (3d, d): Q, K, V
        _linear(s.self_attention.linear[1], layer.self_attn.out_proj)
        _attention(s.self_attention, cfg, model.enc_rel_bias)
        _ffn(s.ffn, layer, layer.norm2)
    for s, layer in zip(dec.layer, model.decoder_layers):
        _norm(s.self_attention.layer_norm, layer.norm1)
        _linear(s.self_attention.linear[0], layer.self_attn.qkv_proj)
        _linear(s.self_attention.linear[1], layer.self_attn.out_proj)
        _attention(s.self_attention, cfg, model.dec_rel_bias)
        _norm(s.attention.layer_norm, layer.norm2)
        _linear(s.attention.linear[0], layer.cross_attn.q_proj)
        _linear(s.attention.linear[1], layer.cross_attn.kv_proj)  # fused (2d, d): K, V
        _linear(s.attention.linear[2], layer.cross_attn.out_proj)
        _attention(s.attention, cfg)
        _ffn(s.ffn, layer, layer.norm3)
    out_weight = model.tgt_embed.weight if model.output_proj is None else model.output_proj.weight
    dec.projection.weight = _numpy(out_weight)
    if model.output_bias is not None:  # z = h W_U + b_U (Marian's and BART's final-logits bias)
        dec.projection.bias = _numpy(model.output_bias)
    if cfg.scale_output:  # z = (h / sqrt(d_model)) W_U (T5 v1.0)
        dec.scale_outputs = cfg.d_model ** -0.5

    tok = loaded.tokenizer
    src_vocab = ct2_vocabulary(tok, "src", model.src_embed.weight.size(0))
    tgt_vocab = ct2_vocabulary(tok, "tgt", out_weight.size(0))
    spec.register_source_vocabulary(src_vocab)
    spec.register_target_vocabulary(tgt_vocab)
    c = spec.config
    c.unk_token, c.eos_token = tgt_vocab[tok.unk_id], tgt_vocab[tok.eos_id]
    c.decoder_start_token = tgt_vocab[tok.bos_id]  # s2s's start symbol (T5, Marian: <pad>; BART: </s>)
    c.add_source_eos = True  # s2s's encoder reads [prefix] x_1..x_n </s>
    if tok.prefix_id >= 0:  # BART's <s> before every source
        c.add_source_bos, c.bos_token = True, src_vocab[tok.prefix_id]
    else:
        c.bos_token = src_vocab[tok.bos_id]
    c.layer_norm_epsilon = cfg.norm_eps
    spec.validate()
    spec.optimize(quantization=quantization)
    target = Path(out)
    with output_dir(target, "export ct2", force, [model_dir]) as tmp:
        spec.save(str(tmp))
        copy_tokenizer(loaded.cfg, loaded.directory, tmp)  # to cut text into pieces
    return target
