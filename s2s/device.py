"""Which device a model runs on: ``auto``, ``cpu``, ``cuda`` (``cuda:N``) or ``mps``.

``auto`` takes the GPU when torch sees one (``torch.cuda.is_available()``), else
the CPU.  Asking for a device that is not there is one error line, never a
silent fall-back to the CPU.
"""

from __future__ import annotations

import re

from s2s.errors import S2SError

DEVICES = ("auto", "cpu", "cuda", "mps")


def is_device_name(name: str) -> bool:
    return name in DEVICES or re.fullmatch(r"cuda:\d+", name) is not None


def check_device_name(name: str, key: str = "--device") -> None:
    """A spelling error in a device name is an error before anything loads (no torch needed)."""
    if not is_device_name(name):
        raise S2SError(f"{key}: {name!r} is not one of {', '.join(DEVICES)} (or cuda:N)")


def resolve_device(name: str = "auto", key: str = "--device"):
    """The torch.device for ``name``; ``key`` (--device, train.device) names the setting in errors."""
    import torch

    check_device_name(name, key)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA"
            raise S2SError(f"{key}: {name}: torch sees no CUDA GPU (this torch {torch.__version__} "
                           f"is built with {build}); use --device cpu or auto")
        index = int(name.split(":")[1]) if ":" in name else 0
        if index >= torch.cuda.device_count():
            raise S2SError(f"{key}: {name}: there are only {torch.cuda.device_count()} CUDA devices")
        return torch.device(name)
    if name == "mps" and not torch.backends.mps.is_available():
        raise S2SError(f"{key}: mps: torch sees no Apple GPU (Metal Performance Shaders); use --device cpu or auto")
    return torch.device(name)


def use_device(device) -> None:
    """Make ``device`` torch's current one where it keeps one (``cuda:N``), so that what torch
    does on "the" GPU (its cache of freed blocks, page-locked memory, the bf16 query) is on
    GPU N.  Called by the process that computes there, not by one that only checks a name
    (a launcher would hold a CUDA context on GPU N for the whole run)."""
    if device.type == "cuda" and device.index is not None:
        import torch

        torch.cuda.set_device(device)
