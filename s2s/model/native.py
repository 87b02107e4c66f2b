"""Few-query attention in C, compiled for the machine it runs on.

A decoding step's attention is G queries (1, or a sentence's beams) against each head's
K/V cache.  torch runs it as two batched matrix products over B x heads small matrices,
    scores = q K^T,  A = softmax(scores / sqrt(d_head) + M),  out = A V,
which read the cross-attention K/V (fixed for the whole search, larger than the core's
caches once a batch's sources are long) at a fraction of the memory's speed.
``native_attention.c`` computes the same function head by head, the next head's K/V
prefetched while one is read, with K/V in fp32 or in bf16 (a beam search's self-attention
slots on a CPU with native bf16: widened as they are read, half the bytes).  Measured on 2
cores of an AMD EPYC (Zen 5), one thread, 64 rows x 4 heads x 64 dims, fp32 K/V out of the
caches as in a step (microseconds, two runs; README, few-query attention in C):

    keys   queries    two bmm       C
      30      1       461-600    244-351
     140      1      1079-1124   629-704
     140      5      2259-2364  1224-1261

The file is compiled once per machine with the system's C compiler (``cc``, or ``$CC``;
``-O3 -march=native``) into s2s's cache directory (``$S2S_CACHE_DIR``, else
``$XDG_CACHE_HOME/s2s``, else ``~/.cache/s2s``), keyed by the source, the compiler and its
flags and the CPU, and loaded with ctypes.  It is reached as the operator
``torch.ops.s2s.few_query_attention``, so that the scripted decoder step
(s2s.model.step_script) calls it as the Python step does.  Where there is no compiler, or
``S2S_NATIVE_ATTENTION=0``, :func:`available` is False and decoding takes torch's route:
nothing else changes.  Its sums run in another order than torch's products, so its
outputs differ from theirs in the last bits (tests/test_native_attention.py).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import platform
import shlex
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

log = logging.getLogger("s2s")

SOURCE = Path(__file__).with_name("native_attention.c")
CFLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
          "-fno-trapping-math", "-fPIC", "-shared")
DISABLE = "S2S_NATIVE_ATTENTION"  # =0: torch's route only
COMPILE_TIMEOUT_S = 120


def cache_dir() -> Path:
    """Where s2s keeps what it builds for this machine: $S2S_CACHE_DIR, else $XDG_CACHE_HOME/s2s,
    else ~/.cache/s2s."""
    if os.environ.get("S2S_CACHE_DIR"):
        return Path(os.environ["S2S_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "s2s"


def build_key(source: bytes, compiler: str) -> str:
    """What the compiled library depends on: the source, the compiler and its flags, and the CPU
    (-march=native), hashed."""
    from s2s.precision import cpuinfo_field

    h = hashlib.sha256(source)
    cpu = [cpuinfo_field(key) for key in ("model name", "flags", "Features", "CPU implementer", "CPU part")]  # x86, arm
    for part in (compiler, " ".join(CFLAGS), platform.machine(), platform.processor(), *cpu):
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:16]


def compile_library() -> Path:
    """The library compiled for this machine, built into :func:`cache_dir` first if it is not
    there (written under a temporary name and renamed, so that processes building it at once
    never load a partial file).  A compiler that failed leaves ``attention-KEY.failed`` (its
    message) instead, and is not run again for the same source, compiler and CPU.  Raises
    OSError or subprocess.SubprocessError where it cannot."""
    compiler = os.environ.get("CC") or "cc"
    source = SOURCE.read_bytes()
    out = cache_dir() / "native" / f"attention-{build_key(source, compiler)}.so"
    failed = out.with_suffix(".failed")
    if out.exists():
        return out
    if failed.exists():
        raise OSError(f"{compiler} failed before ({failed}): {failed.read_text(errors='replace').strip()}")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".attention-", suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        done = subprocess.run([*shlex.split(compiler), *CFLAGS, str(SOURCE), "-o", tmp, "-lm"], capture_output=True,
                              text=True, errors="replace", timeout=COMPILE_TIMEOUT_S, check=False)
        if done.returncode:
            lines = (done.stderr or done.stdout).strip().splitlines()
            why = lines[-1] if lines else f"exit status {done.returncode}"
            failed.write_text(why + "\n")
            raise OSError(f"{compiler} failed: {why}")
        os.chmod(tmp, 0o755)  # (mkstemp's file is 0600: others sharing $S2S_CACHE_DIR may load it too)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.debug("native attention compiled into %s", out)
    return out


@functools.lru_cache(maxsize=None)
def library() -> Optional[ctypes.CDLL]:
    """The compiled kernel's library, loaded; None where it cannot be built or loaded (why: at
    debug level)."""
    try:
        lib = ctypes.CDLL(str(compile_library()))
        fn = lib.s2s_few_query_attention
    except (OSError, subprocess.SubprocessError, AttributeError) as e:
        log.debug("native attention unavailable (%s): torch's route", e)
        return None
    fn.restype = ctypes.c_int
    tensor = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long]  # data, strides of b, h, and g or s
    fn.argtypes = (tensor * 4 + [ctypes.c_void_p, ctypes.c_long, ctypes.c_long]  # q k v mask, columns group capacity
                   + [ctypes.c_void_p] + [ctypes.c_long] * 5  # out B H G S D
                   + [ctypes.c_float, ctypes.c_int])  # c, K/V in bf16
    lib.s2s_argmax_rows.restype = ctypes.c_int  # z, its row stride, N, V, best, index
    lib.s2s_argmax_rows.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long,
                                    ctypes.c_void_p, ctypes.c_void_p]
    return lib


def available() -> bool:
    """Whether decoding takes the C kernel: it compiled and loaded, and ``$S2S_NATIVE_ATTENTION``
    is not 0."""
    return os.environ.get(DISABLE, "1") != "0" and library() is not None


def use_native_attention(model: torch.nn.Module, on: Optional[bool] = None) -> bool:
    """Route the attention of every MultiHeadAttention in ``model`` through the C kernel
    (``on``: default :func:`available`), or back through torch's products; returns ``on``.
    Decoding only: the kernel has no gradient.  Script the step after (it copies the choice)."""
    from s2s.model.attention import MultiHeadAttention

    on = available() if on is None else on
    for m in model.modules():
        if isinstance(m, MultiHeadAttention):
            m.native = on
    return on


def few_query_attention_kernel(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: bool,
                               columns: Optional[Tensor] = None) -> Tensor:
    """The CPU kernel of ``torch.ops.s2s.few_query_attention``: out = softmax(c q K^T + M) V,
    c = 1/sqrt(d_k) with ``scale``, else 1.  q (B, heads, G, d_k) fp32, k, v (B, heads, T_k, d_k)
    both fp32 or both bf16 (widened as they are read; every sum in fp32), each with a contiguous
    last dimension (any other strides), mask None or fp32 broadcastable to (B, heads, G, T_k) ->
    out (B, heads, G, d_k) fp32, contiguous.

    With ``columns`` (B, T) int64 (and G = 1, no mask): row b's keys are only the T rows
    columns[b, :] of k, v (B', heads, capacity, d_k), K/V row b // (B / B'): a beam reading its
    own ancestors' slots (s2s.model.cache) instead of all of its sentence's, masked."""
    B, H, G, D = q.shape
    S = k.size(2)
    group, capacity = 1, S  # q rows per K/V row; the keys a row's columns may name
    if columns is not None:
        if (G != 1 or mask is not None or columns.dim() != 2 or columns.size(0) != B or columns.dtype != torch.int64
                or k.size(0) == 0 or B % k.size(0)):
            raise ValueError(f"s2s::few_query_attention: columns {tuple(columns.shape)} {columns.dtype} for q "
                             f"{tuple(q.shape)}, k {tuple(k.shape)}: (B, T) int64, one query per row, no mask, "
                             f"B a multiple of k's rows")
        group, S, columns = B // k.size(0), columns.size(1), columns.contiguous()  # (the kernel checks each column)
    if (q.dtype != torch.float32 or k.dtype not in (torch.float32, torch.bfloat16) or v.dtype != k.dtype
            or k.shape[1:] != (H, capacity, D) or k.size(0) * group != B or v.shape != k.shape
            or any(x.stride(-1) != 1 for x in (q, k, v)) or (mask is not None and mask.dtype != torch.float32)):
        raise ValueError(f"s2s::few_query_attention: q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} {k.dtype}, "
                         f"v {tuple(v.shape)} {v.dtype}: q fp32, k and v both fp32 or both bf16, (B, heads, T, d) "
                         f"alike, each with a contiguous last dimension")
    out = torch.empty((B, H, G, D), dtype=torch.float32)
    if mask is None:
        m_ptr, m_strides = None, (0, 0, 0)
    else:
        m = mask.expand(B, H, G, S)  # broadcast dimensions get stride 0
        if m.stride(-1) != 1:  # one column broadcast over the keys: the kernel reads a column per key
            m = m.contiguous()
        m_ptr, m_strides = m.data_ptr(), m.stride()[:3]
    c = 1.0 / math.sqrt(D) if scale else 1.0
    lib = library()
    if lib is None:
        raise RuntimeError("s2s::few_query_attention: the native attention library is not built")
    rc = lib.s2s_few_query_attention(q.data_ptr(), *q.stride()[:3], k.data_ptr(), *k.stride()[:3],
                                     v.data_ptr(), *v.stride()[:3], m_ptr, *m_strides,
                                     None if columns is None else columns.data_ptr(), group, capacity, out.data_ptr(),
                                     B, H, G, S, D, c, int(k.dtype == torch.bfloat16))
    if rc == -2:
        raise ValueError(f"s2s::few_query_attention: a column outside 0 .. {capacity - 1}")
    if rc:
        raise MemoryError("s2s::few_query_attention: no memory for the scores")
    return out


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


def register_operator() -> torch.library.Library:
    """Define ``torch.ops.s2s.few_query_attention`` (the CPU kernel above), once per process: the
    scripted decoder step resolves it by name."""
    lib = torch.library.Library("s2s", "FRAGMENT")
    if not hasattr(torch.ops.s2s, "few_query_attention"):
        lib.define("few_query_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, bool scale, "
                   "Tensor? columns=None) -> Tensor")
        lib.impl("few_query_attention", few_query_attention_kernel, "CPU")
    return lib


_OPERATOR = register_operator()  # kept: a Library's registrations end with it
