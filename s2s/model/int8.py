"""int8 matrices for decoding on the CPU, used where they are faster than fp32.

``--quantize int8`` is torch's dynamic quantization: W is stored as int8 with one
symmetric scale per matrix, and each call quantizes its input x over x's own range
(a pass over x), multiplies with int32 sums (fbgemm) and scales the result back:

    y = s_x s_W (q(x) - z_x) q(W)^T + b
    q(W) = round(W / s_W),  s_W = max|W| / 127            (int8)
    q(x) = round(x / s_x) + z_x,  s_x = (max x - min x) / 127  (7 of uint8's bits, as torch does)

That pays on matrices large enough to amortize its fixed cost per call and on
weights too large for the core's cache (an int8 W reads a quarter of the bytes):
measured on 2 cores of an AMD EPYC (AVX2, no VNNI), one thread, fbgemm against
MKL's fp32, microseconds:

    rows x d_in x d_out      fp32    int8
    64 x 192 x 4000 (W_U)   1343     720
    2 x 192 x 4000           200     119
    64 x 192 x 576           184     141
    8 x 192 x 576             54      54
    2 x 192 x 576             33      47
    32 x 192 x 192            41      58
    8 x 768 x 192             61      57

so each matrix keeps both forms and picks per call by a rule fitted to those
figures (:func:`int8_pays`).  With AVX-512 VNNI (fbgemm's int8 kernels multiply-add four
bytes per lane at once) int8 pays from far fewer rows; measured on 2 cores of an AMD EPYC
(Zen 5), one thread, microseconds (the matrices rotated through more than the core's
cache, as a decoder step's are):

    rows x d_in x d_out      fp32    int8
    1 x 256 x 256             7.1    11.8
    2 x 256 x 256             9.7    11.8
    8 x 256 x 256            17.9    12.9
    32 x 256 x 256           49.1    19.2
    1 x 256 x 768            16.6    13.6
    16 x 256 x 768           86.2    21.7
    1 x 1024 x 256           17.9    14.7
    16 x 1024 x 256         146.3    24.7

so there the threshold is :data:`INT8_MIN_MACS_VNNI` multiply-adds (:func:`int8_min_macs`).
The output projection W_U, tied to the embedding or not, is quantized too (the embedding
lookup stays fp32), as CTranslate2's int8 does.

torch packs W for one of two int8 libraries, fbgemm (its default on x86) or oneDNN, and
the product runs in the library W was packed for.  On a wide W (the output projection)
oneDNN is faster from a few dozen rows on, fbgemm below; on the layers' own matrices the
two are within 10% of each other either way.  Measured on 2 cores of an AMD EPYC (Zen 5,
AVX-512 VNNI), one thread, microseconds:

    rows x d_in x d_out       fbgemm   oneDNN
    8 x 256 x 8000                58       70
    64 x 256 x 8000              352      320
    128 x 256 x 8000             722      597
    320 x 256 x 8000 (beam 5)   2579     1485
    320 x 192 x 4000             761      574
    320 x 256 x 768              184      171
    320 x 1024 x 256             235      258

so a wide W (:func:`onednn_pays`) also gets a oneDNN copy, packed the first time a product
of :data:`ONEDNN_MIN_ROWS` or more rows meets it, where the CPU has AVX-512 VNNI (the
CPUs measured; elsewhere fbgemm only).  Both copies hold the same int8 W and scale, so
both give the same y up to the order of the int32 sums' conversion.
"""

from __future__ import annotations

import threading
import warnings
from functools import lru_cache
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

INT8_MIN_MACS = 2 * 1024 * 1024  # rows * d_in * d_out from which the int8 product pays
INT8_MIN_MACS_VNNI = 192 * 1024  # the same on a CPU with AVX-512 VNNI: 1 row of 256 x 768, 3 of 256 x 256
INT8_MIN_WEIGHT_BYTES = 1024 * 1024  # an fp32 W at least this large: int8 at any rows (memory-bound)
ONEDNN_MIN_ROWS = 64  # rows from which a wide W multiplies through its oneDNN copy
ONEDNN_MIN_WIDTH = 6  # d_out / d_in of a wide W: the output projection (31 and 21 in the table) and
# a shortlist's rows of it (7.8 for 1,500 of 192 and 2,000 of 256: 239 against 274 and 387 against
# 436 us at 320 rows), not an FFN's W_1 (4: 65 against 60 us at 64 rows)


def int8_pays(rows: int, d_in: int, d_out: int) -> bool:
    """Whether y = x W^T over ``rows`` rows runs faster in dynamic int8 than in fp32:
    at rows * d_in * d_out >= :func:`int8_min_macs` multiply-adds (2M; 192K with AVX-512
    VNNI), or for any rows when the fp32 W has 1 MiB or more (reading it dominates; the
    int8 W is a quarter of it).  A rule of thumb fitted to the measurements in the module
    docstring, deterministic on a machine so that the same batch always takes the same
    arithmetic."""
    return rows >= int8_min_rows(d_in, d_out)


def int8_min_rows(d_in: int, d_out: int) -> int:
    """The fewest rows from which :func:`int8_pays` takes int8 for a d_in x d_out matrix:
    1 for an fp32 W of INT8_MIN_WEIGHT_BYTES or more, else ceil(int8_min_macs() / (d_in d_out))."""
    if 4 * d_in * d_out >= INT8_MIN_WEIGHT_BYTES:
        return 1
    return -(-int8_min_macs() // (d_in * d_out))


def int8_min_macs() -> int:
    """The multiply-adds from which an int8 product pays: :data:`INT8_MIN_MACS_VNNI` on a CPU
    with AVX-512 VNNI, else :data:`INT8_MIN_MACS` (the module docstring's two tables)."""
    return INT8_MIN_MACS_VNNI if vnni_int8() else INT8_MIN_MACS


@lru_cache(maxsize=1)
def vnni_int8() -> bool:
    """Whether the CPU has AVX-512 VNNI (lscpu's avx512_vnni), which fbgemm's int8 kernels use."""
    from s2s.precision import cpu_flags

    return "avx512_vnni" in cpu_flags()


def onednn_pays(rows: int, d_in: int, d_out: int) -> bool:
    """Whether an int8 product over ``rows`` rows runs faster through oneDNN than fbgemm:
    a wide W (d_out >= ONEDNN_MIN_WIDTH d_in) at ONEDNN_MIN_ROWS rows or more, on a CPU
    with AVX-512 VNNI and a torch built with oneDNN's int8 (module docstring)."""
    return rows >= ONEDNN_MIN_ROWS and d_out >= ONEDNN_MIN_WIDTH * d_in and onednn_int8()


@lru_cache(maxsize=1)
def onednn_int8() -> bool:
    """Whether this process may pack for oneDNN: torch has the engine, the CPU AVX-512 VNNI."""
    return "onednn" in torch.backends.quantized.supported_engines and vnni_int8()


_ENGINE_SWITCH = threading.Lock()


def packed_int8(weight: Tensor, bias: Optional[Tensor], engine: Optional[str] = None) -> torch.ScriptObject:
    """The packed int8 W (d_out, d_in) and fp32 b for ``engine`` (by default torch's current
    one, ``torch.backends.quantized.engine``: fbgemm's kernels on x86; or onednn), made
    once from fp32: W quantized per tensor with the scale torch's dynamic quantization
    gives it (its default weight observer, as ``DynamicLinear.from_float`` does), packed by
    the operator that module packs with.  Without the module: building one packs a zero W
    of W's size first.  The product runs in the library the copy was packed for, whatever
    ``torch.backends.quantized.engine`` says when it runs."""
    with warnings.catch_warnings():  # torch 2.13 flags its quantized tensor API as deprecated
        warnings.simplefilter("ignore", UserWarning)
        observer = torch.ao.quantization.default_dynamic_qconfig.weight()
        observer(weight)
        scale, zero_point = observer.calculate_qparams()
        q_weight = torch.quantize_per_tensor(weight.float(), float(scale), int(zero_point), torch.qint8)
        if engine is None or engine == torch.backends.quantized.engine:
            return torch.ops.quantized.linear_prepack(q_weight, bias)
        with _ENGINE_SWITCH:  # the engine is process-wide: one thread switches it at a time
            engine_before = torch.backends.quantized.engine
            torch.backends.quantized.engine = engine
            try:
                return torch.ops.quantized.linear_prepack(q_weight, bias)
            finally:
                torch.backends.quantized.engine = engine_before


class Int8Linear(nn.Module):
    """y = x W^T + b in int8 where :func:`int8_pays`, else in fp32: the fp32 W (and b) are
    kept as they were (``weight``, ``bias``: what code reading a Linear's matrices sees) and
    an int8 copy is packed once (fbgemm's, on x86), and for a wide W a second one for oneDNN when a
    product first has the rows for it (:func:`onednn_pays`).  For decoding only (no gradient
    flows to the int8 copies)."""

    def __init__(self, weight: Tensor, bias: Optional[Tensor]):
        super().__init__()
        self.in_features, self.out_features = weight.size(1), weight.size(0)
        self.weight, self.bias = weight, bias  # the fp32 ones, shared (a Linear's state-dict keys stay)
        self.packed = self.pack()
        self.packed_onednn: Optional[torch.ScriptObject] = None  # packed on first use
        # the rule of int8_pays and onednn_pays over x.numel() (rows x d_in), fixed for the machine: a
        # decoder step asks it of every product, so it costs one comparison, not a chain of calls
        self.int8_numel = int8_min_rows(self.in_features, self.out_features) * self.in_features
        wide = self.out_features >= ONEDNN_MIN_WIDTH * self.in_features and onednn_int8()
        self.onednn_numel = ONEDNN_MIN_ROWS * self.in_features if wide else None

    def pack(self, engine: Optional[str] = None) -> torch.ScriptObject:
        """This layer's W and b packed for ``engine`` (:func:`packed_int8`)."""
        return packed_int8(self.weight.detach(), None if self.bias is None else self.bias.detach(), engine)

    def int8(self, x: Tensor, relu: bool = False) -> Tensor:
        """x W^T + b by an int8 copy: torch's dynamic int8 product, as its quantized dynamic
        Linear calls it (x quantized to 7 bits: ``reduce_range``), through oneDNN's copy
        where :func:`onednn_pays`, else fbgemm's.  With ``relu``, max(0, x W^T + b) in the
        same call (the library's fused ReLU: the same values as a ReLU after it, without
        a second pass over the output)."""
        packed = self.packed
        if self.onednn_numel is not None and x.numel() >= self.onednn_numel:  # onednn_pays
            if self.packed_onednn is None:
                self.packed_onednn = self.pack("onednn")
            packed = self.packed_onednn
        if relu:
            return torch.ops.quantized.linear_relu_dynamic(x, packed, True)
        return torch.ops.quantized.linear_dynamic(x, packed, True)

    def pays(self, x: Tensor) -> bool:
        """Whether this product of x takes the int8 copy (:func:`int8_pays` over x's rows)."""
        return x.numel() >= self.int8_numel

    def forward(self, x: Tensor) -> Tensor:
        if self.pays(x):
            return self.int8(x)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 from " \
               f"{self.int8_numel // self.in_features} rows"


def quantize_int8(model: nn.Module) -> nn.Module:
    """Every nn.Linear of ``model`` becomes an :class:`Int8Linear` in place, and the output
    projection W_U (``model.output_int8``, read by ModelBase.logits) is one too: the untied
    ``output_proj`` itself, or one over the embedding it is tied to.  Returns the model,
    for decoding only: its state dict keeps every key it had and gains ``output_int8.weight``
    (the shared W_U; the packed int8 copies are no tensors of it), so it is not one to save."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, Int8Linear(child.weight, child.bias))
    if hasattr(model, "output_int8"):
        tied = model.output_proj is None
        model.output_int8 = Int8Linear(model.tgt_embed.weight, None) if tied else model.output_proj
    return model
