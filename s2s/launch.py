"""The ``s2s`` command's entry point (and ``python -m s2s``'s).

Before the command line is parsed (typer, rich and the config loader take about 0.25 s),
a ``translate`` or ``summarize`` that looks like it will decode in worker processes asks
for the workers' server (:func:`s2s.workerserver.start_early`), so that the server's import
of torch, the longest part of the start, runs beside the parsing.  The guess reads the
words alone; it decides only when the server is asked for, never what runs: a server not
used is killed, and one not asked for early is asked for when the workers start.  A command
whose words pick the torch-free search (:func:`searches_without_torch`) decodes in threads of
this process, and asks for no server: starting one and importing torch there cost that route
0.05-0.09 s of a 2-core machine's start (benchmarks/README.md).

A ``train`` or ``pretrain`` first starts itself again, at once, with the allocator that suits
training (:func:`s2s.allocator.training_environ`: mimalloc, or glibc's malloc in huge pages),
where this process was started without it.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Optional

DECODE_COMMANDS = ("translate", "summarize")
TRAIN_COMMANDS = ("train", "pretrain")
GLOBAL_FLAGS = ("--debug", "--quiet", "-q")  # the options s2s takes before its command
DEFAULT_PRECISION = "fp32"  # translate's and summarize's --precision (s2s.cli)
TORCH_ROUTE_WORDS = ("--alignments", "--compile", "--glossary", "--markup", "--coverage-penalty",
                     "--ensemble-weights")  # options the torch-free search lacks


def option_value(args: list[str], name: str) -> Optional[str]:
    """The value of ``--name VALUE`` or ``--name=VALUE`` in ``args`` (the last one given), else None."""
    value = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(name + "="):
            value = arg[len(name) + 1:]
    return value


def command_of(argv: list[str]) -> tuple[Optional[str], list[str]]:
    """The command word of ``s2s ARGV`` (after s2s's own flags) and the words after it."""
    i = 0
    while i < len(argv) and argv[i] in GLOBAL_FLAGS:
        i += 1
    return (argv[i], argv[i + 1:]) if i < len(argv) else (None, [])


def trains(argv: list[str]) -> bool:
    """Whether ``s2s ARGV`` is a train or pretrain (not its --help)."""
    command, args = command_of(argv)
    return command in TRAIN_COMMANDS and "--help" not in args


def restart_for_training(argv: list[str]) -> None:
    """For a train or pretrain: replace this process (same pid, same open files) by the same
    command in the environment of :func:`s2s.allocator.training_environ`, where that would change
    anything.  Returns where it does not; nothing has been imported or read yet."""
    if not trains(argv):
        return
    from s2s.allocator import training_environ

    env = training_environ(os.environ)
    if env is None or not getattr(sys, "orig_argv", None) or not sys.executable:
        return
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)  # this interpreter, its flags
    except OSError:
        return  # run on as it is


def decodes_in_workers(argv: list[str], cores: int, gpu_driver: bool) -> bool:
    """Whether ``s2s ARGV`` looks like a translate or summarize that will decode in worker
    processes, as s2s.workers decides it: ``--workers N`` over 1, or ``--workers`` auto (one
    worker per core) on a machine with more than one core and the CPU as the device
    (``--device cpu``, or auto where there is no GPU driver).  Not with ``--unbuffered``
    (line by line in one process) or ``--help``.  An input of 200 lines or fewer decodes in
    one process too, which the words cannot tell."""
    from s2s.workerserver import device_is_cpu

    command, args = command_of(argv)
    if command not in DECODE_COMMANDS:
        return False
    if any(a in ("--help", "--unbuffered") for a in args):
        return False
    device = option_value(args, "--device") or "auto"
    try:
        workers = int(option_value(args, "--workers") or 0)
    except ValueError:
        return False  # an error the command line will report
    if workers:
        return workers > 1
    return cores > 1 and device_is_cpu(device, gpu_driver)


def searches_without_torch(argv: list[str], flags: Optional[frozenset[str]] = None) -> bool:
    """Whether ``s2s ARGV`` (a translate or summarize) looks like a search the torch-free route
    takes on a CPU with ``flags`` (this one's by default): its ``--precision`` and ``--quantize``
    give that route products (s2s.native_search.products_for), its ``--device`` is the CPU
    (s2s.native_search.device_why_not), no word names an option it lacks
    (:data:`TORCH_ROUTE_WORDS`, or a second ``-m``), and ``$S2S_NATIVE_SEARCH`` is not 0.  The
    words cannot tell a model or a decode setting the route does not take; its workers' server is
    then asked for when the workers start."""
    from s2s import native_search

    _, args = command_of(argv)
    if os.environ.get(native_search.DISABLE, "1") == "0" or any(a.split("=")[0] in TORCH_ROUTE_WORDS for a in args):
        return False
    if sum(a in ("-m", "--model") or a.startswith("--model=") for a in args) > 1:
        return False
    if native_search.device_why_not(option_value(args, "--device") or "auto"):
        return False
    precision = option_value(args, "--precision") or DEFAULT_PRECISION
    return native_search.products_for(precision, option_value(args, "--quantize"), flags)[0] is not None


def _terminated(signum: int, frame) -> None:
    print(f"s2s: terminated by {signal.Signals(signum).name}", file=sys.stderr)
    sys.exit(128 + signum)  # an exit, not the signal's default death: atexit kills the early server


def main() -> None:
    restart_for_training(sys.argv[1:])
    from s2s.workerserver import gpu_driver_present, start_early, usable_cores

    early = decodes_in_workers(sys.argv[1:], usable_cores(), gpu_driver_present()) and not searches_without_torch(
        sys.argv[1:])
    # until the command line installs its own handlers (s2s.cli, over SIG_DFL only), SIGTERM
    # and SIGHUP exit through atexit, which kills the server started early
    caught = [s for s in (signal.SIGTERM, signal.SIGHUP) if early and signal.getsignal(s) == signal.SIG_DFL]
    for s in caught:
        signal.signal(s, _terminated)
    try:
        if early:
            start_early()
        from s2s.cli import run
    finally:
        for s in caught:
            signal.signal(s, signal.SIG_DFL)
    run()
