"""Resumable bulk jobs (s2s.bulk, `translate --resume`) and the progress bar's ETA.

A job killed with SIGKILL (one process, and --workers 2) and run again with the same
command ends with the same bytes as an uninterrupted run; a changed input, model or
setting is one error line naming it; OUT appears only complete.
"""

import fcntl
import gzip
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from s2s.bulk import partial_dir
from s2s.textio import count_lines, read_lines
from s2s.workers import TranslateProgress, eta_seconds, format_duration, progress_bar
from tests.test_bad_inputs import cli

# random weights never stop on their own: cap the outputs
CAP = ["--device", "cpu", "--threads", "1", "--max-len-a", "0", "--max-len-b", "8"]


def _model(prepared, directory: Path, seed: int) -> Path:
    import torch

    from s2s.config import load_config
    from s2s.modeldir import build_model, save_model_dir
    from s2s.tokenizer import Tokenizer

    cfg = load_config(prepared)
    tok = Tokenizer.load(cfg.data.dir, cfg.tokenizer, cfg.data)
    torch.manual_seed(seed)
    save_model_dir(directory, build_model(cfg, tok), cfg, Path(cfg.data.dir), {"step": 0})
    return directory


@pytest.fixture(scope="module")
def models(prepared, tmp_path_factory):
    """Two untrained model directories of the tiny config (different weights)."""
    d = tmp_path_factory.mktemp("bulk")
    return _model(prepared, d / "model", 0), _model(prepared, d / "other", 1)


@pytest.fixture(scope="module")
def src(corpus, tmp_path_factory) -> Path:
    """1,200 lines: the corpus's 400 training sources three times, with empty lines among them."""
    lines = (corpus / "train.en").read_text(encoding="utf-8").splitlines()[:400] * 3
    for i in range(0, len(lines), 37):
        lines[i] = ""
    path = tmp_path_factory.mktemp("bulk-src") / "big.en"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def s2s(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "s2s", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def reference(models, src, tmp_path_factory) -> bytes:
    """An uninterrupted run without --resume."""
    out = tmp_path_factory.mktemp("bulk-ref") / "plain.de"
    r = s2s("translate", "-m", models[0], "-i", src, "-o", out, "--workers", 1, *CAP)
    assert r.returncode == 0, r.stderr
    return out.read_bytes()


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def run_and_kill(args, partial: Path, after_lines: int, log: Path) -> tuple[int, list[int]]:
    """Start `s2s ARGS`; SIGKILL it (it alone, as `kill -9 PID`) once its saved state counts
    ``after_lines`` lines.  Returns the lines its state counts after the kill (a chunk or two
    more may land between the look and the kill) and the processes it had started."""
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "s2s", *map(str, args)], stdout=subprocess.DEVNULL,
                                stderr=err)
    try:
        deadline = time.time() + 240
        while time.time() < deadline:
            assert proc.poll() is None, f"it ended before the kill:\n{log.read_text()}"
            try:
                done = json.loads((partial / "state.json").read_text())["lines_done"]
            except (OSError, ValueError, KeyError):
                done = 0
            if done >= after_lines:
                children = _children(proc.pid)
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
                return json.loads((partial / "state.json").read_text())["lines_done"], children
            time.sleep(0.01)
        pytest.fail(f"no {after_lines} lines saved in 240 s:\n{log.read_text()}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("workers", [1, 2])
def test_a_killed_job_continues_to_the_bytes_of_an_uninterrupted_run(models, src, reference, tmp_path, workers):
    out = tmp_path / "out.de"
    out.write_text("an earlier version\n")
    args = ["translate", "-m", models[0], "-i", src, "-o", out, "--resume", "--chunk-lines", 8,
            "--workers", workers, *CAP]
    partial = partial_dir(out)
    done, children = run_and_kill(args, partial, 40, tmp_path / "killed.log")
    assert 40 <= done < 1200
    assert out.read_text() == "an earlier version\n"  # OUT appears only complete
    state = json.loads((partial / "state.json").read_text())
    assert state["lines_done"] == done and state["lines_done"] % 8 == 0
    assert (partial / "output.part").stat().st_size >= state["bytes_done"]
    if workers > 1:  # the workers notice that the parent is gone, and end
        assert len(children) >= 2
        deadline = time.time() + 60
        while any(_running(c) for c in children) and time.time() < deadline:
            time.sleep(0.2)
        assert not any(_running(c) for c in children), "orphaned workers"
    r = s2s(*args)
    assert r.returncode == 0, r.stderr
    assert f"{out}: resuming after line {done}" in r.stderr
    assert out.read_bytes() == reference
    assert not partial.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["killed.log", "out.de"]


def test_an_uninterrupted_resumable_run_writes_what_a_plain_run_writes(models, src, reference, tmp_path):
    out = tmp_path / "sub" / "out.de"  # its folder is created, as -o does
    r = s2s("translate", "-m", models[0], "-i", src, "-o", out, "--resume", "--workers", 1, *CAP)
    assert r.returncode == 0, r.stderr
    assert out.read_bytes() == reference
    assert os.listdir(out.parent) == ["out.de"]


# --------------------------------------------------------------------------- #
def error_line(result) -> str:
    """The one ``s2s: error:`` line of a run of :func:`tests.test_bad_inputs.cli` that exited 1."""
    code, _, err = result
    assert code == 1 and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("s2s: error: "), err
    return last


def test_a_changed_job_is_refused_naming_what_changed(models, corpus, tmp_path, capsys, monkeypatch, caplog):
    """A job stopped by a bad line (--errors strict) keeps its saved chunks; rerun with anything
    changed, it stops naming what; with --errors replace (nothing translated differs) it goes on
    to the bytes of an uninterrupted run.  N-best rows and a prefix file continue their numbering."""
    m = tmp_path / "m"
    shutil.copytree(models[0], m)
    lines = [f"line {i} of the input" for i in range(1, 61)]
    src = tmp_path / "in.en"
    src.write_bytes("\n".join(lines[:29]).encode() + b"\n\xff bad\n" + "\n".join(lines[30:]).encode() + b"\n")
    prefixes = tmp_path / "prefix.de"
    prefixes.write_text("".join("Die\n" if i % 7 == 0 else "\n" for i in range(60)))
    out = tmp_path / "out.de"
    partial = partial_dir(out)
    job = ["-m", m, "-i", src, "-o", out, "--resume", "--chunk-lines", 8, "--nbest", 2, "--workers", 1,
           "--prefix-file", prefixes, *CAP]

    code, _, err = cli(capsys, monkeypatch, "translate", *job)
    assert code == 1 and f"{src}:30: invalid UTF-8" in err.strip().splitlines()[-1], err
    assert f"{out}: 24 lines done, kept in {partial}; the same command continues" in caplog.text  # s2s: ...
    assert not out.exists() and json.loads((partial / "state.json").read_text())["lines_done"] == 24

    start_over = f"since the run saved in {partial}; run the command as before, or remove {partial} to start over"
    changed = {
        "the decode settings changed (beam: unset then, 3 now)": ["translate", *job, "--beam", 3],
        "the command changed (\"translate\" then, \"summarize\" now)": ["summarize", *job],
        "--chunk-lines changed (8 then, 4 now)": ["translate", *job, "--chunk-lines", 4],
        "--precision changed (\"fp32\" then, \"bf16\" now)": ["translate", *job, "--precision", "bf16"],
        "--prefix-file was given then and is not now": ["translate", *job[:-len(CAP) - 2], *CAP],
    }
    for what, args in changed.items():
        assert error_line(cli(capsys, monkeypatch, *args)) == f"s2s: error: {out}: --resume: {what} {start_over}"
    fixed = tmp_path / "fixed.en"
    fixed.write_bytes(src.read_bytes().replace(b"\xff", b"X"))
    os.replace(fixed, src)
    assert error_line(cli(capsys, monkeypatch, "translate", *job)).startswith(
        f"s2s: error: {out}: --resume: the input file changed (the same size, other bytes) {start_over}")
    src.write_bytes(src.read_bytes().replace(b"X", b"\xff"))  # back as it was
    shutil.copytree(models[1], m, dirs_exist_ok=True)  # the model retrained in place
    assert error_line(cli(capsys, monkeypatch, "translate", *job)) == (
        f"s2s: error: {out}: --resume: the model {m} changed (its weights, config or tokenizer) {start_over}")
    shutil.copytree(models[0], m, dirs_exist_ok=True)

    code, _, err = cli(capsys, monkeypatch, "translate", *job, "--errors", "replace")
    assert code == 0, err
    assert f"{out}: resuming after line 24" in caplog.text and not partial.exists()
    whole = tmp_path / "whole.de"
    code, _, err = cli(capsys, monkeypatch, "translate", *[whole if a == out else a for a in job],
                       "--errors", "replace")
    assert code == 0, err
    assert out.read_bytes() == whole.read_bytes()
    rows = out.read_text().splitlines()
    assert [int(row.split(" ||| ")[0]) for row in rows] == [i for i in range(60) for _ in range(2)]


def test_resume_needs_an_output_and_an_input_file(models, src, tmp_path, capsys, monkeypatch):
    m = ["translate", "-m", models[0]]
    out = tmp_path / "out.de"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    cases = {
        "--resume: needs -o OUT (the job's progress is kept beside OUT)": [*m, "-i", src, "--resume"],
        "--resume: needs an input file (-i FILE), not stdin": [*m, "-o", out, "--resume"],
        "--resume: not with --unbuffered": [*m, "-i", src, "-o", out, "--resume", "--unbuffered"],
        f"--resume: {fifo} is not a regular file (a pipe?)": [*m, "-i", fifo, "-o", out, "--resume"],
        f"{tmp_path}: is a directory; -o names the output file": [*m, "-i", src, "-o", tmp_path, "--resume"],
        "--chunk-lines: only with --resume": [*m, "-i", src, "-o", out, "--chunk-lines", 5],
    }
    for needle, args in cases.items():
        assert needle in error_line(cli(capsys, monkeypatch, *args))
    assert sorted(os.listdir(tmp_path)) == ["fifo"]


def test_a_model_that_does_not_load_leaves_nothing(src, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out.de"
    line = error_line(cli(capsys, monkeypatch, "translate", "-m", tmp_path / "nope", "-i", src, "-o", out,
                          "--resume", *CAP))
    assert "nope" in line
    assert os.listdir(tmp_path) == []


def test_two_jobs_on_one_output(models, src, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out.de"
    partial = partial_dir(out)
    partial.mkdir()
    fd = os.open(partial / "lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, b"4242\n")
        line = error_line(cli(capsys, monkeypatch, "translate", "-m", models[0], "-i", src, "-o", out,
                              "--resume", *CAP))
    finally:
        os.close(fd)
    assert line == f"s2s: error: {out}: another s2s job is writing it (PID 4242); wait for it to end"
    assert not out.exists()


# --------------------------------------------------------------------------- #
def test_eta_and_duration_follow_their_formulas():
    assert eta_seconds(250, 1000, 50.0) == (1000 - 250) / 50.0
    assert eta_seconds(0, 1000, 0.0) is None
    assert format_duration(3725) == "1:02:05" and format_duration(65) == "1:05" and format_duration(0) == "0:00"
    assert progress_bar(5, 20, width=4) == "\u2588" + "\u2591" * 3 and progress_bar(20, 20, width=4) == "\u2588" * 4


@pytest.mark.parametrize("content", [b"", b"one", b"one\ntwo\n", b"one\n\n\nfour", b"\n"])
def test_count_lines_counts_what_read_lines_yields(tmp_path, content):
    plain, packed = tmp_path / "a.txt", tmp_path / "a.txt.gz"
    plain.write_bytes(content)
    packed.write_bytes(gzip.compress(content))
    assert count_lines(plain) == count_lines(packed) == len(list(read_lines(plain)))


def test_progress_shows_a_bar_and_an_eta_on_a_terminal_only(tmp_path):
    from rich.console import Console

    src = tmp_path / "in.txt"
    src.write_text("x\n" * 40)
    tty = io.StringIO()
    progress = TranslateProgress(Console(file=tty, force_terminal=True))
    progress.count_lines_of(src)
    deadline = time.time() + 30
    while progress.total is None and time.time() < deadline:
        time.sleep(0.01)
    progress.resumed(10)
    progress.add(5, 20)
    assert progress.total == 40 and progress.lines == 15
    text = progress.text()
    assert " 15/40 lines (37%) | " in text and "lines/s" in text and "| ETA " in text
    progress.close()
    assert "15/40 lines" in tty.getvalue()
    quiet = TranslateProgress(Console(file=io.StringIO(), force_terminal=False))
    quiet.count_lines_of(src)
    time.sleep(0.1)
    assert quiet.total is None  # nothing shown, nothing counted
    quiet.close()


def test_progress_on_a_pipe_needs_no_console(monkeypatch):
    """stderr not a terminal (here: captured): no console is made (rich is not imported for it),
    and counting and closing still work; FORCE_COLOR makes one, as rich would draw then."""
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.delenv("TTY_COMPATIBLE", raising=False)
    monkeypatch.delenv("TTY_INTERACTIVE", raising=False)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    quiet = TranslateProgress()
    assert quiet.console is None
    quiet.add(3, 9)
    assert quiet.lines == 3 and "3 lines" in quiet.text()
    quiet.close()
    monkeypatch.setenv("FORCE_COLOR", "1")
    assert TranslateProgress().console is not None


def test_a_job_is_its_glossary_s_terms_not_only_its_name(models, src, tmp_path):
    from s2s.bulk import job_change, job_identity
    from s2s.workers import TranslatorSpec

    glossary = tmp_path / "terms.tsv"
    glossary.write_text("port scanner\tPortscanner\n")
    spec = TranslatorSpec((str(models[0]),), {"glossary": str(glossary)}, device="cpu")
    before = job_identity(spec, src, None, 8, "translate")
    assert job_change(before, job_identity(spec, src, None, 8, "translate"), spec.models) is None
    old_size = glossary.stat().st_size
    glossary.write_text("port scanner\tPort-Scanner\n")
    assert job_change(before, job_identity(spec, src, None, 8, "translate"), spec.models) == (
        f"the glossary (--glossary) changed ({old_size} bytes then, {old_size + 1} now)")


def test_how_torch_is_imported_is_not_part_of_a_job(models, src):
    """TranslatorSpec.lean_torch (the CLI's own process imports torch lean) changes no output: a job
    saved by the library, or before the field existed, resumes under the CLI."""
    from s2s.bulk import job_change, job_identity
    from s2s.workers import TranslatorSpec

    library = job_identity(TranslatorSpec((str(models[0]),), device="cpu"), src, None, 8, "translate")
    cli_spec = TranslatorSpec((str(models[0]),), device="cpu", lean_torch=True)
    cli = job_identity(cli_spec, src, None, 8, "translate")
    assert job_change(library, cli, cli_spec.models) is None
    older = {**library, "settings": {k: v for k, v in library["settings"].items() if k != "lean_torch"}}
    assert job_change(older, cli, cli_spec.models) is None
