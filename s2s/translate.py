"""Translating text: batching by length, search, streaming in input order.

``Translator.translate_lines`` reads its input lazily in chunks, sorts each
chunk by length into batches of at most ``batch_tokens`` source tokens,
searches, and yields one result per input line, in input order, chunk by
chunk — so memory stays bounded and output starts before input ends.  An
empty (or all-whitespace) line yields an empty translation.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Optional, Sequence, TextIO

import torch

from s2s.config import DecodeConfig, ExperimentConfig, check_arch_supports
from s2s.constraints import pad_constraints, room_for_constraints, unmet_constraints
from s2s.data import pad_sequences, teacher_forcing_input, tokenizer_fingerprint
from s2s.errors import ConfigError, S2SError
from s2s.glossary import Glossary, load_glossary
from s2s.hypotheses import Hypothesis, Translation
from s2s.langs import language_ids, with_forced
from s2s.leantorch import complete_torch
from s2s.model import S2SModel, Seq2SeqTransformer
from s2s.model.gemm import use_packed_bf16
from s2s.model.native import available as available_native_attention
from s2s.model.native import use_native_attention
from s2s.modeldir import input_cap, model_decode_settings, output_cap, warn_past_output_cap
from s2s.output import OutputFormat, format_translation
from s2s.precision import auto_arithmetic, auto_precision, beam_slot_dtype, greedy_kv_dtype, resolve_precision  # noqa: F401 (auto_precision: importable from here too)
from s2s.search import (
    EnsembleDecoder,
    ModelDecoder,
    SpecialIds,
    ensemble_log_weights,
    greedy_search_runs,
    search,
)
from s2s.shortlist import Shortlist, load_shortlist, subset_positions, subset_search_ids
from s2s.textio import line_numbers
from s2s.tokenizer import BOS_ID, Tokenizer, encode_forced_starts, encode_source_lines
from s2s.workers import (
    PRECISIONS,
    TranslateProgress,  # noqa: F401 (TranslateProgress: re-exported)
    check_translator_options,
    paired_lines,
    sorted_batches,
)

log = logging.getLogger("s2s")


@torch.inference_mode()
def cross_attention(model: Seq2SeqTransformer, src: torch.Tensor, tgt: torch.Tensor,
                    layer: Optional[int] = -1, bos_id: int = BOS_ID) -> torch.Tensor:
    """Cross-attention of a target over its source by teacher forcing, averaged over heads:
    src (B, S), tgt (B, T) target tokens y_1..y_T -> A (B, T, S), row t = where y_t looked.
    ``layer``: a decoder layer index (-1: the last, the one copy and coverage use) or
    None for the mean over all layers."""
    tgt_in = teacher_forcing_input(tgt.tolist(), bos_id=bos_id).to(tgt.device)  # pads stay where tgt has them
    _, weights = model.decode(tgt_in, model.encode(src), need_weights=True)
    per_layer = torch.stack([w.float().mean(1) for w in weights])  # (layers, B, T, S)
    return per_layer.mean(0) if layer is None else per_layer[layer]


@dataclass
class AttentionMap:
    A: torch.Tensor  # (T, S) on the CPU: row t = where target piece t looked
    src_pieces: list[str]  # the S source subwords, </s> included
    tgt_pieces: list[str]  # the T target subwords, </s> included


def attention_map(translator: "Translator", src: str, tgt: Optional[str] = None,
                  layer: Optional[int] = None) -> AttentionMap:
    """The cross-attention of ``tgt`` (default: the translator's best translation of ``src``)
    over ``src``, averaged over heads: ``layer`` a decoder layer (0-based, -1 the last) or
    None for the mean over layers (see :func:`cross_attention`)."""
    model = translator.model
    if model.cfg.arch != "encoder_decoder":
        raise S2SError(f"model.arch: {model.cfg.arch} has no cross-attention to draw")
    n_layers = model.cfg.dec_layers
    if layer is not None and not -n_layers <= layer < n_layers:
        raise S2SError(f"--layer: {layer} is not a layer of this {n_layers}-layer decoder")
    if not src.strip():
        raise S2SError("--src: empty sentence")
    tok = translator.tok
    src_ids = translator.encode_lines([src], 1)[0]
    if tgt is None:
        forced = with_forced(translator.lang.tgt_first, None, 1)  # a target language's token
        tgt_ids = translator.search_sorted([src_ids], forced)[0][0].tokens + [tok.eos_id]
    else:
        tgt_ids = tok.encode_tgt([tgt.strip()])[0]
    on = translator.device
    A = cross_attention(model, torch.tensor([src_ids], device=on), torch.tensor([tgt_ids], device=on),
                        layer, tok.bos_id)[0].cpu()
    return AttentionMap(A, [tok.piece(i, "src") for i in src_ids], [tok.piece(i) for i in tgt_ids])


def check_beam_width(K: int, V: int) -> None:
    """A beam of K hypotheses over a target vocabulary of V tokens: K <= V, else an error (it would
    allocate K x V scores a step for nothing)."""
    if K > V:
        raise ConfigError(f"decode.beam: {K} is more than the {V} tokens of the target vocabulary")


def hard_alignment(A: torch.Tensor, src_len: int, tgt_len: int) -> list[tuple[int, int]]:
    """Pharaoh pairs (j, t): each target token t < tgt_len aligned to argmax_j A_tj over the
    src_len real source tokens (the source's </s> and padding excluded)."""
    best = A[:tgt_len, :src_len].argmax(dim=-1).tolist()
    return [(j, t) for t, j in enumerate(best)]


def max_output_lengths(src_lens: torch.Tensor, a: float, b: int, cap: Optional[int]) -> torch.Tensor:
    """max_len(x) = floor(a * |x| + b), capped by decode.max_output_tokens and the model's position limit."""
    out = (a * src_lens.float() + b).floor().long().clamp(min=1)
    return out.clamp(max=cap) if cap is not None else out


def compile_decode_step(model: S2SModel) -> None:
    """Route ``model.decode_step`` through ``torch.compile`` (Inductor, shapes dynamic), once per
    model.  Not ``mode="reduce-overhead"`` (CUDA graphs) on a GPU: the step writes into the
    self-attention cache it is given and returns buffers the next steps read, which a graph's
    replay would overwrite, and no GPU has run it to show otherwise.  Inductor keeps its
    compiled graphs on disk (TORCHINDUCTOR_CACHE_DIR; fx_graph_cache), so a second
    process loads them instead of compiling.  The first step's time (the compile) is
    logged on its own; where compiling fails the step runs eagerly, with one warning."""
    if getattr(model, "_compiled_step", False):
        return
    if getattr(model, "step_script", None) is not None:  # torch.compile traces the Python step
        object.__setattr__(model, "step_script", None)
    use_native_attention(model, False)  # torch's products, which Inductor can trace
    complete_torch()  # fake tensors read the Python meta kernels a lean import deferred
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    eager = model.decode_step
    state = {"step": torch.compile(eager, dynamic=True), "first": True}

    def step(*args, **kwargs):
        if state["step"] is eager:
            return eager(*args, **kwargs)
        start = time.perf_counter()
        try:
            out = state["step"](*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - any compiler failure: decode eagerly
            log.warning("--compile: torch.compile failed (%s: %s); decoding without it",
                        type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            state["step"] = eager
            return eager(*args, **kwargs)
        if state["first"]:
            state["first"] = False
            log.info("--compile: first decoder step %.1f s (compiling, or loading Inductor's cache)",
                     time.perf_counter() - start)
        return out

    model.decode_step = step
    model._compiled_step = True


class Translator:
    def __init__(self, model: S2SModel, tokenizer: Tokenizer, decode: DecodeConfig,
                 device: str | torch.device = "cpu", trained_src_tokens: int = 0):
        """``trained_src_tokens``: sources were cut to this length in training
        (data.max_src_tokens, e.g. for summarization); inputs are cut the same way, silently."""
        self.model = model.eval()
        self.tok = tokenizer
        self.device = torch.device(device)
        self.decode = decode
        self.max_input = input_cap(model.cfg, decode)
        self.trained_src_tokens = trained_src_tokens
        self.alignments = False  # also align each hypothesis to its source (Pharaoh pairs)
        # the hypotheses carry their log-probabilities; False (no score is shown): a greedy
        # search may skip normalizing its steps, and its hypotheses' scores are NaN
        self.scores = True
        self.precision = "fp32"  # or bf16: the weights converted (set_arithmetic)
        self.int8 = False  # int8 copies of the matrices beside the fp32 ones (set_arithmetic)
        self.extra_models: list[S2SModel] = []  # an ensemble's other members
        self.weights: Optional[list[float]] = None  # the members' weights (None: equal)
        self.directory: Optional[Path] = None  # the model directory (its shortlist.safetensors)
        self.shortlist: Optional[Shortlist] = None  # decode.shortlist: the table, read on first use
        self._glossaries: dict[str, Glossary] = {}  # decode.glossary's files, each read once
        self.languages = ("src", "tgt")  # data.src_lang, data.tgt_lang (s2s.documents: sentence rules, joining)

    @property
    def decode(self) -> DecodeConfig:
        return self._decode

    @decode.setter
    def decode(self, decode: DecodeConfig) -> None:
        """Decode settings, checked against the model: a beam wider than the target vocabulary V
        is an error (it would allocate K x V scores a step for nothing); output lengths are capped
        at decode.max_output_tokens and the learned position table, with a warning when
        max_len_b alone goes past them."""
        check_beam_width(decode.beam, self.target_vocab_size)
        warn_past_output_cap(self.model.cfg, decode)
        if decode.split_sentences:
            from s2s.documents import require_splitter

            require_splitter()
        self.lang = language_ids(self.tok.languages, self.tok.token_id, decode.tgt_lang)  # s2s.langs
        self._decode = decode

    @property
    def target_vocab_size(self) -> int:
        """V, the output projection's rows: the widest beam a search can keep."""
        return self.model.cfg.vocab_size or self.tok.tgt_vocab_size

    def output_cap(self, decode: DecodeConfig) -> int:
        """The longest output (s2s.modeldir.output_cap)."""
        return output_cap(self.model.cfg, decode)

    @classmethod
    def from_dir(cls, directory: str | Path, device: str = "cpu", **decode_overrides) -> "Translator":
        """Load a model directory; ``decode_overrides`` replace its decode settings."""
        return cls.from_dirs([directory], device, decode=decode_overrides)

    @classmethod
    def from_dirs(cls, directories: Sequence[str | Path], device: str | torch.device = "cpu",
                  weights: Optional[Sequence[float]] = None, decode: Optional[Mapping[str, Any]] = None,
                  decode_defaults: Optional[Mapping[str, Any]] = None, precision: str = "fp32",
                  quantize: Optional[str] = None, alignments: bool = False, threads: int = 0) -> "Translator":
        """An ensemble of model directories (or training checkpoints, RUN/checkpoints/step-N)
        that share one tokenizer (the first one's config gives the decode settings); one
        directory is a single model.  Every setting is checked here, once, for the CLI and
        the Python API alike:

        ``weights``: one per member (see :class:`EnsembleDecoder`);
        ``device``: cpu, cuda, cuda:N, mps, or auto (the GPU when torch sees one);
        ``decode``: decode keys replacing the model's (see :func:`decode_settings`);
        ``decode_defaults``: keys used where the model's training did not choose its own
        (``s2s summarize``'s, see :func:`decode_settings`);
        ``precision``, ``quantize``: see :meth:`set_arithmetic`; ``alignments``: align each
        hypothesis to its source (encoder_decoder models only); ``threads``: torch's
        intra-op threads for this process (0: torch's default)."""
        from s2s.device import resolve_device, use_device
        from s2s.modeldir import load_model_dir

        check_translator_options(len(directories), device, weights, precision, quantize, threads)
        if threads:
            torch.set_num_threads(threads)
        if not isinstance(device, torch.device):
            device = resolve_device(device)
        use_device(device)
        loaded = [load_model_dir(d, device) for d in directories]
        first = loaded[0]
        wanted = tokenizer_fingerprint(first.cfg, first.directory)  # sha256 of the SentencePiece files
        for other in loaded[1:]:
            if tokenizer_fingerprint(other.cfg, other.directory) != wanted:
                raise S2SError(f"{other.directory}: another tokenizer than {first.directory}; "
                               "an ensemble needs models trained with the same SentencePiece model(s)")
        settings = model_decode_settings(first.directory, first.cfg, decode or {}, decode_defaults or {})
        translator = cls(first.model, first.tokenizer, settings, device, first.cfg.data.max_src_tokens)
        translator.extra_models = [m.model.eval() for m in loaded[1:]]
        translator.directory = first.directory
        translator.languages = (first.cfg.data.src_lang, first.cfg.data.tgt_lang)
        if weights is not None:
            translator.weights = [float(w) for w in weights]
        for member in [translator.model, *translator.extra_models] if alignments else []:
            if member.cfg.arch != "encoder_decoder":
                raise S2SError(f"--alignments: model.arch {member.cfg.arch} has no cross-attention to align with")
        translator.alignments = alignments
        if device.type == "cpu":
            for member in [translator.model, *translator.extra_models]:
                member.lay_out_for_steps()
        translator.set_arithmetic(precision, quantize)
        translator.glossary()  # a bad glossary file fails here, before any input is read
        return translator

    def set_arithmetic(self, precision: str = "fp32", quantize: Optional[str] = None) -> None:
        """``precision``: fp32; bf16 (the weights converted once, see :meth:`to_bf16`); or auto
        (:func:`auto_arithmetic`: bf16 or fp32 with int8 matrices, whichever was measured faster
        on this kind of CPU; with fp32, a beam search's self-attention K/V in bf16 where the CPU
        multiplies bf16 natively, :func:`~s2s.precision.beam_slot_dtype`, and a greedy search's
        attention K/V where the C kernel reads them, :func:`~s2s.precision.greedy_kv_dtype`).  ``quantize``: None, or
        int8 (see :meth:`quantize_int8`), with fp32 weights only.  On one CPU thread, decoding's
        attention goes through the C kernel where it compiled (s2s.model.native), and a bf16
        model's products through s2s's AMX kernel where the CPU has AMX (:meth:`to_bf16`)."""
        if precision not in PRECISIONS:
            raise S2SError(f"--precision: {precision!r} is not fp32, bf16 or auto")
        if quantize not in (None, "int8"):
            raise S2SError(f"--quantize: {quantize!r} is not int8")
        auto = precision == "auto"
        if auto:
            precision, int8, why = auto_arithmetic(self.device)
            if int8:
                quantize = "int8"
        precision = resolve_precision(precision, self.device, "--precision")
        if quantize == "int8" and precision == "bf16":
            raise S2SError("--quantize int8 quantizes fp32 weights: use it with --precision fp32")
        self.precision = precision
        # the kernels run on one thread (oneDNN's products and torch's attention split over several)
        native = self.device.type == "cpu" and torch.get_num_threads() == 1 and available_native_attention()
        slot_dtype = beam_slot_dtype(self.device, precision) if auto else None
        greedy_dtype = greedy_kv_dtype(self.device, precision) if auto and native else None  # (the kernel widens)
        if auto:
            narrowed = "beams' self-attention K/V" + (" and greedy search's attention K/V" if greedy_dtype else "")
            log.info("--precision auto: %s%s%s (%s)", precision, " and int8" if quantize == "int8" else "",
                     f", {narrowed} in bf16" if slot_dtype else "", why)
        for member in [self.model, *self.extra_models]:
            member.beam_slot_dtype = slot_dtype
            member.greedy_kv_dtype = greedy_dtype
            use_native_attention(member, native)  # before the step is scripted: it copies the choice
        if precision == "bf16":
            self.to_bf16(native_linear=native)
        if quantize == "int8":
            self.quantize_int8()
        self.int8 = quantize == "int8"
        if precision != "bf16" and quantize != "int8":  # (to_bf16 and quantize_int8 script their members)
            self.script_steps()

    def script_steps(self) -> None:
        """Each member's decoder step as one TorchScript program where it can be
        (s2s.model.step_script), built from the matrices it decodes with now: every change of
        them (to_bf16, quantize_int8) scripts again."""
        for member in [self.model, *self.extra_models]:
            if hasattr(member, "script_step"):
                member.script_step()

    def to_bf16(self, native_linear: bool = False) -> None:
        """Convert every member's weights to bf16 once (no autocast per operation).  What
        accuracy needs stays fp32 inside the kernels: layer norm statistics and the
        attention softmax accumulate in fp32 (s2s.model.attention casts the reference
        path's scores up), and the search takes log_softmax of fp32 logits.  On the CPU each
        matrix is packed once (s2s.model.gemm.use_packed_bf16): for s2s's own kernel with
        ``native_linear`` (one thread) where the CPU has AMX (s2s.model.native.linear_isa), else
        for oneDNN."""
        self.model = self.model.to(torch.bfloat16)
        self.extra_models = [m.to(torch.bfloat16) for m in self.extra_models]
        if self.device.type == "cpu":  # each W packed once, not per product
            for member in [self.model, *self.extra_models]:
                use_packed_bf16(member, native=native_linear)
        self.script_steps()

    def quantize_int8(self) -> None:
        """int8 matrices where they pay (s2s.model.int8): every linear layer and the output
        projection, tied or not, keep their fp32 weights and get an int8 copy, and each product
        takes the int8 one when it is large enough to win; CPU only; embeddings stay fp32."""
        if self.device.type != "cpu":
            raise S2SError("--quantize int8: dynamic quantization runs on the CPU only")
        from s2s.model.int8 import quantize_int8

        for member in [self.model, *self.extra_models]:
            quantize_int8(member)
        self.script_steps()

    def glossary(self) -> Optional[Glossary]:
        """decode.glossary's terms (s2s.glossary), the file read once; None without one."""
        path = self.decode.glossary
        if not path:
            return None
        if path not in self._glossaries:
            self._glossaries[path] = load_glossary(path)
        return self._glossaries[path]

    def constraint_ids(self, lines: Sequence[str],
                       glossary: Glossary) -> tuple[list[list[str]], list[list[list[int]]]]:
        """Each line's glossary constraints: the target terms of the source terms it
        contains, and each term's target pieces (without </s>)."""
        terms = [glossary.targets_in(line) for line in lines]
        distinct = list(dict.fromkeys(term for ts in terms for term in ts))
        pieces = dict(zip(distinct, (x[:-1] for x in self.tok.encode_tgt(distinct)))) if distinct else {}
        return terms, [[pieces[term] for term in ts] for ts in terms]

    @property
    def special_ids(self) -> SpecialIds:
        return SpecialIds(bos_id=self.tok.bos_id, eos_id=self.tok.eos_id, pad_id=self.tok.pad_id)

    # ------------------------------------------------------------------ #
    @torch.inference_mode()
    def search_ids(self, src_ids: Sequence[Sequence[int]],
                   prefix_ids: Optional[Sequence[Sequence[int]]] = None,
                   constraint_ids: Optional[Sequence[Sequence[Sequence[int]]]] = None) -> list[list[Hypothesis]]:
        """Search one batch of encoded sources (each ending in </s>); ``prefix_ids``
        are target tokens each output must start with, ``constraint_ids`` token
        sequences each output must contain (s2s.constraints)."""
        for m in (self.model, *self.extra_models):
            check_arch_supports(m.cfg, self.decode, self.alignments)
        src = pad_sequences(src_ids, self.tok.pad_id).to(self.device)  # (B, S)
        src_lens = torch.tensor([len(s) - 1 for s in src_ids], device=self.device)
        max_len = max_output_lengths(src_lens, self.decode.max_len_a, self.decode.max_len_b,
                                     self.output_cap(self.decode))
        prefix = None
        if prefix_ids is not None and any(prefix_ids):
            prefix = pad_sequences(prefix_ids, pad_id=-1).to(self.device)  # (B, P)
            max_len = torch.maximum(max_len, (prefix >= 0).sum(1) + 1)  # room for the prefix and </s>
        constraints = None if constraint_ids is None else pad_constraints(constraint_ids)  # (B, M, L)
        if constraints is not None:
            constraints = constraints.to(self.device)
            max_len = room_for_constraints(max_len, constraints, self.output_cap(self.decode))
        track = self.decode.coverage_penalty > 0
        if self.decode.sampling:
            complete_torch()  # torch.Generator needs torch._prims.rng_prims: a lean import defers it
        if self.decode.compile:
            for m in (self.model, *self.extra_models):
                compile_decode_step(m)
        special, ids = self.special_ids, self.vocab_subset(src, prefix, constraints)
        if ids is not None:  # the search runs over the subset's positions
            special, prefix = subset_search_ids(special, ids), subset_positions(ids, prefix)
            constraints = subset_positions(ids, constraints)
        # greedy search ranks nothing: without a score to show, its steps need no normalizing
        greedy = greedy_search_runs(self.decode, constraints)
        normalized = self.scores or bool(self.extra_models) or not greedy or self.decode.sampling
        narrow = greedy and not self.decode.sampling  # (measured for greedy search)
        decoders = [ModelDecoder(m, src, track, ids, normalized, m.greedy_kv_dtype if narrow else None)
                    for m in [self.model, *self.extra_models]]
        decoder = decoders[0] if len(decoders) == 1 else EnsembleDecoder(decoders, self.weights)
        found = search(decoder, max_len, self.decode, special, prefix, constraints)
        if ids is not None:
            for hyps in found:
                for h in hyps:
                    h.tokens = ids[h.tokens].tolist()  # back to target ids
        if self.alignments:
            self.align(src, [len(s) - 1 for s in src_ids], found)
        return found

    def vocab_subset(self, src: torch.Tensor, prefix: Optional[torch.Tensor],
                     constraints: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """With decode.shortlist, the batch's target ids (V',) ascending: its shortlist
        (see s2s.shortlist), the special ids, a forced prefix's and the constraints' ids;
        else None (all).
        Only a translator loaded from a model directory has a shortlist (dev BLEU while
        training scores the whole vocabulary); an ensemble uses its first member's."""
        if not self.decode.shortlist or (self.directory is None and self.shortlist is None):
            return None
        if self.shortlist is None:
            for m in (self.model, *self.extra_models):
                if m.cfg.copy:
                    raise S2SError("--shortlist: a copy model (model.copy) scores its whole vocabulary "
                                   "and its source; translate it without a shortlist")
            self.shortlist = load_shortlist(self.directory, self.model.src_embed.num_embeddings,
                                            self.model.tgt_embed.num_embeddings)
        always = [self.tok.pad_id, self.tok.unk_id, self.tok.bos_id, self.tok.eos_id]
        for forced in (prefix, constraints):
            if forced is not None:
                always += forced[forced >= 0].unique().tolist()
        return self.shortlist.subset(src, always)

    def align(self, src: torch.Tensor, src_lens: list[int], found: list[list[Hypothesis]]) -> None:
        """Give every hypothesis its alignment: one teacher-forced pass over all of them.

        An ensemble aligns with its members' cross-attention averaged with the ensemble
        weights, A = sum_i w_i A_i (the attention its coverage penalty uses), each A_i the
        last decoder layer's head mean."""
        rows = [(i, h) for i, hyps in enumerate(found) for h in hyps]
        if not rows:
            return
        tgt = pad_sequences([h.tokens + [self.tok.eos_id] for _, h in rows], self.tok.pad_id).to(src.device)
        rows_src = src[[i for i, _ in rows]]
        members = [self.model, *self.extra_models]
        w = ensemble_log_weights(self.weights or [1.0] * len(members)).exp().tolist()
        A = sum(w_i * cross_attention(m, rows_src, tgt, bos_id=self.tok.bos_id)
                for w_i, m in zip(w, members))  # (R, T, S)
        for r, (i, h) in enumerate(rows):
            h.alignment = hard_alignment(A[r], src_lens[i], len(h.tokens))

    def search_sorted(self, src_ids: Sequence[Sequence[int]],
                      prefix_ids: Optional[Sequence[Sequence[int]]] = None,
                      constraint_ids: Optional[Sequence[Sequence[Sequence[int]]]] = None) -> list[list[Hypothesis]]:
        """Search many sources: sorted by length into token-bounded batches, order restored."""
        results: list[list[Hypothesis]] = [[] for _ in src_ids]
        for rows in sorted_batches([len(ids) for ids in src_ids], self.decode.batch_size, self.decode.batch_tokens):
            batch = [src_ids[i] for i in rows]
            prefixes = None if prefix_ids is None else [prefix_ids[i] for i in rows]
            constraints = None if constraint_ids is None else [constraint_ids[i] for i in rows]
            for i, hyps in zip(rows, self.search_ids(batch, prefixes, constraints)):
                results[i] = hyps
        return results

    def encode_lines(self, lines: Sequence[str], first_line_no: int | Sequence[int]) -> list[Optional[list[int]]]:
        """Source ids per line (None for an empty line), truncating over-long lines with a warning
        naming the line (``first_line_no``: the first line's number, or each line's)."""
        return encode_source_lines(self.tok, self.lang, lines, line_numbers(first_line_no, len(lines)),
                                   self.trained_src_tokens, self.max_input)

    def translate_chunk(self, lines: Sequence[str], first_line_no: int | Sequence[int] = 1,
                        prefixes: Optional[Sequence[str]] = None,
                        glossary: Optional[Glossary] = None) -> list[Translation]:
        """One Translation per line; with decode.split_sentences or decode.markup each line is a
        paragraph (s2s.documents), else a sentence (:meth:`translate_sentences`).
        ``first_line_no``: the first line's number, or each line's (messages, n-best rows)."""
        if self.decode.split_sentences or self.decode.markup:
            from s2s.documents import translate_paragraphs

            return translate_paragraphs(self, lines, first_line_no, prefixes, glossary)
        return self.translate_sentences(lines, first_line_no, prefixes, glossary)

    def translate_sentences(self, lines: Sequence[str], first_line_no: int | Sequence[int] = 1,
                            prefixes: Optional[Sequence[str]] = None,
                            glossary: Optional[Glossary] = None) -> list[Translation]:
        """One Translation per line, each line one input of the model (``first_line_no``: the
        first line's number, or each line's); ``prefixes``: see :meth:`translate_lines`;
        ``glossary`` (default: decode.glossary's) gives each line the target terms its output
        must contain, with a warning for a line whose best output misses one."""
        line_nos = line_numbers(first_line_no, len(lines))
        ids = self.encode_lines(lines, line_nos)
        todo = [i for i, x in enumerate(ids) if x is not None]
        wanted = None if prefixes is None else [prefixes[i] for i in todo]
        prefix_ids = encode_forced_starts(self.tok, self.lang, wanted, [line_nos[i] for i in todo],
                                          self.output_cap(self.decode))  # a target language's token, a prefix
        glossary = glossary if glossary is not None else self.glossary()
        terms, constraint_ids = self.constraint_ids([lines[i] for i in todo], glossary) if glossary else (None, None)
        found = self.search_sorted([ids[i] for i in todo], prefix_ids, constraint_ids)
        for i, ts, cs, h in zip(todo, terms or [], constraint_ids or [], found):
            missed = unmet_constraints(h[0].tokens, cs) if h else []
            if missed:
                log.warning("line %d: glossary term(s) %s not in the translation: no hypothesis within "
                            "the maximum output length kept them", line_nos[i],
                            ", ".join(repr(ts[j]) for j in missed))
        hyps: list[list[Hypothesis]] = [[] for _ in lines]
        for i, h in zip(todo, found):
            hyps[i] = h
        return [Translation(line_nos[i], h, [self.tok.decode_tgt(x.tokens) for x in h])
                for i, h in enumerate(hyps)]

    def translate_lines(self, lines: Iterable[str], chunk_lines: int = 1000,
                        prefixes: Optional[Iterable[str]] = None) -> Iterator[Translation]:
        """Translate a (possibly endless) stream of lines, yielding them in input order;
        ``prefixes``, one line per input line, are forced as each output's start."""
        it = iter(lines) if prefixes is None else paired_lines(lines, prefixes)
        line_no = 1
        while True:
            chunk = list(itertools.islice(it, chunk_lines))
            if not chunk:
                return
            if prefixes is None:
                yield from self.translate_chunk(chunk, line_no)
            else:
                yield from self.translate_chunk([x for x, _ in chunk], line_no, [p for _, p in chunk])
            line_no += len(chunk)

    def translate(self, lines: Sequence[str]) -> list[str]:
        """Best translation of each line."""
        return [t.text for t in self.translate_lines(lines)]


def write_translations(translator: Translator, lines: Iterable[str], out: TextIO,
                       fmt: Optional[OutputFormat] = None, line_by_line: bool = False,
                       prefixes: Optional[Iterable[str]] = None,
                       progress: Optional[TranslateProgress] = None) -> None:
    """Translate ``lines`` into ``out`` as ``fmt`` says (see :mod:`s2s.output`; default: one
    line per input line, with ``translator.alignments`` ending in `` ||| j-t ...``: source
    subword j aligned to target subword t, Pharaoh format, 0-based).
    Flushed after every chunk, or every line with ``line_by_line``."""
    fmt = fmt or OutputFormat(alignments=translator.alignments)
    chunk = 1 if line_by_line else 1000
    for t in translator.translate_lines(lines, chunk_lines=chunk, prefixes=prefixes):
        if progress is not None:
            progress.update(t)
        out.write(format_translation(t, fmt))
        if t.line_no % chunk == 0:
            out.flush()
    out.flush()


def distill_corpus(teacher: str | Path, cfg: ExperimentConfig, out_prefix: str | Path,
                   device: str = "auto", **decode_overrides) -> tuple[Path, Path]:
    """Sequence-level knowledge distillation (Kim and Rush 2016): the teacher translates the
    source side of ``data.train`` with beam search into ``OUT.{tgt_lang}``, beside a copy of
    the sources as ``OUT.{src_lang}``; a student recipe then trains on ``data.train: OUT``."""
    from s2s.textio import read_lines, resolve_corpus, staged_files

    if not cfg.data.train:
        raise S2SError("data.train: no training corpus configured")
    src_file = resolve_corpus(cfg.data.train, cfg.data.src_lang)
    out_src = Path(f"{out_prefix}.{cfg.data.src_lang}")
    out_tgt = Path(f"{out_prefix}.{cfg.data.tgt_lang}")
    check_distill_output(cfg, out_prefix)
    translator = Translator.from_dir(teacher, device, **decode_overrides)
    with staged_files() as staged:  # the two sides appear together, or neither
        with staged.open(out_tgt) as f:
            write_translations(translator, read_lines(src_file), f)
        with staged.open(out_src) as f:
            f.writelines(line + "\n" for line in read_lines(src_file))
    return out_src, out_tgt


def check_distill_output(cfg: ExperimentConfig, out_prefix: str | Path) -> None:
    """``s2s distill -o OUT`` is no corpus prefix of the config (its files, OUT.{lang} or
    OUT.{lang}.gz, are what the teacher and the recipe read; a plain OUT.de would also shadow an
    OUT.de.gz)."""
    out = os.path.realpath(out_prefix)
    for split in ("train", "dev", "test"):
        for prefix, _, _ in cfg.data.split_corpora(split):
            if os.path.realpath(prefix) == out:
                raise S2SError(f"{out_prefix}: is the prefix of data.{split} ({prefix}), whose corpus it would "
                               "replace; choose another -o")
