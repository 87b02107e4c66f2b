"""Reading text files and writing outputs so that nothing partial looks complete.

* ``read_lines`` decodes UTF-8 line by line (gzip when the name ends in .gz)
  and names the file and line of any invalid byte.
* ``atomic_write`` / ``atomic_dir``: write to a temporary name next to the
  target, fsync, then rename, so a crash leaves the previous version intact;
  ``atomic_dir`` never renames over a non-empty directory it was not told to replace.
  ``staged_files`` does the same for several files that appear together (the
  splits of ``s2s prepare``, the models of ``s2s tokenizer train``).  An output
  the user names (``-o``) is written through a symlink (the file it names
  replaced, the link kept); a device, FIFO or descriptor (``-o /dev/null``,
  ``-o /dev/stdout``) is written directly.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import hashlib
import os
import re
import shutil
import stat
import sys
import zlib
from pathlib import Path
from typing import IO, Iterable, Iterator, Sequence

from s2s.errors import S2SError


def resolve_corpus(prefix: str, lang: str) -> Path:
    """``{prefix}.{lang}``, or ``{prefix}.{lang}.gz`` when only that exists."""
    plain = Path(f"{prefix}.{lang}")
    if plain.exists():
        return plain
    gz = Path(f"{prefix}.{lang}.gz")
    if gz.exists():
        return gz
    raise S2SError(f"{plain}: no such file (nor {gz.name})")


def _open_binary(path: Path) -> IO[bytes]:
    if path.is_dir():
        raise S2SError(f"{path}: is a directory, expected a text file")
    try:
        if path.suffix == ".gz":
            return gzip.open(path, "rb")
        return open(path, "rb")
    except FileNotFoundError:
        raise S2SError(f"{path}: no such file") from None
    except PermissionError:
        raise S2SError(f"{path}: permission denied") from None


def decode_line(raw: bytes, where: str, lineno: int, errors: str = "strict") -> str:
    """One line of bytes -> str without its newline (nor, on line 1, a UTF-8 byte-order mark,
    which some editors put before a file's text); bad UTF-8 names file:line."""
    try:
        text = raw.decode("utf-8", errors=errors)
    except UnicodeDecodeError as e:
        raise S2SError(f"{where}:{lineno}: invalid UTF-8 (byte {e.start + 1} of the line)") from None
    if lineno == 1 and text.startswith("\ufeff"):
        text = text[1:]
    return text.rstrip("\n").rstrip("\r")


def iter_binary_lines(stream: Iterable[bytes], where: str) -> Iterator[bytes]:
    try:
        yield from stream
    except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
        raise S2SError(f"{where}: read error: {e}") from None


def read_lines(path: str | Path, errors: str = "strict") -> Iterator[str]:
    """Yield the lines of a UTF-8 text file (or ``-`` for stdin), newline stripped."""
    if str(path) == "-":
        for n, raw in enumerate(iter_binary_lines(sys.stdin.buffer, "<stdin>"), 1):
            yield decode_line(raw, "<stdin>", n, errors)
        return
    p = Path(path)
    with _open_binary(p) as f:
        for n, raw in enumerate(iter_binary_lines(f, str(p)), 1):
            yield decode_line(raw, str(p), n, errors)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def os_reason(e: OSError, path: Path) -> str:
    """Why a write failed, in words.  Some writers (numpy's tofile, a C fwrite) raise an
    OSError without errno ("6 requested and 0 written"): a full disk is then named as such."""
    if e.strerror:
        return e.strerror
    try:
        full = os.statvfs(path.parent).f_bavail == 0
    except (OSError, AttributeError):  # no statvfs (Windows) or the directory is gone
        full = False
    return os.strerror(errno.ENOSPC) if full else (str(e) or type(e).__name__)


# /dev/stdout, /dev/stderr, /dev/fd/N, /proc/PID/fd/N: an open descriptor, written through
_DESCRIPTOR = re.compile(r"/dev/(?P<std>stdout|stderr)|/dev/fd/(?P<fd>\d+)|/proc/(?P<pid>self|\d+)/fd/(?P<pfd>\d+)")


def _own_descriptor(path: Path) -> int | None:
    """The descriptor of this process that ``path`` names (/dev/stdout: 1), or None."""
    m = _DESCRIPTOR.fullmatch(os.path.abspath(path))
    if m is None or m["pid"] not in (None, "self", str(os.getpid())):
        return None
    return {"stdout": 1, "stderr": 2}[m["std"]] if m["std"] else int(m["fd"] or m["pfd"])


def writes_in_place(path: Path) -> bool:
    """``path`` is no file to replace but something to write into: a device (/dev/null), a
    FIFO, a socket, or an open descriptor (/dev/stdout, /dev/fd/N)."""
    if _DESCRIPTOR.fullmatch(os.path.abspath(path)):
        return True
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)


def destination(target: Path, follow_links: bool) -> Path:
    """The file that writing ``target`` replaces: with ``follow_links`` (an output the user named,
    as the shell's ``>`` does) the one a symlink there names, the link kept; else ``target``
    itself, a symlink there replaced by the file (s2s's own files: a link into a model directory
    is never written through)."""
    if not (follow_links and target.is_symlink()):
        return target
    final = Path(os.path.realpath(target))
    if not final.parent.is_dir():
        raise S2SError(f"{target}: cannot write (its link names {final}, in no existing directory)")
    return final


def mode_of(path: Path) -> int | None:
    """The permission bits of the file at ``path`` (a 0600 output stays 0600), or None."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode) & 0o777
    except OSError:
        return None


class StagedFiles:
    """Files written under temporary names and renamed into place together (:func:`staged_files`)."""

    def __init__(self) -> None:
        self._temporaries: list[Path] = []  # every one opened, to delete if the set fails
        self._ready: list[tuple[Path, Path, Path]] = []  # (temporary, file it replaces, name given)

    @contextlib.contextmanager
    def open(self, path: str | Path, mode: str = "w", follow_links: bool = False) -> Iterator[IO]:
        """Write ``.NAME.tmp-PID`` beside ``path``, fsynced when the block ends; it becomes ``path``
        (:func:`destination`) when the set is published, with the permission bits of the file it
        replaces.  A device, FIFO or descriptor is written directly."""
        target = Path(path)
        encoding = None if "b" in mode else "utf-8"
        if writes_in_place(target):
            yield from _write_in_place(target, mode, encoding)
            return
        if target.is_dir():
            raise S2SError(f"{target}: is a directory")
        final = destination(target, follow_links)
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
        if tmp in self._temporaries:  # two names of one file (links): the second would truncate the first
            raise S2SError(f"{target}: written twice in one set of outputs (through a symlink?)")
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            f = open(tmp, mode, encoding=encoding)
        except OSError as e:
            raise S2SError(f"{target}: cannot write ({e.strerror})") from None
        self._temporaries.append(tmp)
        try:
            with f:
                if (bits := mode_of(final)) is not None:
                    os.chmod(f.fileno(), bits)
                yield f
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise S2SError(f"{target}: write failed ({os_reason(e, target)})") from None
        self._ready.append((tmp, final, target))

    def publish(self) -> None:
        """Rename the written files into place in the order they were opened.  With several, the
        last marks the set complete (meta.json, tokenizer.json): its old copy goes first, so a
        stop midway never leaves an old marker beside new files."""
        if len(self._ready) > 1:
            self._ready[-1][1].unlink(missing_ok=True)
        for tmp, final, target in self._ready:
            try:
                os.replace(tmp, final)
            except OSError as e:
                raise S2SError(f"{target}: write failed ({os_reason(e, target)})") from None
        for directory in dict.fromkeys(final.parent for _, final, _ in self._ready):
            _fsync_dir(directory)

    def discard(self) -> None:
        for tmp in self._temporaries:
            tmp.unlink(missing_ok=True)


def _write_in_place(target: Path, mode: str, encoding: str | None) -> Iterator[IO]:
    """Write into ``target`` as it is; one of this process's descriptors is written through a
    copy of it (reopening /dev/stdout would truncate a file the shell opened with ``>>``).
    A reader gone (a pipe) is a BrokenPipeError, as on stdout: no error of ours."""
    fd = _own_descriptor(target)
    try:
        f = open(target if fd is None else os.dup(fd), mode, encoding=encoding)
    except OSError as e:
        raise S2SError(f"{target}: cannot write ({e.strerror})") from None
    try:
        with f:
            yield f
            f.flush()
    except BrokenPipeError:
        raise
    except OSError as e:
        raise S2SError(f"{target}: write failed ({os_reason(e, target)})") from None


@contextlib.contextmanager
def staged_files() -> Iterator[StagedFiles]:
    """Write several files that appear together: each opened with ``staged.open(path)`` is
    renamed into place only when the whole block completes, so a failure or a stop anywhere
    leaves every earlier file as it was, and no temporary behind."""
    staged = StagedFiles()
    try:
        yield staged
        staged.publish()
    finally:
        staged.discard()


@contextlib.contextmanager
def atomic_write(path: str | Path, mode: str = "w", follow_links: bool = False) -> Iterator[IO]:
    """Open ``.NAME.tmp-PID`` beside ``path`` for writing; on success fsync and rename it over
    ``path`` (a staged set of one: :class:`StagedFiles`; ``follow_links``: an output the user
    named, written through a symlink as the shell's ``>`` does)."""
    with staged_files() as staged, staged.open(path, mode, follow_links) as f:
        yield f


@contextlib.contextmanager
def atomic_dir(path: str | Path, replace: bool = False) -> Iterator[Path]:
    """Fill a temporary directory; on success rename it to ``path``.

    ``path`` (or the directory a symlink there names) must not exist or be an empty directory: the final rename itself
    refuses a non-empty one, so nothing that appears there meanwhile is lost.
    ``replace=True`` is for a caller that has checked that the directory is its
    own to replace (s2s.outdir.check_output_dir, a run's own checkpoint): the
    old one is moved aside, the new one renamed in, then the old one deleted.
    """
    target = Path(path)
    # through a symlink, the directory it names (the link kept); "." and ".." get their names
    where = Path(os.path.realpath(target))
    if not replace and where.exists() and not is_empty_dir(where):
        raise S2SError(f"{target}: exists and is not empty; not replaced")
    tmp = where.with_name(f".{where.name}.tmp-{os.getpid()}")
    old = where.with_name(f".{where.name}.old-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
    except OSError as e:
        raise S2SError(f"{target}: cannot write ({e.strerror})") from None

    def clean_up() -> None:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not where.exists():  # stopped between the two renames: the old one back
            os.replace(old, where)

    try:
        yield tmp
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if replace and where.exists():
            os.replace(where, old)
            os.replace(tmp, where)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, where)  # ENOTEMPTY / ENOTDIR: something else is there now; kept
        _fsync_dir(where.parent)
    except OSError as e:
        clean_up()
        raise S2SError(f"{target}: write failed ({e.strerror})") from None
    except BaseException:
        clean_up()
        raise


def is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def count_lines(path: str | Path) -> int:
    """The lines ``read_lines(path)`` yields (a last line without its newline counts),
    counted in 1 MiB blocks without decoding them (gzip: decompressed)."""
    n, last = 0, b"\n"
    with _open_binary(Path(path)) as f:
        for block in iter_binary_lines(iter(lambda: f.read(1 << 20), b""), str(path)):
            n += block.count(b"\n")
            last = block[-1:]
    return n + (last != b"\n")


def line_numbers(first_line_no: int | Sequence[int], n: int) -> Sequence[int]:
    """Each of ``n`` lines' number: first_line_no, first_line_no + 1, ... or the ones given."""
    return range(first_line_no, first_line_no + n) if isinstance(first_line_no, int) else first_line_no
