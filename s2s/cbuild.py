"""Compiling s2s's C kernels for the machine they run on, once, into s2s's cache directory.

Two libraries are built from the C files in s2s/model: the torch operators' (s2s.model.native:
the C files linked with native_op.cpp against torch's headers) and the torch-free greedy
search's (s2s.native_search: the C files alone, loaded through ctypes).  Each is keyed by its
sources, the compilers and their flags, what else it depends on (torch's version for the
first) and the CPU (``-march=native``), so that a new source, compiler or CPU builds afresh.
``$S2S_MARCH`` names another target than ``native`` (``x86-64-v3``: AVX2 and FMA alone, as
benchmarks/decode_speed.py ``--isa avx2`` measures a CPU without AVX-512 on one that has it); the
kernels then run what that target has: s2s.native_search picks its products by the CPU's flags
and leaves a command to torch's route where the library lacks them.

This module imports no torch.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Sequence

log = logging.getLogger("s2s")

CFLAGS = ("-O3", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math", "-fPIC")
MARCH = "S2S_MARCH"  # the compiler's -march (native where unset)


def cflags() -> tuple[str, ...]:
    """:data:`CFLAGS` with ``-march=$S2S_MARCH`` (``native`` where it is unset)."""
    return (*CFLAGS, f"-march={os.environ.get(MARCH) or 'native'}")
COMPILE_TIMEOUT_S = 300


def cache_dir() -> Path:
    """Where s2s keeps what it builds for this machine: $S2S_CACHE_DIR, else $XDG_CACHE_HOME/s2s,
    else ~/.cache/s2s."""
    if os.environ.get("S2S_CACHE_DIR"):
        return Path(os.environ["S2S_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "s2s"


@functools.lru_cache(maxsize=None)
def cpuinfo_field(key: str) -> str:
    """The value of the first CPU's ``key`` line in /proc/cpuinfo ("" where there is none).  Only
    the first CPU's block is read: a key it lacks (the arm fields on x86, :func:`build_key` asks
    for both) costs no pass over every core's block, which the kernel writes afresh each time."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():  # the end of the first CPU's block
                    break
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of /proc/cpuinfo (empty where there is none)."""
    return frozenset(cpuinfo_field("flags").split())


def build_key(sources: bytes, parts: Sequence[str]) -> str:
    """What a compiled library depends on: its sources, ``parts`` (the compilers and their flags,
    a library's own dependencies), and the CPU (-march=native), hashed."""
    h = hashlib.sha256(sources)
    cpu = [cpuinfo_field(key) for key in ("model name", "flags", "Features", "CPU implementer", "CPU part")]  # x86, arm
    for part in (*parts, platform.machine(), platform.processor(), *cpu):
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:16]


def compile_library(name: str, c_sources: Sequence[Path], cxx_source: Path | None = None,
                    cxx_flags: Sequence[str] = (), link_flags: Sequence[str] = (),
                    depends: Sequence[str] = ()) -> Path:
    """The library ``NAME-KEY.so`` compiled for this machine from ``c_sources`` (by ``cc``, or
    ``$CC``, with :func:`cflags`) and, with ``cxx_source``, linked with it by ``c++`` (or ``$CXX``,
    with ``cxx_flags`` and ``link_flags``), else linked by ``cc``; built into :func:`cache_dir`
    first if it is not there (written under a temporary name and renamed, so that processes
    building it at once never load a partial file).  A compiler that failed leaves
    ``NAME-KEY.failed`` (its message) instead, and is not run again for the same sources,
    compilers and CPU.  ``depends``: what else the library depends on (in its key).  Raises
    OSError or subprocess.SubprocessError where it cannot."""
    cc, cxx = os.environ.get("CC") or "cc", os.environ.get("CXX") or "c++"
    compilers = [cc] + ([cxx] if cxx_source is not None else [])
    paths = [*c_sources, *([cxx_source] if cxx_source is not None else [])]
    sources = b"".join(path.read_bytes() for path in paths)
    key = build_key(sources, ["\0".join(compilers), " ".join((*cflags(), *cxx_flags)), *depends])
    out = cache_dir() / "native" / f"{name}-{key}.so"
    failed = out.with_suffix(".failed")
    if out.exists():
        return out
    if failed.exists():
        raise OSError(f"compiling failed before ({failed}): {failed.read_text(errors='replace').strip()}")
    for compiler in compilers:  # every one, before compiling anything (no marker: installing one later is enough)
        if not shlex.split(compiler) or shutil.which(shlex.split(compiler)[0]) is None:
            raise OSError(f"{compiler}: no such compiler")
    out.parent.mkdir(parents=True, exist_ok=True)
    log.info("compiling s2s's CPU kernels for this machine, once (%s)", out.name)
    with tempfile.TemporaryDirectory(prefix=f".{name}-", dir=out.parent) as tmp:
        objects = [os.path.join(tmp, f"{path.stem}.o") for path in c_sources]
        lib = os.path.join(tmp, f"{name}.so")
        commands = [(cc, [*shlex.split(cc), *cflags(), "-c", str(path), "-o", obj])
                    for path, obj in zip(c_sources, objects)]
        if cxx_source is not None:
            commands.append((cxx, [*shlex.split(cxx), *cxx_flags, str(cxx_source), *objects, "-o", lib,
                                   *link_flags, "-lm"]))
        else:
            commands.append((cc, [*shlex.split(cc), "-shared", *objects, "-o", lib, *link_flags, "-lm"]))
        for compiler, command in commands:
            done = subprocess.run(command, capture_output=True, text=True, errors="replace",
                                  timeout=COMPILE_TIMEOUT_S, check=False)
            if done.returncode:
                lines = (done.stderr or done.stdout).strip().splitlines()
                why = lines[-1] if lines else f"exit status {done.returncode}"
                failed.write_text(f"{compiler}: {why}\n")
                raise OSError(f"{compiler} failed: {why}")
        os.chmod(lib, 0o755)  # (others sharing $S2S_CACHE_DIR may load it too)
        os.replace(lib, out)
    log.debug("s2s's kernels compiled into %s", out)
    return out
