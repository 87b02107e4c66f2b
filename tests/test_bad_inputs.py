"""Every bad input of every command: one line ``s2s: error: ...`` naming the file,
line or key, a non-zero exit, no traceback, and nothing lost.

One test per row of the README's "Bad inputs" table.  Commands run in-process
through the real entry point (``s2s.cli.run``), so exit codes and stderr are
what a user sees; a few (SIGINT, a full disk on stdout) run in a subprocess.
"""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from s2s.checkpoint import list_checkpoints
from s2s.cli import run
from tests.conftest import TINY_YAML, default_stop_signals, wait_until

BAD_FILES = {
    "missing": None,
    "empty": b"",
    "directory": "dir",
    "invalid-utf8": b"fine\n\xff\xfe broken\n",
    "nul-bytes": b"a\x00b\nok\n",
}


def make(path: Path, kind: str) -> Path:
    """``path`` as a bad file of ``kind`` (see BAD_FILES)."""
    content = BAD_FILES[kind]
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    return path


def cli(capsys, monkeypatch, *args):
    """Run ``s2s ARGS`` in-process; return (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["s2s", *map(str, args)])
    capsys.readouterr()
    try:
        run()
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def cli_ok(capsys, monkeypatch, *args):
    code, out, err = cli(capsys, monkeypatch, *args)
    assert code == 0, err
    return out, err


def assert_error(result, *needles):
    """A non-zero exit whose last stderr line is one ``s2s: error:`` naming every needle."""
    code, _, err = result
    assert code not in (0, None), err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("s2s: error: "), err
    for needle in needles:
        assert str(needle) in last, (needle, last)


@pytest.fixture(scope="module")
def env(corpus, tmp_path_factory):
    """A config, its prepared data and a trained model directory, owned by this module."""
    from s2s.config import load_config
    from s2s.data import prepare
    from s2s.tokenizer import train_tokenizer
    from s2s.trainer import train

    work = tmp_path_factory.mktemp("bad")
    cfg = work / "tiny.yaml"
    cfg.write_text(TINY_YAML.format(d=corpus).replace(f"{corpus}/prep", f"{work}/prep"))
    c = load_config(cfg)
    train_tokenizer(c.tokenizer, c.data, seed=c.seed)
    prepare(c)
    model = train(load_config(cfg, ["train.max_steps=4", "train.validate_every=2"]), work / "run",
                  show_progress=False)
    return {"cfg": cfg, "model": model, "corpus": corpus, "work": work}


def copy_model(env, tmp_path) -> Path:
    d = tmp_path / "model"
    shutil.copytree(env["model"], d)
    return d


# --------------------------------------------------------------------------- #
# Text inputs: translate --input, score HYP REF
# --------------------------------------------------------------------------- #

# what every command that reads a text file says about these (a file named {f})
TEXT_FILE_ERRORS = {"missing": "{f}: no such file", "directory": "{f}: is a directory",
                    "invalid-utf8": "{f}:2: invalid UTF-8"}


@pytest.mark.parametrize("kind", BAD_FILES)
def test_translate_input(env, tmp_path, capsys, monkeypatch, kind):
    f = make(tmp_path / "in.txt", kind)
    r = cli(capsys, monkeypatch, "translate", "-m", env["model"], "--input", f, "--beam", "1")
    if kind in TEXT_FILE_ERRORS:
        assert_error(r, TEXT_FILE_ERRORS[kind].format(f=f))
    else:  # empty: nothing out; NUL bytes: translated like any character
        assert r[0] == 0, r[2]
        assert len(r[1].splitlines()) == BAD_FILES[kind].count(b"\n")


@pytest.mark.parametrize("kind", BAD_FILES)
def test_score_hypotheses(env, tmp_path, capsys, monkeypatch, kind):
    f = make(tmp_path / "hyp.txt", kind)
    ref = tmp_path / "ref.txt"
    ref.write_bytes(b"a b\nok\n")
    r = cli(capsys, monkeypatch, "score", f, ref)
    if kind in TEXT_FILE_ERRORS:
        assert_error(r, TEXT_FILE_ERRORS[kind].format(f=f))
    elif kind == "empty":
        assert_error(r, f"{f} has 0 lines but {ref} has 2")
    else:
        assert r[0] == 0 and "BLEU" in r[1], r[2]


def test_score_different_line_counts(tmp_path, capsys, monkeypatch):
    hyp, ref = tmp_path / "hyp", tmp_path / "ref"
    hyp.write_text("1\n2\n")
    ref.write_text("1\n")
    assert_error(cli(capsys, monkeypatch, "score", hyp, ref), f"{hyp} has 2 lines but {ref} has 1")


# --------------------------------------------------------------------------- #
# The experiment YAML: tokenizer train, prepare, train, info
# --------------------------------------------------------------------------- #

CONFIG_COMMANDS = [["tokenizer", "train"], ["prepare"], ["train"], ["info"]]


CONFIG_KINDS = ["missing", "directory", "invalid-utf8", "nul-bytes", "no-parse", "unknown-key",
                "mistyped-key", "bad-override"]


@pytest.mark.parametrize("command, kind", [
    (command, kind) for command in CONFIG_COMMANDS for kind in CONFIG_KINDS
    if not (command == ["info"] and kind == "bad-override")],  # info takes no --set
    ids=lambda x: " ".join(x) if isinstance(x, list) else x)
def test_config_file(tmp_path, capsys, monkeypatch, command, kind):
    f = tmp_path / "exp.yaml"
    extra = []
    if kind in BAD_FILES:
        make(f, kind)
    elif kind == "no-parse":
        f.write_text("model:\n  d_model: 32\n   heads: [2\n")
    elif kind == "unknown-key":
        f.write_text("model:\n  d_modle: 32\n")
    elif kind == "mistyped-key":
        f.write_text("train:\n  lr: fast\n")
    else:
        f.write_text("model: {d_model: 32}\n")
        extra = ["--set", "model.heads=three"]
    r = cli(capsys, monkeypatch, *command, f, *extra)
    expected = {
        "missing": [f"{f}: no such file"],
        "directory": [f"{f}: is a directory"],
        "invalid-utf8": [f"{f}: not valid UTF-8 (byte 6)"],  # its first bad byte, counting from 1
        "nul-bytes": [f"{f}", "NUL"],
        "no-parse": [f"{f}: line 3: YAML does not parse"],
        "unknown-key": [f"{f}", "model.d_modle", "unknown key"],
        "mistyped-key": [f"{f}", "train.lr"],
        "bad-override": ["model.heads"],
    }[kind]
    if command == ["info"] and kind in ("missing", "directory"):  # info also takes a model directory
        expected = {"missing": [f"{f}: no such model directory or config file"],
                    "directory": [f"{f} is not a trained model directory"]}[kind]
    assert_error(r, *expected)


def test_empty_config_names_the_missing_key(tmp_path, capsys, monkeypatch):
    f = tmp_path / "empty.yaml"
    f.write_text("")
    assert_error(cli(capsys, monkeypatch, "tokenizer", "train", f), "data.train")
    assert_error(cli(capsys, monkeypatch, "prepare", f), "data.train")


# --------------------------------------------------------------------------- #
# Corpora: tokenizer train and prepare
# --------------------------------------------------------------------------- #

def corpus_config(tmp_path, src: bytes | None, tgt: bytes | None) -> Path:
    d = tmp_path / "c"
    d.mkdir(parents=True)
    for lang, content in (("en", src), ("de", tgt)):
        if content == "dir":
            (d / f"train.{lang}").mkdir()
        elif content is not None:
            (d / f"train.{lang}").write_bytes(content)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"tokenizer: {{vocab_size: 40}}\n"
                   f"data: {{src_lang: en, tgt_lang: de, train: {d}/train, dir: {tmp_path}/prep}}\n")
    return cfg


GOOD = b"".join(b"line %d of a tiny corpus with some words\n" % i for i in range(60))


@pytest.mark.parametrize("command", [["tokenizer", "train"], ["prepare"]], ids=" ".join)
@pytest.mark.parametrize("kind", ["missing", "empty", "directory", "invalid-utf8", "line-counts"])
def test_corpus(tmp_path, capsys, monkeypatch, command, kind):
    src = {"missing": None, "empty": b"", "directory": "dir", "invalid-utf8": GOOD + b"\xc3\x28\n",
           "line-counts": GOOD + b"one more\n"}[kind]
    cfg = corpus_config(tmp_path, src, GOOD)
    if command == ["prepare"] and kind != "missing":
        # prepare needs a tokenizer: train one on good text first
        good = corpus_config(tmp_path / "g", GOOD, GOOD)
        cli_ok(capsys, monkeypatch, "tokenizer", "train", good)
        shutil.copytree(tmp_path / "g" / "prep", tmp_path / "prep")
    r = cli(capsys, monkeypatch, *command, cfg)
    en = tmp_path / "c" / "train.en"
    expected = {
        "missing": [f"{en}: no such file"],
        "empty": [f"{en}"],
        "directory": [f"{en}: is a directory"],
        "invalid-utf8": [f"{en}:61: invalid UTF-8"],
        "line-counts": [f"{en} has 61 lines but {tmp_path / 'c' / 'train.de'} has 60"],
    }[kind]
    assert_error(r, *expected)
    assert not (tmp_path / "prep" / "meta.json").exists()  # nothing half-prepared looks complete


def test_nul_bytes_in_a_corpus_are_text(tmp_path, capsys, monkeypatch):
    cfg = corpus_config(tmp_path, GOOD + b"nul \x00 here\n", GOOD + b"auch hier\n")
    cli_ok(capsys, monkeypatch, "tokenizer", "train", cfg)
    code, out, err = cli(capsys, monkeypatch, "prepare", cfg)
    assert code == 0, err
    assert "61" in out


# --------------------------------------------------------------------------- #
# Model directories and checkpoints: translate, info, average, train --resume
# --------------------------------------------------------------------------- #

@pytest.mark.parametrize("command", [["translate", "-m"], ["info"], ["average", "-o", "AVG"]],
                         ids=lambda c: c[0])
@pytest.mark.parametrize("kind", ["missing", "empty-dir", "a-file", "truncated-weights",
                                  "corrupted-weights", "newer-format", "broken-config",
                                  "unknown-config-key"])
def test_model_directory(env, tmp_path, capsys, monkeypatch, command, kind):
    d = tmp_path / "model"
    if kind == "missing":
        needle = f"{d}: no such model directory"
    elif kind == "empty-dir":
        d.mkdir()
        needle = f"{d / 'model.json'}: not found"
    elif kind == "a-file":
        d.write_text("x")
        needle = f"{d}: not a directory"
    else:
        copy_model(env, tmp_path)
        weights = d / "model.safetensors"
        if kind == "truncated-weights":
            weights.write_bytes(weights.read_bytes()[:1000])
            needle = f"{weights}: checksum mismatch"
        elif kind == "corrupted-weights":
            data = bytearray(weights.read_bytes())
            data[len(data) // 2] ^= 0xFF
            weights.write_bytes(bytes(data))
            needle = f"{weights}: checksum mismatch"
        elif kind == "newer-format":
            meta = json.loads((d / "model.json").read_text())
            (d / "model.json").write_text(json.dumps({**meta, "format": 99}))
            needle = f"{d / 'model.json'}: model format 99 is not supported"
        elif kind == "broken-config":
            (d / "config.yaml").write_text("model: [\n")
            needle = f"{d / 'config.yaml'}: line"
        else:
            with open(d / "config.yaml", "a") as f:
                f.write("future_section: {x: 1}\n")
            needle = "future_section"
    args = [a if a != "AVG" else tmp_path / "avg" for a in command]
    if command[0] == "average":
        r = cli(capsys, monkeypatch, "average", d, *args[1:])
        assert not (tmp_path / "avg").exists()
    elif command[0] == "translate":
        monkeypatch.setattr(sys, "stdin", open(env["corpus"] / "dev.en"))
        r = cli(capsys, monkeypatch, "translate", "-m", d)
    else:
        r = cli(capsys, monkeypatch, "info", d)
    if command[0] == "info" and kind == "a-file":  # info reads a file as an experiment YAML
        needle = f"{d}: expected a mapping of sections"
    if command[0] == "info" and kind in ("truncated-weights", "corrupted-weights"):
        assert r[0] == 0  # info reads the config only
        return
    assert_error(r, needle)


def _resume_cfg(env, tmp_path):
    return ["--set", "train.max_steps=6", "--set", "train.validate_every=2",
            "--set", "train.dev_bleu_sentences=0", "--set", "train.best_metric=loss"]


@pytest.mark.parametrize("damage", ["truncated", "corrupted", "half-written"])
def test_resume_skips_a_damaged_checkpoint(env, tmp_path, capsys, monkeypatch, caplog, damage):
    """The newest checkpoint is damaged: --resume warns and continues from the one before,
    and the run ends exactly where an uninterrupted one does."""
    from safetensors.torch import load_file

    sets = _resume_cfg(env, tmp_path)
    full, run = tmp_path / "full", tmp_path / "run"
    cli_ok(capsys, monkeypatch, "train", env["cfg"], "-o", full, *sets)
    cli_ok(capsys, monkeypatch, "train", env["cfg"], "-o", run, *sets[:1], "train.max_steps=4", *sets[2:])
    newest = list_checkpoints(run)[-1]
    if damage == "truncated":
        w = newest / "optimizer.safetensors"
        w.write_bytes(w.read_bytes()[:100])
    elif damage == "corrupted":
        w = newest / "model.safetensors"
        data = bytearray(w.read_bytes())
        data[-5] ^= 0x55
        w.write_bytes(bytes(data))
    else:  # a crash mid-write leaves a temporary directory, never a step-N one
        (newest.parent / ".step-00000006.tmp-1234").mkdir()  # and a crash on the next one
        (newest / "state.json").unlink()
    cli_ok(capsys, monkeypatch, "train", env["cfg"], "-o", run, "--resume", *sets)
    assert f"{newest}: damaged" in caplog.text and "resumed from" in caplog.text
    assert "step-00000002 (step 2" in caplog.text
    a = load_file(str(list_checkpoints(full)[-1] / "model.safetensors"))
    b = load_file(str(list_checkpoints(run)[-1] / "model.safetensors"))
    assert all((a[k] == b[k]).all() for k in a)


def test_resume_with_every_checkpoint_damaged_is_an_error(env, tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    cli_ok(capsys, monkeypatch, "train", env["cfg"], "-o", run, *_resume_cfg(env, tmp_path))
    for ckpt in list_checkpoints(run):
        (ckpt / "optimizer.safetensors").write_bytes(b"junk")
    assert_error(cli(capsys, monkeypatch, "train", env["cfg"], "-o", run, "--resume", *_resume_cfg(env, tmp_path)),
                 f"{run / 'checkpoints'}: no undamaged checkpoint")


def test_resume_with_a_changed_model_names_the_key(env, tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    cli_ok(capsys, monkeypatch, "train", env["cfg"], "-o", run, *_resume_cfg(env, tmp_path))
    assert_error(cli(capsys, monkeypatch, "train", env["cfg"], "-o", run, "--resume",
                     "--set", "model.d_ff=128"), "model.d_ff")


# --------------------------------------------------------------------------- #
# Outputs that cannot be written: read-only, disk full
# --------------------------------------------------------------------------- #

def _fail_with(monkeypatch, module, name, err):
    """``module.name`` raises OSError(err): a full disk or a read-only directory, even as root."""
    def fail(*args, **kwargs):
        raise OSError(err, os.strerror(err))
    monkeypatch.setattr(module, name, fail, raising=False)


def _no_writes(monkeypatch, module, err):
    """``open`` in ``module`` refuses to open anything for writing."""
    import builtins

    def fake_open(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+"):
            raise OSError(err, os.strerror(err), str(file))
        return builtins.open(file, mode, *args, **kwargs)
    monkeypatch.setattr(module, "open", fake_open, raising=False)


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EROFS, errno.EACCES])
def test_translate_output_not_writable(env, tmp_path, capsys, monkeypatch, err):
    import s2s.textio

    out = tmp_path / "out.txt"
    out.write_text("the previous version\n")
    monkeypatch.setattr(sys, "stdin", open(env["corpus"] / "dev.en"))
    if err == errno.ENOSPC:  # the disk fills up while writing
        _fail_with(monkeypatch, s2s.textio.os, "fsync", err)
    else:  # the directory is read-only or not ours
        _no_writes(monkeypatch, s2s.textio, err)
    r = cli(capsys, monkeypatch, "translate", "-m", env["model"], "-o", out, "--beam", "1")
    assert_error(r, f"{out}:", os.strerror(err))
    assert out.read_text() == "the previous version\n"  # nothing lost
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]  # no temporary left


def test_translate_to_a_full_disk_on_stdout(env):
    r = subprocess.run(f"{sys.executable} -m s2s translate -m {env['model']} --beam 1 "
                       f"< {env['corpus'] / 'dev.en'} > /dev/full", shell=True,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1] == "s2s: error: <stdout>: No space left on device"


def test_train_checkpoint_on_a_full_disk(env, tmp_path, capsys, monkeypatch):
    """The disk fills while a checkpoint is written: an error, the previous checkpoint intact,
    and --resume continues once there is room again."""
    import s2s.checkpoint

    sets = _resume_cfg(env, tmp_path)
    run = tmp_path / "run"
    cli_ok(capsys, monkeypatch, "train", env["cfg"], "-o", run, *sets[:1], "train.max_steps=2", *sets[2:])
    before = list_checkpoints(run)
    with monkeypatch.context() as m:
        _fail_with(m, s2s.checkpoint, "save_file", errno.ENOSPC)  # writing the optimizer state
        r = cli(capsys, m, "train", env["cfg"], "-o", run, "--resume", *sets)
    assert_error(r, run / "checkpoints" / "step-00000004", "No space left on device")
    assert list_checkpoints(run) == before
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]
    code, _, err = cli(capsys, monkeypatch, "train", env["cfg"], "-o", run, "--resume", *sets)
    assert code == 0, err
    assert list_checkpoints(run)[-1].name == "step-00000006"


def test_train_run_dir_not_writable(env, tmp_path, capsys, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert_error(cli(capsys, monkeypatch, "train", env["cfg"], "-o", blocker / "run"),
                 f"{blocker / 'run'}: cannot create the run directory")


# --------------------------------------------------------------------------- #
# plot
# --------------------------------------------------------------------------- #

@pytest.mark.parametrize("kind", ["missing", "empty", "invalid-utf8", "not-json", "no-step"])
def test_plot_metrics(tmp_path, capsys, monkeypatch, kind):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    m = run_dir / "metrics.jsonl"
    content = {"missing": None, "empty": b"", "invalid-utf8": b'{"step": 1}\n\xff\n',
               "not-json": b'{"step": 1, "loss": 2}\n{"step": \n', "no-step": b'{"loss": 2}\n'}[kind]
    if content is not None:
        m.write_bytes(content)
    needle = {"missing": f"{m}: not found", "empty": f"{m}: no logged steps",
              "invalid-utf8": f"{m}:2: invalid UTF-8", "not-json": f"{m}:2: not a JSON",
              "no-step": f"{m}:1: no \"step\""}[kind]
    assert_error(cli(capsys, monkeypatch, "plot", run_dir), needle)
    assert not (run_dir / "curves.png").exists()


def test_plot_given_a_file_says_so(env, tmp_path, capsys, monkeypatch):
    f = tmp_path / "metrics.jsonl"
    f.write_text('{"step": 1, "loss": 2.0, "lr": 0.001}\n')
    assert_error(cli(capsys, monkeypatch, "plot", f), f"{f}: is a file; plot takes a training run directory")


# --------------------------------------------------------------------------- #
# Errors that say what is wrong and what helps
# --------------------------------------------------------------------------- #

@pytest.mark.parametrize("full_disk", [True, False])
def test_prepare_write_error_gives_the_reason(env, tmp_path, capsys, monkeypatch, full_disk):
    """A writer that raises OSError without errno (numpy's tofile: "N requested and 0 written"):
    the message names a full disk as such, and otherwise the writer's own words, never "(None)"."""
    import s2s.data
    import s2s.textio

    prep = tmp_path / "prep"
    shutil.copytree(env["work"] / "prep", prep)
    (prep / "meta.json").unlink()

    def short_write(*args, **kwargs):
        raise OSError("6 requested and 0 written")
    monkeypatch.setattr(s2s.data.NpyAppender, "append", short_write)
    if full_disk:
        monkeypatch.setattr(s2s.textio.os, "statvfs", lambda p: os.statvfs_result((4096,) * 3 + (0,) * 7))
    r = cli(capsys, monkeypatch, "prepare", env["cfg"], "--set", f"data.dir={prep}")
    reason = "No space left on device" if full_disk else "6 requested and 0 written"
    assert_error(r, f"{prep}/train.", f".npy: write failed ({reason})")
    assert "None" not in r[2]
    assert not (prep / "meta.json").exists()


def test_average_failure_leaves_nothing(env, tmp_path, capsys, monkeypatch):

    import safetensors.torch

    out = tmp_path / "avg"
    _fail_with(monkeypatch, safetensors.torch, "save_model", errno.ENOSPC)  # modeldir imports it where it writes
    ckpts = list_checkpoints(env["model"])
    assert_error(cli(capsys, monkeypatch, "average", *ckpts, "-o", out), "No space left on device")
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_config_that_does_not_match_the_weights_names_tensor_and_shapes(env, tmp_path, capsys, monkeypatch):
    d = copy_model(env, tmp_path)
    cfg = d / "config.yaml"
    assert "d_ff: 64\n" in cfg.read_text()
    cfg.write_text(cfg.read_text().replace("d_ff: 64\n", "d_ff: 96\n"))
    monkeypatch.setattr(sys, "stdin", open(env["corpus"] / "dev.en"))
    r = cli(capsys, monkeypatch, "translate", "-m", d, "--beam", "1")
    assert_error(r, f"{d / 'model.safetensors'}: tensor ", "has shape (64, 32) but the model's config.yaml "
                 "expects (96, 32)", "more tensors", "the config does not match these weights")
    assert "Error(s) in loading" not in r[2]


def test_tokenizer_missing_from_a_model_directory(env, tmp_path, capsys, monkeypatch):
    d = copy_model(env, tmp_path)
    (d / "spm.model").unlink()
    monkeypatch.setattr(sys, "stdin", open(env["corpus"] / "dev.en"))
    r = cli(capsys, monkeypatch, "translate", "-m", d)
    assert_error(r, f"{d / 'spm.model'}: missing; the model directory {d} is incomplete")
    assert "tokenizer train" not in r[2]  # training a new tokenizer cannot help a trained model


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", "inf", "nan"])
def test_non_finite_numbers_are_refused_at_config_load(env, tmp_path, capsys, monkeypatch, value):
    r = cli(capsys, monkeypatch, "train", env["cfg"], "-o", tmp_path / "run", "--set", f"train.lr={value}")
    assert_error(r, "train.lr: expected a finite number")
    assert not (tmp_path / "run").exists()


def test_train_on_an_empty_config(tmp_path, capsys, monkeypatch):
    cfg = tmp_path / "empty.yaml"
    cfg.write_text("")
    monkeypatch.chdir(tmp_path)
    r = cli(capsys, monkeypatch, "train", cfg, "-o", tmp_path / "run")
    assert_error(r, "data.train: no training corpus configured")


def test_vocab_size_larger_than_the_corpus_gives_is_recorded_as_trained(tmp_path, capsys, monkeypatch, caplog):
    """SentencePiece's soft limit gives fewer pieces on a small corpus: s2s warns and records the
    size it trained, so tokenizer.json, the model and the embeddings agree."""
    import sentencepiece as spm

    cfg = corpus_config(tmp_path, GOOD, GOOD)
    cli_ok(capsys, monkeypatch, "tokenizer", "train", cfg, "--vocab-size", "5000")
    pieces = spm.SentencePieceProcessor(model_file=str(tmp_path / "prep" / "spm.model")).get_piece_size()
    assert pieces < 5000
    assert f"tokenizer.vocab_size: 5000 asked, but the corpus gives {tmp_path / 'prep' / 'spm.model'} " \
           f"only {pieces} pieces" in caplog.text
    assert json.loads((tmp_path / "prep" / "tokenizer.json").read_text())["vocab_size"] == pieces
    cli_ok(capsys, monkeypatch, "prepare", cfg)  # the recorded settings are the ones prepared with


def test_resume_when_the_time_budget_is_used_says_why(env, tmp_path, capsys, monkeypatch, caplog):
    run = tmp_path / "run"
    sets = ["--set", "train.max_steps=0", "--set", "train.max_time=1", "--set", "train.validate_every=1000"]
    cli_ok(capsys, monkeypatch, "train", env["cfg"], "-o", run, *sets)
    steps = len(list_checkpoints(run))
    cli_ok(capsys, monkeypatch, "train", env["cfg"], "-o", run, "--resume", *sets)
    err, _ = caplog.text, caplog.clear()
    assert f"{run}: nothing to train: the time budget train.max_time=1 is used" in err
    assert "raise train.max_time to continue" in err
    assert len(list_checkpoints(run)) == steps
    cli_ok(capsys, monkeypatch, "train", env["cfg"], "-o", run, "--resume", *sets[:-3],
           "train.max_time=1h", "--set", "train.max_steps=1", "--set", "train.validate_every=1000")
    assert "nothing to train: train.max_steps=1 reached; raise train.max_steps to continue" in caplog.text


# --------------------------------------------------------------------------- #
# Directory outputs: export ct2, export hf, import hf, average; train -o
# --------------------------------------------------------------------------- #

DIR_WRITERS = ["export ct2", "export hf", "import hf", "average"]


def _writer_args(env, command: str, out: Path, model: Path | None = None) -> list:
    """``s2s COMMAND ... -o OUT`` reading ``model`` (default: the module's trained run)."""
    model = model or env["model"]
    if command == "average":
        return ["average", list_checkpoints(model)[-1], "-o", out]
    if command == "import hf":
        return ["import", "hf", model, "-o", out]
    return [*command.split(), "-m", model, "-o", out]


def _tree(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("force", [False, True], ids=["", "force"])
@pytest.mark.parametrize("command", DIR_WRITERS)
def test_a_directory_output_never_replaces_a_users_files(env, tmp_path, capsys, monkeypatch, command, force):
    out = tmp_path / "mine"
    (out / "opus-mt-en-de").mkdir(parents=True)
    (out / "README.txt").write_text("my notes\n")
    (out / "opus-mt-en-de" / "config.json").write_text("{}")
    before = _tree(out)
    r = cli(capsys, monkeypatch, *_writer_args(env, command, out), *(["--force"] if force else []))
    assert_error(r, f"{out}: not empty and not an output of s2s {command}")
    assert _tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no temporary left


@pytest.mark.parametrize("command", DIR_WRITERS)
def test_a_directory_output_is_never_a_run_or_the_input(env, tmp_path, capsys, monkeypatch, command):
    run = copy_model(env, tmp_path)  # a training run: checkpoints/, metrics.jsonl
    before = _tree(run)
    for force in ([], ["--force"]):
        other = env["model"]  # -o another run
        assert_error(cli(capsys, monkeypatch, *_writer_args(env, command, run, model=other), *force),
                     f"{run}: is a training run directory; s2s {command} never replaces one")
        # -o the input itself (average: the run its checkpoint belongs to)
        assert_error(cli(capsys, monkeypatch, *_writer_args(env, command, run, model=run), *force),
                     f"{run}: ", "the input", "choose another -o")
        # -o . in the directory that holds the input
        monkeypatch.chdir(tmp_path)
        assert_error(cli(capsys, monkeypatch, *_writer_args(env, command, Path("."), model=Path("model")), *force),
                     ".: holds the input model")
    assert _tree(run) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


@pytest.mark.parametrize("command", ["export ct2", "average"])
def test_force_replaces_only_an_earlier_output_of_the_same_command(env, tmp_path, capsys, monkeypatch, command):
    out = tmp_path / "out"
    cli_ok(capsys, monkeypatch, *_writer_args(env, command, out))
    marker = json.loads((out / "s2s-output.json").read_text())
    assert marker["command"] == command and set(marker["files"]) == set(_tree(out)) - {"s2s-output.json"}
    assert_error(cli(capsys, monkeypatch, *_writer_args(env, command, out)),
                 f"{out}: holds an earlier output of s2s {command}; pass --force")
    stale = out / marker["files"][0]
    stale.write_bytes(b"stale")
    cli_ok(capsys, monkeypatch, *_writer_args(env, command, out), "--force")
    assert stale.read_bytes() != b"stale"  # replaced by a complete new output
    (out / "notes.txt").write_text("mine\n")  # the user added a file: --force no longer replaces it
    before = _tree(out)
    assert_error(cli(capsys, monkeypatch, *_writer_args(env, command, out), "--force"),
                 f"{out}: holds notes.txt, which s2s {command} did not write; not replaced")
    assert _tree(out) == before
    other = "export hf" if command == "export ct2" else "import hf"
    assert_error(cli(capsys, monkeypatch, *_writer_args(env, other, out), "--force"),
                 f"{out}: is an output of s2s {command}, not of s2s {other}")
    assert _tree(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_atomic_dir_never_renames_over_a_non_empty_directory(tmp_path):
    """The helper itself: an existing directory with files is refused up front, and one
    that fills while the output is written is kept (the rename fails, nothing is lost)."""
    from s2s.errors import S2SError
    from s2s.textio import atomic_dir

    full = tmp_path / "full"
    full.mkdir()
    (full / "a.txt").write_text("keep")
    with pytest.raises(S2SError, match="exists and is not empty; not replaced"):
        with atomic_dir(full):
            pass
    late = tmp_path / "late"
    late.mkdir()
    with pytest.raises(S2SError, match="write failed"):
        with atomic_dir(late) as tmp:
            (tmp / "new.bin").write_bytes(b"new")
            (late / "b.txt").write_text("keep")  # someone else writes there meanwhile
    assert (full / "a.txt").read_text() == "keep" and (late / "b.txt").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full", "late"]
    with atomic_dir(tmp_path / "empty") as tmp:  # a new (or empty) directory is simply written
        (tmp / "x").write_text("x")
    assert (tmp_path / "empty" / "x").read_text() == "x"


@pytest.mark.parametrize("where", ["users-folder", "dot"])
def test_train_refuses_a_directory_that_is_not_a_run(env, tmp_path, capsys, monkeypatch, where):
    """A user's folder (their own config.yaml, metrics.jsonl) or `-o .` from a project folder."""
    folder = tmp_path / "project"
    folder.mkdir()
    config = folder / "config.yaml"
    config.write_text("# my experiment, with comments\n" + env["cfg"].read_text())
    (folder / "metrics.jsonl").write_text('{"step": 1, "loss": 9.9}\n')
    before = _tree(folder)
    if where == "dot":
        monkeypatch.chdir(folder)
        r = cli(capsys, monkeypatch, "train", "config.yaml", "-o", ".")
        assert_error(r, ".: not empty and not a training run directory")
    else:
        r = cli(capsys, monkeypatch, "train", config, "-o", folder, "--resume")
        assert_error(r, f"{folder}: not empty and not a training run directory")
    assert _tree(folder) == before


def test_train_accepts_its_own_run_directories(tmp_path):
    """New, empty, a run holding train.lock, and a run of an s2s from before the lock file."""
    from s2s.errors import S2SError
    from s2s.outdir import check_run_dir

    check_run_dir(tmp_path / "new")
    (tmp_path / "empty").mkdir()
    check_run_dir(tmp_path / "empty")
    for name, files in (("locked", {"train.lock": "", "metrics.jsonl": ""}),
                        ("legacy", {"env.json": '{"s2s": "0.1.0", "torch": "2"}', "config.yaml": "",
                                    "metrics.jsonl": ""}),
                        ("not-env", {"env.json": '{"PATH": "/bin"}', "config.yaml": ""})):
        d = tmp_path / name
        d.mkdir()
        for f, text in files.items():
            (d / f).write_text(text)
        if name == "not-env":
            with pytest.raises(S2SError, match="not a training run directory"):
                check_run_dir(d)
        else:
            check_run_dir(d)
    with pytest.raises(S2SError, match="exists and is not a directory"):
        check_run_dir(tmp_path / "locked" / "train.lock")


def test_two_trainings_in_one_run_directory(env, tmp_path, capsys, monkeypatch):
    """The second gets a one-line error naming the first's PID; kill -9 leaves no stale lock."""
    run = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "s2s", "train", str(env["cfg"]), "-o", str(run),
                              "--set", "train.max_steps=100000", "--set", "train.validate_every=100000"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_until((run / "metrics.jsonl").exists, 120), "the first run did not start"
        for resume in ([], ["--resume"]):
            assert_error(cli(capsys, monkeypatch, "train", env["cfg"], "-o", run, *resume),
                         f"{run}: in use by another training run (PID {first.pid})")
    finally:
        first.kill()  # SIGKILL: no cleanup runs; the kernel releases the lock
        first.wait()
    cli_ok(capsys, monkeypatch, "train", env["cfg"], "-o", run, "--resume",
           "--set", "train.max_steps=2", "--set", "train.validate_every=2")
    assert list_checkpoints(run)[-1].name == "step-00000002"


# --------------------------------------------------------------------------- #
# SIGINT, SIGTERM, SIGHUP in the middle of translate (train: tests/test_train.py)
# --------------------------------------------------------------------------- #

@pytest.mark.parametrize("signum, code, last", [
    (signal.SIGINT, 130, "s2s: interrupted"),
    (signal.SIGTERM, 143, "s2s: terminated by SIGTERM"),
    (signal.SIGHUP, 129, "s2s: terminated by SIGHUP")], ids=["SIGINT", "SIGTERM", "SIGHUP"])
def test_a_signal_during_translate_leaves_no_output(env, tmp_path, signum, code, last):
    big = tmp_path / "big.txt"
    big.write_text((env["corpus"] / "train.en").read_text() * 50)
    out = tmp_path / "out.txt"
    proc = subprocess.Popen([sys.executable, "-m", "s2s", "translate", "-m", str(env["model"]),
                             "--input", str(big), "-o", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_stop_signals)  # as a user's, not a background job's
    wait_until(lambda: any(p.name.startswith(".out.txt.tmp") for p in tmp_path.iterdir()), 120)
    time.sleep(0.5)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, (err, sorted(p.name for p in tmp_path.iterdir()))
    assert err.strip().splitlines()[-1] == last and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.txt"]  # no partial file left


# --------------------------------------------------------------------------- #
# Unbounded inputs: long lines, huge sizes, closed streams (issue 18, items 7-9)
# --------------------------------------------------------------------------- #

def test_ter_skips_a_line_over_its_word_limit(tmp_path, capsys, monkeypatch, caplog):
    """TER's shift search grows faster than the line: a 20,000-word line is left out of TER
    with a warning naming it, quickly, while BLEU and chrF still score it."""
    from s2s.metrics import TER_MAX_WORDS

    long_hyp = " ".join(f"w{i % 50}" for i in range(20_000))
    long_ref = " ".join(f"w{i % 37}" for i in range(20_000))
    hyp, ref = tmp_path / "hyp", tmp_path / "ref"
    hyp.write_text(f"a small cat\n{long_hyp}\nthe dog runs\n")
    ref.write_text(f"a small dog\n{long_ref}\nthe dog ran\n")
    start = time.time()
    out, _ = cli_ok(capsys, monkeypatch, "score", hyp, ref, "--json")
    assert time.time() - start < 60
    assert f"TER: line 2 skipped: over {TER_MAX_WORDS} words" in caplog.text
    scores = json.loads(out)
    assert set(scores) == {"bleu", "chrf", "ter"}
    assert scores["ter"]["signature"].endswith(f"|maxwords:{TER_MAX_WORDS}")
    # TER of the two short lines alone: 1 + 1 edits over 3 + 3 reference words
    assert scores["ter"]["score"] == round(100 * 2 / 6, 2)


def test_align_on_a_long_source_draws_a_bounded_figure(env, tmp_path, capsys, monkeypatch, caplog):
    from PIL import Image

    from s2s.plot import ALIGN_MAX_PIECES

    src = " ".join((env["corpus"] / "dev.en").read_text().split()[:300])
    tgt = " ".join((env["corpus"] / "dev.de").read_text().split()[:300])
    out = tmp_path / "a.png"
    start = time.time()
    cli_ok(capsys, monkeypatch, "align", "-m", env["model"], "--src", src, "--tgt", tgt, "-o", out)
    assert time.time() - start < 120
    assert f"align: drawing the first {ALIGN_MAX_PIECES} of" in caplog.text and "source pieces" in caplog.text
    width, height = Image.open(out).size
    # figure inches: max(4, 0.45 S + 2) x max(3, 0.4 T + 1.5) at 100 dpi, S and T at most the cap
    assert width <= 100 * (0.45 * ALIGN_MAX_PIECES + 2) and height <= 100 * (0.4 * ALIGN_MAX_PIECES + 1.5)


@pytest.mark.parametrize("closed", ["stdin", "stdout"])
def test_closed_standard_streams(env, tmp_path, capsys, monkeypatch, closed):
    """`s2s translate -m M <&-` / `>&-` and `s2s score - REF <&-`: Python sets the closed
    stream to None; the command says so in one line."""
    if closed == "stdin":
        monkeypatch.setattr(sys, "stdin", None)
        assert_error(cli(capsys, monkeypatch, "translate", "-m", env["model"]), "<stdin>: input is closed")
        monkeypatch.setattr(sys, "stdin", None)
        assert_error(cli(capsys, monkeypatch, "score", "-", env["corpus"] / "dev.de"), "<stdin>: input is closed")
    else:
        monkeypatch.setattr(sys, "stdin", open(env["corpus"] / "dev.en"))
        monkeypatch.setattr(sys, "stdout", None)
        assert_error(cli(capsys, monkeypatch, "translate", "-m", env["model"], "--beam", "1"),
                     "<stdout>: output is closed")


def test_export_into_the_current_directory_is_not_a_traceback(env, tmp_path, capsys, monkeypatch):
    pytest.importorskip("ctranslate2")
    work = tmp_path / "here"
    work.mkdir()
    monkeypatch.chdir(work)
    code, _, err = cli(capsys, monkeypatch, "export", "ct2", "-m", env["model"], "-o", ".")
    assert "Traceback" not in err
    assert code == 0 or err.strip().splitlines()[-1].startswith("s2s: error: "), err


def test_sizes_past_what_can_exist_are_one_line_errors(env, tmp_path, capsys, monkeypatch):
    import yaml

    assert_error(cli(capsys, monkeypatch, "tokenizer", "train", env["cfg"],
                     "--set", "tokenizer.vocab_size=100000000000"), "tokenizer.vocab_size")
    monkeypatch.setattr(sys, "stdin", open(env["corpus"] / "dev.en"))
    assert_error(cli(capsys, monkeypatch, "translate", "-m", env["model"], "--beam", "1000000000"),
                 "decode.beam: 1000000000 is more than the")
    for key, value in (("d_model", 10**12), ("vocab_size", 10**10)):
        model = tmp_path / key
        shutil.copytree(env["model"], model)
        cfg = yaml.safe_load((model / "config.yaml").read_text())
        cfg["model"][key] = value
        (model / "config.yaml").write_text(yaml.safe_dump(cfg))
        monkeypatch.setattr(sys, "stdin", open(env["corpus"] / "dev.en"))
        assert_error(cli(capsys, monkeypatch, "translate", "-m", model), f"model.{key}={value}")
        code, _, err = cli(capsys, monkeypatch, "info", model)
        assert "Traceback" not in err
        if key == "d_model":  # 3e24 elements overflow even an unallocated tensor
            assert_error((code, "", err), f"model.{key}={value}")
        else:  # counted without allocating
            assert code == 0


def test_max_len_b_is_capped_by_the_documented_maximum(env, tmp_path, capsys, monkeypatch, caplog):
    from s2s.config import DecodeConfig

    src = tmp_path / "one.en"
    src.write_text("Clipboard management\n")
    start = time.time()
    cli_ok(capsys, monkeypatch, "translate", "-m", env["model"], "-i", src, "--beam", "1",
           "--max-len-b", "1000000000")
    assert time.time() - start < 120
    assert "decode.max_len_b: 1000000000 is more than the" in caplog.text
    from s2s.translate import Translator

    t = Translator.from_dir(env["model"], beam=1, max_len_b=10**9)
    (hyp,), = t.search_sorted(t.encode_lines(["Clipboard management"], 1))
    assert len(hyp.tokens) < DecodeConfig().max_output_tokens


@pytest.mark.parametrize("writer", ["optimizer", "weights"])
def test_checkpoint_write_failing_inside_safetensors(env, tmp_path, monkeypatch, writer):
    """safetensors reports a full disk as SafetensorError, not OSError: still
    `RUN/checkpoints/step-N: write failed (No space left on device)`, nothing left behind."""
    import safetensors.torch  # modeldir imports save_model where it writes: patch it at its source
    import torch
    from safetensors import SafetensorError

    import s2s.checkpoint
    from s2s.checkpoint import TrainState, save_checkpoint
    from s2s.errors import S2SError

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(s2s.checkpoint if writer == "optimizer" else safetensors.torch,
                        "save_file" if writer == "optimizer" else "save_model", full)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    with pytest.raises(S2SError) as e:
        save_checkpoint(run_dir, model, optimizer, TrainState(step=4), keep=5)
    assert str(e.value) == f"{run_dir / 'checkpoints' / 'step-00000004'}: write failed (No space left on device)"
    assert list((run_dir / "checkpoints").iterdir()) == []


@pytest.mark.parametrize("route", [["--precision", "fp32"], ["--precision", "auto", "--device", "cpu"]],
                         ids=["torch", "torch-free where this CPU has it"])
def test_a_prefix_file_that_does_not_fit_names_its_line(env, tmp_path, capsys, monkeypatch, route):
    """--prefix-file: one line shorter than the input, or a prefix that leaves no room for </s>
    within decode.max_output_tokens, is an error naming the line, on either route; the lines
    before it are written."""
    from s2s import native_search
    from s2s.workers import TranslatorSpec

    if "auto" in route and native_search.engine_for(TranslatorSpec((str(env["model"]),), precision="auto",
                                                                    device="cpu")) is None:
        pytest.skip("no torch-free search on this CPU (or for this model)")
    src = tmp_path / "in.txt"
    src.write_text("a\nb\nc\n")
    short = tmp_path / "short.txt"
    short.write_text("Das\n\n")
    args = ["translate", "-m", env["model"], "--input", src, "--beam", "1", "--unbuffered", *route]
    assert_error(cli(capsys, monkeypatch, *args, "--prefix-file", short), "--prefix-file", "ends at line 2")
    long = tmp_path / "long.txt"
    long.write_text("Das\n" + "Paket " * 40 + "\n\n")
    code, out, err = cli(capsys, monkeypatch, *args, "--prefix-file", long, "--set", "decode.max_output_tokens=20")
    assert_error((code, out, err), "--prefix-file: line 2: its prefix is", "stop at 20")
    assert out.splitlines()[0].startswith("Das")  # (line 1, written before line 2 failed)
