"""The translate workers' server: multiprocessing's forkserver, preloading s2s.workerboot
(torch, imported lean, and the decoder), from which each decoding worker is forked.

Importing torch is most of a worker's start-up (about 1 s), and the server does it once
for all the workers.  ``s2s translate`` and ``s2s summarize`` ask for the server as their
first act (:func:`start_early`, from s2s.launch), before the command line is parsed, so
that its import runs beside the parent's own start (typer, the config loader, the
model's settings, the input's first lines: about 0.25 s).  When the command then decodes
in its own process after all (a short input, ``--unbuffered``, one worker), the server
asked for early is killed (:func:`release_early`) and the command goes on as before.

This module imports no torch and little else: s2s.launch imports it before anything.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import signal
import threading
from typing import Optional


def usable_cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def gpu_driver_present() -> bool:
    """Whether the machine has a GPU driver at all (so only then is torch imported to ask)."""
    return any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/kfd"))


def device_is_cpu(device: str, gpu_driver: bool) -> bool:
    """Whether ``--device DEVICE`` is the CPU, told without torch: cpu, or auto on a machine
    without a GPU driver (``gpu_driver``: :func:`gpu_driver_present`)."""
    return device == "cpu" or (device == "auto" and not gpu_driver)


def worker_context():
    """How the workers start: forked from a server process that imported torch and the decoder
    once (multiprocessing's forkserver, preloading s2s.workerboot: torch through s2s.leantorch,
    s2s.translate and s2s.modeldir), so that N workers pay one
    import of torch instead of N side by side on the same cores; spawn where there is no
    forkserver (Windows).  Never a fork of this process: it may hold torch's threads and locks
    (the server never runs a torch operation, so forking it is safe)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["s2s.workerboot"])
    return ctx


@contextlib.contextmanager
def sigint_ignored():
    """SIGINT ignored inside (on the main thread; elsewhere signals are not this thread's to
    set).  A process started inside keeps it ignored, a new interpreter too: a Ctrl-C while
    it imports torch prints no traceback of its own, the parent alone handles it.  In this
    process a Ctrl-C that comes inside is not lost: SIGINT is also blocked meanwhile (a blocked
    signal is kept pending even while ignored), and reaches the handler put back on the way out.
    (The mask is this thread's: where the process has other threads, a progress display's say,
    one of them may still take the signal and drop it.)"""
    main = threading.current_thread() is threading.main_thread()
    if not main:
        yield
        return
    blocks = hasattr(signal, "pthread_sigmask")
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}) if blocks else None
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
        if blocks:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def start_server() -> None:
    """Ask for the forkserver; returns at once (the server imports on its own).  It is
    spawned with SIGINT ignored (:func:`sigint_ignored`), and the workers forked from it
    inherit that."""
    from multiprocessing import forkserver

    with sigint_ignored():
        forkserver.ensure_running()


# the server start_early asked for: its pid, and whether a worker has been forked from it
_early: dict = {"pid": None, "used": False}


def start_early() -> bool:
    """Ask for the workers' server now, before the command knows it will use it; returns
    whether it did (not where there is no forkserver, nor when one runs already).  Unless a
    worker is forked from it (:func:`mark_used`), it is killed when the command decides to
    decode in its own process or when this process exits."""
    if worker_context().get_start_method() != "forkserver":
        return False
    from multiprocessing import forkserver

    if getattr(forkserver._forkserver, "_forkserver_pid", None) is not None:
        return False  # started before (and perhaps in use): not ours to kill
    atexit.register(release_early)  # before the server exists: an exit right after it starts kills it
    start_server()
    _early.update(pid=getattr(forkserver._forkserver, "_forkserver_pid", None), used=False)
    return True


def mark_used() -> None:
    """A worker is about to be forked: the server started early is now in use (killing it
    would orphan the workers' exit codes, which reach the parent through it)."""
    _early["used"] = True


def release_early() -> Optional[int]:
    """Kill the server :func:`start_early` asked for if no worker was forked from it (it
    would otherwise go on importing torch for up to a second, holding a copy of stdout that a
    pipeline's next command waits on); returns its pid if it did.  A later use of the
    workers starts a new server."""
    pid, _early["pid"] = _early["pid"], None
    if pid is None or _early["used"]:
        return None
    from multiprocessing import forkserver

    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    server = forkserver._forkserver
    stop = getattr(server, "_stop", None)
    if stop is not None:  # reap it and forget its address, so ensure_running starts a new one
        try:
            stop()
        except ChildProcessError:  # SIGCHLD ignored (kept across exec): the kernel reaped it already
            server._forkserver_pid = server._forkserver_address = None
    return pid
