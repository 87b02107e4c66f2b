"""Host memory for tensors: keep what torch frees for the next allocation of the same size.

PyTorch allocates CPU tensors with malloc.  glibc's malloc serves a block of 32 MiB
or more (less at first: its threshold starts at 128 KiB) with a fresh mmap and
unmaps it when freed, so a tensor of that size made again at every training update
(the logits of a batch, their gradient, the softmax inside the loss, the FFN's hidden
layer of a large batch) costs a page fault for each of its 4 KiB pages while the
kernel hands out zeroed pages.  Serving every block from the heap and never trimming
it keeps those pages mapped: the next update's tensors reuse them.  The price is that
the process's resident memory stays at its peak instead of shrinking between updates.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD = -1  # mallopt parameters, glibc's malloc.h
M_MMAP_THRESHOLD = -3
HEAP_ONLY = 1 << 30  # blocks up to 1 GiB from the heap; glibc caps the mmap threshold at 32 MiB by default
NEVER_TRIM = (1 << 31) - 1  # free memory at the heap's top kept up to 2 GiB


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to serve blocks below 1 GiB from the heap and to keep freed memory
    (mallopt M_MMAP_THRESHOLD and M_TRIM_THRESHOLD); True where it took effect.  Elsewhere
    (macOS, Windows, musl) nothing changes and it returns False."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # no libc, or one without mallopt (musl)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, HEAP_ONLY)) and bool(mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))
