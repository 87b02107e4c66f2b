"""Reading text files and writing outputs so that nothing partial looks complete.

* ``read_lines`` decodes UTF-8 line by line (gzip when the name ends in .gz)
  and names the file and line of any invalid byte.
* ``atomic_write`` / ``atomic_dir``: write to a temporary name next to the
  target, fsync, then rename, so a crash leaves the previous version intact;
  ``atomic_dir`` never renames over a non-empty directory it was not told to replace.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import hashlib
import os
import shutil
import sys
from pathlib import Path
from typing import IO, Iterator, Sequence

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
    """One line of bytes -> str without its newline; bad UTF-8 names file:line."""
    try:
        text = raw.decode("utf-8", errors=errors)
    except UnicodeDecodeError as e:
        raise S2SError(f"{where}:{lineno}: invalid UTF-8 (byte {e.start + 1} of the line)") from None
    return text.rstrip("\n").rstrip("\r")


def iter_binary_lines(stream: IO[bytes], where: str) -> Iterator[bytes]:
    try:
        yield from stream
    except (OSError, EOFError, gzip.BadGzipFile) as e:
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


@contextlib.contextmanager
def atomic_write(path: str | Path, mode: str = "w") -> Iterator[IO]:
    """Open ``path.tmp-PID`` for writing; on success fsync and rename over ``path``."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        f = open(tmp, mode, encoding=None if "b" in mode else "utf-8")
    except OSError as e:
        raise S2SError(f"{target}: cannot write ({e.strerror})") from None
    try:
        with f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        _fsync_dir(target.parent)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise S2SError(f"{target}: write failed ({os_reason(e, target)})") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_dir(path: str | Path, replace: bool = False) -> Iterator[Path]:
    """Fill a temporary directory; on success rename it to ``path``.

    ``path`` must not exist or be an empty directory: the final rename itself
    refuses a non-empty one, so nothing that appears there meanwhile is lost.
    ``replace=True`` is for a caller that has checked that the directory is its
    own to replace (s2s.outdir.check_output_dir, a run's own checkpoint): the
    old one is moved aside, the new one renamed in, then the old one deleted.
    """
    target = Path(path)
    where = Path(os.path.abspath(target))  # "." and ".." have no name to put beside them
    if not replace and (target.is_symlink() or (target.exists() and not is_empty_dir(target))):
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
        if replace and target.exists():
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
        for block in iter(lambda: f.read(1 << 20), b""):
            n += block.count(b"\n")
            last = block[-1:]
    return n + (last != b"\n")


def line_numbers(first_line_no: int | Sequence[int], n: int) -> Sequence[int]:
    """Each of ``n`` lines' number: first_line_no, first_line_no + 1, ... or the ones given."""
    return range(first_line_no, first_line_no + n) if isinstance(first_line_no, int) else first_line_no
