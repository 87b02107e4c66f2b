"""Data-parallel training: two processes (under torchrun, or started by train.procs) against one
process on the same batches."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from s2s.allocator import malloc_in_use, training_environ
from s2s.checkpoint import list_checkpoints
from s2s.config import load_config
from s2s.distributed import World, auto_procs, shard, threads_per_process, training_bytes
from s2s.trainer import make_trainer
from tests.conftest import default_stop_signals, logged_lines, wait_until

# No dropout, so that both runs draw nothing at random after the (identical) initialization.
# adam_eps 1e-4: the key bias's gradient is zero in exact arithmetic (softmax ignores a constant
# added to every score), and with a tiny eps Adam would turn its rounding noise into full-size steps.
SETTINGS = ["train.adam_eps=1e-4", "train.max_steps=5", "train.validate_every=5", "train.log_every=1",
            "train.dev_bleu_sentences=0",
            "train.best_metric=loss", "train.max_tokens=96", "model.dropout=0", "model.attention_dropout=0",
            "train.threads=1"]


def _train(prepared, out, update_freq, nproc, launcher="torchrun", extra=()):
    """Train with ``nproc`` processes: started by torchrun, or by s2s itself (train.procs)."""
    procs = nproc > 1 and launcher == "torchrun"
    start = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
             if procs else [sys.executable])
    sets = [a for s in [*SETTINGS, f"train.update_freq={update_freq}", *extra] for a in ("--set", s)]
    if launcher == "s2s":
        sets += ["--set", f"train.procs={nproc}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*start, "-m", "s2s", "train", str(prepared), "-o", str(out), *sets],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_training_allocator(proc.stderr, env)
    _train.proc = proc
    return out


def _assert_training_allocator(stderr: str, env: dict) -> None:
    """``s2s train`` (which starts itself again), torchrun's ranks (each an ``s2s train``) and the
    ranks that train.procs starts train with the allocator of training_environ: rank 0 logs it."""
    assert f"host memory: {malloc_in_use(training_environ(env) or env)}\n" in stderr, stderr[-3000:]


@pytest.fixture(scope="module")
def one_process(prepared, tmp_path_factory):
    """The reference: one process, two batches per update."""
    return _train(prepared, tmp_path_factory.mktemp("one") / "run", update_freq=2, nproc=1)


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_shard_takes_every_world_size_th_batch():
    group = list("abcde")
    assert shard(group, World(0, 2)) == ["a", "c", "e"]
    assert shard(group, World(1, 2)) == ["b", "d"]
    assert shard(group, World()) == group


def _assert_same_training(one, two, prepared, tmp_path):
    """Same weights after 5 updates (far from the start), and rank 0 logged every step's loss."""
    a = load_file(str(list_checkpoints(one)[-1] / "model.safetensors"))
    b = load_file(str(list_checkpoints(two)[-1] / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5, msg=k)
    # the updates moved the weights far more than the tolerance: the comparison means something
    start = make_trainer(load_config(prepared, SETTINGS), tmp_path / "unused", show_progress=False).model.state_dict()
    assert max(float((a[k] - start[k]).abs().max()) for k in a) > 1e-3
    # rank 0 alone logged: one line per step, with the losses and token counts of both ranks' batches
    m1 = [r for r in _metrics(one) if "loss" in r]
    m2 = [r for r in _metrics(two) if "loss" in r]
    assert [r["step"] for r in m2] == [1, 2, 3, 4, 5]
    for r1, r2 in zip(m1, m2):
        assert r2["loss"] == pytest.approx(r1["loss"], abs=2e-4)
    assert json.loads((two / "model.json").read_text())["step"] == 5


@pytest.mark.parametrize("launcher", ["torchrun", "s2s"])
def test_a_locked_run_directory_stops_every_rank(prepared, tmp_path, launcher):
    """Rank 0 takes the run directory's lock; when another run holds it, every rank stops
    (none waits in a collective) with the holder's PID named (by train.procs: in one line)."""
    from s2s.outdir import lock_run_dir

    run = tmp_path / "run"
    sets = [a for s in SETTINGS for a in ("--set", s)]
    start = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    if launcher == "s2s":
        start, sets = [sys.executable], [*sets, "--set", "train.procs=2"]
    with lock_run_dir(run):  # this test process is "the first run"
        proc = subprocess.run([*start, "-m", "s2s", "train", str(prepared), "-o", str(run), *sets],
                              capture_output=True, text=True, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0
    assert f"s2s: error: {run}: in use by another training run (PID {os.getpid()})" in proc.stderr
    if launcher == "s2s":
        assert proc.returncode == 1 and proc.stderr.count("s2s: error:") == 1, proc.stderr
    assert sorted(p.name for p in run.iterdir()) == ["train.lock"]  # nothing written


def _assert_rank_0_speaks(proc, two):
    """Rank 0 alone speaks: the run directory once on stdout, one "done" line, no rank's empty state."""
    assert proc.stdout == f"{two}\n"
    assert proc.stderr.count("s2s: done:") == 1, proc.stderr[-3000:]
    assert "None at step 0" not in proc.stderr


def test_auto_procs_one_process_per_core_while_memory_allows():
    GB = 1 << 30
    small = training_bytes(7_600_000, 4096, 6, 256, 1024, 8000)  # the reference model
    assert small == 24 * 7_600_000 + 4 * 4096 * (6 * (16 * 256 + 2 * 1024) + 3 * 8000) + (512 << 20)
    assert auto_procs(cores=2, threads=0, per_process=small, memory=24 * GB, gpus=0) == 2
    assert auto_procs(cores=16, threads=2, per_process=small, memory=64 * GB, gpus=0) == 8
    # a big model: as many processes as fit in half the memory, the cores shared out among them
    big = 10 * GB
    assert auto_procs(cores=16, threads=0, per_process=big, memory=64 * GB, gpus=0) == 3
    assert threads_per_process(3, 0, 16) == 5 and threads_per_process(3, 2, 16) == 2
    assert auto_procs(cores=16, threads=0, per_process=big, memory=8 * GB, gpus=0) == 1
    assert auto_procs(cores=1, threads=0, per_process=small, memory=24 * GB, gpus=0) == 1
    assert auto_procs(cores=16, threads=0, per_process=small, memory=24 * GB, gpus=1) == 1  # one per GPU


def test_train_procs_count_gpus_only_when_training_on_them(monkeypatch):
    """On a machine with 2 GPUs: train.device cpu runs any number of CPU processes; cuda (or auto)
    needs one GPU per process."""
    from s2s.config import ExperimentConfig, TrainConfig
    from s2s.distributed import process_split
    from s2s.errors import S2SError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for name in ("WORLD_SIZE", "RANK"):  # not under torchrun
        monkeypatch.delenv(name, raising=False)

    def split(device):
        return process_split(ExperimentConfig(train=TrainConfig(procs=4, threads=1, device=device)))
    assert split("cpu") == (4, 1)
    for device in ("cuda", "auto"):
        with pytest.raises(S2SError, match="4 processes need one GPU each; this machine has 2"):
            split(device)


def test_two_processes_match_one_process_on_the_combined_batches(prepared, one_process, tmp_path):
    two = _train(prepared, tmp_path / "two", update_freq=1, nproc=2)
    _assert_rank_0_speaks(_train.proc, two)
    _assert_same_training(one_process, two, prepared, tmp_path)


def test_train_procs_2_starts_its_ranks_and_matches_one_process(prepared, one_process, tmp_path):
    """train.procs: 2 without torchrun: s2s starts both ranks itself, with the same updates."""
    two = _train(prepared, tmp_path / "two", update_freq=1, nproc=2, launcher="s2s")
    _assert_rank_0_speaks(_train.proc, two)
    assert "rank 1" not in _train.proc.stderr and "Traceback" not in _train.proc.stderr
    _assert_same_training(one_process, two, prepared, tmp_path)
    assert json.loads((two / "config.yaml").read_text().split("procs: ")[1].split("\n")[0]) == 2


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_train_procs_2_passes_signals_to_its_ranks(prepared, tmp_path, sig):
    """Ctrl-C (or SIGTERM) to `s2s train` reaches both ranks once: they finish the update,
    rank 0 writes a checkpoint, and the exit status is 130 (143) with one line saying so."""
    run = tmp_path / "int"
    sets = [a for s in [*SETTINGS, "train.max_steps=100000", "train.validate_every=100000", "train.procs=2"]
            for a in ("--set", s)]
    proc = subprocess.Popen([sys.executable, "-m", "s2s", "train", str(prepared), "-o", str(run), *sets],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"},
                            preexec_fn=default_stop_signals)  # as a user's, not a background job's
    wait_until(lambda: logged_lines(run) >= 2, 300, proc)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + sig, err[-3000:]
    assert out == "" and "Traceback" not in err
    assert err.count("s2s: interrupted: ") == 1 and err.strip().splitlines()[-1].startswith("s2s: interrupted: ")
    assert f"stopped by {signal.Signals(sig).name}" in err and "checkpoint written" in err
    state = json.loads((list_checkpoints(run)[-1] / "state.json").read_text())["train_state"]
    assert state["step"] >= 2 and state["batching"]["world_size"] == 2
