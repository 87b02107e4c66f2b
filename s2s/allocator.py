"""Host memory for tensors: keep what torch frees for the next allocation of the same size.

PyTorch allocates CPU tensors with malloc.  glibc's malloc serves a block of 32 MiB
or more (less at first: its threshold starts at 128 KiB) with a fresh mmap and
unmaps it when freed, so a tensor of that size made again at every training update
(the logits of a batch, their gradient, the softmax inside the loss, the FFN's hidden
layer of a large batch) costs a page fault for each of its 4 KiB pages while the
kernel hands out zeroed pages.  Serving every block from the heap and never trimming
it keeps those pages mapped: the next update's tensors reuse them.  The price is that
the process's resident memory stays at its peak instead of shrinking between updates.

The heap still grows while a trainer meets new batch shapes: glibc's malloc, serving blocks
of a different size at every update, leaves holes it cannot fill, and a bf16 trainer's heap grew
from 1.1 to 2.5 GB over its first 150 updates.  Each page new to the process costs a page fault
on its first write, about 16 us per 4 KiB page on the virtual machines s2s is built on (33 ms
for one 8 MiB activation), and the virtual machine's host may add its own.  So ``s2s train`` and
``s2s pretrain`` start themselves again (s2s.launch; the ranks of ``train.procs`` start so) with
a better allocator for this pattern where they can (:func:`training_environ`):

- mimalloc (its shared library from the cmeel-mimalloc wheel, an s2s dependency on Linux)
  through LD_PRELOAD, told never to give freed memory back (``MIMALLOC_PURGE_DELAY=-1``): its
  size classes reuse what the last update freed, and the heap stopped growing at 1.5 GB;
- else glibc's malloc in transparent huge pages of 2 MiB (the tunable ``glibc.malloc.hugetlb=1``,
  glibc 2.35 and later, where the kernel gives them on request): one fault per 2 MiB.

Both are read once, when a process starts: hence the restart.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from typing import Mapping, Optional

MIMALLOC_DIST = "cmeel-mimalloc"  # mimalloc's shared library as a wheel (cmeel.prefix/lib)
MIMALLOC_OPTIONS = {"MIMALLOC_PURGE_DELAY": "-1"}  # freed memory kept for the next update, never given back
PRELOADED_MALLOCS = ("mimalloc", "jemalloc", "tcmalloc")  # in LD_PRELOAD: an allocator chosen already

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


HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb"  # 1: madvise(MADV_HUGEPAGE) on malloc's memory
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def transparent_huge_pages(path: str = THP_MODE) -> str:
    """The kernel's transparent huge page mode (always, madvise or never: the word in brackets
    in /sys/kernel/mm/transparent_hugepage/enabled); "" where there is no such file."""
    try:
        with open(path, encoding="ascii") as f:
            words = f.read().split()
    except (OSError, ValueError):
        return ""
    return next((w[1:-1] for w in words if w.startswith("[") and w.endswith("]")), "")


def glibc_version() -> Optional[tuple[int, int]]:
    """(major, minor) of the glibc this process runs on; None elsewhere (musl, macOS, Windows)."""
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()  # "glibc 2.36"
        major, minor = version.split(".")[:2]
        return (int(major), int(minor)) if name == "glibc" else None
    except (AttributeError, ValueError, OSError):
        return None


def huge_pages_environ(environ: Mapping[str, str], thp_mode: str,
                       glibc: Optional[tuple[int, int]]) -> Optional[dict[str, str]]:
    """``environ`` with ``glibc.malloc.hugetlb=1`` added to GLIBC_TUNABLES, for a process to be
    started: where glibc has the tunable (2.35 and later) and the kernel gives huge pages on
    request (``thp_mode`` always or madvise).  None where nothing would change, or where
    GLIBC_TUNABLES already sets the tunable: a user's ``glibc.malloc.hugetlb=0`` stands."""
    if thp_mode not in ("always", "madvise") or glibc is None or glibc < (2, 35):
        return None
    if glibc_tunable(environ, HUGE_PAGES_TUNABLE) is not None:
        return None
    tunables = environ.get("GLIBC_TUNABLES", "")
    return {**environ, "GLIBC_TUNABLES": ":".join(filter(None, (tunables, HUGE_PAGES_TUNABLE + "=1")))}


def glibc_tunable(environ: Mapping[str, str], name: str) -> Optional[str]:
    """The value GLIBC_TUNABLES (``name=value:name=value``) in ``environ`` gives ``name`` (the
    last where it is given twice), or None."""
    value = None
    for tunable in environ.get("GLIBC_TUNABLES", "").split(":"):
        key, _, v = tunable.partition("=")
        if key == name:
            value = v
    return value


def with_huge_pages(environ: Mapping[str, str]) -> Optional[dict[str, str]]:
    """:func:`huge_pages_environ` for this machine's kernel and glibc."""
    return huge_pages_environ(environ, transparent_huge_pages(), glibc_version())


def mimalloc_library() -> Optional[str]:
    """The path of mimalloc's shared library installed beside s2s (the cmeel-mimalloc wheel), or None."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        dist = distribution(MIMALLOC_DIST)
    except PackageNotFoundError:
        return None
    for f in dist.files or ():
        if f.name == "libmimalloc.so":  # preloaded on Linux only (mimalloc_environ)
            path = str(dist.locate_file(f))
            return path if os.path.isfile(path) else None
    return None


def preloaded_malloc(environ: Mapping[str, str]) -> Optional[str]:
    """The allocator LD_PRELOAD puts before glibc's (mimalloc, jemalloc or tcmalloc), or None."""
    for lib in environ.get("LD_PRELOAD", "").replace(":", " ").split():
        name = os.path.basename(lib)
        for malloc in PRELOADED_MALLOCS:
            if name.startswith("lib" + malloc):
                return malloc
    return None


def mimalloc_environ(environ: Mapping[str, str], library: Optional[str]) -> Optional[dict[str, str]]:
    """``environ`` with mimalloc's ``library`` first in LD_PRELOAD and :data:`MIMALLOC_OPTIONS`
    (where not set already), for a process to be started on Linux; None where there is no
    library, elsewhere, or where LD_PRELOAD names an allocator already (the user's, or this one)."""
    if library is None or not sys.platform.startswith("linux") or preloaded_malloc(environ):
        return None
    preload = environ.get("LD_PRELOAD", "")
    return {**MIMALLOC_OPTIONS, **environ, "LD_PRELOAD": f"{library} {preload}" if preload else library}


def training_environ(environ: Mapping[str, str]) -> Optional[dict[str, str]]:
    """The environment a training process on this machine starts with, from ``environ``:
    mimalloc preloaded where it is installed (:func:`mimalloc_environ`), else glibc's malloc in
    huge pages (:func:`with_huge_pages`); None where ``environ`` is that already, or nothing
    would change.  ``S2S_MALLOC=glibc`` keeps the process as it was started (no restart)."""
    if environ.get("S2S_MALLOC") == "glibc" or preloaded_malloc(environ):
        return None
    return mimalloc_environ(environ, mimalloc_library()) or with_huge_pages(environ)


def malloc_in_use(environ: Mapping[str, str] = os.environ) -> str:
    """What serves this process's malloc, as the log says it: the preloaded allocator, or glibc
    in huge pages, or glibc."""
    preloaded = preloaded_malloc(environ)
    if preloaded:
        return preloaded + " (LD_PRELOAD)"
    if glibc_tunable(environ, HUGE_PAGES_TUNABLE) == "1" and glibc_version() is not None:
        return "glibc malloc in transparent huge pages"
    return "glibc malloc"
