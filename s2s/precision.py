"""Arithmetic precision: which one a device does fast, and bf16 training with fp32 master weights.

``auto`` (``--precision auto`` in translate, ``train.precision: auto``) picks bf16
where the hardware multiplies bf16 natively and fp32 elsewhere:

    CUDA    bf16 when torch.cuda.is_bf16_supported() (Ampere and later)
    CPU     bf16 with AVX-512 BF16 or AMX-BF16 (the CPU flags avx512_bf16, amx_bf16;
            torch.cpu._is_avx512_bf16_supported / _is_amx_tile_supported), else fp32

and, decoding only (:func:`auto_arithmetic`), takes fp32 weights with int8 matrices
(s2s.model.int8) instead on the CPUs where those were measured faster: every CPU with AVX2
but not AMX, but for AVX-512 without VNNI (unmeasured there).

oneDNN "supports" bf16 on plain AVX-512 too (torch.ops.mkldnn._is_mkldnn_bf16_supported()
is true there) by converting to fp32, many times slower than fp32 itself: that check
says nothing about speed and is not used.

Training in bf16 (:class:`Bf16Copy`): the optimizer keeps the fp32 weights (the master
weights theta).  Once per update they are rounded into a working copy,
    theta_16 = bf16(theta),
the forward and backward passes run on theta_16 (activations bf16; softmax, layer-norm
statistics and the loss accumulate in fp32 inside their kernels and in s2s.loss, where
the output head and the loss run in one pass, OutputNLL), and each batch's gradients flow back into theta's
fp32 gradients,
    grad theta += fp32(grad theta_16),
where clipping and AdamW work on them as in fp32 training.  The working copy may
fuse matrices the model keeps apart (a gated FFN's W_1 and W_3 into one matmul):
the model, its state-dict keys and its checkpoints are unchanged.
"""

from __future__ import annotations

import copy
import logging
from typing import Optional

import torch
from torch import Tensor, nn

from s2s.cbuild import cpu_flags, cpuinfo_field  # noqa: F401 (cpuinfo_field: importable from here too)

log = logging.getLogger("s2s")


def native_bf16_cpu(flags: Optional[set[str] | frozenset[str]] = None) -> list[str]:
    """Why this CPU multiplies bf16 natively: the flags among avx512_bf16, amx_bf16 it has
    (from ``flags``, else /proc/cpuinfo and torch's own CPU probe); [] when it does not."""
    if flags is not None:
        return sorted(set(flags) & {"avx512_bf16", "amx_bf16"})
    found = set(cpu_flags()) & {"avx512_bf16", "amx_bf16"}
    if torch.cpu._is_avx512_bf16_supported():
        found.add("avx512_bf16")
    if torch.cpu._is_amx_tile_supported():
        found.add("amx_bf16")
    return sorted(found)


def auto_precision(device: torch.device, flags: Optional[set[str] | frozenset[str]] = None) -> tuple[str, str]:
    """The precision ``auto`` picks on ``device``, and why: bf16 on a GPU that has it and on
    a CPU with native bf16 matmuls (AVX-512 BF16 or AMX-BF16), else fp32."""
    if device.type == "cuda":
        return ("bf16", "the GPU has bf16") if torch.cuda.is_bf16_supported() else ("fp32", "no bf16 on this GPU")
    if device.type != "cpu":
        return "fp32", f"device {device.type}"
    native = native_bf16_cpu(flags)
    if native:
        return "bf16", "CPU flags " + " ".join(native)
    return "fp32", "no avx512_bf16/amx_bf16 among the CPU flags"


def auto_arithmetic(device: torch.device, flags: Optional[set[str] | frozenset[str]] = None
                    ) -> tuple[str, bool, str]:
    """What decoding's ``--precision auto`` picks on ``device``: (precision, int8, why).

    Measured on the CPUs seen (benchmarks/README.md: decode speed), int8 matrices (fp32 weights with int8
    copies where a product is large enough, s2s.model.int8) or bf16, whichever decoded faster:

        amx_bf16                              bf16 (Intel Xeon with AMX)
        avx512_bf16, avx512_vnni, no AMX      fp32 + int8 (AMD EPYC Zen 5: int8 beat bf16)
        avx2 without avx512f                  fp32 + int8 (AMD EPYC Zen 2)
        avx512f and avx512_vnni, no bf16      fp32 + int8 (1.46-1.94x fp32: a Zen 4 capped to
                                              Cascade Lake's instructions)
        avx512f without avx512_vnni           fp32 (int8 unmeasured there: Skylake-SP)

    Anything else, and other devices, take :func:`auto_precision`'s choice.  (This is torch's
    route: a plain search with ``--precision auto`` runs in s2s.native_search without torch, in
    bf16 on AMX and in int8 products of its own on the other CPUs with AVX2, as with ``--quantize
    int8`` there: s2s.native_search.products_for.)"""
    precision, why = auto_precision(device, flags)
    if device.type != "cpu":
        return precision, False, why
    native = native_bf16_cpu(flags)
    flags = cpu_flags() if flags is None else frozenset(flags)
    if "amx_bf16" in native:
        return precision, False, why
    if "avx2" not in flags:
        return precision, False, why + "; no avx2 for int8"
    if "avx512f" in flags and "avx512_vnni" not in flags:
        return precision, False, why + "; int8 unmeasured with AVX-512 without avx512_vnni"
    if precision == "bf16":
        return "fp32", True, why + " but no amx_bf16: int8 matrices (faster than bf16 there)"
    return "fp32", True, why + "; int8 matrices where they are faster (avx2, no AMX)"


def beam_slot_dtype(device: torch.device, precision: str,
                    flags: Optional[set[str] | frozenset[str]] = None) -> Optional[torch.dtype]:
    """The dtype decoding's ``--precision auto`` keeps a beam search's self-attention K/V
    slots in (s2s.model.cache), where not the model's: bf16 for an fp32 model (int8
    matrices or not) on a CPU with native bf16 products (AVX-512 BF16 or AMX-BF16), else
    None.  The beams' attention products then multiply bf16, 1.5-2.7x faster per call
    there; the outputs move by bf16's rounding (benchmarks/README.md, bf16 beam slots: 0.87-0.94 of beam
    5's time paired on an AMD EPYC Zen 5, BLEU within 0.1)."""
    if device.type != "cpu" or precision != "fp32" or not native_bf16_cpu(flags):
        return None
    return torch.bfloat16


def greedy_kv_dtype(device: torch.device, precision: str,
                    flags: Optional[set[str] | frozenset[str]] = None) -> Optional[torch.dtype]:
    """The dtype decoding's ``--precision auto`` keeps a greedy search's attention K/V in
    (s2s.model.cache.DecoderCache.narrow_kv), where not the model's and the attention kernel
    reads them (the caller's condition: one thread, the kernel built): bf16 for an fp32 model
    (int8 matrices or not) on a CPU with native bf16 products, as for :func:`beam_slot_dtype`;
    else None.  A greedy step reads every row's K/V for its one query: half the bytes,
    widened as the kernel reads them (paired on an Intel Xeon with AMX, int8 matrices, one
    thread, 1,000 lines: 0.90-0.94 of greedy's time, BLEU within 0.1; benchmarks/README.md, the AMX Xeon
    again; through torch's bf16 products instead, 1.58x the time on a Zen 5).  Not for a beam
    search: its beams share each sentence's K/V, and widening them cost more than the bytes
    saved (1.01-1.02 of beam 5's time)."""
    return beam_slot_dtype(device, precision, flags)


def resolve_precision(asked: str, device: torch.device, key: str) -> str:
    """fp32 or bf16 for ``asked`` (fp32, bf16, auto) on ``device``: auto is logged with the
    reason for its choice; bf16 on a CPU without native bf16 matmuls gets a warning.
    ``key`` (--precision, train.precision) names the setting in both."""
    picked, why = auto_precision(device)
    if asked == "auto":
        log.info("%s auto: %s (%s)", key, picked, why)
        return picked
    if asked == "bf16" and device.type == "cpu" and picked != "bf16":
        log.warning("%s bf16: this CPU has no native bf16 matmul (AVX-512 BF16 or AMX; %s); "
                    "expect it to be slower than fp32", key, why)
    return asked


# --------------------------------------------------------------------------- #
# bf16 training with fp32 master weights
# --------------------------------------------------------------------------- #

class Bf16Copy:
    """theta_16 = bf16(theta) made once per update (:meth:`refresh`), and
    grad theta += fp32(grad theta_16) after each backward pass (:meth:`accumulate_grads`).

    ``model`` holds the fp32 master weights theta (the optimizer's); :attr:`module` is the
    working copy the forward and backward passes run on.  Tied parameters stay tied in
    the copy.  Each working tensor is made of one master tensor, or of several stacked
    along dim 0 (a fused matrix: a module's ``fuse_matmuls`` makes it and names its
    parts in ``fused_from``): ``slots`` pairs them.
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype = torch.bfloat16):
        self.model = model
        self.module = copy.deepcopy(model).to(dtype)
        for m in self.module.modules():  # matrices the copy multiplies as one (s2s.model's fuse_matmuls)
            if hasattr(m, "fuse_matmuls"):
                m.fuse_matmuls()
        masters = dict(model.named_parameters())
        fused: dict[str, list[str]] = {}  # a fused working tensor's name -> its masters' names
        for prefix, m in self.module.named_modules():
            at = f"{prefix}." if prefix else ""
            for local, parts in getattr(m, "fused_from", {}).items():
                fused[at + local] = [at + part for part in parts]
        # (working tensor, its master tensors stacked along dim 0)
        self.slots: list[tuple[Tensor, list[Tensor]]] = [
            (p, [masters[n] for n in fused.get(name, [name])]) for name, p in self.module.named_parameters()]
        covered = {id(m) for _, ms in self.slots for m in ms}
        missing = [n for n, m in masters.items() if id(m) not in covered]
        if missing:
            raise ValueError(f"Bf16Copy: no working tensor for {', '.join(missing)}")

    @torch.no_grad()
    def refresh(self) -> None:
        """theta_16 <- bf16(theta) (after the optimizer changed theta; once per update)."""
        for work, masters in self.slots:
            work.copy_(masters[0] if len(masters) == 1 else torch.cat(masters))
        for work_buf, master_buf in zip(self.module.buffers(), self.model.buffers()):
            work_buf.copy_(master_buf)

    @torch.no_grad()
    def accumulate_grads(self) -> None:
        """grad theta += fp32(grad theta_16); the working gradients are cleared."""
        for work, masters in self.slots:
            if work.grad is None:
                continue
            g = work.grad.float()
            parts = [g] if len(masters) == 1 else g.split([m.size(0) for m in masters])
            for m, g_m in zip(masters, parts):
                m.grad = g_m if m.grad is None else m.grad.add_(g_m)
            work.grad = None
