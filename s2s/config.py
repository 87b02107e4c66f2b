"""Typed experiment configuration: frozen dataclasses loaded from one YAML file.

An experiment YAML has the top-level keys ``name``, ``seed``, ``output_dir``
and one section per stage: ``tokenizer``, ``data``, ``model``, ``train``,
``decode``.  Every key has exactly one name, used both in YAML and in
``--set section.key=value`` overrides.  Loading checks, with an error that
names the file and the key:

* unknown keys (the message lists the valid ones),
* types (``int``, ``float``, ``bool``, ``str``, ``Literal`` choices),
* values and cross-field constraints (``__post_init__`` of each section).
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml

from s2s.device import DEVICES, is_device_name
from s2s.errors import ConfigError

# PyYAML's safe loader in C (libyaml, in PyYAML's wheels) where it was built: the same
# documents, about 8x faster than the Python one (a model's config.yaml: 1.4 against 11 ms)
YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

# --------------------------------------------------------------------------- #
# Sections
# --------------------------------------------------------------------------- #


def _check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {msg}")


@dataclass(frozen=True)
class TokenizerConfig:
    """SentencePiece settings (``s2s tokenizer train``)."""

    # unigram | bpe: SentencePiece models s2s trains; byte_bpe: GPT-2's byte-level BPE of an
    # imported BART (merges.txt + vocab.json, read through the tokenizers package)
    type: Literal["unigram", "bpe", "byte_bpe"] = "unigram"
    joint: bool = True  # one vocabulary for source and target
    vocab_size: int = 8000  # per vocabulary; includes the special symbols
    character_coverage: float = 1.0
    byte_fallback: bool = False  # unseen characters become UTF-8 byte pieces instead of <unk>
    # SentencePiece's normalization; identity keeps text exactly (with byte_fallback,
    # decode(encode(x)) == x for any text), the others apply NFKC and collapse whitespace
    normalization: Literal["nmt_nfkc", "nfkc", "nmt_nfkc_cf", "nfkc_cf", "identity"] = "nmt_nfkc"
    sentinels: int = 0  # <extra_id_0> .. <extra_id_{n-1}> reserved for denoising
    max_sentences: int = 2_000_000  # sentences sampled for training the model
    # The model's ids of the special symbols.  `s2s tokenizer train` reserves 0-3;
    # an imported checkpoint keeps its own (T5: pad 0, eos 1, unk 2, decoder start = pad).
    pad_id: int = 0
    unk_id: int = 1
    bos_id: int = 2  # the decoder's start symbol (y_0); may equal pad_id or eos_id
    eos_id: int = 3
    # "": model ids are the SentencePiece ids; else a JSON file (piece -> id) beside the
    # SentencePiece models that maps pieces to the model's ids (Marian's vocab.json)
    vocab_file: str = ""
    prefix_id: int = -1  # an id put before every source and target (BART's <s>); -1: none
    # ids just past the SentencePiece pieces decode as <extra_id_N>, the last one <extra_id_0>
    # (transformers' T5Tokenizer: an imported T5 has 100); ids past those decode to nothing
    extra_ids: int = 0
    # How the model is told its target language (s2s.langs): none; target_tag, a target-language
    # token first in the source (s2s's <2de>, Marian's >>de<<); mbart, the source ends with
    # </s> and its language code, the output starts with the target's; m2m100, the source starts
    # with its language code, the output with the target's (M2M100, NLLB, mBART-50).
    lang_scheme: Literal["none", "target_tag", "mbart", "m2m100"] = "none"
    lang_tokens: tuple[str, ...] = ()  # the target-language tokens, kept whole in any input
    src_lang_token: str = ""  # mbart, m2m100: the source language's token, put in every source

    def __post_init__(self) -> None:
        _check(self.type != "byte_bpe" or (self.vocab_file and self.joint), "tokenizer.type",
               "byte_bpe needs tokenizer.vocab_file and tokenizer.joint: true")
        _check(16 <= self.vocab_size < 2**31, "tokenizer.vocab_size",
               "must be in [16, 2^31) (SentencePiece ids are 32-bit)")
        _check(self.extra_ids >= 0, "tokenizer.extra_ids", "must be >= 0")
        for key in ("pad_id", "unk_id", "bos_id", "eos_id"):
            _check(getattr(self, key) >= 0, f"tokenizer.{key}", "must be >= 0")
        _check(self.eos_id != self.pad_id, "tokenizer.eos_id", "must differ from tokenizer.pad_id")
        _check(self.unk_id not in (self.pad_id, self.bos_id, self.eos_id), "tokenizer.unk_id",
               "must differ from pad_id, bos_id and eos_id")
        _check(0.9 <= self.character_coverage <= 1.0, "tokenizer.character_coverage",
               "must be in [0.9, 1.0]")
        _check(self.sentinels >= 0, "tokenizer.sentinels", "must be >= 0")
        _check(self.max_sentences > 0, "tokenizer.max_sentences", "must be > 0")
        _check(self.lang_scheme == "none" or bool(self.lang_tokens), "tokenizer.lang_tokens",
               f"lang_scheme {self.lang_scheme} needs the model's language tokens")
        _check(len(set(self.lang_tokens)) == len(self.lang_tokens) and all(t.strip() == t and t
                                                                           for t in self.lang_tokens),
               "tokenizer.lang_tokens", "must be distinct non-empty tokens without spaces around them")


_LANG_CODE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")


@dataclass(frozen=True)
class PairConfig:
    """One language pair of ``data.pairs``: files ``{prefix}.{src_lang}`` and ``{prefix}.{tgt_lang}``."""

    src_lang: str = ""
    tgt_lang: str = ""
    train: str = ""
    dev: str = ""
    test: str = ""

    def __post_init__(self) -> None:
        for key in ("src_lang", "tgt_lang"):
            _check(bool(_LANG_CODE.match(getattr(self, key))), key,
                   f"{getattr(self, key)!r} is not a language code (letters, digits, _ and -)")
        _check(self.src_lang != self.tgt_lang, "tgt_lang", "must differ from src_lang (file suffixes would collide)")
        _check(bool(self.train), "train", "each pair needs its training corpus prefix")


@dataclass(frozen=True)
class DataConfig:
    """Parallel corpora and the cleaning rules of ``s2s prepare``.

    ``train``/``dev``/``test`` are path prefixes: the files are
    ``{prefix}.{src_lang}`` and ``{prefix}.{tgt_lang}``, optionally gzipped
    (``.gz`` is tried when the plain file does not exist).
    """

    src_lang: str = "src"
    tgt_lang: str = "tgt"
    train: str = ""
    dev: str = ""
    test: str = ""
    dir: str = "prepared"  # tokenizer models and binarized splits go here
    max_tokens_per_sentence: int = 256  # longer pairs are dropped from train
    max_length_ratio: float = 3.0  # drop train pairs with len ratio above this (0: keep all)
    max_src_tokens: int = 0  # truncate sources to this many tokens, </s> included (0: never)
    dedupe: bool = True
    # several language pairs in one run (instead of src_lang/tgt_lang/train/dev/test): each source
    # is prefixed with its target language's tag <2xx>, a piece the (joint) tokenizer reserves
    pairs: tuple[PairConfig, ...] = ()

    def __post_init__(self) -> None:
        if self.pairs:
            _check(not (self.train or self.dev or self.test), "data.pairs",
                   "give the corpora either in data.pairs or in data.train/dev/test, not both")
            seen = [(p.src_lang, p.tgt_lang) for p in self.pairs]
            twice = next((p for i, p in enumerate(seen) if p in seen[:i]), None)
            _check(twice is None, "data.pairs", f"the pair {twice and '-'.join(twice)} is listed twice")
        _check(bool(self.src_lang) and bool(self.tgt_lang), "data.src_lang",
               "src_lang and tgt_lang must be non-empty")
        _check(self.src_lang != self.tgt_lang, "data.tgt_lang",
               "must differ from data.src_lang (file suffixes would collide)")
        _check(self.max_tokens_per_sentence >= 1, "data.max_tokens_per_sentence", "must be >= 1")
        _check(self.max_length_ratio >= 1.0 or self.max_length_ratio == 0, "data.max_length_ratio",
               "must be >= 1 (or 0: no ratio filter)")
        _check(self.max_src_tokens == 0 or self.max_src_tokens >= 2, "data.max_src_tokens",
               "must be 0 (no truncation) or >= 2")

    def split_corpora(self, split: str) -> list[tuple[str, str, str]]:
        """(prefix, src_lang, tgt_lang) of each corpus of ``split`` (train, dev or test):
        those of data.pairs that have one, else the single pair's, if configured."""
        if self.pairs:
            return [(getattr(p, split), p.src_lang, p.tgt_lang) for p in self.pairs if getattr(p, split)]
        prefix = getattr(self, split)
        return [(prefix, self.src_lang, self.tgt_lang)] if prefix else []

    @property
    def target_langs(self) -> tuple[str, ...]:
        """The target languages of data.pairs, in order of first appearance (none without pairs)."""
        return tuple(dict.fromkeys(p.tgt_lang for p in self.pairs))


@dataclass(frozen=True)
class ModelConfig:
    """The encoder-decoder transformer (docs/model.md (3)-(21))."""

    # encoder_decoder; prefix_lm or decoder_only: one stack of enc_layers + dec_layers blocks over [x; y]
    arch: Literal["encoder_decoder", "prefix_lm", "decoder_only"] = "encoder_decoder"
    d_model: int = 256
    heads: int = 4
    enc_layers: int = 3
    dec_layers: int = 3
    d_ff: int = 1024
    head_dim: int = 0  # d_head of every attention head; 0: d_model / heads
    activation: Literal["relu", "gelu", "gelu_tanh", "silu"] = "relu"
    gated_ffn: bool = False  # FFN(x) = W_2 (act(W_1 x) * W_3 x)  (T5 v1.1's gated-GELU)
    bias: bool = True  # biases in the attention and FFN projections (T5 has none)
    attention_scale: bool = True  # scores divided by sqrt(d_head) (T5 folds it into W_Q)
    norm: Literal["pre", "post"] = "pre"  # docs/model.md (11)
    norm_type: Literal["layernorm", "rmsnorm"] = "layernorm"  # rmsnorm: x / rms(x) * g (T5)
    norm_eps: float = 1e-5  # epsilon inside every norm
    embed_norm: bool = False  # a norm on the (scaled, position-added) embeddings (BART)
    positions: Literal["sinusoidal", "learned", "t5_bias"] = "sinusoidal"
    max_positions: int = 1024  # learned positions table size
    position_offset: int = 0  # learned positions: position p reads row p + offset (BART: 2)
    rel_buckets: int = 32  # t5_bias: number of buckets
    rel_max_distance: int = 128  # t5_bias: distance mapped to the last bucket
    scale_embeddings: bool = True  # multiply embeddings by sqrt(d_model)
    tie_output: bool = True  # W_U = E^T
    share_embeddings: bool = True  # one embedding for source and target
    output_bias: bool = False  # z_t = h_t W_U + b_U (the final logits bias of Marian and BART)
    scale_output: bool = False  # z_t = (h_t / sqrt(d_model)) W_U (T5 v1.0, tied)
    vocab_size: int = 0  # rows of the embedding and output tables; 0: the tokenizer's vocabulary
    dropout: float = 0.1  # on embeddings and on each sublayer's output before its residual add
    attention_dropout: float = 0.0  # on the attention weights A
    activation_dropout: float = 0.0  # inside the FFN, after the activation (fairseq's --activation-dropout)
    # pointer-generator (docs/model.md (41)): P(w) = p_gen P_vocab(w) + (1 - p_gen) sum_{j: x_j = w} A_tj,
    # A = the last decoder layer's cross-attention averaged over heads; needs one shared vocabulary
    copy: bool = False
    # feed the coverage c^t = sum_{t' < t} A_t' into the last layer's cross-attention scores
    coverage: bool = False

    def __post_init__(self) -> None:
        for key in ("d_model", "heads", "d_ff", "max_positions", "rel_buckets", "rel_max_distance"):
            _check(getattr(self, key) >= 1, f"model.{key}", "must be >= 1")
        for key in ("head_dim", "position_offset", "vocab_size"):
            _check(getattr(self, key) >= 0, f"model.{key}", "must be >= 0")
        _check(0 < self.norm_eps < 1, "model.norm_eps", "must be in (0, 1)")
        _check(self.enc_layers >= 1, "model.enc_layers", "must be >= 1")
        _check(self.dec_layers >= 1, "model.dec_layers", "must be >= 1")
        _check(self.head_dim > 0 or self.d_model % self.heads == 0, "model.d_model",
               f"d_model={self.d_model} is not divisible by heads={self.heads} (or set model.head_dim)")
        _check(self.rel_buckets >= 4, "model.rel_buckets", "must be >= 4")
        _check(self.rel_max_distance > self.rel_buckets // 4, "model.rel_max_distance",
               "must exceed rel_buckets / 4 (the last exactly-represented distance)")
        _check(0.0 <= self.dropout < 1.0, "model.dropout", "must be in [0, 1)")
        _check(0.0 <= self.attention_dropout < 1.0, "model.attention_dropout", "must be in [0, 1)")
        _check(0.0 <= self.activation_dropout < 1.0, "model.activation_dropout", "must be in [0, 1)")
        if self.arch != "encoder_decoder":
            _check(self.share_embeddings, "model.arch", f"{self.arch} reads x and y with one embedding table; "
                   "needs model.share_embeddings: true (and a joint tokenizer)")
            for key, on in (("copy", self.copy), ("coverage", self.coverage),
                            ("positions", self.positions == "t5_bias")):
                _check(not on, f"model.{key}", f"not available with model.arch: {self.arch}")
        _check(not self.copy or self.share_embeddings, "model.copy",
               "copying source tokens needs one shared vocabulary (model.share_embeddings: true)")

    @property
    def d_head(self) -> int:
        return self.head_dim or self.d_model // self.heads


@dataclass(frozen=True)
class DistillConfig:
    """Word-level knowledge distillation (docs/model.md (44)):
    L_KD = (1 - lambda) CE(y, p^s) + lambda T^2 KL(p^t_T || p^s_T)."""

    YAML_KEYS = {"lambda": "lambda_"}  # YAML name -> field (lambda is a Python keyword)

    teacher: str = ""  # a model directory with the student's tokenizer; "" = no distillation
    lambda_: float = 0.5  # weight of the softened teacher term (YAML key: lambda)
    temperature: float = 1.0  # T: both distributions softened as softmax(z / T)

    def __post_init__(self) -> None:
        _check(0.0 <= self.lambda_ <= 1.0, "train.distill.lambda", "must be in [0, 1]")
        _check(self.temperature > 0, "train.distill.temperature", "must be > 0")


@dataclass(frozen=True)
class TrainConfig:
    """Teacher-forced training (docs/model.md (22)-(27))."""

    max_tokens: int = 4096  # padded source+target tokens per batch (upper bound)
    update_freq: int = 1  # batches accumulated per update
    lr: float = 1e-3  # peak learning rate
    warmup_steps: int = 4000  # inverse-sqrt schedule warmup
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    clip_norm: float = 1.0  # 0 disables
    label_smoothing: float = 0.1
    coverage_weight: float = 0.0  # lambda of the coverage loss L_cov (summarization; docs/model.md (40))
    max_steps: int = 100_000  # 0: no limit
    max_epochs: int = 0  # 0: no limit
    max_time: str = ""  # wall-clock budget: "900", "15m", "1h"; "" no limit
    # bf16: a bf16 copy of the fp32 master weights made once per update (s2s.precision.Bf16Copy);
    # auto: bf16 where the device multiplies bf16 natively (AVX-512 BF16, AMX, a CUDA GPU with bf16), else fp32
    precision: Literal["fp32", "bf16", "auto"] = "fp32"
    # the BLAS of fp32 training's matrix products on the CPU (s2s.model.gemm): auto is openblas where
    # torch's MKL runs its generic kernels (a CPU not made by Intel) in a one-thread process, else torch
    gemm: Literal["auto", "torch", "openblas"] = "auto"
    threads: int = 0  # torch intra-op threads (per process); 0: torch's default, or cores / procs
    # data-parallel processes on this machine (s2s.distributed.launch_local); an update takes
    # procs * update_freq batches.  auto: one per core (train.threads each), fewer if memory is short
    # (s2s.distributed.auto_procs); one per GPU on CUDA.  Ignored under torchrun.
    procs: int | Literal["auto"] = 1
    compile: bool = False  # each batch's forward pass and loss through torch.compile (backward compiled with it)
    device: str = "auto"  # auto (the GPU when torch sees one) | cpu | cuda | cuda:N | mps; dev BLEU too
    log_every: int = 50
    validate_every: int = 1000  # steps between dev loss/BLEU (and checkpoints)
    dev_bleu_sentences: int = 300  # dev sentences translated for BLEU; 0 skips BLEU
    dev_beam: int = 1  # beam used for dev BLEU (1 = greedy)
    best_metric: Literal["bleu", "loss"] = "bleu"
    early_stopping: int = 0  # stop after this many validations without a new best (0: never)
    keep_checkpoints: int = 3  # last N checkpoints kept
    init_from: str = ""  # model directory whose weights start training
    distill: DistillConfig = field(default_factory=DistillConfig)

    def __post_init__(self) -> None:
        for key in ("max_tokens", "update_freq", "log_every", "validate_every", "keep_checkpoints",
                    "dev_beam"):
            _check(getattr(self, key) >= 1, f"train.{key}", "must be >= 1")
        for key in ("max_steps", "max_epochs", "warmup_steps", "threads", "dev_bleu_sentences",
                    "early_stopping"):
            _check(getattr(self, key) >= 0, f"train.{key}", "must be >= 0")
        _check(self.procs == "auto" or self.procs >= 1, "train.procs", "must be >= 1 or auto")
        _check(self.lr > 0, "train.lr", "must be > 0")
        _check(0.0 <= self.label_smoothing < 1.0, "train.label_smoothing", "must be in [0, 1)")
        _check(self.coverage_weight >= 0, "train.coverage_weight", "must be >= 0")
        _check(0.0 <= self.adam_beta1 < 1.0 and 0.0 <= self.adam_beta2 < 1.0, "train.adam_beta1",
               "Adam betas must be in [0, 1)")
        _check(self.clip_norm >= 0, "train.clip_norm", "must be >= 0")
        _check(is_device_name(self.device), "train.device",
               f"{self.device!r} is not one of {', '.join(DEVICES)} (or cuda:N)")
        _check(parse_duration(self.max_time, "train.max_time") > 0, "train.max_time",
               "must be more than 0 (leave it empty for no time limit)")
        _check(bool(self.max_steps or self.max_epochs or self.max_time), "train.max_steps",
               "set at least one of train.max_steps, train.max_epochs, train.max_time")
        _check(self.best_metric == "loss" or self.dev_bleu_sentences > 0, "train.best_metric",
               "bleu needs train.dev_bleu_sentences > 0")

    @property
    def max_seconds(self) -> float:
        return parse_duration(self.max_time, "train.max_time")


@dataclass(frozen=True)
class DecodeConfig:
    """Search settings for ``s2s translate`` (docs/model.md (29)-(36))."""

    beam: int = 5  # 1 = greedy
    alpha: float = 0.6  # length-penalty exponent
    length_penalty: Literal["gnmt", "power", "none"] = "gnmt"
    stop: Literal["exact", "early"] = "exact"  # beam: when a sentence stops (s2s.search.beam_stop_bound)
    max_len_a: float = 1.5  # max output length = a * |x| + b
    max_len_b: int = 10
    min_len: int = 0
    no_repeat_ngram: int = 0  # n > 0: no n-gram occurs twice in an output (fairseq's --no-repeat-ngram-size)
    coverage_penalty: float = 0.0  # beta of Wu et al.'s cp = beta * sum_j log min(sum_t A_tj, 1) (beam; beam 1 too)
    nbest: int = 1  # the nbest best hypotheses; with sampling, nbest samples per input
    sampling: bool = False  # draw each token from p instead of searching (needs beam: 1)
    temperature: float = 1.0  # sampling: q ∝ p^(1/T)
    top_k: int = 0  # sampling: among the k most probable tokens; 0 = all
    top_p: float = 1.0  # sampling: among the smallest set with mass >= top_p (nucleus)
    seed: int = 0  # sampling: the same seed draws the same outputs
    batch_tokens: int = 4096  # source tokens per decoding batch
    batch_size: int = 0  # at most this many sentences per decoding batch (0: only batch_tokens limits)
    max_input_tokens: int = 1024  # longer inputs are truncated with a warning
    max_output_tokens: int = 1024  # a*|x|+b is capped here (and by a learned position table)
    shortlist: bool = False  # score only each batch's shortlist (MODEL/shortlist.safetensors, `s2s shortlist`)
    compile: bool = False  # run the decoder step through torch.compile (Inductor; falls back to eager)
    glossary: str = ""  # a file of `source term<TAB>target term` lines the outputs must keep (s2s.glossary)
    split_sentences: bool = False  # a line is a paragraph: its sentences translated, rejoined on one line
    markup: bool = False  # inline tags (<b>..</b>, <br/>) taken out and put back through the alignment
    tgt_lang: str = ""  # the target language of a multilingual model (s2s.langs); "": the model's own

    def __post_init__(self) -> None:
        _check(self.beam >= 1, "decode.beam", "must be >= 1")
        _check(self.nbest >= 1 and (self.sampling or self.nbest <= self.beam), "decode.nbest",
               "must be in [1, beam] (any number of samples with decode.sampling)")
        _check(self.alpha >= 0, "decode.alpha", "must be >= 0")
        _check(self.max_len_a >= 0 and self.max_len_b >= 1, "decode.max_len_b",
               "max_len_a must be >= 0 and max_len_b >= 1")
        _check(self.min_len >= 0, "decode.min_len", "must be >= 0")
        _check(self.no_repeat_ngram >= 0, "decode.no_repeat_ngram", "must be >= 0")
        _check(self.coverage_penalty >= 0, "decode.coverage_penalty", "must be >= 0")
        _check(not self.sampling or self.beam == 1, "decode.sampling", "needs decode.beam: 1")
        _check(not (self.sampling and self.coverage_penalty), "decode.coverage_penalty",
               "rescores searched hypotheses; sampling draws them (set it to 0 with decode.sampling)")
        _check(not (self.sampling and self.glossary), "decode.glossary",
               "constrains searched hypotheses; sampling draws them (no glossary with decode.sampling)")
        _check(self.temperature > 0, "decode.temperature", "must be > 0")
        _check(self.top_k >= 0, "decode.top_k", "must be >= 0")
        _check(0 < self.top_p <= 1, "decode.top_p", "must be in (0, 1]")
        _check(self.batch_tokens >= 1, "decode.batch_tokens", "must be >= 1")
        _check(self.batch_size >= 0, "decode.batch_size", "must be >= 0")
        _check(self.max_input_tokens >= 1, "decode.max_input_tokens", "must be >= 1")
        _check(self.max_output_tokens >= 1, "decode.max_output_tokens", "must be >= 1")


def check_arch_supports(model: ModelConfig, decode: DecodeConfig, alignments: bool = False) -> None:
    """Refuse decode settings ``model.arch`` cannot serve: the coverage penalty, markup and
    alignments read the cross-attention, which only encoder_decoder has (copy and
    coverage are refused by ModelConfig itself).  ``alignments``: --alignments."""
    if model.arch == "encoder_decoder":
        return
    _check(not decode.markup, "decode.markup", f"places tags by the cross-attention; model.arch {model.arch} has none")
    _check(decode.coverage_penalty == 0, "decode.coverage_penalty",
           f"needs cross-attention; model.arch {model.arch} has none")
    _check(not alignments, "--alignments", f"model.arch {model.arch} has no cross-attention to align with")


@dataclass(frozen=True)
class PretrainConfig:
    """Denoising pretraining (``s2s pretrain``; docs/model.md (46)-(48))."""

    objective: Literal["span_corruption", "bart"] = "span_corruption"
    noise_density: float = 0.15  # span_corruption: fraction of tokens in noise spans
    mean_span: float = 3.0  # span_corruption: mean noise span length
    mask_rate: float = 0.0  # bart: token masking
    delete_rate: float = 0.0  # bart: token deletion
    infill_rate: float = 0.3  # bart: text infilling, fraction of tokens in spans
    poisson_lambda: float = 3.0  # bart: infilling span lengths ~ Poisson(lambda)
    permute_rate: float = 1.0  # bart: probability of shuffling a document's sentences
    rotate_rate: float = 0.0  # bart: probability of rotating a document

    def __post_init__(self) -> None:
        _check(0 < self.noise_density < 1, "pretrain.noise_density", "must be in (0, 1)")
        _check(self.mean_span >= 1, "pretrain.mean_span", "must be >= 1")
        for key in ("mask_rate", "delete_rate", "infill_rate", "permute_rate", "rotate_rate"):
            _check(0 <= getattr(self, key) <= 1, f"pretrain.{key}", "must be in [0, 1]")
        _check(self.mask_rate + self.delete_rate + self.infill_rate < 1, "pretrain.mask_rate",
               "mask_rate + delete_rate + infill_rate must stay below 1")
        _check(self.poisson_lambda >= 0.5, "pretrain.poisson_lambda", "must be >= 0.5")


@dataclass(frozen=True)
class ExperimentConfig:
    name: str = "experiment"
    seed: int = 1
    output_dir: str = ""  # run directory of `s2s train` (overridden by -o)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)

    def __post_init__(self) -> None:
        if self.model.positions == "learned" and (
                self.data.max_tokens_per_sentence > self.model.max_positions):
            raise ConfigError(f"data.max_tokens_per_sentence: {self.data.max_tokens_per_sentence} "
                              f"exceeds model.max_positions={self.model.max_positions} "
                              "(learned positions)")
        check_arch_supports(self.model, self.decode)
        _check(self.train.coverage_weight == 0 or self.model.arch == "encoder_decoder", "train.coverage_weight",
               f"the coverage loss needs cross-attention; model.arch {self.model.arch} has none")
        if self.train.early_stopping and not self.data.split_corpora("dev"):
            raise ConfigError("train.early_stopping: needs a dev split (data.dev)")
        if self.model.share_embeddings and not (self.tokenizer.joint or self.tokenizer.vocab_file):
            raise ConfigError("model.share_embeddings: needs a joint vocabulary "
                              "(tokenizer.joint: true) or share_embeddings: false")
        if self.data.pairs and not self.tokenizer.joint:
            raise ConfigError("data.pairs: several language pairs need one joint vocabulary "
                              "(tokenizer.joint: true)")


# --------------------------------------------------------------------------- #
# Loading, validation, overrides
# --------------------------------------------------------------------------- #

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")


def parse_duration(text: str, key: str = "duration") -> float:
    """'' -> inf; '90' or '90s' -> 90; '15m' -> 900; '2h' -> 7200."""
    if text == "" or text is None:
        return float("inf")
    m = _DURATION.match(str(text))
    if not m:
        raise ConfigError(f"{key}: {text!r} is not a duration like 900, 15m or 2h")
    unit = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
    return float(m.group(1)) * unit


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; ints are accepted as floats."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(str, choices))}")
        return value
    if origin is typing.Union:  # Optional[X], or one of several: int | Literal["auto"]
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None and len(args) < len(typing.get_args(tp)):
            return None
        for arg in args[:-1]:
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                pass
        try:
            return _coerce(value, args[-1], key)
        except ConfigError:
            if len(args) == 1:
                raise
        raise ConfigError(f"{key}: expected {' or '.join(map(_describe, args))}, got {value!r}") from None
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if not math.isfinite(value):  # YAML's .inf and .nan: no setting means infinity or NaN
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if isinstance(value, bool) or value is None or isinstance(value, (dict, list)):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return str(value)
    raise TypeError(f"unsupported config annotation {tp!r} for {key}")


def _describe(tp: Any) -> str:
    """How an error message names a type: 'an integer', 'auto'."""
    if typing.get_origin(tp) is Literal:
        return " or ".join(map(str, typing.get_args(tp)))
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, str(tp))


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix[:-1] or 'config'}: expected a mapping of keys, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    aliases = getattr(cls, "YAML_KEYS", {})
    fields = {f.name: f for f in dataclasses.fields(cls)}
    names = {**{f: f for f in fields}, **aliases}  # YAML name (or field name) -> field
    kwargs = {}
    for key, value in raw.items():
        full = f"{prefix}{key}"
        if key not in names:
            valid = [_yaml_name(cls, f) for f in fields]
            raise ConfigError(f"{full}: unknown key (valid keys{' in ' + prefix[:-1] if prefix else ''}: "
                              f"{', '.join(valid)})")
        name = names[key]
        tp = hints[name]
        if isinstance(value, FlowText):  # --set KEY=[...]
            value = value.parsed if typing.get_origin(tp) is tuple else str(value)
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, value, f"{full}.")
        elif typing.get_origin(tp) is tuple:  # tuple[X, ...]: a YAML list
            if not isinstance(value, (list, tuple)):
                raise ConfigError(f"{full}: expected a list, got {value!r}")
            item = typing.get_args(tp)[0]
            kwargs[name] = tuple(_build(item, v, f"{full}[{i}].") if dataclasses.is_dataclass(item)
                                 else _coerce(v, item, f"{full}[{i}]") for i, v in enumerate(value))
        else:
            kwargs[name] = _coerce(value, tp, full)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        if prefix.endswith("]."):  # an item of a list: its checks name keys relative to it
            raise ConfigError(f"{prefix}{e}") from None
        raise


def _yaml_name(cls: type, field_name: str) -> str:
    return {f: y for y, f in getattr(cls, "YAML_KEYS", {}).items()}.get(field_name, field_name)


def config_from_dict(raw: dict, source: str = "<config>") -> ExperimentConfig:
    """Validate a plain dict into an :class:`ExperimentConfig`; errors name ``source``."""
    try:
        return _build(ExperimentConfig, raw, "")
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def _set_dotted(raw: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = raw
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"--set {dotted}: {part} is not a section")
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """'model.d_model=512' -> ('model.d_model', 512); the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"--set {text}: expected key=value, e.g. --set model.d_model=512")
    key, _, value = text.partition("=")
    key = key.strip()
    if not key:
        raise ConfigError(f"--set {text}: empty key")
    try:
        parsed = yaml.load(value, Loader=YAML_LOADER) if value.strip() else ""
    except (yaml.YAMLError, UnicodeError):  # libyaml encodes the text: a lone surrogate (bytes not UTF-8) fails there
        parsed = value
    if isinstance(parsed, (dict, list)):
        parsed = FlowText(value, parsed)
    return key, parsed


class FlowText(str):
    """An override's value that YAML reads as a list or mapping ('[<2de>, <2fr>]'): the list for a
    key that takes one, else the text as it was typed (a path '[draft].txt' stays a path)."""

    def __new__(cls, text: str, parsed: Any):
        self = super().__new__(cls, text)
        self.parsed = parsed
        return self

    def __getnewargs__(self) -> tuple[str, Any]:  # pickled to a --workers process, copied
        return str(self), self.parsed


def decode_overrides(items: Optional[list[str]], command: str) -> dict:
    """``--set decode.KEY=VALUE`` items of ``s2s COMMAND`` -> {KEY: VALUE} (checked when
    applied, like a loaded config): translate, summarize and serve take decode keys only."""
    out = {}
    for item in items or []:
        key, value = parse_override(item)
        section, _, name = key.partition(".")
        if section != "decode" or not name:
            raise ConfigError(f"--set {item}: s2s {command} takes decode.* keys only "
                              "(the model's other settings are fixed by its training)")
        out[name] = value
    return out


def read_yaml(path: str | Path) -> dict:
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{p}: no such file")
    if p.is_dir():
        raise ConfigError(f"{p}: is a directory, expected a YAML file")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not valid UTF-8 (byte {e.start + 1})") from None
    if "\x00" in text:
        raise ConfigError(f"{p}: contains NUL bytes, not a YAML file")
    try:
        raw = yaml.load(text, Loader=YAML_LOADER)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{p}:{where}: YAML does not parse: {problem}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: expected a mapping of sections at the top level")
    return raw


def load_config(path: str | Path, overrides: Optional[list[str]] = None) -> ExperimentConfig:
    """Read ``path`` (YAML), apply ``--set`` overrides, validate."""
    raw = read_yaml(path)
    for item in overrides or []:
        key, value = parse_override(item)
        _set_dotted(raw, key, value)
    return config_from_dict(raw, str(path))


def chosen_decode_keys(path: str | Path, overrides: Optional[list[str]] = None) -> frozenset[str]:
    """The decode keys an experiment sets on purpose: those its YAML's decode section names,
    and those its ``--set decode.KEY=...`` overrides name."""
    section = read_yaml(path).get("decode")
    keys = set(section) if isinstance(section, dict) else set()
    for item in overrides or []:
        key, _ = parse_override(item)
        if key.startswith("decode."):
            keys.add(key.removeprefix("decode."))
    return frozenset(keys)


def load_training_config(path: str | Path, overrides: Optional[list[str]] = None) -> ExperimentConfig:
    """:func:`load_config` for ``s2s train``: the config also remembers, as ``cfg.decode_keys``
    (not a config key), which decode keys the experiment chose, so that the model directory
    records them in model.json (``decode_keys``) and ``s2s summarize`` keeps them."""
    cfg = load_config(path, overrides)
    object.__setattr__(cfg, "decode_keys", chosen_decode_keys(path, overrides))
    return cfg


def to_dict(cfg: Any) -> dict:
    """The config as plain nested dicts (and lists), keys named as in YAML."""
    def plain(v: Any) -> Any:
        if dataclasses.is_dataclass(v):
            return to_dict(v)
        return [plain(x) for x in v] if isinstance(v, tuple) else v

    return {_yaml_name(type(cfg), f.name): plain(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}


def to_yaml(cfg: ExperimentConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, allow_unicode=True)


def replace(section: Any, prefix: str = "", **changes: Any) -> Any:
    """A copy of a config section with ``changes``, type-checked and validated like
    a loaded one; errors name the key as ``{prefix}{key}`` (e.g. prefix "decode.")."""
    return _build(type(section), {**to_dict(section), **changes}, prefix)
