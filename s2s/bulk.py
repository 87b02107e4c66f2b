"""Resumable bulk jobs: ``s2s translate -i BIG -o OUT --resume`` (and ``summarize``).

    OUT's folder/.OUT.s2s-partial/    the job's progress, beside OUT
        output.part                   the output of the chunks done so far, in input order
        state.json                    what the job is (see job_identity) and how much of output.part is done
        lock                          flock'ed by the process running the job

The input is translated in chunks of ``chunk_lines`` lines (--chunk-lines, default 1000), each
written whole and in input order whatever the number of --workers.  After each chunk,
output.part is fsync'ed, then state.json replaced (atomically) with the new count of lines
and bytes.  A job killed at any moment (SIGKILL, a power cut) leaves at most the chunks
after the last saved one in output.part: the same command cuts them off and goes on from
the line after the last saved chunk.  Each chunk is translated as in an uninterrupted run,
so the final output is the same, byte for byte.  When the last chunk is saved, output.part
is renamed to OUT and the directory removed: OUT only ever appears complete.

A job resumes only where everything its output depends on is unchanged (the input's bytes,
the models' files, every translation setting, the s2s version); otherwise it stops with
one line naming what changed, never mixing two jobs' outputs in one file.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import itertools
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Optional

from s2s import __version__
from s2s.errors import S2SError
from s2s.outdir import pid_flock
from s2s.textio import (
    _fsync_dir,
    atomic_write,
    destination,
    file_sha256,
    mode_of,
    os_reason,
    read_lines,
    writes_in_place,
)

log = logging.getLogger("s2s")

CHUNK_LINES = 1000  # lines per saved chunk: the chunks one `s2s translate` process translates
STATE = "state.json"
PART = "output.part"
LOCK = "lock"
STATE_FORMAT = 1
# the parts of a job, in the order a change is reported (the s2s version explains any other)
JOB_KEYS = ("s2s_version", "command", "input", "prefix_file", "glossary", "models", "settings", "chunk_lines")
# TranslatorSpec fields that do not change a line's translation (threads: cores/N per worker)
NOT_OUTPUT_SETTINGS = ("models", "threads", "lean_torch")
# the names a user knows TranslatorSpec's fields by (any other: "the setting NAME")
SETTING_NAMES = {"overrides": "the decode settings",
                 "defaults": "the command's decode defaults", "device": "--device", "precision": "--precision",
                 "quantize": "--quantize", "alignments": "--alignments", "nbest_rows": "--nbest",
                 "weights": "--ensemble-weights"}


def partial_dir(output: Path) -> Path:
    """Where the job writing ``output`` keeps its progress: a hidden directory beside the file it
    becomes (through a symlink, the file the link names)."""
    final = destination(output, follow_links=True)
    return final.parent / f".{Path(os.path.abspath(final)).name}.s2s-partial"


def check_resumable(input: str, output: Optional[Path], unbuffered: bool = False) -> None:
    """--resume needs -o OUT and an input file that can be read again from its start."""
    if output is None:
        raise S2SError("--resume: needs -o OUT (the job's progress is kept beside OUT)")
    if input == "-":
        raise S2SError("--resume: needs an input file (-i FILE), not stdin: a resumed job reads its input again")
    if unbuffered:
        raise S2SError("--resume: not with --unbuffered (a resumable job is saved chunk by chunk)")
    if Path(input).is_dir():
        raise S2SError(f"{input}: is a directory, expected a text file")
    if not Path(input).is_file():
        raise S2SError(f"--resume: {input} is not a regular file (a pipe?); a resumed job reads its input again")
    if output.is_dir():
        raise S2SError(f"{output}: is a directory; -o names the output file")
    if writes_in_place(output):
        raise S2SError(f"--resume: {output} is not a regular file (a device, FIFO or descriptor); a resumable "
                       "job saves its progress beside the file it writes")


# --------------------------------------------------------------------------- #
# What the output depends on
def file_identity(path: Path) -> dict:
    """A file's size and the SHA-256 of its bytes (its lines, whatever its name or mtime)."""
    if not path.exists():
        raise S2SError(f"{path}: no such file")
    if path.is_dir():
        raise S2SError(f"{path}: is a directory, expected a text file")
    try:
        return {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
    except OSError as e:
        raise S2SError(f"{path}: cannot read ({e.strerror})") from None


def model_files(model: Path) -> list[Path]:
    """The files of a model directory, or of a training checkpoint RUN/checkpoints/step-N, that
    decide its translations, besides the weights: the record of the weights' SHA-256 (model.json,
    or the checkpoint's state.json; loading checks the weights against it), config.yaml, the
    tokenizer's files and the vocabulary shortlist (s2s.modeldir, s2s.checkpoint, s2s.shortlist)."""
    from s2s.config import load_config
    from s2s.modeldir import CONFIG, META
    from s2s.tokenizer import Tokenizer

    checkpoint = model.parent.name == "checkpoints"
    home = model.parent.parent if checkpoint else model  # its config and tokenizer
    files = [model / ("state.json" if checkpoint else META), home / CONFIG, home / "shortlist.safetensors"]
    with contextlib.suppress(S2SError, OSError):  # an unreadable config: loading the model names it
        cfg = load_config(home / CONFIG)
        files += Tokenizer.all_files(home, cfg.tokenizer, cfg.data)
    return files


def model_identity(model: str) -> str:
    """SHA-256 over the names and bytes of :func:`model_files` (those that exist)."""
    h = hashlib.sha256()
    for p in model_files(Path(os.path.abspath(model))):
        if p.is_file():
            h.update(f"{p.name}\0{file_sha256(p)}\0".encode())
    return h.hexdigest()


def job_identity(spec, input: Path, prefix_file: Optional[Path], chunk_lines: int, command: str) -> dict:
    """Everything the output depends on, as JSON values: the command, the s2s version, the
    input's (prefix file's, glossary's) bytes, each model's files, every setting of ``spec`` (a
    TranslatorSpec) but the threads, and the chunk size (it decides the batches)."""
    settings = {k: v for k, v in dataclasses.asdict(spec).items() if k not in NOT_OUTPUT_SETTINGS}
    glossary = spec.overrides.get("glossary")  # --glossary FILE (decode.glossary)
    job = {"s2s_version": __version__, "command": command, "input": file_identity(input),
           "prefix_file": None if prefix_file is None else file_identity(prefix_file),
           "glossary": None if not glossary else file_identity(Path(glossary)),  # its terms, not only its name
           "models": [model_identity(m) for m in spec.models], "settings": settings, "chunk_lines": chunk_lines}
    return json.loads(json.dumps(job, sort_keys=True, default=str))  # as state.json will give it back


def _show(value: Any) -> str:
    return "unset" if value is None else json.dumps(value)


def _then_now(old: Any, new: Any) -> str:
    return f"{_show(old)} then, {_show(new)} now"


def _file_change(what: str, old: Optional[dict], new: Optional[dict]) -> str:
    if old is None or new is None:
        return f"{what} was {'not ' if old is None else ''}given then and is{' not' if new is None else ''} now"
    if old.get("bytes") != new["bytes"] and isinstance(old.get("bytes"), int):
        return f"{what} changed ({old['bytes']:,} bytes then, {new['bytes']:,} now)"
    return f"{what} changed (the same size, other bytes)"


def job_change(saved: dict, now: dict, models: tuple[str, ...]) -> Optional[str]:
    """What differs between the job saved in state.json and this one, in words; None: nothing."""
    for key in [*JOB_KEYS, *(k for k in [*now, *saved] if k not in JOB_KEYS)]:
        old, new = saved.get(key), now.get(key)
        if old == new:
            continue
        if key == "input":
            return _file_change("the input file", old, new)
        if key == "prefix_file":
            return _file_change("--prefix-file", old, new)
        if key == "glossary":
            return _file_change("the glossary (--glossary)", old, new)
        if key == "models" and isinstance(old, list) and len(old) == len(new):
            i = next(i for i, (a, b) in enumerate(zip(old, new)) if a != b)
            return f"the model {models[i]} changed (its weights, config or tokenizer)"
        if key == "models":
            return f"the models (-m) changed ({len(old or [])} then, {len(new)} now)"
        if key == "settings" and isinstance(old, dict):
            return _settings_change(old, new)
        if key == "chunk_lines":
            return f"--chunk-lines changed ({_then_now(old, new)})"
        return f"the {key.replace('_', ' ')} changed ({_then_now(old, new)})"
    return None


def _settings_change(old: dict, new: dict) -> str:
    key = next(k for k in [*new, *old] if old.get(k) != new.get(k))
    name = SETTING_NAMES.get(key, f"the setting {key}")
    a, b = old.get(key), new.get(key)
    if isinstance(a, dict) and isinstance(b, dict):  # decode keys: name each one that differs
        keys = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        return f"{name} changed ({'; '.join(f'{k}: {_then_now(a.get(k), b.get(k))}' for k in keys)})"
    return f"{name} changed ({_then_now(a, b)})"


# --------------------------------------------------------------------------- #
# The progress on disk
class PartialOutput:
    """DIR/output.part and DIR/state.json, written by ``translate_stream`` as its output
    stream: ``write`` appends a chunk's text, ``chunk_done`` saves it (fsync, then the state)."""

    def __init__(self, directory: Path, job: dict, where: dict, lines_done: int = 0, bytes_done: int = 0):
        self.directory, self.job, self.where = directory, job, where
        self.lines_done, self.bytes_done = lines_done, bytes_done
        self.part = directory / PART
        try:
            self._file = open(self.part, "r+b" if bytes_done else "wb")
            self._file.truncate(bytes_done)  # a chunk written after the last save: translated again
            self._file.seek(bytes_done)
        except OSError as e:
            raise S2SError(f"{self.part}: cannot write ({os_reason(e, self.part)})") from None

    def write(self, text: str) -> None:
        try:
            self._file.write(text.encode("utf-8"))
        except OSError as e:
            raise S2SError(f"{self.part}: write failed ({os_reason(e, self.part)})") from None

    def flush(self) -> None:
        """Nothing: a chunk is on disk when :meth:`chunk_done` saves it."""

    def chunk_done(self, lines: int) -> None:
        """The chunk of ``lines`` lines just written is complete: make it durable, then count it."""
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as e:
            raise S2SError(f"{self.part}: write failed ({os_reason(e, self.part)})") from None
        self.lines_done += lines
        self.bytes_done = self._file.tell()
        self.save()

    def save(self, finished: bool = False) -> None:
        state = {"format": STATE_FORMAT, "job": self.job, "where": self.where, "lines_done": self.lines_done,
                 "bytes_done": self.bytes_done, "finished": finished}
        with atomic_write(self.directory / STATE) as f:
            json.dump(state, f, indent=1)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._file.close()

    def finish(self, output: Path) -> None:
        """Every chunk is saved: output.part becomes ``output``, the directory goes."""
        self._file.close()
        self.save(finished=True)
        _publish(self.part, output, self.directory)


def _publish(part: Path, output: Path, directory: Path) -> None:
    final = destination(output, follow_links=True)
    try:
        if (bits := mode_of(final)) is not None:
            os.chmod(part, bits)
        os.replace(part, final)
    except OSError as e:
        raise S2SError(f"{output}: write failed ({os_reason(e, output)})") from None
    _fsync_dir(final.parent)
    shutil.rmtree(directory, ignore_errors=True)


def read_state(directory: Path) -> Optional[dict]:
    """DIR/state.json, or None when there is none (a new job)."""
    path = directory / STATE
    if not path.exists():
        return None
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"format {state.get('format')}, this s2s reads {STATE_FORMAT}")
        int(state["lines_done"]), int(state["bytes_done"]), dict(state["job"])
        return state
    except (OSError, ValueError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
        raise S2SError(f"{path}: not a state this s2s can resume from ({e}); "
                       f"remove {directory} to start over") from None


def open_partial(directory: Path, output: Path, job: dict, where: dict,
                 models: tuple[str, ...]) -> Optional[PartialOutput]:
    """The saved progress of this job, or a new one; None when the last run had already
    finished (and stopped only before renaming output.part to ``output``: done now)."""
    state = read_state(directory)
    if state is None or (state["lines_done"] == 0 and not state.get("finished")):  # nothing done: begin
        partial = PartialOutput(directory, job, where)
        partial.save()
        return partial
    change = job_change(state["job"], job, models)
    if change is not None:
        raise S2SError(f"{output}: --resume: {change} since the run saved in {directory}; "
                       f"run the command as before, or remove {directory} to start over")
    part = directory / PART
    if state.get("finished"):
        if part.exists():
            _publish(part, output, directory)
        shutil.rmtree(directory, ignore_errors=True)
        log.info("%s: complete (the last run had finished)", output)
        return None
    size = part.stat().st_size if part.is_file() else -1
    if size < state["bytes_done"]:
        raise S2SError(f"{part}: {max(size, 0)} bytes, fewer than the {state['bytes_done']} its state "
                       f"records (damaged?); remove {directory} to start over")
    return PartialOutput(directory, job, where, state["lines_done"], state["bytes_done"])


def locked(directory: Path, output: Path) -> contextlib.AbstractContextManager[None]:
    """Hold an exclusive flock on DIR/lock (DIR created if need be): one job per output."""
    return pid_flock(directory / LOCK, f"{directory}: cannot write ({{reason}})",
                     f"{output}: another s2s job is writing it (PID {{pid}}); wait for it to end")


# --------------------------------------------------------------------------- #
def translate_resumable(spec, input: Path, output: Path, prefix_file: Optional[Path] = None,
                        errors: str = "strict", workers: int = 0, progress=None,
                        chunk_lines: Optional[int] = None, command: str = "translate") -> None:
    """Translate the file ``input`` into ``output`` as ``s2s.workers.translate_stream`` does
    (``spec``: a TranslatorSpec), saving the progress chunk by chunk in :func:`partial_dir`,
    so that the same call after a kill continues after the last saved chunk; ``output``
    appears, complete, at the end.  ``progress``: a TranslateProgress or None."""
    from s2s.workers import translate_stream

    chunk_lines = CHUNK_LINES if chunk_lines is None else chunk_lines
    if chunk_lines < 1:
        raise S2SError(f"--chunk-lines: {chunk_lines} is not a positive number")
    directory = partial_dir(output)
    job = job_identity(spec, input, prefix_file, chunk_lines, command)
    where = {"input": os.path.abspath(input), "output": os.path.abspath(output),
             "models": [os.path.abspath(m) for m in spec.models]}
    with locked(directory, output):
        try:
            partial = open_partial(directory, output, job, where, spec.models)
        except BaseException:
            if not (directory / STATE).exists():  # no job of ours there: leave nothing behind
                shutil.rmtree(directory, ignore_errors=True)
            raise
        if partial is None:
            return
        lines = read_lines(input, errors)
        prefixes = None if prefix_file is None else read_lines(prefix_file, errors)
        try:
            if partial.lines_done:
                log.info("%s: resuming after line %d (saved in %s)", output, partial.lines_done, directory)
                for stream in (lines, prefixes):  # read again, not translated again
                    if stream is not None:
                        collections.deque(itertools.islice(stream, partial.lines_done), maxlen=0)
                if progress is not None:
                    progress.resumed(partial.lines_done)
            translate_stream(spec, lines, partial, workers, False, prefixes, progress, chunk_lines,
                             first_line_no=partial.lines_done + 1, on_chunk=partial.chunk_done)
            partial.finish(output)
        except BaseException:
            partial.close()
            if partial.lines_done == 0:  # nothing to keep (a model that does not load, a bad option)
                shutil.rmtree(directory, ignore_errors=True)
            else:
                log.warning("%s: %d lines done, kept in %s; the same command continues from there",
                            output, partial.lines_done, directory)
            raise
