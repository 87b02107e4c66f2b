"""A training run directory over its life: resumes that must not change what it means
(best_metric, processes), what a killed run leaves (half-written checkpoints, log lines past its
last checkpoint), and the commands that read it (plot, info, average)."""

import json
import os
import shutil
from pathlib import Path

import pytest

from s2s.checkpoint import check_batching, list_checkpoints, remove_stale_temporaries
from s2s.config import load_config
from s2s.errors import ConfigError, S2SError
from s2s.plot import read_curves
from s2s.runlog import MetricsLog
from s2s.trainer import train
from tests.test_bad_inputs import assert_error, cli, cli_ok

STEPS = ["train.max_steps=4", "train.validate_every=2", "train.dev_bleu_sentences=0"]
SHORT = ["train.max_steps=2", "train.validate_every=2", "train.dev_bleu_sentences=0", "train.best_metric=loss"]


@pytest.fixture(scope="module")
def run(prepared, tmp_path_factory) -> Path:
    """A run of 4 steps, checkpoints at 2 and 4, selected by dev loss."""
    return train(load_config(prepared, [*STEPS, "train.best_metric=loss"]),
                 tmp_path_factory.mktemp("rundir") / "run", show_progress=False)


def test_best_metric_cannot_change_on_resume(prepared, run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    with pytest.raises(S2SError, match="train.best_metric: bleu differs from the run being resumed \\(loss\\)"):
        train(load_config(prepared, ["train.max_steps=6", "train.validate_every=2", "train.best_metric=bleu"]),
              copy, resume=True, show_progress=False)


def test_the_number_of_processes_is_part_of_the_batching():
    now = {"seed": 1, "train.max_tokens": 600, "world_size": 2}
    with pytest.raises(S2SError, match=r"processes \(train.procs\): 2 differs from the run being resumed \(1\)"):
        check_batching({"seed": 1, "train.max_tokens": 600}, now)  # a run of one process recorded none
    with pytest.raises(S2SError, match=r"processes \(train.procs\): 1 differs .* \(2\)"):
        check_batching(now, {**now, "world_size": 1})
    check_batching({"seed": 1, "train.max_tokens": 600}, {**now, "world_size": 1})


def test_a_killed_checkpoint_write_leaves_nothing_behind(run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    d = copy / "checkpoints"
    last, first = list_checkpoints(copy)[-1], list_checkpoints(copy)[0]
    shutil.copytree(last, d / f".{last.name}.tmp-99999")  # killed while writing
    os.replace(first, d / f".{first.name}.old-99998")  # killed between the two renames of a redo
    remove_stale_temporaries(copy)
    assert sorted(p.name for p in d.iterdir()) == [first.name, last.name]


def test_log_lines_past_the_checkpoint_resumed_from_go(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
        {"step": 1, "loss": 5.0}, {"step": 2, "dev_loss": 4.0}, {"step": 3, "loss": 4.5}, {"step": 4, "loss": 4.4})))
    MetricsLog(tmp_path).keep_until(2)
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    MetricsLog(tmp_path).keep_until(0)
    assert (tmp_path / "metrics.jsonl").read_text() == ""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n{"step": 2, "lo')  # torn by a kill
    MetricsLog(tmp_path).keep_until(2)
    MetricsLog(tmp_path).write({"step": 2, "loss": 4.0})
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_resume_after_a_kill_logs_each_step_once(prepared, run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    shutil.rmtree(list_checkpoints(copy)[-1])  # killed after logging steps 3 and 4, before their checkpoint
    train(load_config(prepared, [*STEPS, "train.best_metric=loss"]), copy, resume=True, show_progress=False)
    steps = [(r["step"], "loss" in r) for r in map(json.loads, (copy / "metrics.jsonl").read_text().splitlines())]
    assert len(steps) == len(set(steps)) and max(s for s, _ in steps) == 4


def test_plot_draws_the_logged_learning_rate_when_the_config_changed(run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    c = read_curves(copy)
    assert c.lr_steps == [1, 2, 3, 4]  # the config's schedule, every step
    config = (copy / "config.yaml").read_text()
    (copy / "config.yaml").write_text(config.replace("lr: ", "lr: 1", 1))  # as a resume with another train.lr
    c = read_curves(copy)
    logged = [r for r in c.train if "lr" in r]
    assert c.lr_steps == [r["step"] for r in logged] and c.lr == [r["lr"] for r in logged]


def test_plot_of_a_run_stopped_before_its_first_log_line(tmp_path, capsys, monkeypatch):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "train.lock").write_text("1\n")
    assert_error(cli(capsys, monkeypatch, "plot", tmp_path / "run"), "metrics.jsonl: no logged steps yet")


def test_info_on_a_checkpoint(run, capsys, monkeypatch):
    out, _ = cli_ok(capsys, monkeypatch, "info", list_checkpoints(run)[0])
    assert "step 2" in out and "parameters" in out


def test_average_names_the_architecture_key_that_differs(prepared, run, tmp_path, capsys, monkeypatch):
    other = train(load_config(prepared, [*SHORT, "model.dropout=0.0"]), tmp_path / "other", show_progress=False)
    ckpts = [list_checkpoints(run)[-1], list_checkpoints(other)[-1]]
    cli_ok(capsys, monkeypatch, "average", *ckpts, "-o", tmp_path / "avg")  # dropout is no architecture
    (tmp_path / "wide.yaml").write_text(prepared.read_text().replace("d_ff: 64", "d_ff: 96"))
    wide = train(load_config(tmp_path / "wide.yaml", SHORT), tmp_path / "wide", show_progress=False)
    assert_error(cli(capsys, monkeypatch, "average", ckpts[0], list_checkpoints(wide)[-1], "-o", tmp_path / "x"),
                 "model.d_ff is 96 there but 64 in")


def test_set_takes_lists_for_list_keys_and_text_elsewhere(prepared):
    import copy
    import pickle

    from s2s.config import decode_overrides

    cfg = load_config(prepared, ["data.pairs=[]", "tokenizer.lang_tokens=[<2de>, <2fr>]", "data.dir=[x]"])
    assert cfg.data.pairs == () and cfg.tokenizer.lang_tokens == ("<2de>", "<2fr>")
    assert cfg.data.dir == "[x]" and type(cfg.data.dir) is str
    given = decode_overrides(["decode.glossary=[terms]"], "translate")  # sent to --workers processes
    assert pickle.loads(pickle.dumps(given)) == copy.deepcopy(given) == {"glossary": "[terms]"}


def test_a_time_budget_of_zero_is_refused(prepared):
    with pytest.raises(ConfigError, match="train.max_time: must be more than 0"):
        load_config(prepared, ["train.max_time=0"])
