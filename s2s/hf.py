"""Hugging Face transformers checkpoints in and out: MarianMT, BART/mBART, T5 and M2M100/NLLB (in only).

    s2s import hf PATH -o MODEL_DIR      a local Hugging Face directory -> an s2s model directory
    s2s export hf -m MODEL_DIR -o PATH   an s2s model of one of those families -> a directory
                                         that AutoModelForSeq2SeqLM.from_pretrained loads

Nothing here needs transformers: configs are JSON, weights are safetensors
(or a PyTorch .bin read with ``weights_only=True``, which executes no code).
Each family is a translation of names and settings into s2s's one model:

    family   blocks          norms                   positions              FFN            other
    marian   post-norm       LayerNorm               sinusoidal             act            x sqrt(d), logits bias
    bart     post-norm       LayerNorm + on embeds   learned, offset 2      act            logits bias
    mbart    pre-norm        LayerNorm + on embeds   learned, offset 2      act            logits bias, final norms
    t5       pre-norm        RMSNorm, no bias        relative bias          relu or gated  no 1/sqrt(d_k), no biases
    m2m_100  pre-norm        LayerNorm               fairseq sinusoid at    act            x sqrt(d), final norms
                                                     p + pad + 1 (a fixed
                                                     learned-position table)

M2M100 (and NLLB-200, the same architecture) computes its sinusoid, with
frequencies 10000^(-i/(d/2 - 1)), instead of storing it: the import writes
those values into a learned position table, which reads the same numbers
(and which fine-tuning then trains).  Language tokens (Marian's >>de<<,
mBART's de_DE, M2M100's __de__, NLLB's deu_Latn) become tokenizer.lang_*
(see s2s.langs); ``export hf`` writes no M2M100.

The ids stay the checkpoint's (``tokenizer.pad_id``... in the s2s config), so
token for token the two implementations see the same inputs.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from s2s.config import ExperimentConfig, config_from_dict, to_dict
from s2s.errors import S2SError
from s2s.langs import LANG_TOKEN, Languages
from s2s.model import Seq2SeqTransformer
from s2s.model.positions import fairseq_sinusoid
from s2s.outdir import check_output_dir, output_dir

log = logging.getLogger("s2s")

FAMILIES = ("marian", "bart", "mbart", "t5", "m2m_100")
# Hugging Face activation names <-> model.activation
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
               "silu": "silu", "swish": "silu"}
TO_HF_ACTIVATION = {"relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_new", "silu": "swish"}
BART_POSITION_OFFSET = 2  # BartLearnedPositionalEmbedding reads row p + 2
# The languages of M2M100's dictionary (tokenizer_config.json's language_codes), in the order of
# their tokens __xx__ after vocab.json: the 100 of the M2M100 paper, alphabetical, and the 8 of
# the WMT21 models
M2M100_LANGUAGES = {
    "m2m100": ("af am ar ast az ba be bg bn br bs ca ceb cs cy da de el en es et fa ff fi fr fy ga gd gl gu "
               "ha he hi hr ht hu hy id ig ilo is it ja jv ka kk km kn ko lb lg ln lo lt lv mg mk ml mn mr ms "
               "my ne nl no ns oc or pa pl ps pt ro ru sd si sk sl so sq sr ss su sv sw ta th tl tn tr uk ur uz "
               "vi wo xh yi yo zh zu").split(),
    "wmt21": "en ha is ja cs ru zh de".split(),
}


# --------------------------------------------------------------------------- #
# Reading a Hugging Face directory
# --------------------------------------------------------------------------- #

def read_hf_config(path: Path) -> dict:
    cfg_path = path / "config.json"
    if not path.is_dir():
        raise S2SError(f"{path}: not a directory (expected a Hugging Face model directory)")
    if not cfg_path.is_file():
        raise S2SError(f"{cfg_path}: not found; {path} is not a Hugging Face model directory")
    try:
        hf = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise S2SError(f"{cfg_path}: not valid JSON ({e})") from None
    family = hf.get("model_type") if isinstance(hf, dict) else None
    if family not in FAMILIES:
        raise S2SError(f"{cfg_path}: model_type {family!r} is not supported "
                       f"(supported: {', '.join(FAMILIES)})")
    return hf


def read_hf_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of model.safetensors (sharded or not), else of pytorch_model.bin."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise S2SError(f"{index}: not a safetensors index ({e})") from None
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    elif (path / "pytorch_model.bin").is_file():
        bin_path = path / "pytorch_model.bin"
        try:  # weights_only: tensors and containers only, no code runs
            state = torch.load(bin_path, map_location="cpu", weights_only=True)
        except Exception as e:  # an unpickling error of any kind: the file is not plain weights
            raise S2SError(f"{bin_path}: cannot read as plain weights ({str(e).splitlines()[0]})") from None
        return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    else:
        raise S2SError(f"{path}: no model.safetensors or pytorch_model.bin")
    weights = {}
    for name in files:
        try:
            with safe_open(str(path / name), framework="pt") as f:
                for key in f.keys():
                    weights[key] = f.get_tensor(key)
        except (SafetensorError, OSError) as e:
            raise S2SError(f"{path / name}: cannot read ({str(e).splitlines()[0]})") from None
    return weights


# --------------------------------------------------------------------------- #
# Configs: Hugging Face <-> s2s
# --------------------------------------------------------------------------- #

def _same(hf: dict, a: str, b: str, default=None):
    """A setting both stacks must share (s2s has one value for both)."""
    va, vb = hf.get(a, default), hf.get(b, hf.get(a, default))
    if va != vb:
        raise S2SError(f"config.json: {a}={va} but {b}={vb}; s2s needs the same value in both stacks")
    return va


def _activation(name) -> str:
    if name not in ACTIVATIONS:
        raise S2SError(f"config.json: activation {name!r} is not supported "
                       f"(supported: {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


def s2s_config(hf: dict) -> dict:
    """The s2s config sections (model, tokenizer ids, decode) of a Hugging Face config."""
    family = hf["model_type"]
    vocab = int(hf["vocab_size"])
    if family == "t5":
        gated = str(hf.get("feed_forward_proj", "relu")).startswith("gated-")
        act = hf.get("dense_act_fn") or str(hf.get("feed_forward_proj", "relu")).split("-")[-1]
        if hf.get("feed_forward_proj") == "gated-gelu":
            act = "gelu_new"  # what transformers runs for "gated-gelu"
        model = dict(
            d_model=hf["d_model"], heads=hf["num_heads"], head_dim=hf["d_kv"], d_ff=hf["d_ff"],
            enc_layers=hf["num_layers"], dec_layers=hf.get("num_decoder_layers") or hf["num_layers"],
            activation=_activation(act), gated_ffn=gated, bias=False, attention_scale=False,
            norm="pre", norm_type="rmsnorm", norm_eps=hf.get("layer_norm_epsilon", 1e-6),
            positions="t5_bias", rel_buckets=hf.get("relative_attention_num_buckets", 32),
            rel_max_distance=hf.get("relative_attention_max_distance", 128),
            scale_embeddings=False, share_embeddings=True, tie_output=True,
            # T5 v1.0 rescales the decoder output by d^-1/2 before the tied projection, v1.1 does not
            scale_output=hf.get("scale_decoder_outputs", hf.get("tie_word_embeddings", True) is not False),
            dropout=hf.get("dropout_rate", 0.1), activation_dropout=hf.get("dropout_rate", 0.1))
        pad, eos = hf.get("pad_token_id", 0), hf.get("eos_token_id", 1)
        start = hf.get("decoder_start_token_id")
        ids = dict(pad_id=pad, eos_id=eos, unk_id=2, bos_id=pad if start is None else start)
    else:
        pre = family in ("mbart", "m2m_100")
        pad = hf.get("pad_token_id", 1)
        model = dict(
            d_model=hf["d_model"], heads=_same(hf, "encoder_attention_heads", "decoder_attention_heads"),
            d_ff=_same(hf, "encoder_ffn_dim", "decoder_ffn_dim"), enc_layers=hf["encoder_layers"],
            dec_layers=hf["decoder_layers"], activation=_activation(hf.get("activation_function", "gelu")),
            norm="pre" if pre else "post", scale_embeddings=bool(hf.get("scale_embedding", False)),
            embed_norm=family in ("bart", "mbart"), output_bias=family != "m2m_100",
            positions="sinusoidal" if family == "marian" else "learned",
            max_positions=hf.get("max_position_embeddings", 1024),
            # M2M100's position ids start at pad + 1 (fairseq's make_positions)
            position_offset={"marian": 0, "m2m_100": pad + 1}.get(family, BART_POSITION_OFFSET),
            share_embeddings=bool(hf.get("share_encoder_decoder_embeddings", True)),
            tie_output=hf.get("tie_word_embeddings", True) is not False,
            dropout=hf.get("dropout", 0.1), attention_dropout=hf.get("attention_dropout", 0.0),
            activation_dropout=hf.get("activation_dropout", 0.0))
        if family == "marian" and hf.get("decoder_vocab_size", vocab) != vocab:
            raise S2SError(f"config.json: decoder_vocab_size={hf['decoder_vocab_size']} differs from "
                           f"vocab_size={vocab}; s2s needs one size for both vocabularies")
        eos = hf.get("eos_token_id", 2)
        # the decoder's first input: decoder_start_token_id, else (as generate does) bos_token_id
        start = next((hf[k] for k in ("decoder_start_token_id", "bos_token_id") if hf.get(k) is not None),
                     pad if family == "marian" else eos)
        ids = dict(pad_id=pad, eos_id=eos, unk_id=1 if family == "marian" else 3, bos_id=start)
    model["vocab_size"] = vocab
    for key in ("pad_id", "eos_id", "bos_id"):
        if not isinstance(ids[key], int):
            raise S2SError(f"config.json: {key.replace('_id', '_token_id')} must be one integer, got {ids[key]!r}")
    # the longest training pair must fit the position table
    data = {"max_tokens_per_sentence": min(256, model.get("max_positions", 256))}
    return {"model": model, "tokenizer": ids, "data": data}


def hf_family(cfg: ExperimentConfig) -> str:
    """Which family an s2s model's architecture is, or an error naming what differs from the nearest."""
    m = cfg.model
    wants = {
        "t5": dict(norm="pre", norm_type="rmsnorm", positions="t5_bias", bias=False, attention_scale=False,
                   scale_embeddings=False, embed_norm=False, output_bias=False, share_embeddings=True),
        "marian": dict(norm="post", norm_type="layernorm", positions="sinusoidal", bias=True,
                       attention_scale=True, embed_norm=False, gated_ffn=False, head_dim_default=True),
        "bart": dict(norm="post", norm_type="layernorm", positions="learned", bias=True, attention_scale=True,
                     embed_norm=True, gated_ffn=False, head_dim_default=True),
        "mbart": dict(norm="pre", norm_type="layernorm", positions="learned", bias=True, attention_scale=True,
                      embed_norm=True, gated_ffn=False, head_dim_default=True),
    }
    have = {**to_dict(cfg)["model"], "head_dim_default": m.d_head * m.heads == m.d_model}
    misses = {f: [k for k, v in w.items() if have[k] != v] for f, w in wants.items()}
    if m.arch != "encoder_decoder":
        raise S2SError(f"export hf: model.arch {m.arch} is not an encoder-decoder family of Hugging Face's")
    for feature in ("copy", "coverage"):
        if getattr(m, feature):
            raise S2SError(f"export hf: model.{feature} has no counterpart in Hugging Face's families")
    if m.scale_output and not m.tie_output:
        raise S2SError("export hf: model.scale_output needs model.tie_output (T5 v1.0)")
    best = min(misses, key=lambda f: len(misses[f]))
    if misses[best]:
        diff = ", ".join(f"model.{k}: {have[k]} (wants {wants[best][k]})" for k in misses[best]
                         if k != "head_dim_default") or "model.head_dim (wants d_model / heads)"
        raise S2SError(f"export hf: the architecture matches no Hugging Face family; nearest is {best}: {diff}")
    return best


def hf_config(cfg: ExperimentConfig, family: str, vocab: int) -> dict:
    """config.json for an s2s model of ``family``."""
    m, t = cfg.model, cfg.tokenizer
    common = dict(model_type=family, vocab_size=vocab, d_model=m.d_model, pad_token_id=t.pad_id,
                  eos_token_id=t.eos_id, decoder_start_token_id=t.bos_id, is_encoder_decoder=True,
                  tie_word_embeddings=m.tie_output, forced_eos_token_id=None)
    if family == "t5":
        act = TO_HF_ACTIVATION[m.activation]
        return {**common, "architectures": ["T5ForConditionalGeneration"], "d_kv": m.d_head, "d_ff": m.d_ff,
                "num_heads": m.heads, "num_layers": m.enc_layers, "num_decoder_layers": m.dec_layers,
                "feed_forward_proj": ("gated-" if m.gated_ffn else "") + ("gelu" if act == "gelu_new" else act),
                "dense_act_fn": act, "is_gated_act": m.gated_ffn, "layer_norm_epsilon": m.norm_eps,
                "relative_attention_num_buckets": m.rel_buckets,
                "relative_attention_max_distance": m.rel_max_distance, "dropout_rate": m.dropout,
                # transformers < 5 reads "tie_word_embeddings: false" as T5 v1.1 (no rescale, own lm_head);
                # 5.x as no rescale (it always ties)
                "scale_decoder_outputs": m.scale_output, "tie_word_embeddings": m.scale_output}
    arch = {"marian": "MarianMTModel", "bart": "BartForConditionalGeneration",
            "mbart": "MBartForConditionalGeneration"}[family]
    out = {**common, "architectures": [arch], "encoder_layers": m.enc_layers, "decoder_layers": m.dec_layers,
           "encoder_attention_heads": m.heads, "decoder_attention_heads": m.heads,
           "encoder_ffn_dim": m.d_ff, "decoder_ffn_dim": m.d_ff,
           "activation_function": TO_HF_ACTIVATION[m.activation], "scale_embedding": m.scale_embeddings,
           "max_position_embeddings": m.max_positions, "dropout": m.dropout,
           "attention_dropout": m.attention_dropout, "activation_dropout": m.activation_dropout,
           "normalize_before": m.norm == "pre", "bos_token_id": None}
    if family == "marian":
        out.update(decoder_vocab_size=vocab, share_encoder_decoder_embeddings=m.share_embeddings)
    elif not m.share_embeddings:
        raise S2SError(f"export hf: {family} has one embedding table; needs model.share_embeddings: true")
    return out


# --------------------------------------------------------------------------- #
# Weights: one table of names for both directions
# --------------------------------------------------------------------------- #

# (s2s name, [Hugging Face names concatenated along dim 0 to make it])
NameMap = list[tuple[str, list[str]]]


def _bart_names(model: Seq2SeqTransformer, family: str) -> NameMap:
    names: NameMap = [("src_embed.weight", ["model.shared.weight"])]
    if not model.cfg.share_embeddings:
        names = [("src_embed.weight", ["model.encoder.embed_tokens.weight"]),
                 ("tgt_embed.weight", ["model.decoder.embed_tokens.weight"])]
    if model.output_proj is not None:
        names.append(("output_proj.weight", ["lm_head.weight"]))
    if family != "m2m_100":
        names.append(("output_bias", ["final_logits_bias"]))
    for side, stack, n in (("enc", "encoder", model.cfg.enc_layers), ("dec", "decoder", model.cfg.dec_layers)):
        p = f"model.{stack}"
        if family in ("bart", "mbart"):  # (M2M100's positions are computed: see model_from_hf)
            names += [(f"{side}_positions.table.weight", [f"{p}.embed_positions.weight"]),
                      (f"{side}_embed_norm.weight", [f"{p}.layernorm_embedding.weight"]),
                      (f"{side}_embed_norm.bias", [f"{p}.layernorm_embedding.bias"])]
        if family in ("mbart", "m2m_100"):
            names += [(f"{side}_final_norm.weight", [f"{p}.layer_norm.weight"]),
                      (f"{side}_final_norm.bias", [f"{p}.layer_norm.bias"])]
        for i in range(n):
            s, h = f"{stack}_layers.{i}", f"{p}.layers.{i}"
            norms = ["self_attn_layer_norm", "final_layer_norm"] if stack == "encoder" else [
                "self_attn_layer_norm", "encoder_attn_layer_norm", "final_layer_norm"]
            for wb in ("weight", "bias"):
                names += [
                    (f"{s}.self_attn.qkv_proj.{wb}", [f"{h}.self_attn.{x}_proj.{wb}" for x in "qkv"]),
                    (f"{s}.self_attn.out_proj.{wb}", [f"{h}.self_attn.out_proj.{wb}"]),
                    (f"{s}.ffn.w_1.{wb}", [f"{h}.fc1.{wb}"]),
                    (f"{s}.ffn.w_2.{wb}", [f"{h}.fc2.{wb}"]),
                ]
                names += [(f"{s}.norm{j + 1}.{wb}", [f"{h}.{norm}.{wb}"]) for j, norm in enumerate(norms)]
                if stack == "decoder":
                    names += [(f"{s}.cross_attn.q_proj.{wb}", [f"{h}.encoder_attn.q_proj.{wb}"]),
                              (f"{s}.cross_attn.kv_proj.{wb}", [f"{h}.encoder_attn.{x}_proj.{wb}" for x in "kv"]),
                              (f"{s}.cross_attn.out_proj.{wb}", [f"{h}.encoder_attn.out_proj.{wb}"])]
    return names


def _t5_names(model: Seq2SeqTransformer, family: str) -> NameMap:
    names: NameMap = [("src_embed.weight", ["shared.weight"])]
    if model.output_proj is not None:
        names.append(("output_proj.weight", ["lm_head.weight"]))
    gated = model.cfg.gated_ffn
    for side, stack, n in (("enc", "encoder", model.cfg.enc_layers), ("dec", "decoder", model.cfg.dec_layers)):
        rel_bias = f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
        names += [(f"{side}_rel_bias.bias.weight", [rel_bias]),
                  (f"{side}_final_norm.weight", [f"{stack}.final_layer_norm.weight"])]
        for i in range(n):
            s, h = f"{stack}_layers.{i}", f"{stack}.block.{i}.layer"
            ffn = 1 if stack == "encoder" else 2
            names += [
                (f"{s}.self_attn.qkv_proj.weight", [f"{h}.0.SelfAttention.{x}.weight" for x in "qkv"]),
                (f"{s}.self_attn.out_proj.weight", [f"{h}.0.SelfAttention.o.weight"]),
                (f"{s}.norm1.weight", [f"{h}.0.layer_norm.weight"]),
                (f"{s}.ffn.w_1.weight", [f"{h}.{ffn}.DenseReluDense.{'wi_0' if gated else 'wi'}.weight"]),
                (f"{s}.ffn.w_2.weight", [f"{h}.{ffn}.DenseReluDense.wo.weight"]),
                (f"{s}.norm{ffn + 1}.weight", [f"{h}.{ffn}.layer_norm.weight"]),
            ]
            if gated:
                names.append((f"{s}.ffn.w_3.weight", [f"{h}.{ffn}.DenseReluDense.wi_1.weight"]))
            if stack == "decoder":
                names += [(f"{s}.cross_attn.q_proj.weight", [f"{h}.1.EncDecAttention.q.weight"]),
                          (f"{s}.cross_attn.kv_proj.weight", [f"{h}.1.EncDecAttention.{x}.weight" for x in "kv"]),
                          (f"{s}.cross_attn.out_proj.weight", [f"{h}.1.EncDecAttention.o.weight"]),
                          (f"{s}.norm2.weight", [f"{h}.1.layer_norm.weight"])]
    return names


NAME_MAPS: dict[str, Callable[[Seq2SeqTransformer, str], NameMap]] = {
    "marian": _bart_names, "bart": _bart_names, "mbart": _bart_names, "t5": _t5_names, "m2m_100": _bart_names}

# names a checkpoint may hold under another spelling (tied copies), tried in order
ALIASES = {"model.shared.weight": ["model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight"],
           "shared.weight": ["encoder.embed_tokens.weight", "decoder.embed_tokens.weight"]}


def _get(weights: dict[str, torch.Tensor], name: str, source: Path) -> torch.Tensor:
    for candidate in [name, *ALIASES.get(name, [])]:
        if candidate in weights:
            return weights[candidate]
    raise S2SError(f"{source}: weight {name} is missing from the checkpoint")


def _untied_output(weights: dict[str, torch.Tensor], embed: str) -> bool:
    """A checkpoint's lm_head is its own matrix only when it is stored and differs from the embeddings."""
    head = weights.get("lm_head.weight")
    return head is not None and embed in weights and not torch.equal(head, weights[embed])


def model_from_hf(path: str | Path) -> tuple[Seq2SeqTransformer, dict]:
    """The s2s model of a Hugging Face directory (eval mode) and its s2s config sections."""
    path = Path(path)
    hf = read_hf_config(path)
    family = hf["model_type"]
    weights = read_hf_weights(path)
    try:
        sections = s2s_config(hf)
    except KeyError as e:
        raise S2SError(f"{path / 'config.json'}: no {e.args[0]!r} key, which a {family} config has") from None
    except (TypeError, ValueError) as e:
        raise S2SError(f"{path / 'config.json'}: a value has the wrong type ({e})") from None
    embed = "shared.weight" if family == "t5" else "model.shared.weight"
    if _untied_output(weights, embed) or (family == "t5" and not sections["model"]["scale_output"]
                                           and "lm_head.weight" in weights and embed not in weights):
        sections["model"]["tie_output"] = False
    cfg = config_from_dict(sections, f"{path}/config.json")
    model = Seq2SeqTransformer(cfg.model, cfg.model.vocab_size, cfg.model.vocab_size, cfg.tokenizer.pad_id)
    state = {}
    for s2s_name, hf_names in NAME_MAPS[family](model, family):
        if s2s_name == "output_bias" and not any(n in weights for n in hf_names):
            state[s2s_name] = torch.zeros(cfg.model.vocab_size)  # a buffer some savers leave out
            continue
        t = torch.cat([_get(weights, n, path) for n in hf_names], dim=0)
        state[s2s_name] = t.reshape(-1) if s2s_name == "output_bias" else t
    if family == "m2m_100":  # the sinusoid M2M100 computes, as the table s2s reads at p + offset
        m = cfg.model
        table = fairseq_sinusoid(m.max_positions + m.position_offset, m.d_model, cfg.tokenizer.pad_id)
        state["enc_positions.table.weight"] = state["dec_positions.table.weight"] = table
    expected = model.state_dict()
    for name, t in state.items():
        if name not in expected:
            raise S2SError(f"{path}: {name} has no place in the s2s model (an unsupported variant of {family})")
        if t.shape != expected[name].shape:
            raise S2SError(f"{path}: {' + '.join(dict(NAME_MAPS[family](model, family))[name])} has shape "
                           f"{tuple(t.shape)}, the config implies {tuple(expected[name].shape)}")
    missing = [n for n in expected if n not in state and not _is_tied(model, n)]
    if missing:
        raise S2SError(f"{path}: no weights for {', '.join(missing[:3])} (an unsupported variant of {family})")
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    if family == "marian":  # check the checkpoint's sinusoid is the one s2s computes
        stored = weights.get("model.encoder.embed_positions.weight")
        if stored is not None:
            mine = model.enc_positions(stored.size(0))
            if not torch.allclose(stored.float(), mine, atol=1e-4):
                raise S2SError(f"{path}: model.encoder.embed_positions is not the sinusoid Marian computes")
    return model.eval(), sections


def _is_tied(model: Seq2SeqTransformer, name: str) -> bool:
    return name == "tgt_embed.weight" and model.tgt_embed is model.src_embed


def hf_state_dict(model: Seq2SeqTransformer, family: str) -> dict[str, torch.Tensor]:
    """The Hugging Face tensors of an s2s model (the inverse of :func:`model_from_hf`'s map)."""
    state = model.state_dict()
    out: dict[str, torch.Tensor] = {}
    for s2s_name, hf_names in NAME_MAPS[family](model, family):
        if s2s_name == "output_bias":
            t = state[s2s_name] if model.output_bias is not None else torch.zeros(model.tgt_embed.num_embeddings)
            out[hf_names[0]] = t.reshape(1, -1).clone()
            continue
        t = state[s2s_name]
        if s2s_name.endswith("_positions.table.weight") and model.cfg.position_offset != BART_POSITION_OFFSET:
            # BART reads row p + 2: give it two rows in front of the table s2s reads at p + offset
            rows = t[model.cfg.position_offset:]
            t = torch.cat([rows.new_zeros(BART_POSITION_OFFSET, rows.size(1)), rows])
        for name, part in zip(hf_names, t.chunk(len(hf_names), dim=0)):
            out[name] = part.contiguous().clone()
    return out


# --------------------------------------------------------------------------- #
# Tokenizers
# --------------------------------------------------------------------------- #

def _import_tokenizer(path: Path, family: str, out: Path, sections: dict) -> dict:
    """Copy the SentencePiece model(s) into ``out``; return the config's tokenizer and data sections."""
    tok = sections["tokenizer"]
    settings = _json_object(path / "tokenizer_config.json")
    special = _json_object(path / "special_tokens_map.json")  # where older savers list the language codes
    if family in ("mbart", "m2m_100") and not _additional_tokens(settings):
        settings["additional_special_tokens"] = _additional_tokens(special)
    src_lang = settings.get("source_lang") or "src"
    tgt_lang = settings.get("target_lang") or "tgt"
    if src_lang == tgt_lang:
        src_lang, tgt_lang = "src", "tgt"
    data = {"src_lang": src_lang, "tgt_lang": tgt_lang, "dir": str(out)}
    if family == "marian":
        src_spm, tgt_spm, vocab = path / "source.spm", path / "target.spm", path / "vocab.json"
        for p in (src_spm, tgt_spm, vocab):
            if not p.is_file():
                raise S2SError(f"{p}: not found (a Marian tokenizer is source.spm, target.spm and vocab.json)")
        joint = src_spm.read_bytes() == tgt_spm.read_bytes()
        if joint:
            shutil.copyfile(src_spm, out / "spm.model")
        else:
            shutil.copyfile(src_spm, out / f"spm.{src_lang}.model")
            shutil.copyfile(tgt_spm, out / f"spm.{tgt_lang}.model")
        shutil.copyfile(vocab, out / "vocab.json")
        pieces = json.loads(vocab.read_text(encoding="utf-8"))
        tok.update(joint=joint, vocab_file="vocab.json", unk_id=pieces.get("<unk>", tok["unk_id"]),
                   vocab_size=len(pieces))
    elif family == "t5":
        spm_path = path / "spiece.model"
        if not spm_path.is_file():
            raise S2SError(f"{spm_path}: not found (T5's tokenizer is a SentencePiece model)")
        shutil.copyfile(spm_path, out / "spm.model")
        # transformers' T5Tokenizer puts extra_ids sentinels (default 100) after the pieces
        extra = settings.get("extra_ids") or sum(
            1 for t in settings.get("additional_special_tokens") or [] if str(t).startswith("<extra_id_"))
        tok.update(joint=True, vocab_size=sections["model"]["vocab_size"],
                   extra_ids=int(extra) if "extra_ids" in settings or extra else 100)
    elif family == "bart":
        vocab, merges = path / "vocab.json", path / "merges.txt"
        for p in (vocab, merges):
            if not p.is_file():
                raise S2SError(f"{p}: not found (BART's tokenizer is vocab.json and merges.txt)")
        shutil.copyfile(vocab, out / "vocab.json")
        shutil.copyfile(merges, out / "merges.txt")
        pieces = json.loads(vocab.read_text(encoding="utf-8"))
        tok.update(type="byte_bpe", joint=True, vocab_file="vocab.json", vocab_size=len(pieces),
                   unk_id=pieces.get("<unk>", tok["unk_id"]), prefix_id=pieces.get("<s>", -1))
    else:  # mbart; m2m100 (M2M100Tokenizer: vocab.json; NllbTokenizer: mBART's dictionary)
        spm_path = path / "sentencepiece.bpe.model"
        if not spm_path.is_file():
            raise S2SError(f"{spm_path}: not found ({family}'s tokenizer is a SentencePiece model)")
        shutil.copyfile(spm_path, out / "spm.model")
        if family == "m2m_100" and (path / "vocab.json").is_file():
            if not _additional_tokens(settings) and settings.get("language_codes", "m2m100") in M2M100_LANGUAGES:
                # transformers 5 saves M2M100Tokenizer without its language tokens: they are its codes list's
                codes = M2M100_LANGUAGES[settings.get("language_codes", "m2m100")]
                settings["additional_special_tokens"] = [f"__{c}__" for c in codes]
            vocab = _m2m100_vocab(path / "vocab.json", settings)
        else:
            vocab = _fairseq_vocab(spm_path, settings)
        (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
        tok.update(joint=True, vocab_file="vocab.json", vocab_size=len(vocab))
    if tok.get("vocab_file"):
        vocab = json.loads((out / tok["vocab_file"]).read_text(encoding="utf-8"))
        sections["decode"] = _import_languages(family, settings, vocab, tok)
    return data


def _import_languages(family: str, settings: dict, vocab: dict[str, int], tok: dict) -> dict:
    """The tokenizer.lang_* settings of an imported vocabulary (in ``tok``), and the decode
    settings: tokenizer_config.json's tgt_lang, if it names one of the languages, as decode.tgt_lang."""
    if family not in ("marian", "mbart", "m2m_100"):
        return {}
    listed = {*_additional_tokens(settings), *_added_tokens(settings)}  # the tokenizer's special tokens
    tokens = tuple(t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if LANG_TOKEN.match(t)
                   and (t.startswith(">>") if family == "marian" else t in listed))
    if not tokens:
        return {}
    tokenizer_class = str(settings.get("tokenizer_class") or "")
    if family == "marian":
        scheme = "target_tag"  # >>de<< first in the source
    elif family == "mbart" and not tokenizer_class.startswith("MBart50"):
        scheme = "mbart"  # x </s> en_XX; the output starts with the target's code
    else:  # mBART-50, M2M100, NLLB: en_XX x </s> (NLLB's legacy_behaviour: as mBART)
        scheme = "mbart" if settings.get("legacy_behaviour") else "m2m100"
    langs = Languages(scheme, tokens)
    chosen = {}
    for key in ("src_lang", "tgt_lang"):
        value = settings.get(key)
        if isinstance(value, str) and value:
            try:
                chosen[key] = langs.resolve(value, f"tokenizer_config.json: {key}")
            except S2SError as e:
                log.warning("%s; not used", e)
    src_token = chosen.get("src_lang", "") if scheme != "target_tag" else ""
    tok.update(lang_scheme=scheme, lang_tokens=list(tokens), src_lang_token=src_token)
    return {"tgt_lang": chosen["tgt_lang"]} if "tgt_lang" in chosen else {}


def _added_tokens(settings: dict) -> dict[str, int]:
    """The ids tokenizer_config.json's added_tokens_decoder records (transformers >= 4.34)."""
    decoder = settings.get("added_tokens_decoder")
    added = {}
    for i, entry in (decoder.items() if isinstance(decoder, dict) else []):
        content = entry.get("content") if isinstance(entry, dict) else None
        if isinstance(content, str) and str(i).isdigit():
            added[content] = int(i)
    return added


def _m2m100_vocab(path: Path, settings: dict) -> dict[str, int]:
    """M2M100's ids: vocab.json, then its language tokens __xx__ (the added tokens' recorded
    ids, else in tokenizer_config.json's additional_special_tokens order after vocab.json's)."""
    vocab = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(vocab, dict):
        raise S2SError(f"{path}: expected a JSON object mapping pieces to ids")
    for token, i in _added_tokens(settings).items():
        vocab.setdefault(token, i)
    for token in _additional_tokens(settings):
        if token not in vocab:
            vocab[token] = max(vocab.values()) + 1
    return vocab


def _additional_tokens(settings: dict) -> list[str]:
    """additional_special_tokens (transformers 5: extra_special_tokens), as strings or as
    {"content": ...} entries."""
    tokens = settings.get("additional_special_tokens") or settings.get("extra_special_tokens") or []
    if not isinstance(tokens, list):
        return []
    contents = (t.get("content") if isinstance(t, dict) else t for t in tokens)
    return [t for t in contents if isinstance(t, str)]


def _json_object(path: Path) -> dict:
    """The JSON object in ``path``, or {} when there is no such file."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise S2SError(f"{path}: not valid JSON ({e})") from None
    return value if isinstance(value, dict) else {}


def _fairseq_vocab(spm_path: Path, settings: dict) -> dict[str, int]:
    """mBART's ids: <s> 0, <pad> 1, </s> 2, <unk> 3, then SentencePiece piece i (i >= 3) at i + 1
    (fairseq's dictionary), then the language codes and <mask>."""
    import sentencepiece as spm

    proc = spm.SentencePieceProcessor()
    proc.load(str(spm_path))
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for i in range(3, proc.get_piece_size()):
        vocab.setdefault(proc.id_to_piece(i), i + 1)
    for token, i in _added_tokens(settings).items():  # the ids transformers recorded win
        vocab.setdefault(token, i)
    for code in _additional_tokens(settings):
        vocab.setdefault(code, max(vocab.values()) + 1)
    vocab.setdefault("<mask>", max(vocab.values()) + 1)
    return vocab


# --------------------------------------------------------------------------- #
# The two commands
# --------------------------------------------------------------------------- #

def import_hf(path: str | Path, out: str | Path, force: bool = False) -> Path:
    """Write the Hugging Face model in ``path`` as an s2s model directory ``out``
    (``force``: replace an earlier ``import hf`` output there; see s2s.outdir)."""
    from s2s.modeldir import save_model_dir

    path, out = Path(path), Path(out)
    check_output_dir(out, "import hf", force, [path])
    model, sections = model_from_hf(path)
    family = read_hf_config(path)["model_type"]
    with output_dir(out, "import hf", force, [path]) as tmp:
        data = {**sections["data"], **_import_tokenizer(path, family, tmp, sections)}
        raw = {"name": f"{family}-import", "tokenizer": sections["tokenizer"], "data": data,
               "model": sections["model"],
               "decode": {"length_penalty": "power", "stop": "early", "alpha": 1.0, "beam": 4, "max_len_a": 0.0,
                          "max_len_b": 256, **sections.get("decode", {})}}
        raw["tokenizer"].setdefault("joint", True)
        cfg = config_from_dict(raw, f"{path}/config.json")
        save_model_dir(tmp, model, cfg, tmp, {"imported_from": str(path), "family": family})
    log.info("imported %s (%s, %s parameters) into %s", path, family,
             f"{sum(p.numel() for p in model.parameters()):,}", out)
    return out


def export_hf(model_dir: str | Path, out: str | Path, force: bool = False) -> Path:
    """Write the s2s model in ``model_dir`` as a Hugging Face directory ``out``
    (``force``: replace an earlier ``export hf`` output there; see s2s.outdir)."""
    from s2s.modeldir import load_model_dir

    check_output_dir(out, "export hf", force, [model_dir])
    loaded = load_model_dir(model_dir)
    cfg, model, tok = loaded.cfg, loaded.model, loaded.tokenizer
    family = hf_family(cfg)
    vocab = model.tgt_embed.num_embeddings
    config = hf_config(cfg, family, vocab)
    state = hf_state_dict(model, family)
    if family == "t5" and model.output_proj is None and not cfg.model.scale_output:
        state["lm_head.weight"] = state["shared.weight"].clone()  # v1.1 layout: lm_head stored
    out = Path(out)
    with output_dir(out, "export hf", force, [model_dir]) as tmp:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
        gen = {"decoder_start_token_id": cfg.tokenizer.bos_id, "eos_token_id": cfg.tokenizer.eos_id,
               "pad_token_id": cfg.tokenizer.pad_id, "bad_words_ids": [[cfg.tokenizer.pad_id]]}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2), encoding="utf-8")
        _export_tokenizer(loaded.directory, cfg, tok, family, tmp)
    return out


def _export_tokenizer(src_dir: Path, cfg: ExperimentConfig, tok, family: str, out: Path) -> None:
    from s2s.tokenizer import Tokenizer

    src_spm, tgt_spm = Tokenizer.files(src_dir, cfg.data, cfg.tokenizer.joint, cfg.tokenizer.type)
    if cfg.tokenizer.type == "byte_bpe":
        shutil.copyfile(src_spm, out / "merges.txt")
        shutil.copyfile(src_dir / cfg.tokenizer.vocab_file, out / "vocab.json")
        settings = {"tokenizer_class": "BartTokenizer"}
    elif family == "marian":
        shutil.copyfile(src_spm, out / "source.spm")
        shutil.copyfile(tgt_spm, out / "target.spm")
        if cfg.tokenizer.vocab_file:
            shutil.copyfile(src_dir / cfg.tokenizer.vocab_file, out / "vocab.json")
        else:
            vocab = {tok.tgt.id_to_piece(i): i for i in range(tok.tgt.get_piece_size())}
            (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
        settings = {"tokenizer_class": "MarianTokenizer", "source_lang": cfg.data.src_lang,
                    "target_lang": cfg.data.tgt_lang, "separate_vocabs": False}
    elif family == "t5" and not cfg.tokenizer.vocab_file:
        shutil.copyfile(src_spm, out / "spiece.model")
        settings = {"tokenizer_class": "T5Tokenizer", "extra_ids": cfg.tokenizer.extra_ids}
    else:
        log.warning("export hf: %s's Hugging Face tokenizer is not written (weights and config only)", family)
        return
    (out / "tokenizer_config.json").write_text(json.dumps(settings, indent=2), encoding="utf-8")

