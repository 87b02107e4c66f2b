"""What a command writes never destroys what is there (README "Bad inputs, failures and what is
kept"): outputs that are not files (a FIFO, /dev/stdout), symlinks and permissions, outputs that
are inputs, several files that appear together, and directories that belong to a model."""

import os
import shutil
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from s2s.config import load_config
from s2s.errors import S2SError
from s2s.textio import atomic_dir, atomic_write, staged_files, writes_in_place
from tests.conftest import TINY_YAML, untrained_model_dir
from tests.test_bad_inputs import assert_error, cli, cli_ok


@pytest.fixture(scope="module")
def model(prepared, tmp_path_factory) -> Path:
    return untrained_model_dir(prepared, tmp_path_factory.mktemp("safety") / "model")


def _own_config(corpus: Path, tmp_path: Path) -> Path:
    """The tiny config with data.dir in ``tmp_path``, its tokenizer trained and data prepared."""
    from s2s.data import prepare
    from s2s.tokenizer import train_tokenizer

    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY_YAML.format(d=corpus).replace(f"{corpus}/prep", f"{tmp_path}/prep"))
    c = load_config(cfg)
    train_tokenizer(c.tokenizer, c.data, seed=c.seed)
    prepare(c, workers=1)
    return cfg


def _snapshot(d: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


# --------------------------------------------------------------------------- #
# What an output path names
# --------------------------------------------------------------------------- #

def test_a_fifo_or_a_descriptor_is_written_not_replaced(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    with atomic_write(fifo) as f:
        f.write("through the pipe\n")
    reader.join(10)
    assert got == [b"through the pipe\n"] and stat.S_ISFIFO(os.lstat(fifo).st_mode)
    r, w = os.pipe()
    with atomic_write(f"/dev/fd/{w}") as f:  # -o /dev/stdout, -o >(gzip > x.gz)
        f.write("through a descriptor\n")
    os.close(w)
    assert os.read(r, 100) == b"through a descriptor\n"
    os.close(r)
    assert not [p for p in tmp_path.iterdir() if p.name != "fifo"]


def test_dev_stdout_appends_where_the_shell_appends(model, tmp_path):
    """`-o /dev/stdout >> log`: written through the shell's descriptor, not a reopened (truncated) file."""
    log = tmp_path / "log"
    log.write_text("an earlier line\n")
    (tmp_path / "in.txt").write_text("Clipboard management\nport scanner\n")
    subprocess.run(f"{sys.executable} -m s2s translate -m {model} -i {tmp_path / 'in.txt'} -o /dev/stdout >> {log}",
                   shell=True, check=True, timeout=300)
    lines = log.read_text().splitlines()
    assert lines[0] == "an earlier line" and len(lines) == 3


def test_devices_and_descriptors_are_written_in_place():
    assert writes_in_place(Path(os.devnull)) and writes_in_place(Path("/dev/stdout"))
    assert writes_in_place(Path("/proc/self/fd/1")) and not writes_in_place(Path("/dev/shm/out.txt"))


def test_a_symlink_output_replaces_the_file_it_names_with_its_permissions(tmp_path):
    target = tmp_path / "secret.txt"
    target.write_text("old\n")
    target.chmod(0o600)
    link = tmp_path / "link.txt"
    link.symlink_to(target.name)
    with atomic_write(link, follow_links=True) as f:  # -o LINK, as the shell's > LINK
        f.write("new\n")
    assert link.is_symlink() and target.read_text() == "new\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.txt", "secret.txt"]
    with atomic_write(link) as f:  # s2s's own file: the link is replaced, what it named untouched
        f.write("own\n")
    assert not link.is_symlink() and link.read_text() == "own\n" and target.read_text() == "new\n"


def test_one_file_twice_in_a_set_is_refused(tmp_path):
    (tmp_path / "a").write_text("old")
    (tmp_path / "b").symlink_to("a")
    with pytest.raises(S2SError, match="written twice in one set"):
        with staged_files() as staged:
            with staged.open(tmp_path / "a") as f:
                f.write("1")
            with staged.open(tmp_path / "b", follow_links=True) as f:
                f.write("2")
    assert (tmp_path / "a").read_text() == "old" and sorted(os.listdir(tmp_path)) == ["a", "b"]


def test_resume_through_a_symlink_and_not_into_a_fifo(model, tmp_path, capsys, monkeypatch):
    src = tmp_path / "in.txt"
    src.write_text("Clipboard management\nport scanner\n")
    (tmp_path / "real.txt").write_text("old\n")
    (tmp_path / "link.txt").symlink_to("real.txt")
    cli_ok(capsys, monkeypatch, "translate", "-m", model, "-i", src, "-o", tmp_path / "link.txt", "--resume")
    assert (tmp_path / "link.txt").is_symlink() and len((tmp_path / "real.txt").read_text().splitlines()) == 2
    os.mkfifo(tmp_path / "fifo")
    assert_error(cli(capsys, monkeypatch, "translate", "-m", model, "-i", src, "-o", tmp_path / "fifo", "--resume"),
                 "--resume:", "is not a regular file")
    assert stat.S_ISFIFO(os.lstat(tmp_path / "fifo").st_mode)
    assert sorted(os.listdir(tmp_path)) == ["fifo", "in.txt", "link.txt", "real.txt"]


def test_a_file_named_dash(model, tmp_path, capsys, monkeypatch):
    (tmp_path / "in.txt").write_text("Clipboard management\n")
    monkeypatch.chdir(tmp_path)
    out, _ = cli_ok(capsys, monkeypatch, "translate", "-m", model, "-i", "in.txt", "-o", "./-")
    assert out == "" and len((tmp_path / "-").read_text().splitlines()) == 1


def test_a_directory_output_is_refused_before_any_work(tmp_path):
    with pytest.raises(S2SError, match="is a directory"):
        with atomic_write(tmp_path):
            raise AssertionError("the block ran")


def test_atomic_dir_through_a_symlink_keeps_the_link_and_leaves_nothing(tmp_path):
    (tmp_path / "avg").mkdir()
    (tmp_path / "avg" / "old").write_text("x")
    (tmp_path / "link").symlink_to("avg")
    with atomic_dir(tmp_path / "link", replace=True) as tmp:
        (tmp / "new").write_text("y")
    assert (tmp_path / "link").is_symlink() and sorted(os.listdir(tmp_path / "avg")) == ["new"]
    assert sorted(os.listdir(tmp_path)) == ["avg", "link"]
    (tmp_path / "empty").mkdir()
    (tmp_path / "to-empty").symlink_to("empty")
    with atomic_dir(tmp_path / "to-empty") as tmp:  # an empty directory through a link is empty
        (tmp / "f").write_text("z")
    assert (tmp_path / "empty" / "f").read_text() == "z"


def test_staged_files_appear_together_or_not_at_all(tmp_path):
    for name in ("a", "b", "meta.json"):
        (tmp_path / name).write_text(f"old {name}")
    with pytest.raises(RuntimeError):
        with staged_files() as staged:
            with staged.open(tmp_path / "a") as f:
                f.write("new a")
            with staged.open(tmp_path / "b") as f:
                f.write("new b")
                raise RuntimeError("stopped while writing b")
    assert _snapshot(tmp_path) == {n: f"old {n}".encode() for n in ("a", "b", "meta.json")}
    with staged_files() as staged:
        for name in ("a", "b", "meta.json"):
            with staged.open(tmp_path / name) as f:
                f.write(f"new {name}")
    assert _snapshot(tmp_path) == {n: f"new {n}".encode() for n in ("a", "b", "meta.json")}


# --------------------------------------------------------------------------- #
# Outputs that are inputs
# --------------------------------------------------------------------------- #

@pytest.mark.parametrize("option", ["-i", "--prefix-file", "--glossary"])
def test_translate_never_writes_over_what_it_reads(model, tmp_path, capsys, monkeypatch, option):
    src = tmp_path / "in.txt"
    src.write_text("Clipboard management\n")
    other = tmp_path / "other.txt"
    other.write_text("Clipboard\tZwischenablage\n" if option == "--glossary" else "Die\n")
    read = src if option == "-i" else other
    args = ["-i", src] + ([] if option == "-i" else [option, other])
    before = read.read_bytes()
    for resume in ([], ["--resume"]):
        assert_error(cli(capsys, monkeypatch, "translate", "-m", model, *args, "-o", read, *resume),
                     f"{read}: is the", "choose another -o")
        assert read.read_bytes() == before


def test_stdin_is_read_once(model, tmp_path, capsys, monkeypatch):
    prefixes = tmp_path / "p.txt"
    prefixes.write_text("Die\n")
    for option in ("--prefix-file", "--glossary"):
        assert_error(cli(capsys, monkeypatch, "translate", "-m", model, option, "-"),
                     f"{option}: - is stdin, which the input (-i -) reads")


def test_dash_output_is_stdout(model, tmp_path, capsys, monkeypatch):
    src = tmp_path / "in.txt"
    src.write_text("Clipboard management\nport scanner\n")
    monkeypatch.chdir(tmp_path)
    out, _ = cli_ok(capsys, monkeypatch, "translate", "-m", model, "-i", src, "-o", "-")
    assert len(out.splitlines()) == 2 and not (tmp_path / "-").exists()


def test_plot_replaces_a_png_and_nothing_else(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    metrics = '{"step": 1, "loss": 5.0, "lr": 0.001}\n{"step": 2, "loss": 4.0, "lr": 0.002}\n'
    (run / "metrics.jsonl").write_text(metrics)
    assert_error(cli(capsys, monkeypatch, "plot", run, "-o", run / "metrics.jsonl"),
                 "metrics.jsonl: exists and is not a PNG image; not replaced")
    assert (run / "metrics.jsonl").read_text() == metrics
    cli_ok(capsys, monkeypatch, "plot", run, "-o", tmp_path / "c.png")
    cli_ok(capsys, monkeypatch, "plot", run, "-o", tmp_path / "c.png")  # an earlier plot: replaced
    assert (tmp_path / "c.png").read_bytes().startswith(b"\x89PNG")


def test_distill_never_writes_over_a_corpus_of_the_config(corpus, model, tmp_path, capsys, monkeypatch):
    shutil.copytree(corpus, tmp_path / "c", ignore=shutil.ignore_patterns("prep", "*.yaml"))
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY_YAML.format(d=tmp_path / "c"))
    before = _snapshot(tmp_path / "c")
    for split in ("train", "dev"):
        prefix = tmp_path / "c" / split
        assert_error(cli(capsys, monkeypatch, "distill", cfg, "-m", model, "-o", prefix),
                     f"{prefix}: is the prefix of data.{split}")
    assert _snapshot(tmp_path / "c") == before


# --------------------------------------------------------------------------- #
# Several files that appear together: prepare, tokenizer train
# --------------------------------------------------------------------------- #

def test_a_failed_prepare_keeps_the_earlier_prepared_data(corpus, tmp_path, capsys, monkeypatch):
    import s2s.data

    cfg = _own_config(corpus, tmp_path)
    before = _snapshot(tmp_path / "prep")
    real = s2s.data.prepare_split

    def second_split_fails(pairs, rules, tok, staged, out, split, *args):
        if split == "dev":
            raise KeyboardInterrupt
        return real(pairs, rules, tok, staged, out, split, *args)

    monkeypatch.setattr(s2s.data, "prepare_split", second_split_fails)
    code, _, err = cli(capsys, monkeypatch, "prepare", cfg, "--set", "data.max_tokens_per_sentence=20")
    assert code == 130, err
    assert _snapshot(tmp_path / "prep") == before  # meta.json and every split as they were


def test_a_failed_tokenizer_train_keeps_the_earlier_tokenizer(corpus, tmp_path, capsys, monkeypatch):
    import s2s.tokenizer

    cfg = _own_config(corpus, tmp_path)
    cli_ok(capsys, monkeypatch, "tokenizer", "train", cfg, "--separate", "--vocab-size", "200")
    before = _snapshot(tmp_path / "prep")
    real, calls = s2s.tokenizer._train_one, []

    def second_model_fails(*args):
        calls.append(1)
        if len(calls) == 2:
            raise S2SError("spm.de.model: SentencePiece training failed: stopped")
        return real(*args)

    monkeypatch.setattr(s2s.tokenizer, "_train_one", second_model_fails)
    assert_error(cli(capsys, monkeypatch, "tokenizer", "train", cfg, "--separate", "--vocab-size", "250"),
                 "stopped")
    assert len(calls) == 2 and _snapshot(tmp_path / "prep") == before


def test_a_link_in_data_dir_is_not_written_through(model, corpus, tmp_path, capsys, monkeypatch):
    """data.dir/spm.model a symlink into a model: tokenizer train replaces the link, not the model's."""
    copy = tmp_path / "m"
    shutil.copytree(model, copy)
    before = _snapshot(copy)
    (tmp_path / "prep").mkdir()
    (tmp_path / "prep" / "spm.model").symlink_to(copy / "spm.model")
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY_YAML.format(d=corpus).replace(f"{corpus}/prep", f"{tmp_path}/prep"))
    cli_ok(capsys, monkeypatch, "tokenizer", "train", cfg, "--vocab-size", "250")
    assert not (tmp_path / "prep" / "spm.model").is_symlink() and _snapshot(copy) == before


@pytest.mark.parametrize("command", ["tokenizer train", "prepare"])
def test_data_dir_is_never_a_model_directory(model, corpus, tmp_path, capsys, monkeypatch, command):
    copy = tmp_path / "m"
    shutil.copytree(model, copy)
    before = _snapshot(copy)
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY_YAML.format(d=corpus).replace(f"{corpus}/prep", str(copy)))
    assert_error(cli(capsys, monkeypatch, *command.split(), cfg), f"data.dir: {copy} is a model directory")
    assert _snapshot(copy) == before


def test_resume_never_trains_over_a_finished_model(corpus, tmp_path, capsys, monkeypatch):
    cfg = _own_config(corpus, tmp_path)
    run = tmp_path / "run"
    cli_ok(capsys, monkeypatch, "train", cfg, "-o", run, "--set", "train.max_steps=2")
    shutil.rmtree(run / "checkpoints")  # kept the model, dropped the checkpoints to save space
    before = _snapshot(run)
    assert_error(cli(capsys, monkeypatch, "train", cfg, "-o", run, "--resume"),
                 "no checkpoint to resume from, and it holds a trained model")
    assert _snapshot(run) == before


# --------------------------------------------------------------------------- #
# The encoding pool of prepare, stopped by a signal to the whole process group
# --------------------------------------------------------------------------- #

def test_encoding_workers_are_out_of_reach_of_the_process_group(prepared):
    """`timeout`, Ctrl-C and a closed terminal signal the whole process group; a pool worker killed
    beside the main process can die holding a queue's lock, and Pool.terminate() then hangs."""
    from s2s.data import _encoding_pool

    cfg = load_config(prepared)
    with _encoding_pool(2, Path(cfg.data.dir), cfg) as pool:
        groups = pool.map(_process_group, range(4))
    assert os.getpgid(0) not in groups


def _process_group(_: int) -> int:
    return os.getpgid(0)


def test_stopped_prepare_exits_and_keeps_the_data(corpus, tmp_path):
    """SIGTERM to the process group of `s2s prepare` at moments through its run: it always exits,
    and the prepared data are either the earlier ones, whole, or the new ones, whole."""
    import signal
    import time

    big = tmp_path / "big"
    big.mkdir()
    for name in ("train.en", "train.de", "dev.en", "dev.de"):  # 20,000 pairs: seconds of encoding
        (big / name).write_text((corpus / name).read_text() * (50 if name.startswith("train") else 1))
    cfg = _own_config(big, tmp_path)
    prep = tmp_path / "prep"
    command = [sys.executable, "-m", "s2s", "prepare", str(cfg), "--workers", "2",
               "--set", "data.max_tokens_per_sentence=30"]
    before = _snapshot(prep)
    shutil.copytree(prep, tmp_path / "before")
    started = time.monotonic()
    subprocess.run(command, check=True, capture_output=True, timeout=300)
    whole_run, after = time.monotonic() - started, _snapshot(prep)
    assert after != before
    for fraction in (0.6, 0.75, 0.9):
        shutil.rmtree(prep)
        shutil.copytree(tmp_path / "before", prep)
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        time.sleep(fraction * whole_run)
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        # 143: stopped by s2s; -15: before s2s set its handlers (importing) or after it restored them
        assert proc.returncode in (0, 143, -15), proc.stderr.read()
        assert _snapshot(prep) in (before, after)
        assert not [p for p in prep.iterdir() if ".tmp-" in p.name]
