"""Directories that commands write, under one rule: never destroy what is not theirs.

* ``s2s export ct2``, ``export hf``, ``import hf`` and ``average`` write a
  directory (``-o OUT``) through :func:`output_dir`: the files go into a
  temporary directory that is renamed to OUT when complete, with
  ``OUT/s2s-output.json`` naming the command and every file it wrote.  An
  existing non-empty OUT is refused, except the same command's own earlier
  output with ``--force``, and then only when OUT holds nothing but the files
  that output listed.  A training run directory and the command's inputs (or
  a directory holding them) are never replaced.
* ``s2s tokenizer train`` and ``s2s prepare`` refuse a ``data.dir`` that is a
  model directory or a training run (:func:`check_data_dir`).
* ``s2s train`` and ``s2s pretrain`` accept only a new or empty directory or a
  run directory of their own (:func:`check_run_dir`), and hold an exclusive
  lock on ``RUN/train.lock`` while they run (:func:`lock_run_dir`): an OS file
  lock (flock), released by the kernel when the process ends however it ends,
  so a killed run never leaves a stale lock.  The lock file stays; it marks the
  directory as a run directory and holds the PID of the run that took it last.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from pathlib import Path
from typing import Iterable, Iterator

from s2s import __version__
from s2s.errors import S2SError
from s2s.textio import atomic_dir, is_empty_dir

MARKER = "s2s-output.json"  # in every directory export/import/average writes
LOCK = "train.lock"  # in every run directory train/pretrain writes
RUN_SIGNS = ("checkpoints", "metrics.jsonl", LOCK)  # any one: a training run's directory


# --------------------------------------------------------------------------- #
# What a directory is
# --------------------------------------------------------------------------- #

def looks_like_run(d: Path) -> bool:
    """``d`` holds anything a training run writes (never replaced by another command)."""
    return any((d / name).exists() for name in RUN_SIGNS)


def is_run_dir(d: Path) -> bool:
    """``d`` is a directory ``s2s train`` wrote: its lock file, or (runs of s2s before the
    lock existed) an ``env.json`` of package versions beside ``config.yaml``."""
    if (d / LOCK).is_file():
        return True
    try:
        env = json.loads((d / "env.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    return isinstance(env, dict) and {"s2s", "torch"} <= env.keys() and (d / "config.yaml").is_file()


def _files(d: Path) -> set[str]:
    """Every non-directory entry under ``d``, as paths relative to it."""
    found = set()
    for root, dirs, files in os.walk(d):
        for name in files + [x for x in dirs if os.path.islink(os.path.join(root, x))]:
            found.add(Path(os.path.relpath(os.path.join(root, name), d)).as_posix())
    return found


def _read_marker(d: Path) -> dict | None:
    try:
        marker = json.loads((d / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return marker if isinstance(marker, dict) and isinstance(marker.get("files"), list) else None


def _contains(outer: Path, inner: Path) -> bool:
    """``inner`` is ``outer`` or lies under it (both resolved)."""
    return inner == outer or outer in inner.parents


def check_data_dir(d: Path) -> None:
    """``data.dir``, which ``s2s tokenizer train`` and ``prepare`` write, is no model directory
    or training run: the tokenizer there is the model's own, and replacing it breaks the model."""
    from s2s.modeldir import META

    if (d / META).is_file() or looks_like_run(d):
        raise S2SError(f"data.dir: {d} is a model directory or a training run, whose tokenizer is the model's; "
                       "choose another data.dir")


# --------------------------------------------------------------------------- #
# Outputs of export / import / average
# --------------------------------------------------------------------------- #

def check_output_dir(out: str | Path, command: str, force: bool, inputs: Iterable[str | Path]) -> bool:
    """Whether ``s2s COMMAND -o OUT`` may write OUT; True when it replaces its own earlier output.

    Refused (one-line S2SError): OUT is a file; OUT is, or holds, one of ``inputs``;
    OUT is the current directory or holds it; OUT looks like a training run;
    OUT is non-empty and not COMMAND's earlier output; it is, but ``--force`` is
    not given; or it holds a file that output did not list.
    """
    target = Path(out)
    where = target.resolve()
    for inp in inputs:
        if _contains(where, Path(inp).resolve()):
            what = "is" if where == Path(inp).resolve() else "holds"
            raise S2SError(f"{target}: {what} the input {inp} of s2s {command}; choose another -o")
    if _contains(where, Path.cwd().resolve()):
        raise S2SError(f"{target}: is the current directory{'' if where == Path.cwd().resolve() else ' or holds it'};"
                       " name a new directory for -o")
    if not target.exists() and not target.is_symlink():
        return False
    if not target.is_dir():
        raise S2SError(f"{target}: exists and is not a directory")
    if is_empty_dir(target):
        return False
    if looks_like_run(target):
        raise S2SError(f"{target}: is a training run directory; s2s {command} never replaces one "
                       "(choose another -o)")
    marker = _read_marker(target)
    if marker is None:
        raise S2SError(f"{target}: not empty and not an output of s2s {command} (no {MARKER}); "
                       "choose another -o or a new directory")
    if marker.get("command") != command:
        raise S2SError(f"{target}: is an output of s2s {marker.get('command')}, not of s2s {command}; "
                       "choose another -o")
    if not force:
        raise S2SError(f"{target}: holds an earlier output of s2s {command}; "
                       "pass --force to replace it, or choose another -o")
    foreign = sorted(_files(target) - set(marker["files"]) - {MARKER})
    if foreign:
        raise S2SError(f"{target}: holds {foreign[0]}{f' (and {len(foreign) - 1} more)' if len(foreign) > 1 else ''}, "
                       f"which s2s {command} did not write; not replaced")
    return True


@contextlib.contextmanager
def output_dir(out: str | Path, command: str, force: bool, inputs: Iterable[str | Path]) -> Iterator[Path]:
    """Fill a temporary directory that becomes ``out`` when complete, with its ``s2s-output.json``.

    The checks of :func:`check_output_dir` run again here (call it before the
    work too, to fail early); an earlier output is replaced only after the new
    one is complete.
    """
    inputs = [str(p) for p in inputs]
    replace = check_output_dir(out, command, force, inputs)
    with atomic_dir(out, replace=replace) as tmp:
        yield tmp
        marker = {"command": command, "s2s_version": __version__, "inputs": inputs,
                  "files": sorted(_files(tmp) - {MARKER})}
        (tmp / MARKER).write_text(json.dumps(marker, indent=1) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------- #
# Training run directories
# --------------------------------------------------------------------------- #

def check_run_dir(run_dir: Path) -> None:
    """``s2s train -o RUN`` may use RUN: new, empty, or a run directory of its own."""
    if run_dir.exists() and not run_dir.is_dir():
        raise S2SError(f"{run_dir}: exists and is not a directory")
    if run_dir.is_dir() and not is_empty_dir(run_dir) and not is_run_dir(run_dir):
        raise S2SError(f"{run_dir}: not empty and not a training run directory (no {LOCK}); "
                       "training would overwrite its files: choose a new or empty directory for -o")


@contextlib.contextmanager
def pid_flock(lock_file: Path, cannot_create: str, busy: str) -> Iterator[None]:
    """Hold an exclusive flock on ``lock_file`` (its directory created if need be), the file
    holding this process's PID.  ``cannot_create`` (with ``{reason}``) and ``busy`` (with
    ``{pid}``, another holder's PID) are the one-line errors.  A kill -9 leaves no stale lock:
    the kernel releases a flock with its last descriptor."""
    try:
        lock_file.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise S2SError(cannot_create.format(reason=e.strerror)) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = ""
            for _ in range(10):  # the holder may be between truncating the file and writing its PID
                holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
                if holder:
                    break
                time.sleep(0.05)
            raise S2SError(busy.format(pid=holder or "unknown")) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing the only descriptor releases the lock


def lock_run_dir(run_dir: Path) -> contextlib.AbstractContextManager[None]:
    """Hold an exclusive flock on ``RUN/train.lock`` (created with RUN if need be).
    Another process holding it: a one-line error naming its PID."""
    return pid_flock(run_dir / LOCK, f"{run_dir}: cannot create the run directory ({{reason}})",
                     f"{run_dir}: in use by another training run (PID {{pid}}); "
                     "wait for it to end or choose another -o")
