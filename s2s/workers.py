"""Translating a stream of lines with one or N decoding processes, output in input order.

    parent: read K lines -> chunk i -> its lines sorted by length, cut into the batches a
            worker decodes, one task each -> task queue -> worker 1..N (each its own model,
            cores/N torch threads) -> result queue -> write chunk i once all its tasks and
            0..i-1 are written

Each task is translated as ``Translator.translate_chunk`` translates its lines in one
process, and the tasks do not depend on the number of workers, so the output is one line
per input line, in input order, whatever the number of workers.  Cutting a chunk's lines
sorted by length (as CTranslate2 cuts a read buffer for its ``inter_threads``) gives each
task sentences of one length, so its batches pad little, and gives the workers the work
of a chunk in pieces small enough that none waits long for the other at the end (a task
is one batch, at most 1/8 of the chunk's lines).  At
most 2N tasks are in flight (sent and not yet received) and two chunks held, so memory
stays bounded however long the input.  A bad input line stops the reading: the chunks before it are written,
then the error, as with one process.  A worker that dies (killed, out of memory) is one
error line; Ctrl-C stops every worker.

This module imports no torch: the parent only reads, sends and writes.  Small models
decode faster as N single-thread processes than as one N-thread process (a decoder
step's matrices are too small to split between threads); see the README.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import math
import os
import queue
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, TextIO

from s2s import workerserver
from s2s.errors import S2SError
from s2s.output import OutputFormat, check_format, format_translation
from s2s.workerserver import gpu_driver_present, usable_cores, worker_context

log = logging.getLogger("s2s")

CHUNK_LINES = 1000  # lines read, sorted by length and written as one chunk
TASKS_PER_CHUNK = 8  # a chunk is cut into at least this many tasks for the workers
MIN_PARALLEL_LINES = 200  # --workers auto: a shorter input is translated in this one process
CHUNKS_HELD = 2  # chunks read and not yet written: a worker can start the next while one ends


PRECISIONS = ("fp32", "bf16", "auto")


def check_translator_options(n_models: int, device: Any = "auto", weights: Optional[Any] = None,
                             precision: str = "fp32", quantize: Optional[str] = None, threads: int = 0) -> None:
    """Refuse a bad setting of ``Translator.from_dirs`` before anything loads (torch-free, so the
    CLI's parent process checks them before reading its input)."""
    from s2s.device import check_device_name

    if threads < 0:
        raise S2SError(f"--threads: {threads} is negative")
    if isinstance(device, str):
        check_device_name(device)
    if precision not in PRECISIONS:
        raise S2SError(f"--precision: {precision!r} is not fp32, bf16 or auto")
    if quantize not in (None, "int8"):
        raise S2SError(f"--quantize: {quantize!r} is not int8")
    if weights is not None:
        if len(weights) != n_models:
            raise S2SError(f"ensemble weights: {len(weights)} weights for {n_models} models")
        if not all(isinstance(w, (int, float)) and math.isfinite(w) and w > 0 for w in weights):
            raise S2SError(f"ensemble weights must be positive numbers, got {list(weights)}")


@dataclass(frozen=True)
class TranslatorSpec:
    """Everything needed to build the same Translator in this process or in a worker."""

    models: tuple[str, ...]  # model directories (more than one: an ensemble)
    overrides: dict = field(default_factory=dict)  # decode keys set on the command line
    defaults: dict = field(default_factory=dict)  # decode keys used where the model's config keeps the default
    device: str = "auto"  # auto | cpu | cuda | cuda:N | mps
    precision: str = "fp32"
    quantize: Optional[str] = None
    alignments: bool = False
    nbest_rows: bool = False  # print `LINE ||| TEXT ||| SCORE` rows even for one hypothesis (--nbest 1)
    threads: int = 0  # torch threads of the process that builds it (0: torch's default)
    weights: Optional[tuple[float, ...]] = None  # ensemble weights, one per model
    scores: bool = False  # --scores: each row ends in TAB and its confidence (s2s.output)
    output_format: str = "text"  # --format: text | jsonl (s2s.output)
    lean_torch: bool = False  # build() imports torch through s2s.leantorch (the CLI's own process)

    def check(self) -> None:
        """The settings' errors, before any model loads."""
        check_translator_options(len(self.models), self.device, self.weights, self.precision, self.quantize,
                                 self.threads)
        check_format(self.output_format)
        if self.overrides.get("glossary"):  # a bad file names its line now, not once per worker
            from s2s.glossary import load_glossary

            load_glossary(self.overrides["glossary"])

    def build(self):
        """Load the model(s) with these settings, each checked by ``Translator.from_dirs``."""
        if self.lean_torch:
            from s2s.leantorch import import_torch

            import_torch()
        from s2s.translate import Translator

        translator = Translator.from_dirs(list(self.models), self.device, weights=self.weights, decode=self.overrides,
                                          decode_defaults=self.defaults, precision=self.precision,
                                          quantize=self.quantize, alignments=self.alignments, threads=self.threads)
        translator.scores = self.output(translator).shows_scores  # none shown: greedy need not normalize
        return translator

    def output(self, translator) -> OutputFormat:
        """How the translator's output is written (see s2s.output)."""
        return self.output_format_for(translator.decode.nbest, translator.alignments)

    def output_format_for(self, nbest: int, alignments: bool) -> OutputFormat:
        """How a search of ``nbest`` hypotheses a line (decode.nbest) is written, with or without
        alignments: n-best rows for more than one hypothesis or --nbest 1's rows."""
        return OutputFormat(nbest=nbest > 1 or self.nbest_rows, alignments=alignments, scores=self.scores,
                            format=self.output_format)


def auto_workers(device: str, cores: int) -> int:
    """--workers 0 (auto): one single-thread worker per core on the CPU, one process on a GPU."""
    if device == "cpu":
        return cores
    if device != "auto":
        return 1
    if not gpu_driver_present():
        return cores
    import torch

    return 1 if torch.cuda.is_available() else cores


def threads_per_worker(workers: int, cores: int, threads: int = 0) -> int:
    """--threads when given, else the cores shared out: max(1, cores // workers)."""
    return threads or max(1, cores // workers)


# --------------------------------------------------------------------------- #
def output_tokens(t) -> int:
    """Tokens of a Translation's best hypothesis, </s> included (0 for an empty line)."""
    return len(t.hypotheses[0].tokens) + 1 if t.hypotheses else 0


def eta_seconds(done: int, total: int, rate: float) -> Optional[float]:
    """Time left at the present pace: ETA = (total - done) / rate, rate in lines/s
    (None while no line has been timed)."""
    return (total - done) / rate if rate > 0 else None


def format_duration(seconds: float) -> str:
    """H:MM:SS, or M:SS under an hour."""
    s = int(round(seconds))
    h, m = divmod(s, 3600)
    return f"{h}:{m // 60:02d}:{m % 60:02d}" if h else f"{m // 60}:{m % 60:02d}"


def progress_bar(done: int, total: int, width: int = 20) -> str:
    """``width`` cells, done/total of them filled."""
    filled = min(width, width * done // total) if total else width
    return "█" * filled + "░" * (width - filled)


def shows_on_stderr() -> bool:
    """Whether rich may draw on stderr: it is a terminal, or the environment tells rich to act as
    if it were (FORCE_COLOR, TTY_COMPATIBLE, TTY_INTERACTIVE)."""
    if any(os.environ.get(name) for name in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")):
        return True
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # (no stderr, or a closed one)
        return False


class TranslateProgress:
    """Lines/s and output tokens/s on stderr while translating (when stderr is a
    terminal; in a pipe or a log file, nothing), updated at most 4 times a second.
    With the input's line count (:meth:`count_lines_of`, a file) also a bar, the
    percentage done and the ETA."""

    def __init__(self, console=None):
        if console is None and not shows_on_stderr():  # (rich not even imported: 40-50 ms of a start)
            self.console = None
        else:
            from rich.console import Console

            self.console = console or Console(stderr=True)
        self.lines = self.tokens = 0
        self.total: Optional[int] = None  # the input's lines, once counted
        self.earlier = 0  # lines an earlier run translated (--resume): done, but not timed
        self.started = self.shown = time.time()
        shown = self.console is not None and self.console.is_terminal
        self._status = self.console.status("translating", spinner="dots") if shown else None
        if self._status is not None:
            self._status.start()

    def count_lines_of(self, path) -> None:
        """Count the lines of the input file ``path`` in a background thread (so that
        translating starts at once); nothing when nothing is shown."""
        if self._status is None or not os.path.isfile(path):  # never read a pipe: its lines are the input
            return
        import threading

        from s2s.textio import count_lines

        def count() -> None:
            try:
                self.total = count_lines(path)
            except (S2SError, OSError, EOFError):  # the reader names the problem; the bar just has no total
                pass

        threading.Thread(target=count, name="s2s-count-lines", daemon=True).start()

    def resumed(self, lines: int) -> None:
        """``lines`` were translated by an earlier run (--resume): shown as done, not in lines/s."""
        self.lines += lines
        self.earlier += lines

    def text(self) -> str:
        dt = max(time.time() - self.started, 1e-9)
        rate = (self.lines - self.earlier) / dt
        speed = f"{rate:,.1f} lines/s | {self.tokens / dt:,.0f} tokens/s"
        total = self.total
        if total is None or total < self.lines:
            return f"{self.lines:,} lines | {speed}"
        eta = eta_seconds(self.lines, total, rate)
        return (f"{progress_bar(self.lines, total)} {self.lines:,}/{total:,} lines "
                f"({100 * self.lines // max(total, 1)}%) | {speed} | "
                f"ETA {'?' if eta is None else format_duration(eta)}")

    def update(self, t) -> None:
        """Count one Translation."""
        self.add(1, output_tokens(t))

    def add(self, lines: int, tokens: int) -> None:
        """Count ``lines`` translated lines holding ``tokens`` output tokens."""
        self.lines += lines
        self.tokens += tokens
        if self._status is not None and time.time() - self.shown >= 0.25:
            self.shown = time.time()
            self._status.update(self.text())

    def close(self) -> None:
        if self._status is not None:
            self._status.stop()
            self.console.print(f"s2s: {self.text()}", highlight=False)


# --------------------------------------------------------------------------- #
def translate_stream(spec: TranslatorSpec, lines: Iterable[str], out: TextIO, workers: int = 0,
                     line_by_line: bool = False, prefixes: Optional[Iterable[str]] = None,
                     progress: Optional[TranslateProgress] = None, chunk_lines: int = CHUNK_LINES,
                     first_line_no: int = 1, on_chunk: Optional[Callable[[int], None]] = None) -> int:
    """Translate ``lines`` into ``out`` (the format of ``s2s.translate.write_translations``)
    with ``workers`` processes; returns the number of processes used.

    ``workers`` 0 (auto): one single-thread worker per core on the CPU (see
    :func:`auto_workers`), but one process for an input of at most MIN_PARALLEL_LINES lines.
    ``line_by_line`` (--unbuffered) always runs in this one process.  A plain greedy or beam search
    the torch-free route takes (s2s.native_search: bf16 products on AMX or AVX512-BF16, int8 on
    AVX2) runs in this process without torch, each of its threads
    searching a batch on one core: as many threads as the workers' threads together.
    ``first_line_no``: the number of the first line (n-best rows, messages) when ``lines``
    continue an input; ``on_chunk(n_lines)`` is called after each chunk of ``chunk_lines``
    lines is written whole to ``out``, in input order (s2s.bulk saves its progress there).
    """
    if workers < 0:
        raise S2SError(f"--workers: {workers} is negative")
    cores = usable_cores()
    n = workers or auto_workers(spec.device, cores)
    if line_by_line and n > 1:
        if workers > 1:
            log.info("--unbuffered: translating line by line in one process (--workers %d not used)", workers)
        n = 1
    items: Iterator[Any] = iter(lines) if prefixes is None else paired_lines(lines, prefixes, first_line_no)
    from s2s.native_search import engine_for

    engine = engine_for(spec)
    if engine is not None:  # a plain search the torch-free route takes: no torch, threads of this process
        workerserver.release_early()
        threads = n * threads_per_worker(n, cores, spec.threads)  # the cores torch's route would take
        engine.translate_stream(items, threads, 1 if line_by_line else chunk_lines, first_line_no,
                                lambda text, n_lines, n_tokens: _write_chunk(out, text, n_lines, n_tokens, progress,
                                                                             on_chunk), prefixes is not None)
        return 1
    if n > 1 and not workers:  # auto: a short input is not worth starting processes for
        head = list(itertools.islice(items, MIN_PARALLEL_LINES + 1))
        if len(head) <= MIN_PARALLEL_LINES:
            n = 1
        items = itertools.chain(head, items)
    if n == 1:
        workerserver.release_early()  # a server s2s.launch asked for, not used: one process decodes
    if n == 1 and (on_chunk is not None or first_line_no != 1):
        _translate_here(spec, items, out, prefixes is not None, progress, chunk_lines, first_line_no, on_chunk)
        return 1
    if n == 1:
        translator = spec.build()  # first: it chooses how torch is imported
        from s2s.translate import write_translations

        sources, prefix_lines = (items, None) if prefixes is None else _unzip(items)
        write_translations(translator, sources, out, spec.output(translator), line_by_line, prefix_lines, progress)
        return 1
    with TranslatorPool(spec, n) as pool:
        pool._translate(items, out, prefixes is not None, progress, chunk_lines, first_line_no, on_chunk)
    return n


def translate_task(translator, fmt: OutputFormat, line_nos: int | list[int], lines: list[str],
                   prefixes: Optional[list[str]]) -> tuple[list[str], int]:
    """Lines numbered ``line_nos`` (the first's number, or each one's): (each line's output
    text, the output tokens), in a worker or in this process."""
    found = translator.translate_chunk(lines, line_nos, prefixes)
    return [format_translation(t, fmt) for t in found], sum(output_tokens(t) for t in found)


def sorted_batches(lengths: Sequence[int], batch_size: int, batch_tokens: int) -> list[list[int]]:
    """The indices of ``lengths`` (sources' lengths in pieces), longest first (ties in their
    order), cut into the batches a Translator decodes: each of at most ``batch_size`` sentences
    (0: no cap) whose padded size, its longest length times its sentences, is at most
    ``batch_tokens`` (a longer sentence alone is a batch)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)
    cap = batch_size or len(order)
    batches, start = [], 0
    while start < len(order):
        end = start + 1
        width = lengths[order[start]]  # longest first: the first sets the width
        while end < len(order) and end - start < cap and width * (end - start + 1) <= batch_tokens:
            end += 1
        batches.append(order[start:end])
        start = end
    return batches


def task_batches(lengths: Sequence[int], batch_size: int, batch_tokens: int) -> list[list[int]]:
    """A chunk's :func:`sorted_batches`, each of at most 1/TASKS_PER_CHUNK of its lines: the tasks
    N workers (or threads, s2s.native_search) share out, none of them long at the chunk's end."""
    cap = -(-len(lengths) // TASKS_PER_CHUNK)  # at least TASKS_PER_CHUNK tasks of a chunk
    return sorted_batches(lengths, min(batch_size or cap, cap), batch_tokens)


def _translate_here(spec: TranslatorSpec, items: Iterator[Any], out: TextIO, paired: bool,
                    progress: Optional[TranslateProgress], chunk_lines: int, first_line_no: int,
                    on_chunk: Optional[Callable[[int], None]]) -> None:
    """One process, chunk by chunk as the workers' chunks: each written whole, then reported."""
    translator = spec.build()
    fmt = spec.output(translator)
    for line_no, lines, prefixes in _chunks(items, chunk_lines, paired, first_line_no):
        texts, n_tokens = translate_task(translator, fmt, line_no, lines, prefixes)
        _write_chunk(out, "".join(texts), len(texts), n_tokens, progress, on_chunk)


def _write_chunk(out: TextIO, text: str, n_lines: int, n_tokens: int, progress: Optional[TranslateProgress],
                 on_chunk: Optional[Callable[[int], None]]) -> None:
    """A chunk's output, written whole and flushed, then counted and reported (``on_chunk``)."""
    out.write(text)
    out.flush()
    if progress is not None:
        progress.add(n_lines, n_tokens)
    if on_chunk is not None:
        on_chunk(n_lines)


def _unzip(pairs: Iterator[tuple[str, str]]) -> tuple[Iterator[str], Iterator[str]]:
    """Two lazy streams from one stream of (line, prefix) pairs, read in step."""
    a, b = itertools.tee(pairs)
    return (x for x, _ in a), (p for _, p in b)


def paired_lines(lines: Iterable[str], prefixes: Iterable[str],
                 first_line_no: int = 1) -> Iterator[tuple[str, str]]:
    """(line, prefix) pairs; an error when one stream ends before the other (lines numbered
    from ``first_line_no``)."""
    sentinel = object()
    for n, (line, prefix) in enumerate(itertools.zip_longest(lines, prefixes, fillvalue=sentinel), first_line_no):
        if line is sentinel or prefix is sentinel:
            short = "the input" if line is sentinel else "the prefix file"
            raise S2SError(f"--prefix-file: {short} ends at line {n - 1}, the other goes on")
        yield line, prefix


def _chunks(items: Iterator[Any], k: int, paired: bool,
            first_line_no: int = 1) -> Iterator[tuple[int, list, Optional[list]]]:
    """(first line number, lines, prefixes or None) of each run of ``k`` items."""
    line_no = first_line_no
    while chunk := list(itertools.islice(items, k)):
        if paired:
            yield line_no, [x for x, _ in chunk], [p for _, p in chunk]
        else:
            yield line_no, chunk, None
        line_no += len(chunk)


def _died(i: int, n: int, code: int) -> S2SError:
    how = f"exit code {code}"
    if code < 0:
        try:
            how = f"killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"killed by signal {-code}"
        if -code == signal.SIGKILL:
            how += ", out of memory?"
    return S2SError(f"translate worker {i + 1} of {n} died ({how}); nothing after the last "
                    "complete chunk was written")


class TranslatorPool:
    """N decoding processes kept between translations: what ``s2s translate --workers N`` runs.

    Each worker loads its own copy of the model(s) of ``spec`` and runs cores/N torch
    threads (``spec.threads`` where set); each :meth:`translate` reads its lines in chunks,
    cuts each chunk into the batches a worker decodes and writes the chunks in input order, as
    the module docstring says.  For a Python program that translates many inputs without
    loading the models each time (CTranslate2's ``Translator`` with ``inter_threads``)::

        with TranslatorPool(TranslatorSpec(models=("exp/ddtp-en-de",)), workers=2) as pool:
            pool.wait_ready()  # optional: return once every worker has loaded its model
            pool.translate(lines, sys.stdout)

    (in a script, under ``if __name__ == "__main__":``: the workers start as multiprocessing's
    forkserver or spawn start them, which import the main module).
    An error (a bad line, a worker that fails or dies, Ctrl-C) ends every worker at once: the
    pool cannot translate again.  Leaving the ``with`` block without an error lets the
    workers finish.  One call at a time: a pool is not for several threads at once, nor for
    a call from inside ``on_chunk``.
    """

    def __init__(self, spec: TranslatorSpec, workers: int):
        if workers < 1:
            raise S2SError(f"--workers: a pool needs at least one worker, got {workers}")
        self.workers = workers
        self.spec = replace(spec, threads=threads_per_worker(workers, usable_cores(), spec.threads))
        ctx = worker_context()
        self._tasks, self._results = ctx.Queue(), ctx.Queue()
        self._procs = [ctx.Process(target=_worker, args=(self.spec, self._tasks, self._results,
                                                         log.getEffectiveLevel()),
                                   name=f"s2s-translate-{i + 1}", daemon=True) for i in range(workers)]
        self._ready = 0  # workers that have loaded their models
        self._closed = False
        try:
            self._plan = task_planner(self.spec)  # while the server imports torch: starting a fork waits for it
            _start(ctx, self._procs)
        except BaseException:
            self.close(clean=False)
            raise

    def __enter__(self) -> "TranslatorPool":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(clean=exc_type is None)

    def wait_ready(self) -> None:
        """Return once every worker has loaded its model(s); a worker's error is raised here."""
        with self._ended_by_errors():
            while self._ready < self.workers:
                self._handle(_receive(self._results, self._procs))

    def translate(self, lines: Iterable[str], out: TextIO, prefixes: Optional[Iterable[str]] = None,
                  progress: Optional[TranslateProgress] = None, chunk_lines: int = CHUNK_LINES,
                  first_line_no: int = 1, on_chunk: Optional[Callable[[int], None]] = None) -> None:
        """Translate ``lines`` into ``out`` as :func:`translate_stream` does (its arguments)."""
        items: Iterator[Any] = iter(lines) if prefixes is None else paired_lines(lines, prefixes, first_line_no)
        self._translate(items, out, prefixes is not None, progress, chunk_lines, first_line_no, on_chunk)

    def close(self, clean: bool = True) -> None:
        """Stop the workers: let them finish (clean), else end them now.  Idempotent."""
        if not self._closed:
            self._closed = True
            _stop(self._procs, self._tasks, self._results, clean)

    @contextlib.contextmanager
    def _ended_by_errors(self):
        """Refuse a pool that has stopped; any error inside ends every worker at once, and the
        pool goes on no more."""
        if self._closed:
            raise S2SError("this translator pool has stopped (closed, or after an error)")
        try:
            yield
        except BaseException:
            self.close(clean=False)
            raise

    def _handle(self, msg: tuple) -> None:
        """A worker's "ready" (its start-up log shown once: every worker logs the same) or error."""
        if msg[0] == "ready":
            if self._ready == 0:
                _replay(msg[1])
            self._ready += 1
            return
        if msg[0] == "error":
            _, kind, text = msg
            if kind == "s2s":
                raise S2SError(text)
            raise RuntimeError(f"a translate worker failed:\n{text}")
        raise RuntimeError(f"a translate worker sent {msg[0]!r} when no task was in flight")

    def _translate(self, items: Iterator[Any], out: TextIO, paired: bool, progress: Optional[TranslateProgress],
                   chunk_lines: int, first_line_no: int, on_chunk: Optional[Callable[[int], None]]) -> None:
        if chunk_lines < 1:
            raise S2SError(f"chunk_lines: {chunk_lines} is not a positive number of lines")
        with self._ended_by_errors():
            self._run(items, out, paired, progress, chunk_lines, first_line_no, on_chunk)

    def _run(self, items: Iterator[Any], out: TextIO, paired: bool, progress: Optional[TranslateProgress],
             chunk_lines: int, first_line_no: int, on_chunk: Optional[Callable[[int], None]]) -> None:
        n, tasks = self.workers, self._tasks
        reader = enumerate(_chunks(items, chunk_lines, paired, first_line_no))
        chunks: dict[int, _Chunk] = {}  # read and not yet written
        unsent: collections.deque = collections.deque()  # their tasks not yet sent
        in_flight = written = 0
        reading, read_error = True, None
        while True:
            # bounded: at most 2N tasks in flight, and CHUNKS_HELD chunks read and not written
            while in_flight < 2 * n and (unsent or (reading and len(chunks) < CHUNKS_HELD)):
                if not unsent:
                    try:
                        index, read = next(reader)
                    except StopIteration:
                        reading = False
                        break
                    except S2SError as e:  # a bad line: write what came before it, then fail
                        read_error, reading = e, False
                        break
                    chunks[index], chunk_tasks = _plan(index, *read, self._plan)
                    unsent.extend(chunk_tasks)
                tasks.put(unsent.popleft())
                in_flight += 1
            if in_flight == 0:
                break
            msg = _receive(self._results, self._procs)
            if msg[0] != "done":
                self._handle(msg)
                continue
            _, (index, piece, rows), texts, n_tokens, records = msg
            in_flight -= 1
            chunks[index].receive(piece, rows, texts, n_tokens, records)
            if progress is not None:
                progress.add(len(rows), n_tokens)
            while written in chunks and chunks[written].pending == 0:
                done = chunks.pop(written)
                for _, task_records in sorted(done.records.items()):
                    _replay(task_records)
                _write_chunk(out, "".join(done.texts), len(done.texts), done.n_tokens, None, on_chunk)
                written += 1
        if read_error is not None:
            raise read_error


@dataclass
class _Chunk:
    """A chunk's outputs as its tasks return them (parent side)."""

    texts: list[str]  # each line's output; "" until its task returns
    pending: int  # tasks not yet returned
    n_tokens: int = 0
    records: dict[int, list[tuple[int, str]]] = field(default_factory=dict)  # each task's log lines

    def receive(self, piece: int, rows: list[int], texts: list[str], n_tokens: int,
                records: list[tuple[int, str]]) -> None:
        for i, text in zip(rows, texts):
            self.texts[i] = text
        self.pending -= 1
        self.n_tokens += n_tokens
        self.records[piece] = records


def task_planner(spec: TranslatorSpec) -> Callable[[list[str]], list[list[int]]]:
    """How the parent cuts a chunk into the workers' tasks: into the batches a worker decodes
    (:func:`sorted_batches` of the lengths its sources will have, by the first model's
    tokenizer and settings, read here: sentencepiece, no torch), each of at most
    1/TASKS_PER_CHUNK of the chunk's lines.  A task of one batch keeps the worker's batches
    full: cut by equal work, the longest sentences made tasks of a few dozen lines, decoded
    as small batches.  Where the model cannot be read, by characters and the default batch
    size (the workers then load the model and say what is wrong)."""
    from s2s.config import DecodeConfig
    from s2s.langs import language_ids
    from s2s.modeldir import input_cap, load_spec, model_decode_settings, run_dir_of

    try:
        run = run_dir_of(Path(spec.models[0]))
        cfg, tok = load_spec(run)
        decode = model_decode_settings(run, cfg, spec.overrides, spec.defaults)
        extra = language_ids(tok.languages, tok.token_id, decode.tgt_lang).extra  # a language token or two
    except (S2SError, OSError, RuntimeError, IndexError):
        default = DecodeConfig()
        return lambda lines: task_batches([len(line) for line in lines], default.batch_size, default.batch_tokens)
    trained, kept = cfg.data.max_src_tokens or math.inf, input_cap(cfg.model, decode) - extra

    def source_length(ids: list[int], line: str) -> int:
        """|x| as Translator.encode_lines makes x: cut to data.max_src_tokens and to the input
        cap, the language tokens around it; an empty line is no source (0)."""
        return min(len(ids), trained, kept) + extra if line.strip() else 0

    return lambda lines: task_batches([source_length(ids, line) for ids, line in zip(tok.encode_src(lines), lines)],
                             decode.batch_size, decode.batch_tokens)


def _plan(index: int, line_no: int, lines: list[str], prefixes: Optional[list[str]],
          plan: Callable[[list[str]], list[list[int]]]) -> tuple[_Chunk, list[tuple]]:
    """Chunk ``index``'s record and its tasks, ((chunk index, piece, rows), line numbers,
    lines, prefixes), cut by ``plan`` (:func:`task_planner`)."""
    runs = plan(lines)
    return _Chunk([""] * len(lines), len(runs)), [
        ((index, piece, rows), [line_no + i for i in rows], [lines[i] for i in rows],
         None if prefixes is None else [prefixes[i] for i in rows]) for piece, rows in enumerate(runs)]


def _start(ctx, procs) -> None:
    """Start the workers with SIGINT ignored from their first instruction on, so that Ctrl-C
    while they import torch prints no traceback of theirs: the parent alone handles it.  A
    new interpreter keeps an ignored SIGINT ignored: spawned workers are started with it
    ignored here; with a forkserver, the server is (:func:`s2s.workerserver.start_server`),
    and its forks inherit that.

    Starting a fork waits for the server to import torch, and a request sent cannot be
    taken back: a parent gone meanwhile would leave the server forking a worker whose queues
    are gone.  So a Ctrl-C (or SIGTERM, SIGHUP) while the forks start is held until they
    have, then raised (:func:`_signals_held`)."""
    if ctx.get_start_method() == "forkserver":
        workerserver.start_server()  # returns at once if s2s.launch asked for it already
        workerserver.mark_used()
        with _signals_held():
            for p in procs:
                p.start()
        return
    with workerserver.sigint_ignored():
        for p in procs:
            p.start()


@contextlib.contextmanager
def _signals_held():
    """SIGINT, SIGTERM and SIGHUP that come inside are held (:func:`s2s.signals.signals_caught`),
    and the first of them is raised once the block has ended, to the handler in place before it
    (a signal ignored stays ignored).  Off the main thread, which cannot handle signals, nothing is held."""
    import threading

    from s2s.signals import signals_caught

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    with signals_caught(lambda signum, frame: held.append(signum)):
        yield
    if held:
        signal.raise_signal(held[0])


def _receive(results, procs) -> tuple:
    """The next message of any worker; a worker that exited meanwhile is an error."""
    while True:
        try:
            return results.get(timeout=0.2)
        except queue.Empty:
            for i, p in enumerate(procs):
                if p.exitcode is not None:
                    raise _died(i, len(procs), p.exitcode) from None


def _replay(records: list[tuple[int, str]]) -> None:
    for level, message in records:
        log.log(level, "%s", message)


def _stop(procs, tasks, results, clean: bool) -> None:
    """Ask the workers to finish (clean), else end them now; never leave one behind."""
    procs = [p for p in procs if p.pid is not None]  # not those a Ctrl-C kept from starting
    if clean:
        for _ in procs:
            tasks.put(None)
        deadline = time.time() + 30
        for p in procs:
            p.join(max(0.0, deadline - time.time()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join()
    tasks.cancel_join_thread()  # unread tasks must not keep this process from exiting
    tasks.close()
    results.close()


class _Collect(logging.Handler):
    """A worker's log lines, sent to the parent with the chunk they belong to."""

    def __init__(self):
        super().__init__()
        self.records: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.levelno, record.getMessage()))

    def take(self) -> list[tuple[int, str]]:
        taken, self.records = self.records, []
        return taken


def _next_task(tasks, results) -> Optional[tuple]:
    """The next task, or None: the parent asked the worker to stop, or the parent is gone
    (killed with SIGKILL, which it cannot pass on), so that no orphan waits forever holding
    a model in memory."""
    import multiprocessing

    parent = multiprocessing.parent_process()
    while True:
        if parent is not None and not parent.is_alive():  # also before each queued task: none is wasted
            results.cancel_join_thread()  # nobody reads the results now: exit without flushing them
            return None
        try:
            return tasks.get(timeout=1.0)
        except queue.Empty:
            pass


def _worker(spec: TranslatorSpec, tasks, results, log_level: int) -> None:
    """A decoding process: build the translator once, then translate chunks until None.
    SIGINT stays ignored (see :func:`_start`): Ctrl-C is the parent's to handle."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # also when started from another thread
    collect = _Collect()
    s2s_log = logging.getLogger("s2s")
    s2s_log.handlers[:] = [collect]
    s2s_log.setLevel(log_level)
    s2s_log.propagate = False
    logging.getLogger().setLevel(logging.ERROR)  # other libraries: the parent shows their warnings once
    try:
        translator = spec.build()
        fmt = spec.output(translator)
        results.put(("ready", collect.take()))
        while (task := _next_task(tasks, results)) is not None:
            key, line_nos, lines, prefixes = task
            results.put(("done", key, *translate_task(translator, fmt, line_nos, lines, prefixes),
                         collect.take()))
    except S2SError as e:
        results.put(("error", "s2s", str(e)))
    except Exception:  # a bug: the parent shows the worker's traceback
        results.put(("error", "bug", traceback.format_exc()))
