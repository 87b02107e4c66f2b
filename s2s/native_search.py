"""Greedy and beam search without torch: ``s2s translate``'s route for a plain search on a CPU with
bf16 products (AMX, or AVX512-BF16 without it), or with int8 products on AVX2 (VNNI where there).

On a 2-core Intel Xeon with AMX, a greedy ``s2s translate`` of 1,000 lines spent 0.85 s
importing torch (in the workers' server) before its first line, and 0.6 s decoding them
(benchmarks/README.md). This module decodes the same model without torch: ``native_search.c`` (with
``native_attention.c`` and ``native_linear.c``, the kernels the torch route calls as operators)
runs a whole batch's encoder and greedy or beam search in one C call, its products on AMX (or
AVX512-BF16's vdpbf16ps on a CPU without AMX, as AMD's Zen 4 and 5) with each W packed once,
or int8 products on AVX2 or VNNI (``native_int8.c``: W quantized once row by row, x per call),
the residual stream, the softmax and the scores in fp32, each thread's buffers kept from batch
to batch (s2s/model/native_search.c); with ``decode.shortlist`` each batch's output projection
over its shortlist alone (s2s.shortlist: the table read here without torch, the subset computed
in C, W_U's rows for it packed per batch). The weights are read with safetensors (no numpy either)
and checked against model.json's checksum, as s2s.modeldir loads them for torch; the sources
are encoded and the outputs decoded by the same tokenizer, and batched as the workers batch
them. The C call releases the GIL, so that N threads of this one process decode N batches at
once (``--workers N``: threads, not processes, here).

:func:`engine_for` takes the route only where it computes what the torch route would
(:func:`products_for`: ``--precision bf16`` on a CPU with amx_bf16 or avx512_bf16, and auto on
AMX, in bf16; ``--quantize int8``, and ``--precision auto`` on the other CPUs with AVX2, in int8;
greedy or beam
search, or sampling (its draws seeded per line: :func:`sample_seed`), with forced prefixes
(--prefix-file, a target language's token) and --split-sentences (s2s.documents) but none of
the options this file does not implement (:func:`model_why_not`, :func:`spec_why_not`), its
output as s2s.output writes it: text rows, with their confidence (--scores), n-best rows of a
beam search or of samples (--nbest) or JSON lines; a single encoder-decoder model of
sinusoidal or learned positions) and where the library compiled;
anything else, and ``S2S_NATIVE_SEARCH=0``, takes torch's route, with the reason at debug level.  The
outputs are not bit for bit torch's: the residual stream and the scores stay in fp32 here,
where torch's bf16 model rounds them to bf16, and int8 products quantize x row by row and W
row by row, where torch's quantize x and W whole (tests/test_native_search.py).

This module imports no torch.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import math
import os
import subprocess
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

from s2s import cbuild
from s2s.errors import S2SError
from s2s.hypotheses import Hypothesis, Translation, length_penalty
from s2s.output import OutputFormat
from s2s.textio import line_numbers

log = logging.getLogger("s2s")

MODEL_DIR = Path(__file__).parent / "model"
SOURCES = tuple(MODEL_DIR / name for name in ("native_attention.c", "native_linear.c", "native_int8.c",
                                              "native_thread.c", "native_search.c"))
DISABLE = "S2S_NATIVE_SEARCH"  # =0: torch's route
ACTIVATIONS = {"relu": 0, "gelu": 1, "gelu_tanh": 2, "silu": 3}  # native_search.c's ACT_*
LENGTH_PENALTIES = {"gnmt": 0, "power": 1, "none": 2}  # its LP_*
KERNELS = {1: "AMX", 2: "AVX512-BF16 (vdpbf16ps)"}  # native_linear.c's ISA_*
I8_KERNELS = {1: "AVX2 (vpmaddubsw)", 2: "VNNI (vpdpbusd)"}  # native_int8.c's s2s_i8_linear_available
BF16_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})  # a CPU with bf16 products
INT8_FLAGS = frozenset({"avx2", "fma"})  # one with native_int8.c's
MASK64 = (1 << 64) - 1
ERRORS = {-1: "out of memory", -2: "no kernel for the model's products in this process",
          -3: "a step's scores hold NaN", -4: "a kernel ran out of memory"}


class Linear(ctypes.Structure):
    _fields_ = [("P", ctypes.c_void_p), ("b", ctypes.c_void_p), ("N", ctypes.c_long), ("K", ctypes.c_long),
                ("int8", ctypes.c_int)]


class Norm(ctypes.Structure):
    _fields_ = [("g", ctypes.c_void_p), ("b", ctypes.c_void_p)]


class Layer(ctypes.Structure):
    _fields_ = ([(name, Norm) for name in ("norm1", "norm2", "norm3")]
                + [(name, Linear) for name in ("qkv", "self_out", "q", "kv", "cross_out", "w1", "w3", "w2")])


class Model(ctypes.Structure):
    _fields_ = ([(name, ctypes.c_long) for name in ("d", "heads", "d_head", "d_ff", "vocab", "enc_layers",
                                                     "dec_layers")]
                + [(name, ctypes.c_int) for name in ("pre_norm", "rms", "activation", "pad_id", "bos_id", "eos_id")]
                + [(name, ctypes.c_float) for name in ("eps", "embed_scale", "output_scale", "attention_scale")]
                + [(name, ctypes.c_void_p) for name in ("src_embed", "tgt_embed", "enc_positions", "dec_positions")]
                + [(name, Norm) for name in ("enc_embed_norm", "dec_embed_norm", "enc_final_norm", "dec_final_norm")]
                + [("output", Linear), ("enc", ctypes.POINTER(Layer)), ("dec", ctypes.POINTER(Layer)),
                   ("tgt_ids", ctypes.c_void_p)])


@functools.lru_cache(maxsize=None)
def library() -> Optional[ctypes.CDLL]:
    """The search's library (s2s.cbuild: compiled once per machine with ``cc``), loaded;
    None where it cannot be built or loaded, or this process has no kernel for its products (AMX,
    AVX512-BF16 or AVX2; why: at debug level)."""
    try:
        lib = ctypes.CDLL(str(cbuild.compile_library("search", SOURCES, link_flags=("-pthread",))))
        lib.s2s_beam  # noqa: B018  (an older or foreign file: AttributeError)
    except (OSError, subprocess.SubprocessError, AttributeError) as e:
        log.debug("native search unavailable (%s)", e)
        return None
    lib.s2s_greedy.restype = ctypes.c_int
    prefix = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p]  # (prefix, its stride, prefix_len)
    sampling = [ctypes.c_void_p, ctypes.c_float, ctypes.c_long, ctypes.c_float]  # (seeds, temperature, top_k, top_p)
    lib.s2s_greedy.argtypes = [ctypes.POINTER(Model), ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p,
                               ctypes.c_void_p, ctypes.c_long, *prefix, *sampling, ctypes.c_long, ctypes.c_void_p,
                               ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    lib.s2s_beam.restype = ctypes.c_int
    lib.s2s_beam.argtypes = [ctypes.POINTER(Model), ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p,
                             ctypes.c_void_p, ctypes.c_long, *prefix, ctypes.c_long, ctypes.c_long, ctypes.c_long,
                             ctypes.c_double,
                             ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p,
                             ctypes.c_void_p, ctypes.c_void_p]
    lib.s2s_pack_f32.restype = ctypes.c_int
    lib.s2s_pack_f32.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p]
    lib.s2s_to_bf16.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p]
    lib.s2s_sinusoidal_table.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p]
    lib.s2s_bf16_linear_use.argtypes = [ctypes.c_int]
    lib.s2s_shortlist_subset.restype = ctypes.c_long
    lib.s2s_shortlist_subset.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_long,
                                         ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_long,
                                         ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    lib.s2s_ids_outside.restype = ctypes.c_long
    lib.s2s_ids_outside.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long]
    lib.s2s_pack_rows.restype = ctypes.c_int
    lib.s2s_pack_rows.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p,
                                  ctypes.c_void_p, ctypes.c_void_p]
    lib.s2s_i8_packed_bytes.restype = ctypes.c_long
    lib.s2s_i8_packed_bytes.argtypes = [ctypes.c_long, ctypes.c_long]
    lib.s2s_i8_quantize_rows.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p,
                                         ctypes.c_void_p]
    lib.s2s_i8_pack.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long,
                                ctypes.c_void_p]
    lib.s2s_pack_rows_i8.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p,
                                     ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    # the products themselves (the search calls them in C; tests and benchmarks/native_kernels.py here)
    lib.s2s_bf16_linear.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_long,
                                    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_long]
    lib.s2s_i8_linear.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_long,
                                  ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                  ctypes.c_long]
    if not lib.s2s_bf16_linear_isa() and not lib.s2s_i8_linear_available():
        log.debug("native search unavailable: no kernel for its products (this library or this process)")
        return None
    return lib


def has_products(lib: ctypes.CDLL, products: str) -> bool:
    """Whether ``lib`` (:func:`library`) runs ``products`` (bf16 or int8) in this process."""
    return bool(lib.s2s_i8_linear_available() if products == "int8" else lib.s2s_bf16_linear_isa())


# --------------------------------------------------------------------------- #
# When the route is taken
# --------------------------------------------------------------------------- #

def model_why_not(model, decode) -> Optional[str]:
    """Why a model (ModelConfig) with these decode settings (DecodeConfig) is not searched here,
    or None where it is."""
    if model.arch != "encoder_decoder":
        return f"model.arch {model.arch}"
    if model.positions not in ("sinusoidal", "learned"):
        return f"model.positions {model.positions}"
    if model.copy or model.coverage:
        return "model.copy or model.coverage"
    for name, size in (("d_model", model.d_model), ("heads x d_head", model.heads * model.d_head),
                       ("d_ff", model.d_ff)):
        if size % 32:
            return f"{name} {size} is not whole tiles of 32"
    if decode.coverage_penalty:
        return "a coverage penalty"
    if decode.length_penalty not in LENGTH_PENALTIES or decode.stop not in ("exact", "early"):
        return f"decode.length_penalty {decode.length_penalty} or decode.stop {decode.stop}"
    for key in ("compile", "glossary", "markup"):
        if getattr(decode, key):
            return f"decode.{key}"
    return None


def device_why_not(device: str) -> Optional[str]:
    """Why ``--device`` keeps a search off this route, which runs on the CPU alone (auto: where
    the machine has no GPU driver), or None."""
    from s2s.workerserver import device_is_cpu, gpu_driver_present

    return None if device_is_cpu(device, gpu_driver_present()) else f"--device {device}"


def spec_why_not(spec) -> Optional[str]:
    """Why a TranslatorSpec (s2s.workers) is not decoded here, or None where it may be (the
    model's own settings are :func:`model_why_not`'s)."""
    if os.environ.get(DISABLE, "1") == "0" or os.environ.get("S2S_NATIVE_ATTENTION", "1") == "0":
        return f"${DISABLE} or $S2S_NATIVE_ATTENTION is 0"
    if len(spec.models) != 1 or spec.weights is not None:
        return "an ensemble"
    if why := device_why_not(spec.device):
        return why
    if spec.alignments:
        return "alignments"
    products, why = products_for(spec.precision, spec.quantize)
    return why if products is None else None


def products_for(precision: str, quantize: Optional[str],
                 flags: Optional[frozenset[str]] = None) -> tuple[Optional[str], str]:
    """The products this route runs for ``--precision`` and ``--quantize`` on a CPU with ``flags``
    (this one's by default), and why: ("bf16" or "int8", why), or (None, why not).  For auto, the
    faster as measured (benchmarks/README.md): bf16 on AMX's tiles (amx_bf16), else int8 on any CPU with AVX2
    (with VNNI's vpdpbusd 1.17-1.31x bf16's vdpbf16ps on AMD's Zen 4; 3.1-4.2x torch's fp32 on a
    Zen 4 capped to Cascade Lake's instructions, 2.3-3.1x capped to Skylake-SP's; 1.5-2.1x
    CTranslate2 int8 capped to AVX2).  bf16
    for bf16 where the CPU has bf16 products (amx_bf16 or avx512_bf16); int8 for ``--quantize
    int8`` with fp32 on a CPU with AVX2, and with auto where auto is int8 (on AMX, where auto is
    bf16, torch's route refuses it).  The flags are the CPU's; a library built for less
    (``$S2S_MARCH``) without the products picked sends the command to torch's route
    (:func:`has_products`)."""
    flags = cbuild.cpu_flags() if flags is None else flags
    if quantize == "int8":
        if precision == "auto" and products_for("auto", None, flags)[0] == "int8":
            return "int8", "--precision auto --quantize int8"
        if precision != "fp32":
            return None, f"--precision {precision} --quantize int8"  # (torch's route refuses it, or not)
        if not INT8_FLAGS <= flags:
            return None, "--quantize int8 without avx2 and fma (the route's int8 products)"
        return "int8", "--quantize int8"
    if quantize or precision not in ("auto", "bf16"):
        return None, f"--precision {precision}" + (f" --quantize {quantize}" if quantize else "")
    if precision == "auto" and "amx_bf16" not in flags and INT8_FLAGS <= flags:
        return "int8", "--precision auto: int8 products on a CPU with AVX2 and no AMX"
    if flags & BF16_FLAGS:
        return "bf16", f"--precision {precision}, CPU flags {' '.join(sorted(flags & BF16_FLAGS))}"
    return None, f"--precision {precision} and no amx_bf16 or avx512_bf16 (the route's bf16 products)"


# --------------------------------------------------------------------------- #
# The model
# --------------------------------------------------------------------------- #

class SearchModel:
    """A model directory's weights laid out for native_search.c: every W packed into AMX's tiles
    in bf16 (or, ``products`` int8, quantized row by row and packed for native_int8.c), biases in
    bf16, embeddings, position tables and norms in fp32.  ``weights``: name -> (shape, fp32
    bytes), as safetensors' ``deserialize`` gives them."""

    def __init__(self, cfg, weights: dict[str, tuple[list[int], bytearray]], tok, position_rows: int,
                 shortlist: Optional[tuple[Any, int, Any, int]] = None, products: str = "bf16"):
        lib = library()
        m = cfg.model
        self.lib, self.pad_id, self.products, self.int8 = lib, tok.pad_id, products, products == "int8"
        self._keep: list[Any] = []  # every buffer the struct points into

        def buffer(ctype, n: int):
            a = (ctype * n)()
            self._keep.append(a)
            return a

        def f32(name: str, keep: bool = True) -> int:
            data = weights[name][1]
            if keep:  # (a matrix only read to be packed is not: its fp32 bytes go with ``weights``)
                self._keep.append(data)
            return ctypes.addressof((ctypes.c_char * len(data)).from_buffer(data))

        def pointer(name: str) -> Optional[int]:
            return f32(name) if name in weights else None

        def bf16(name: str, n: int) -> int:
            b16 = buffer(ctypes.c_uint16, n)
            lib.s2s_to_bf16(f32(name, keep=False), n, b16)
            return ctypes.addressof(b16)

        def quantized(name: str, N: int, K: int) -> tuple[Any, Any]:  # q(W) row by row, and s_W
            Wq, scale = (ctypes.c_int8 * (N * K))(), (ctypes.c_float * N)()
            lib.s2s_i8_quantize_rows(f32(name, keep=False), N, K, Wq, scale)
            return Wq, scale

        def linear(weight: str, bias: Optional[str]) -> Linear:
            if weight not in weights:
                return Linear()
            N, K = weights[weight][0]
            P = self._packed(N, K)
            self._keep.append(P)
            if self.int8:
                lib.s2s_i8_pack(*quantized(weight, N, K), None, N, K, P)
            elif lib.s2s_pack_f32(f32(weight, keep=False), N, K, P):
                raise MemoryError("packing the weights")
            return Linear(ctypes.addressof(P), bf16(bias, N) if bias in weights else None, N, K, self.int8)

        def projection(prefix: str) -> Linear:
            return linear(prefix + ".weight", prefix + ".bias")

        def norm(prefix: str) -> Norm:
            return Norm(pointer(prefix + ".weight"), pointer(prefix + ".bias"))

        def layer(prefix: str) -> Layer:
            return Layer(norm1=norm(prefix + "norm1"), norm2=norm(prefix + "norm2"), norm3=norm(prefix + "norm3"),
                         qkv=projection(prefix + "self_attn.qkv_proj"),
                         self_out=projection(prefix + "self_attn.out_proj"),
                         q=projection(prefix + "cross_attn.q_proj"), kv=projection(prefix + "cross_attn.kv_proj"),
                         cross_out=projection(prefix + "cross_attn.out_proj"), w1=projection(prefix + "ffn.w_1"),
                         w3=projection(prefix + "ffn.w_3"), w2=projection(prefix + "ffn.w_2"))

        if m.positions == "sinusoidal":  # one table for both stacks
            table = buffer(ctypes.c_float, position_rows * m.d_model)
            lib.s2s_sinusoidal_table(position_rows, m.d_model, table)

        def positions(stack: str) -> int:
            if m.positions == "learned":  # row p + offset of the stack's own table
                return f32(f"{stack}_positions.table.weight") + 4 * m.position_offset * m.d_model
            return ctypes.addressof(table)

        tgt_embed = "tgt_embed.weight" if "tgt_embed.weight" in weights else "src_embed.weight"  # (tied: one entry)
        self.vocab = weights[tgt_embed][0][0]
        self.enc_layers = (Layer * m.enc_layers)(*(layer(f"encoder_layers.{i}.") for i in range(m.enc_layers)))
        self.dec_layers = (Layer * m.dec_layers)(*(layer(f"decoder_layers.{i}.") for i in range(m.dec_layers)))
        # W_U: the target embedding where tied; b_U.  With a shortlist, W_U's rows in bf16 (or
        # quantized, with their scales), each batch's packed for it (search), and b_U
        w_u = tgt_embed if m.tie_output else "output_proj.weight"
        self.shortlist = shortlist  # (top, k, frequent, F) as ctypes arrays and sizes
        if shortlist is None:
            output = linear(w_u, "output_bias")
        else:
            output = Linear(None, None, 0, m.d_model, self.int8)
            if self.int8:
                self.w_uq = quantized(w_u, self.vocab, m.d_model)
                self._keep.extend(self.w_uq)
            else:
                self.w_u16 = bf16(w_u, self.vocab * m.d_model)
            self.b_u16 = bf16("output_bias", self.vocab) if "output_bias" in weights else None
            self.always = (ctypes.c_int32 * 4)(tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id)
        self.model = Model(
            d=m.d_model, heads=m.heads, d_head=m.d_head, d_ff=m.d_ff, vocab=self.vocab, enc_layers=m.enc_layers,
            dec_layers=m.dec_layers, pre_norm=int(m.norm == "pre"), rms=int(m.norm_type == "rmsnorm"),
            activation=ACTIVATIONS[m.activation], pad_id=tok.pad_id, bos_id=tok.bos_id, eos_id=tok.eos_id,
            eps=m.norm_eps, embed_scale=math.sqrt(m.d_model) if m.scale_embeddings else 1.0,
            output_scale=m.d_model ** -0.5 if m.scale_output else 1.0,
            attention_scale=1 / math.sqrt(m.d_head) if m.attention_scale else 1.0,
            src_embed=pointer("src_embed.weight"), tgt_embed=pointer(tgt_embed),
            enc_positions=positions("enc"), dec_positions=positions("dec"),
            enc_embed_norm=norm("enc_embed_norm"), dec_embed_norm=norm("dec_embed_norm"),
            enc_final_norm=norm("enc_final_norm"), dec_final_norm=norm("dec_final_norm"), output=output,
            enc=self.enc_layers, dec=self.dec_layers)

    def search(self, sources: Sequence[Sequence[int]], max_len: Sequence[int], decode, log_p: bool = False,
               prefixes: Optional[Sequence[Sequence[int]]] = None,
               seeds: Optional[Sequence[int]] = None) -> list[list[tuple[list[int], float, float]]]:
        """The best outputs of each of a batch of sources (each ending in </s>) by greedy search
        (``decode.beam`` 1) or beam search (DecodeConfig; its ``nbest`` best, best first, as
        many as it finished); ``max_len`` each output's longest, </s> included -> each source's
        hypotheses: tokens (</s> not included), score, log p / lp(m) (NaN for a greedy search,
        which ranks by nothing), and log p, </s> included (a greedy search sums it only with
        ``log_p``: NaN without).  A sentence's outputs do not depend on the others in its batch:
        every row's arithmetic is its own (a shortlist's batch aside: its union is the batch's).
        ``prefixes``: each output's forced first tokens (target ids; s2s.search.forced_tokens),
        at the model's log p, each shorter than its ``max_len``.  With ``decode.sampling``, its
        ``nbest`` samples of each source, best score first, drawn from q (s2s.search.
        sampling_distribution) by random numbers seeded with ``seeds`` (one per source and sample,
        source b's sample k at b nbest + k: :func:`sample_seed`)."""
        if decode.sampling:  # each sample a row of its own
            K = decode.nbest
            found = self.search([x for x in sources for _ in range(K)], [n for n in max_len for _ in range(K)],
                                dataclasses.replace(decode, nbest=1, sampling=False), True,
                                None if prefixes is None else [p for p in prefixes for _ in range(K)], seeds)
            lp = [length_penalty(len(hyps[0][0]) + 1, decode.alpha, decode.length_penalty) for hyps in found]
            samples = [(hyps[0][0], hyps[0][2] / norm, hyps[0][2]) for hyps, norm in zip(found, lp)]
            return [sorted(samples[b * K:(b + 1) * K], key=lambda h: -h[1]) for b in range(len(sources))]
        B = len(sources)
        S, T = max(len(s) for s in sources), max(max_len)
        padded = [self.pad_id] * (B * S)
        for b, s in enumerate(sources):
            padded[b * S:b * S + len(s)] = s
        src = (ctypes.c_int32 * (B * S))(*padded)
        src_len = (ctypes.c_long * B)(*(len(s) for s in sources))
        longest = (ctypes.c_long * B)(*max_len)
        n = decode.nbest if decode.beam > 1 else 1
        out, out_len = (ctypes.c_int32 * (B * n * T))(), (ctypes.c_long * (B * n))()
        forced = sorted({v for p in prefixes for v in p}) if prefixes else []
        model, ids = (ctypes.byref(self.model), None) if self.shortlist is None else self._shortlisted(src, forced)
        prefix = (None, 0, None) if not forced else self._prefix(prefixes, ids)
        score, logp = ((ctypes.c_float * (B * n))(*[math.nan] * (B * n)) for _ in range(2))
        if decode.beam == 1:
            draws = (None, 1.0, 0, 1.0) if seeds is None else (
                (ctypes.c_uint64 * B)(*seeds), decode.temperature, decode.top_k, decode.top_p)
            rc = self.lib.s2s_greedy(model, B, src, S, src_len, longest, decode.min_len, *prefix, *draws,
                                     decode.no_repeat_ngram, out, T, out_len, logp if log_p else None)
        else:
            rc = self.lib.s2s_beam(model, B, src, S, src_len, longest, decode.min_len, *prefix, decode.no_repeat_ngram,
                                   decode.beam, n,
                                   decode.alpha, LENGTH_PENALTIES[decode.length_penalty], decode.stop == "exact", out,
                                   T, out_len, score, logp)
        if rc:
            raise S2SError(f"the native search failed: {ERRORS.get(rc, f'error {rc}')}")
        found: list[list[tuple[list[int], float, float]]] = []
        for b in range(B):
            hyps = [(out[o * T:o * T + out_len[o]], score[o], logp[o]) for o in range(b * n, b * n + n)
                    if out_len[o] >= 0]  # (-1: fewer finished than n)
            if ids is not None:  # shortlist positions -> target ids
                hyps = [([ids[v] for v in tokens], sc, lp) for tokens, sc, lp in hyps]
            found.append(hyps)
        return found

    def _packed(self, N: int, K: int) -> Any:
        """A buffer for W (N, K) packed for this model's products: AMX's tiles of bf16
        (s2s_bf16_pack, 16 x 32 elements a tile), or native_int8.c's layout."""
        if self.int8:
            return (ctypes.c_uint8 * self.lib.s2s_i8_packed_bytes(N, K))()
        return (ctypes.c_uint16 * (-(-N // 16) * (K // 32) * 512))()

    def _prefix(self, prefixes: Sequence[Sequence[int]], ids: Any) -> tuple[Any, int, Any]:
        """The forced prefixes as s2s_greedy and s2s_beam take them: (B, P) token ids (with a
        shortlist, positions among its ``ids``), -1 padded, P, each one's length."""
        P = max(len(p) for p in prefixes)
        position = None if ids is None else {v: i for i, v in enumerate(ids)}
        flat = [-1] * (len(prefixes) * P)
        for b, p in enumerate(prefixes):
            flat[b * P:b * P + len(p)] = p if position is None else [position[v] for v in p]
        return (ctypes.c_int32 * len(flat))(*flat), P, (ctypes.c_long * len(prefixes))(*map(len, prefixes))

    def _shortlisted(self, src, forced: Sequence[int] = ()) -> tuple[Any, Any]:
        """The model of a batch of source ids ``src`` (padding included: the pad's list is the
        frequent pieces', as in torch's route) whose outputs are its shortlist's ids (s2s.shortlist:
        the union of its source pieces' lists, the frequent pieces, the special ids and the ids of
        ``forced`` prefixes), W_U's rows for them packed: (a reference to that model, the ids
        ascending)."""
        top, k, frequent, F = self.shortlist
        V, d, lib = self.vocab, self.model.d, self.lib
        mark, ids = (ctypes.c_ubyte * V)(), (ctypes.c_int32 * V)()
        always = (ctypes.c_int32 * (len(self.always) + len(forced)))(*self.always, *forced)
        n = lib.s2s_shortlist_subset(top, k, src, len(src), frequent, F, always, len(always), V, mark, ids)
        b = (ctypes.c_uint16 * n)() if self.b_u16 is not None else None
        P = self._packed(n, d)
        if self.int8:
            lib.s2s_pack_rows_i8(*self.w_uq, d, ids, n, self.b_u16, P, b)
        elif lib.s2s_pack_rows(self.w_u16, d, ids, n, self.b_u16, P, b):
            raise MemoryError("packing the shortlist's rows")
        model = Model.from_buffer_copy(self.model)
        position = {v: i for i, v in enumerate(ids[:n])}
        model.vocab, model.tgt_ids = n, ctypes.addressof(ids)
        model.pad_id, model.bos_id, model.eos_id = (position[x] for x in (self.always[0], self.always[2],
                                                                          self.always[3]))
        model.output = Linear(ctypes.addressof(P), None if b is None else ctypes.addressof(b), n, d, self.int8)
        model._keep = (P, b, ids)  # (what the struct points into, for as long as it lives)
        return ctypes.byref(model), ids[:n]


def sample_seed(seed: int, line_no: int, sentence: int, k: int) -> int:
    """The random state that draws the tokens of sample k of a line's sentence (its first: 0; a
    --split-sentences line has more) with decode.seed ``seed``: splitmix64 over the four, so
    that a line's draws are the same in any batch, chunk, worker or thread (but with
    decode.shortlist, whose batch's union of lists is what q spans)."""
    x = 0
    for part in (seed, line_no, sentence, k):
        x = (x ^ part) + 0x9E3779B97F4A7C15 & MASK64
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & MASK64
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & MASK64
        x ^= x >> 31
    return x


def max_output_length(src_len: int, a: float, b: int, cap: int) -> int:
    """max_len(x) = floor(a |x| + b), at least 1 and at most ``cap``, each step rounded to fp32 as
    s2s.translate.max_output_lengths computes it (a = 2.1, |x| = 30: 63, where doubles give 64)."""
    def fp32(x: float) -> float:
        return ctypes.c_float(x).value

    return min(max(math.floor(fp32(fp32(fp32(a) * src_len) + b)), 1), cap)


# --------------------------------------------------------------------------- #
# The engine
# --------------------------------------------------------------------------- #

@dataclass
class NativeSearch:
    """A model directory's search without torch, with what translating lines needs (and what
    s2s.documents reads of a translator to split lines into sentences and join them)."""

    model: SearchModel
    tok: Any  # s2s.tokenizer.Tokenizer
    decode: Any  # DecodeConfig
    lang: Any  # s2s.langs.LanguageIds
    trained_src_tokens: int
    max_input: int
    cap: int  # the longest output (s2s.modeldir.output_cap)
    fmt: OutputFormat = field(default_factory=OutputFormat)  # what is written of each line
    languages: tuple[str, str] = ("src", "tgt")  # data.src_lang, data.tgt_lang (s2s.documents)
    alignments: bool = False  # (s2s.documents reads it: alignments are torch's route's)
    pool: Optional[ThreadPoolExecutor] = None  # the threads translate_sentences searches with

    def translate_sentences(self, lines: Sequence[str], first_line_no: int | Sequence[int] = 1,
                            prefixes: Optional[Sequence[str]] = None) -> list[Translation]:
        """One Translation per line, each line one input of the model (``first_line_no``: the first
        line's number, or each line's), as s2s.translate.Translator.translate_sentences gives it:
        the lines sorted by length into batches (s2s.workers.task_batches), searched by
        :attr:`pool`'s threads at once (or here).  ``prefixes`` (--prefix-file), one per line, are
        forced as each output's start (an empty one forces nothing), after the target language's
        token where the model has one to force."""
        from s2s.tokenizer import encode_forced_starts, encode_source_lines
        from s2s.workers import sorted_batches, task_batches

        line_nos = line_numbers(first_line_no, len(lines))
        ids = encode_source_lines(self.tok, self.lang, lines, line_nos, self.trained_src_tokens, self.max_input)
        todo = [i for i, x in enumerate(ids) if x is not None]
        forced = encode_forced_starts(self.tok, self.lang, None if prefixes is None else [prefixes[i] for i in todo],
                                      [line_nos[i] for i in todo], self.cap)
        prefix_of = {} if forced is None else dict(zip(todo, forced))
        pool = self.pool
        cut = task_batches if pool is not None else sorted_batches
        batches = [[todo[j] for j in rows] for rows in cut([len(ids[i]) for i in todo], self.decode.batch_size,
                                                           self.decode.batch_tokens)]
        d = self.decode

        sentence, seen = [], Counter()  # each sentence's place in its line (--split-sentences: each draws anew)
        for n in line_nos:
            sentence.append(seen[n])
            seen[n] += 1

        def search(rows: list[int]) -> list[list[tuple[list[int], float, float]]]:
            sources = [ids[i] for i in rows]
            prefixes = [prefix_of.get(i, []) for i in rows]
            # (room for a prefix and </s>, as torch's route makes it)
            longest = [max(max_output_length(len(s) - 1, d.max_len_a, d.max_len_b, self.cap), len(p) + 1)
                       for s, p in zip(sources, prefixes)]
            seeds = [sample_seed(d.seed, line_nos[i], sentence[i], k) for i in rows for k in range(d.nbest)
                     ] if d.sampling else None
            return self.model.search(sources, longest, d, self.fmt.shows_scores, prefixes if any(prefixes) else None,
                                     seeds)

        out = [Translation(n, [], []) for n in line_nos]
        for rows, found in zip(batches, pool.map(search, batches) if pool is not None else map(search, batches)):
            for i, hyps in zip(rows, found):
                out[i] = Translation(line_nos[i], [Hypothesis(tokens, score, log_p) for tokens, score, log_p in hyps],
                                     [self.tok.decode_tgt(tokens) for tokens, _, _ in hyps])
        return out

    def translate_lines(self, lines: Sequence[str], line_nos: Sequence[int], pool: Optional[ThreadPoolExecutor],
                        prefixes: Optional[Sequence[str]] = None) -> tuple[list[str], int]:
        """Each line's output as ``fmt`` writes it (s2s.output.format_translation: its text,
        confidence, n-best rows or JSON object; an empty line's too), without the last newline,
        and the output tokens, </s> included: :meth:`translate_sentences` with ``pool``'s threads,
        or with decode.split_sentences each line's sentences searched and joined as
        s2s.documents.translate_paragraphs does it for torch's route."""
        from s2s.output import format_translation
        from s2s.workers import output_tokens

        self.pool = pool
        try:
            found = self.translate_chunk(lines, list(line_nos), prefixes)
        finally:
            self.pool = None
        return [format_translation(t, self.fmt)[:-1] for t in found], sum(output_tokens(t) for t in found)

    def translate_chunk(self, lines: Sequence[str], first_line_no: int | Sequence[int] = 1,
                        prefixes: Optional[Sequence[str]] = None) -> list[Translation]:
        """One Translation per line, as s2s.translate.Translator.translate_chunk gives it: each line
        one input (:meth:`translate_sentences`), or with decode.split_sentences its sentences
        searched and joined (s2s.documents.translate_paragraphs)."""
        if self.decode.split_sentences:
            from s2s.documents import translate_paragraphs

            return translate_paragraphs(self, lines, first_line_no, prefixes)
        return self.translate_sentences(lines, first_line_no, prefixes)

    def translate_stream(self, items: Iterator[Any], threads: int, chunk_lines: int, first_line_no: int,
                         write_chunk: Callable[[str, int, int], None], paired: bool = False) -> None:
        """``items`` (lines, or with ``paired`` (line, prefix) pairs: --prefix-file) translated
        chunk by chunk of ``chunk_lines`` lines, each chunk written whole by ``write_chunk(text,
        lines, tokens)`` in input order, with ``threads`` threads."""
        from s2s.workers import _chunks

        pool = ThreadPoolExecutor(threads, thread_name_prefix="s2s-search") if threads > 1 else None
        try:
            for line_no, lines, prefixes in _chunks(items, chunk_lines, paired, first_line_no):
                texts, n_tokens = self.translate_lines(lines, range(line_no, line_no + len(lines)), pool, prefixes)
                write_chunk("".join(text + "\n" for text in texts), len(lines), n_tokens)
        finally:
            if pool is not None:
                pool.shutdown(cancel_futures=True)


def engine_for(spec) -> Optional[NativeSearch]:
    """The native search of ``spec`` (a TranslatorSpec), or None where torch's route
    decodes it (why: at debug level; a model directory that cannot be read is left to torch's
    route too, which names what is wrong)."""
    from safetensors import SafetensorError

    why = spec_why_not(spec)
    if why is None:
        try:
            return _load(spec)
        except _NotHere as e:
            why = str(e)
        except (S2SError, OSError, ValueError, KeyError, SafetensorError) as e:
            why = f"the model directory ({e})"
    log.debug("search through torch: %s", why)
    return None


class _NotHere(Exception):
    """A reason the native route does not take a model."""


def _shortlist(d: Path, weights: dict) -> tuple[Any, int, Any, int]:
    """``d/shortlist.safetensors`` (s2s.shortlist.save_shortlist) read without torch, as
    SearchModel takes it: (top, k, frequent, F).  One that is missing or does not fit the model
    is left to torch's route, whose error names it."""
    from safetensors import deserialize

    from s2s.modeldir import SHORTLIST

    path = d / SHORTLIST
    if not path.is_file():
        raise _NotHere(f"no {path}")
    tensors = {name: t for name, t in deserialize(path.read_bytes())}
    top, frequent = tensors.get("top"), tensors.get("frequent")
    V_src = weights["src_embed.weight"][0][0]
    V_tgt = weights.get("tgt_embed.weight", weights["src_embed.weight"])[0][0]
    if (top is None or frequent is None or top["dtype"] != "I32" or frequent["dtype"] != "I32"
            or len(top["shape"]) != 2 or top["shape"][0] != V_src or len(frequent["shape"]) != 1):
        raise _NotHere(f"{path} does not fit the model")
    k, F = top["shape"][1], frequent["shape"][0]
    top_ids = (ctypes.c_int32 * (V_src * k)).from_buffer(top["data"])
    frequent_ids = (ctypes.c_int32 * F).from_buffer(frequent["data"])
    lib = library()
    if lib.s2s_ids_outside(top_ids, V_src * k, -1, V_tgt) or lib.s2s_ids_outside(frequent_ids, F, 0, V_tgt):
        raise _NotHere(f"{path} does not fit the model")
    return top_ids, k, frequent_ids, F


def _load(spec) -> NativeSearch:
    from safetensors import deserialize

    from s2s.langs import language_ids
    from s2s.modeldir import (
        WEIGHTS,
        input_cap,
        load_spec,
        model_decode_settings,
        output_cap,
        verified_meta,
        warn_past_output_cap,
    )

    d = Path(spec.models[0])
    if not (d / WEIGHTS).is_file():
        raise _NotHere("not a model directory with its weights (a checkpoint?)")
    cfg, tok = load_spec(d)
    decode = model_decode_settings(d, cfg, spec.overrides, spec.defaults)
    lang = language_ids(tok.languages, tok.token_id, decode.tgt_lang)
    why = model_why_not(cfg.model, decode)
    if why is not None:
        raise _NotHere(why)
    if decode.split_sentences:
        from s2s.documents import require_splitter

        require_splitter()  # (torch's route names what is missing)
    fmt = spec.output_format_for(decode.nbest, alignments=False)  # (alignments: torch's route)
    if fmt.nbest and decode.beam == 1 and not decode.sampling:
        raise _NotHere("n-best rows of a greedy search (its search score, log p / lp(m), is not computed here)")
    products = products_for(spec.precision, spec.quantize)[0]
    if library() is None or not has_products(library(), products):
        raise _NotHere(f"the library did not compile or load, or has no kernel for {products} products here")
    verified_meta(d)  # (after the checks above: torch's route, where they send it, hashes the weights itself)
    warn_past_output_cap(cfg.model, decode)
    tensors = deserialize((d / WEIGHTS).read_bytes())
    if any(t["dtype"] != "F32" for _, t in tensors):
        raise _NotHere("weights not stored in fp32")
    weights = {name: (t["shape"], t["data"]) for name, t in tensors}
    if decode.beam > weights.get("tgt_embed.weight", weights["src_embed.weight"])[0][0]:  # (torch's says so)
        raise _NotHere("a beam wider than the vocabulary")
    cap, max_input = output_cap(cfg.model, decode), input_cap(cfg.model, decode)
    shortlist = _shortlist(d, weights) if decode.shortlist else None
    model = SearchModel(cfg, weights, tok, max(max_input, cap) + 1, shortlist, products)
    log.debug("search without torch: %s", f"int8 products on {I8_KERNELS.get(library().s2s_i8_linear_available(), '?')}"
              if products == "int8" else f"bf16 products on {KERNELS.get(library().s2s_bf16_linear_isa(), '?')}")
    return NativeSearch(model, tok, decode, lang, cfg.data.max_src_tokens, max_input, cap, fmt,
                        (cfg.data.src_lang, cfg.data.tgt_lang))
