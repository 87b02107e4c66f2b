"""How the model's matrices are multiplied on the CPU: in training through torch's BLAS or OpenBLAS,
bf16 rows in whole blocks (:class:`RowBlockLinear`); in bf16 decoding with each W packed for
oneDNN once (:func:`use_packed_bf16`).

torch's CPU wheels call Intel MKL for every x W^T.  MKL takes its tuned AVX2 and
AVX-512 kernels only on CPUs whose vendor is GenuineIntel and a generic path
elsewhere.  On an AMD EPYC core (AVX2), one thread each, OpenBLAS (the BLAS numpy
ships; numpy is torch's own dependency) multiplies a training step's shapes 1.05-1.5x
faster than torch's MKL, the output projection (4,096 x 256 x 8,000) the most.  So
there the linear layers can run through numpy's matmul on the same memory (no copy:
``Tensor.numpy()`` and ``torch.from_numpy`` share it):

    y = x W^T + b                                      (blas_linear: numpy.matmul(x, W.T), + b)
    dL/dx = dL/dy W,   dL/dW = (dL/dy)^T x,   dL/db = sum over rows of dL/dy     (LinearThroughBlas)

``gemm`` (``train.gemm``): ``torch``, ``openblas``, or ``auto``: openblas where torch's BLAS is
MKL, /proc/cpuinfo names a vendor other than GenuineIntel and the process runs one thread (``train.procs``
splits the cores into one-thread processes); else torch.  With two threads in one process,
OpenBLAS's threads and torch's OpenMP threads (which spin between operators) took the same
two cores from each other: 1,987 tokens/s against torch's 3,281.  fp32 only: bf16 (numpy
has no bf16), a GPU, autocast and torch.compile keep torch's matmul (the trainer warns when
``openblas`` was asked for and cannot apply).  Decoding keeps
torch's: its matrices are a few rows, where numpy's per-call cost ate the gain (benchmarks/README.md).
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from s2s.errors import S2SError
from s2s.model.native import linear_isa
from s2s.precision import cpuinfo_field, native_bf16_cpu

log = logging.getLogger("s2s")

GEMMS = ("auto", "torch", "openblas")


def auto_gemm(device: torch.device, threads: int, vendor: Optional[str] = None,
              mkl: Optional[bool] = None) -> tuple[str, str]:
    """The BLAS ``auto`` picks on ``device`` for a process of ``threads`` torch threads, and
    why (``vendor``, ``mkl``: this machine's unless given): openblas where torch's MKL would
    run its generic kernels (a CPU not made by Intel) and the process has one thread."""
    if device.type != "cpu":
        return "torch", f"device {device.type}"
    vendor = cpuinfo_field("vendor_id") if vendor is None else vendor  # GenuineIntel, AuthenticAMD, ...
    mkl = torch.backends.mkl.is_available() if mkl is None else mkl
    if not mkl:
        return "torch", "torch's CPU BLAS is not MKL"
    if vendor in ("GenuineIntel", ""):
        return "torch", f"MKL on {vendor or 'an unknown CPU'}"
    if threads != 1:
        return "torch", f"{threads} threads in one process"
    return "openblas", f"MKL runs its generic kernels on {vendor}"


def resolve_gemm(asked: str, device: torch.device, key: str = "train.gemm") -> str:
    """torch or openblas for ``asked`` (auto, torch, openblas) on ``device``, for this process's
    torch threads; ``key`` names the setting in the error and in auto's log line."""
    if asked not in GEMMS:
        raise S2SError(f"{key}: {asked!r} is not auto, torch or openblas")
    if asked == "auto":
        picked, why = auto_gemm(device, torch.get_num_threads())
        log.info("%s auto: %s (%s)", key, picked, why)
        return picked
    if asked == "openblas" and device.type != "cpu":
        raise S2SError(f"{key}: openblas multiplies on the CPU, not on {device.type}")
    return asked


def match_blas_threads(threads: Optional[int] = None) -> None:
    """OpenBLAS's thread count := ``threads`` (torch's intra-op threads by default)."""
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=threads or torch.get_num_threads(), user_api="blas")


def _through_blas(*tensors: Optional[Tensor]) -> bool:
    """Whether numpy can multiply these: fp32 CPU tensors, outside autocast and compile."""
    if torch.compiler.is_compiling() or torch.is_autocast_enabled("cpu"):
        return False
    return all(t is None or (t.dtype == torch.float32 and t.device.type == "cpu") for t in tensors)


def blas_linear(x: Tensor, W: Tensor, b: Optional[Tensor] = None) -> Tensor:
    """y = x W^T + b for x (..., in), W (out, in) in any layout, b (out,) or None, through
    numpy's matmul (OpenBLAS); no autograd (see :class:`LinearThroughBlas`)."""
    x2 = x.reshape(-1, x.shape[-1])
    y = np.matmul(x2.detach().numpy(), W.detach().numpy().T)
    if b is not None:
        y += b.detach().numpy()
    # reshaped in numpy: a view made by torch inside an autograd Function could not be changed in place
    return torch.from_numpy(y.reshape(*x.shape[:-1], W.shape[0]))


class LinearThroughBlas(torch.autograd.Function):
    """y = x W^T + b forward and backward through OpenBLAS (module docstring)."""

    @staticmethod
    def forward(ctx, x: Tensor, W: Tensor, b: Optional[Tensor]) -> Tensor:
        ctx.save_for_backward(x, W)
        ctx.has_bias = b is not None
        return blas_linear(x, W, b)

    @staticmethod
    @once_differentiable  # numpy's products have no graph: no second derivatives
    def backward(ctx, dy: Tensor):
        x, W = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1]).contiguous().numpy()  # (rows, out)
        dx = dW = db = None
        if ctx.needs_input_grad[0]:
            dx = torch.from_numpy(dy2 @ W.detach().numpy()).view(x.shape)  # dL/dy W
        if ctx.needs_input_grad[1]:
            x2 = x.detach().reshape(-1, x.shape[-1]).numpy()
            dW = torch.from_numpy(dy2.T @ x2)  # (dL/dy)^T x: (out, in)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = torch.from_numpy(dy2.sum(axis=0))
        return dx, dW, db


def _recorded(*tensors: Optional[Tensor]) -> bool:
    """Whether autograd records a product of these (a training step's)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def linear(x: Tensor, W: Tensor, b: Optional[Tensor] = None) -> Tensor:
    """y = x W^T + b: through OpenBLAS, forward and backward, where autograd records it on
    fp32 CPU tensors (a training step; :func:`_through_blas`), else F.linear (evaluation and
    decoding keep torch's: module docstring)."""
    if _recorded(x, W, b) and _through_blas(x, W, b):
        return LinearThroughBlas.apply(x, W, b)
    return F.linear(x, W, b)


class BlasLinear(nn.Linear):
    """nn.Linear multiplying through OpenBLAS (:func:`linear`); same parameters and
    state-dict keys, so a checkpoint does not know which BLAS made it."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


def use_openblas(model: nn.Module) -> int:
    """Every nn.Linear of ``model`` (exactly nn.Linear: quantized layers keep their own
    kernels) made a :class:`BlasLinear` over the same parameters, in place, and the
    model's other matrix products (the tied output projection) told to use it
    (``model.gemm``); OpenBLAS's threads matched to torch's.  Returns how many layers."""
    swapped = _swap_linears(model, BlasLinear, "openblas")
    match_blas_threads()
    return swapped


def _swap_linears(model: nn.Module, cls: type[nn.Linear], gemm: str) -> int:
    """Every module of ``model`` that is exactly an nn.Linear made a ``cls`` (a subclass with
    the same parameters and keys), in place, and every module with a ``gemm`` attribute (the
    tied output projection's owner) set to ``gemm``.  Returns how many layers."""
    swapped = 0
    for m in model.modules():
        if type(m) is nn.Linear:
            m.__class__ = cls  # the same object: its parameters, hooks and owner unchanged
            swapped += 1
        elif hasattr(m, "gemm"):
            m.gemm = gemm
    return swapped


# --------------------------------------------------------------------------- #
# bf16 on the CPU: rows multiplied in whole blocks, so that oneDNN's kernels are reused
# --------------------------------------------------------------------------- #
# torch multiplies bf16 matrices on the CPU through oneDNN, which builds (JIT-compiles) a kernel
# for each new shape and caches it: about 5 ms for a first (3,000 x 256) x (256 x 1,024), against
# 0.7 ms for every later one.  Each training batch has its own number of rows (its tokens), so every
# update met new shapes: the bf16 matmuls of the reference model ran at a fifth of their speed.
# Multiplying the rows in whole blocks of ROW_BLOCK, and the last few rows as one block padded with
# zeros, leaves 4,096 / 128 = 32 row counts per layer shape, whose kernels stay in oneDNN's cache
# (1,024 by default), at the price of one more product of a single block per product.  fp32
# multiplies through MKL, which has no such cost, and is left as it is.

ROW_BLOCK = 128
# A W with at least this many times more outputs than inputs (the output projection, 8,000 x 256)
# multiplies forward from a contiguous copy of W^T: oneDNN took 10.1 ms for 3,968 rows through the
# transposed view and 6.4 ms (+ 1 ms to copy) through the copy; the layers' own W (up to 4x) keep the view.
WIDE = 8


def _split_rows(t: Tensor, rows: int) -> tuple[Tensor, Tensor]:
    """t (..., n) as rows: the first floor(rows / ROW_BLOCK) blocks (a view) and the rest,
    padded with zeros to one block (a copy of fewer than ROW_BLOCK rows; (0, n) if none)."""
    t2 = t.reshape(rows, t.size(-1))
    whole = rows - rows % ROW_BLOCK
    rest = t2.new_zeros(ROW_BLOCK if whole < rows else 0, t2.size(1))
    rest[:rows - whole] = t2[whole:]
    return t2[:whole], rest


def _mm_rows(a: Tensor, a_rest: Tensor, B: Tensor, out: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """out (rows, m) = [a; a_rest] @ B (+ bias), a_rest's padding rows dropped: a product of
    whole blocks written in place and one of a single block."""
    whole = a.size(0)
    if whole:
        if bias is None:
            torch.mm(a, B, out=out[:whole])
        else:
            torch.addmm(bias, a, B, out=out[:whole])
    if a_rest.size(0):
        tail = a_rest @ B if bias is None else torch.addmm(bias, a_rest, B)
        out[whole:] = tail[:out.size(0) - whole]
    return out


class RowBlockLinear(torch.autograd.Function):
    """y = x W^T + b, every product over a whole number of :data:`ROW_BLOCK` rows: x's rows
    (and dL/dy's) split into whole blocks, multiplied where they lie, and the rest, padded
    with zeros to one block.  The same values as F.linear up to the order of the sums."""

    @staticmethod
    def forward(ctx, x: Tensor, W: Tensor, b: Optional[Tensor]) -> Tensor:  # type: ignore[override]
        rows = x.numel() // x.size(-1)
        x_whole, x_rest = _split_rows(x, rows)
        W_t = W.t().contiguous() if W.size(0) >= WIDE * W.size(1) else W.t()
        y = _mm_rows(x_whole, x_rest, W_t, x.new_empty(rows, W.size(0)), b)
        ctx.save_for_backward(x_whole, x_rest, W)
        ctx.rows, ctx.x_shape, ctx.has_bias = rows, x.shape, b is not None
        return y.view(*x.shape[:-1], W.size(0))

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: Tensor):  # type: ignore[override]
        x_whole, x_rest, W = ctx.saved_tensors
        dy_whole, dy_rest = _split_rows(dy, ctx.rows)
        dx = dW = db = None
        if ctx.needs_input_grad[0]:  # dL/dy W
            dx = _mm_rows(dy_whole, dy_rest, W, dy.new_empty(ctx.rows, W.size(1))).view(ctx.x_shape)
        if ctx.needs_input_grad[1]:  # (dL/dy)^T x
            dW = dy_rest.t() @ x_rest if dy_rest.size(0) else None
            if dy_whole.size(0):
                dW = dy_whole.t() @ x_whole if dW is None else dW.addmm_(dy_whole.t(), x_whole)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.reshape(ctx.rows, -1).sum(0)
        return dx, dW, db


def row_block_linear(x: Tensor, W: Tensor, b: Optional[Tensor] = None) -> Tensor:
    """y = x W^T + b: through :class:`RowBlockLinear` where autograd records it on bf16 CPU tensors
    (a training step), else F.linear.  Decoding takes no row blocks: they left a bf16 beam search
    and greedy as fast as they were (7.8 and 3.3 s for 1,000 sentences either way); bf16 decoding
    on the CPU multiplies by W packed once instead (:class:`PackedLinear`)."""
    bf16_cpu = x.device.type == "cpu" and x.dtype == torch.bfloat16
    if _recorded(x, W, b) and bf16_cpu and not torch.compiler.is_compiling():
        return RowBlockLinear.apply(x, W, b)
    return F.linear(x, W, b)


class RowBlockLinearModule(nn.Linear):
    """nn.Linear multiplying through :func:`row_block_linear`; same parameters and keys."""

    def forward(self, x: Tensor) -> Tensor:
        return row_block_linear(x, self.weight, self.bias)


def use_row_blocks(model: nn.Module) -> int:
    """Every nn.Linear of ``model`` made a :class:`RowBlockLinearModule`, in place, and the tied
    output projection told to use it (``model.gemm = "rows"``).  Returns how many layers."""
    return _swap_linears(model, RowBlockLinearModule, "rows")


# --------------------------------------------------------------------------- #
# bf16 decoding on the CPU: each W reordered for oneDNN once, not at every product
# --------------------------------------------------------------------------- #
# F.linear on bf16 CPU tensors hands W to oneDNN in torch's plain layout, and oneDNN reorders it
# into its blocked (AMX/VNNI) layout inside every call.  A decoding step multiplies a few dozen rows,
# so that reorder is a large share of each product: one thread of an Intel Xeon with AMX, 64 rows,
# 256 x 1,024: 75 us through F.linear, 55 us with W reordered once (37 -> 27 us at 256 x 256,
# 119 -> 79 us at 256 x 2,000).  Decoding reorders every matrix of a bf16 model once when it
# loads (a shortlist's rows once per batch) and multiplies through oneDNN's linear on the packed
# W: the same sums, so the same values.  fp32 keeps MKL: packed for oneDNN, fp32 was no faster.


@functools.lru_cache(maxsize=None)
def packs_bf16() -> bool:
    """Whether bf16 products go through packed weights here: a CPU that multiplies bf16 natively
    (s2s.precision.native_bf16_cpu; elsewhere oneDNN converts to fp32 and bf16 is not the choice)
    and a torch with oneDNN's prepacked linear (CPU wheels built with mkldnn)."""
    return (bool(native_bf16_cpu()) and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise") and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def pack_bf16(W: Tensor, native: bool = False) -> Optional[Tensor]:
    """W (out, in) bf16 on the CPU packed once for y = x W^T: with ``native``, into s2s's own
    layout where its kernel runs and takes W (AMX, and ``in`` a multiple of 32:
    ``torch.ops.s2s.bf16_pack``, a 3-dimensional tensor of AMX tiles,
    s2s.model.native_linear.c), else into oneDNN's; None
    where neither can take it (another dtype or device, or a torch without oneDNN's operator)."""
    if W.dtype != torch.bfloat16 or W.device.type != "cpu":
        return None
    if native and W.size(1) > 0 and W.size(1) % 32 == 0 and linear_isa() == "amx_bf16":
        return torch.ops.s2s.bf16_pack(W.detach())
    if not packs_bf16():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(W.detach(), PACK_ROWS)


PACK_ROWS = 64  # the rows a decoding step usually multiplies (a batch of 64, or 13 sentences' 5 beams)


# activations oneDNN applies to x W^T + b inside the product (a post-op), as (its name, algorithm)
POST_OPS = {"relu": ("relu", ""), "gelu": ("gelu", "none"), "gelu_tanh": ("gelu", "tanh"), "silu": ("swish", "")}


def takes_packed(x: Tensor, packed: Optional[Tensor]) -> bool:
    """Whether x multiplies through a packed W: x in the packed dtype, and no autograd or compile."""
    return (packed is not None and x.dtype == packed.dtype and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling())


def packed_linear(x: Tensor, W: Tensor, packed: Optional[Tensor], b: Optional[Tensor] = None,
                  activation: Optional[str] = None) -> Tensor:
    """y = x W^T + b through the packed W (:func:`pack_bf16`) where :func:`takes_packed`, else
    F.linear on W itself.  ``activation`` (a key of :data:`POST_OPS`, packed only): act(x W^T + b)
    in the same call, before the result is rounded to bf16."""
    if not takes_packed(x, packed):
        if activation is not None:
            raise ValueError("packed_linear: an activation is applied only with a packed W")
        return F.linear(x, W, b)
    name, algorithm = POST_OPS[activation] if activation is not None else ("none", "")
    if packed.dim() == 3:  # s2s's own kernel (pack_bf16 with native)
        return torch.ops.s2s.bf16_linear(x, W, packed, b, name, algorithm)
    return torch.ops.mkldnn._linear_pointwise(x, packed, b, name, [], algorithm)


class PackedLinear(nn.Linear):
    """nn.Linear multiplying through its W packed once (:func:`packed_linear`); same parameters
    and keys.  The packed copy is made by :func:`use_packed_bf16` and is not part of the state."""

    packed: Optional[Tensor] = None

    def forward(self, x: Tensor) -> Tensor:
        return packed_linear(x, self.weight, self.packed, self.bias)


def use_packed_bf16(model: nn.Module, native: bool = False) -> int:
    """For decoding a bf16 model on the CPU: every nn.Linear made a :class:`PackedLinear` with its W
    packed, and the tied output projection's W_U packed too (``model.gemm = "packed"``), for
    oneDNN or, with ``native``, for s2s's kernel where it takes them (``model.gemm = "native"``;
    one thread, on a CPU with AMX: s2s.model.native.linear_isa).  Returns how many layers; 0 (and
    nothing changed) where the weights cannot be packed."""
    native = native and linear_isa() == "amx_bf16"  # (no AMX here: oneDNN's packing; its vdpbf16ps kernel
    # lost to oneDNN at beam 5 on the Xeon, native_linear.c: the torch-free search is where it runs)
    if pack_bf16(next(model.parameters()), native) is None:
        return 0
    swapped = _swap_linears(model, PackedLinear, "native" if native else "packed")
    for m in model.modules():
        if isinstance(m, PackedLinear):
            m.packed = pack_bf16(m.weight, native)
        elif getattr(m, "gemm", None) in ("packed", "native"):  # W_U = E^T: the embedding's table, packed
            m.output_packed = pack_bf16(m.tgt_embed.weight, native)
    return swapped
