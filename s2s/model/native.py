"""Few-query attention and bf16 products in C, compiled for the machine it runs on.

A decoding step's attention is G queries (1, or a sentence's beams) against each head's
K/V cache.  torch runs it as two batched matrix products over B x heads small matrices,
    scores = q K^T,  A = softmax(scores / sqrt(d_head) + M),  out = A V,
which read the cross-attention K/V (fixed for the whole search, larger than the core's
caches once a batch's sources are long) at a fraction of the memory's speed.
``native_attention.c`` computes the same function head by head, the next head's K/V
prefetched while one is read, with K/V in fp32 or in bf16 (a beam search's self-attention
slots on a CPU with native bf16: widened as they are read, half the bytes).  Measured on 2
cores of an AMD EPYC (Zen 5), one thread, 64 rows x 4 heads x 64 dims, fp32 K/V out of the
caches as in a step (microseconds, two runs; benchmarks/README.md, few-query attention in C):

    keys   queries    two bmm       C
      30      1       461-600    244-351
     140      1      1079-1124   629-704
     140      5      2259-2364  1224-1261

The same library holds ``native_linear.c``: a decoding step's bf16 products x W^T + b on AMX,
W packed once (``torch.ops.s2s.bf16_pack`` and ``bf16_linear``; s2s.model.gemm
takes them on one thread, :func:`linear_isa`), where oneDNN costs about 19 us a call.

Both C files are compiled once per machine with the system's C compiler (``cc``, or ``$CC``;
``-O3 -march=native``) and linked with ``native_op.cpp`` (compiled by ``c++``, or ``$CXX``,
against torch's own headers: the operators' CPU kernels) into one library in s2s's cache
directory (``$S2S_CACHE_DIR``, else ``$XDG_CACHE_HOME/s2s``, else ``~/.cache/s2s``), keyed by
the sources, the compilers and their flags, torch's version and the CPU.  Loading it
registers the CPU kernels of the operators (their schemas are defined at import here), so
that the scripted decoder step (s2s.model.step_script) calls them as it calls torch's own
operators, about 2 us a call where an operator implemented in Python cost 35; ctypes reaches
the greedy argmax.  Where either compiler is missing or fails, or ``S2S_NATIVE_ATTENTION=0``,
:func:`available` is False and decoding takes torch's route: nothing else changes.  Its sums
run in another order than torch's products, so its outputs differ from theirs in the last
bits (tests/test_native_attention.py).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import subprocess
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from s2s import cbuild

log = logging.getLogger("s2s")

SOURCES = tuple(Path(__file__).with_name(name) for name in ("native_attention.c", "native_linear.c"))
OPERATOR_SOURCE = Path(__file__).with_name("native_op.cpp")
CXXFLAGS = ("-O2", "-std=c++17", "-fPIC", "-shared", "-w")
DISABLE = "S2S_NATIVE_ATTENTION"  # =0: torch's route only
SCHEMAS = ("few_query_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, bool scale, Tensor? columns=None) "
           "-> Tensor",
           "bf16_pack(Tensor W) -> Tensor",
           "bf16_linear(Tensor x, Tensor W, Tensor P, Tensor? b, str activation='none', str algorithm='') -> Tensor")


def torch_build_flags() -> list[str]:
    """What native_op.cpp compiles and links with: torch's headers and libraries (already loaded
    into the process that loads the library), and its C++ ABI."""
    root = Path(torch.__file__).parent
    return [f"-I{root / 'include'}", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            f"-L{root / 'lib'}", f"-Wl,-rpath,{root / 'lib'}", "-ltorch_cpu", "-lc10"]


def compile_library() -> Path:
    """The library compiled for this machine (s2s.cbuild.compile_library: once, into s2s's cache
    directory, ``attention-KEY.so``), keyed also by torch's version and C++ ABI (its headers).
    Raises OSError or subprocess.SubprocessError where it cannot."""
    return cbuild.compile_library("attention", SOURCES, OPERATOR_SOURCE, CXXFLAGS, torch_build_flags(),
                                  (torch.__version__, str(torch._C._GLIBCXX_USE_CXX11_ABI)))


@functools.lru_cache(maxsize=None)
def library() -> Optional[ctypes.CDLL]:
    """The compiled library, loaded (which registers the operator's CPU kernel); None where it
    cannot be built or loaded (why: at debug level)."""
    try:
        lib = ctypes.CDLL(str(compile_library()))
        lib.s2s_argmax_rows  # noqa: B018  (an older or foreign file: AttributeError)
    except (OSError, subprocess.SubprocessError, AttributeError) as e:
        log.debug("native attention unavailable (%s): torch's route", e)
        return None
    lib.s2s_argmax_rows.restype = ctypes.c_int  # z, its row stride, N, V, best, index
    lib.s2s_argmax_rows.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long,
                                    ctypes.c_void_p, ctypes.c_void_p]
    lib.s2s_bf16_linear_isa.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether decoding takes the C kernel: it compiled and loaded, and ``$S2S_NATIVE_ATTENTION``
    is not 0."""
    return os.environ.get(DISABLE, "1") != "0" and library() is not None


def linear_isa() -> Optional[str]:
    """Which of the CPU's bf16 instructions ``torch.ops.s2s.bf16_linear`` multiplies with here
    (native_linear.c): amx_bf16, avx512_bf16 (vdpbf16ps, a CPU without AMX), or None (neither,
    no kernel compiled, or ``$S2S_NATIVE_ATTENTION=0``)."""
    if not available():
        return None
    return {1: "amx_bf16", 2: "avx512_bf16"}.get(library().s2s_bf16_linear_isa())


def use_native_attention(model: torch.nn.Module, on: Optional[bool] = None) -> bool:
    """Route the attention of every MultiHeadAttention in ``model`` through the C kernel
    (``on``: default, or where it is not :func:`available`, off), or back through torch's
    products; returns whether it did.
    Decoding only: the kernel has no gradient.  Script the step after (it copies the choice)."""
    from s2s.model.attention import MultiHeadAttention

    on = available() if on is None else bool(on) and available()  # (no kernel: nothing to call)
    for m in model.modules():
        if isinstance(m, MultiHeadAttention):
            m.native = on
    return on


def argmax_rows(z: Tensor) -> Optional[tuple[Tensor, Tensor]]:
    """(max_v z[n, v], the first v holding it) of each row of bf16 scores z (N, V) on the CPU,
    read as they are: a greedy step that shows no score picks its token from the output
    projection's bf16 scores without converting all N x V of them to fp32 first (64 x 8,000
    on one core of an Intel Xeon with AMX: 81 us against 214 us converting, then numpy's
    argmax).  None where the kernel is not built, or z is not a bf16 CPU matrix whose rows are
    contiguous, or a row holds NaN: the caller takes its own route."""
    lib = library() if os.environ.get(DISABLE, "1") != "0" else None
    if (lib is None or z.dim() != 2 or z.dtype != torch.bfloat16 or z.device.type != "cpu" or z.stride(-1) != 1
            or z.size(1) == 0):
        return None
    N, V = z.shape
    best, index = torch.empty(N, dtype=torch.float32), torch.empty(N, dtype=torch.int64)
    if lib.s2s_argmax_rows(z.data_ptr(), z.stride(0), N, V, best.data_ptr(), index.data_ptr()):
        return None
    return best, index


def define_operators() -> torch.library.Library:
    """Define the schemas of ``torch.ops.s2s.few_query_attention``, ``bf16_pack`` and
    ``bf16_linear``, once per process, so that the scripted decoder step resolves them by name
    whether or not the library is loaded (their CPU kernels come with the library,
    :func:`library`; without it nothing calls them)."""
    lib = torch.library.Library("s2s", "FRAGMENT")
    for schema in SCHEMAS:
        if not hasattr(torch.ops.s2s, schema.split("(")[0]):
            lib.define(schema)
    return lib


_OPERATORS = define_operators()  # kept: a Library's registrations end with it
