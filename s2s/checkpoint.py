"""Training checkpoints: the file format, listing, saving, loading and resuming.

    RUN/checkpoints/step-NNNNNNNN/model.safetensors      the weights (as in a model directory)
    RUN/checkpoints/step-NNNNNNNN/optimizer.safetensors  AdamW moments and the RNG states (torch, CUDA)
    RUN/checkpoints/step-NNNNNNNN/state.json             TrainState (step, data position, validations),
                                                         the optimizer's param groups and scalars, the
                                                         s2s version and the sha256 of both files

Each checkpoint is written into a temporary directory that is renamed when
complete (``--resume`` never sees half of one); the last ``train.keep_checkpoints``
are kept.  A checkpoint is also something ``s2s translate -m`` and ``s2s average``
accept: its config and tokenizer are those of the run directory two levels up.
A run resumes from the newest checkpoint that is intact, and only with the
model, tokenizer and batching settings it was saved under.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from s2s import __version__
from s2s.config import ExperimentConfig, load_config, to_dict
from s2s.errors import S2SError
from s2s.modeldir import (
    CHECKPOINTS,
    CONFIG,
    META,
    WEIGHTS,
    check_finite,
    load_weights,
    read_meta,
    write_error,
    write_weights,
)
from s2s.textio import atomic_dir, file_sha256
from s2s.tokenizer import Tokenizer

log = logging.getLogger("s2s")

CHECKPOINT_STATE = "state.json"  # in checkpoints/step-N/, beside model.safetensors
OPTIMIZER = "optimizer.safetensors"
_CKPT_RE = re.compile(r"^step-(\d+)$")


@dataclass
class TrainState:
    step: int = 0  # optimizer updates done
    epoch: int = 0  # current epoch (0-based)
    batch: int = 0  # next batch index within the epoch's batch order
    elapsed: float = 0.0  # wall-clock seconds over all segments of the run
    best_value: Optional[float] = None
    best_step: int = 0
    validations: list = field(default_factory=list)
    batching: dict = field(default_factory=dict)  # what the data position depends on


class DamagedCheckpoint(S2SError):
    """A checkpoint that is incomplete or whose files do not match their checksums."""


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary directories are ignored)."""
    d = run_dir / CHECKPOINTS
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _CKPT_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def is_checkpoint(path: Path) -> bool:
    """A training checkpoint (checkpoints/step-N: weights and state.json, no model.json)."""
    return path.is_dir() and not (path / META).exists() and (path / CHECKPOINT_STATE).is_file()


def recorded_sha256(directory: Path) -> str:
    """The sha256 recorded for ``directory/model.safetensors``: by model.json in a model
    directory, by state.json in a training checkpoint."""
    state = directory / CHECKPOINT_STATE
    if directory.is_dir() and not (directory / META).exists() and state.is_file():
        try:
            return json.loads(state.read_text(encoding="utf-8"))["sha256"][WEIGHTS]
        except (ValueError, UnicodeDecodeError, KeyError, TypeError):
            raise S2SError(f"{state}: corrupted checkpoint state") from None
    return read_meta(directory).get("sha256")


def on_cuda(model: torch.nn.Module) -> bool:
    """Whether ``model``'s parameters are on a GPU (whose random states a checkpoint then keeps)."""
    return any(p.is_cuda for p in model.parameters())


def save_checkpoint(run_dir: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    state: TrainState, keep: int) -> Path:
    """Write RUN/checkpoints/step-N atomically (a failed write is ``step-N: write failed (...)``,
    nothing left behind) and remove all but the newest ``keep``."""
    target = run_dir / CHECKPOINTS / f"step-{state.step:08d}"
    opt = optimizer.state_dict()
    tensors = {"rng.torch": torch.get_rng_state()}
    if on_cuda(model):  # a CPU run on a GPU machine opens no CUDA context
        tensors.update({f"rng.cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    scalars = {}
    for idx, st in opt["state"].items():
        for key, value in st.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{idx}.{key}"] = value.contiguous()
            else:
                scalars[f"{idx}.{key}"] = value
    check_finite(model, target)
    with atomic_dir(target, replace=True) as tmp:  # replace: a step redone after resuming from an older one;
        # a failed write (OSError) is `target: write failed (...)`
        digests = {WEIGHTS: write_weights(model, tmp / WEIGHTS)}
        try:
            save_file(tensors, str(tmp / OPTIMIZER))
        except SafetensorError as e:  # a full disk, as safetensors reports it
            raise OSError(errno.EIO, write_error(e)) from None
        digests[OPTIMIZER] = file_sha256(tmp / OPTIMIZER)
        (tmp / CHECKPOINT_STATE).write_text(json.dumps({
            "train_state": asdict(state), "param_groups": opt["param_groups"],
            "optimizer_scalars": scalars, "s2s_version": __version__, "sha256": digests}, indent=1))
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return target


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> TrainState:
    """Restore model, optimizer and RNG from ``path``.  The files' checksums are verified
    before anything is loaded; anything that does not fit is a :class:`DamagedCheckpoint`."""
    try:
        meta = json.loads((path / CHECKPOINT_STATE).read_text(encoding="utf-8"))
        for name, digest in meta.get("sha256", {}).items():
            if file_sha256(path / name) != digest:
                raise DamagedCheckpoint(f"{path}: damaged ({name}: checksum mismatch)")
        tensors = load_file(str(path / OPTIMIZER))
    except (OSError, ValueError, SafetensorError) as e:
        raise DamagedCheckpoint(f"{path}: damaged ({e})") from None
    try:
        load_weights(model, path / WEIGHTS)
        state: dict = {}
        for name, value in tensors.items():
            if name.startswith("state."):
                _, idx, key = name.split(".", 2)
                state.setdefault(int(idx), {})[key] = value
        for name, value in meta.get("optimizer_scalars", {}).items():
            idx, key = name.split(".", 1)
            state.setdefault(int(idx), {})[key] = value
        optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
        train_state = TrainState(**meta["train_state"])
        rng = tensors["rng.torch"]
    except (S2SError, KeyError, TypeError, ValueError, RuntimeError) as e:
        raise DamagedCheckpoint(f"{path}: damaged ({e})") from None
    torch.set_rng_state(rng)
    n_cuda = sum(1 for k in tensors if k.startswith("rng.cuda."))
    cuda = [tensors[f"rng.cuda.{i}"] for i in range(n_cuda)]
    if cuda and torch.cuda.is_available() and on_cuda(model):  # as many GPUs' as this machine has
        torch.cuda.set_rng_state_all(cuda[:torch.cuda.device_count()])
    return train_state


def load_newest_intact(run_dir: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> TrainState:
    """Resume from the newest checkpoint that loads and matches its checksums;
    damaged newer ones (a disk error, a crash of the file system) are skipped with a warning."""
    for ckpt in reversed(list_checkpoints(run_dir)):
        try:
            state = load_checkpoint(ckpt, model, optimizer)
        except DamagedCheckpoint as e:
            log.warning("%s; trying the checkpoint before it", e)
            continue
        log.info("resumed from %s (step %d, epoch %d)", ckpt, state.step, state.epoch)
        return state
    raise S2SError(f"{run_dir / CHECKPOINTS}: no undamaged checkpoint to resume from; "
                   "start a new run with another -o")


def restart_advice(run_dir: Path) -> str:
    """How to go on after a failed run: --resume only when there is a checkpoint to resume from."""
    ckpts = list_checkpoints(run_dir)
    if ckpts:
        return f"--resume from the last checkpoint ({ckpts[-1]})"
    return f"start again (no checkpoint was written; remove {run_dir} or pass another -o)"


def check_resumable(run_dir: Path, cfg: ExperimentConfig, data_dir: Path) -> None:
    """A run resumes only with the model config it started with and the tokenizer it copied."""
    old = run_dir / CONFIG
    if old.is_file():
        started = load_config(old)
        before, now = to_dict(started)["model"], to_dict(cfg)["model"]
        for key in now:
            if before[key] != now[key]:
                raise S2SError(f"{old}: model.{key} differs from the run being resumed")
        if started.train.best_metric != cfg.train.best_metric:
            raise S2SError(f"{old}: train.best_metric: {cfg.train.best_metric} differs from the run being resumed "
                           f"({started.train.best_metric}), by which its best model so far was chosen")
    for p in Tokenizer.all_files(data_dir, cfg.tokenizer, cfg.data):
        mine = run_dir / p.name
        if mine.is_file() and file_sha256(mine) != file_sha256(p):
            raise S2SError(f"{p}: the tokenizer changed since {run_dir} started; "
                           "resume with the original tokenizer or start a new run")


# what a checkpoint that does not record a batching setting was saved with (runs of one process
# recorded no world_size before it was recorded always)
BATCHING_DEFAULTS = {"world_size": 1}


def check_batching(saved: dict, now: dict) -> None:
    """The data position (epoch, batch) of a checkpoint means the same batches only under the
    settings it was saved with (seed, train.max_tokens, train.update_freq, data.dir, world size)."""
    for key, value in now.items():
        before = saved.get(key, BATCHING_DEFAULTS.get(key))
        if before is not None and before != value:
            what = "processes (train.procs)" if key == "world_size" else key
            raise S2SError(f"{what}: {value} differs from the run being resumed "
                           f"({before}); the data position would not match")


def remove_stale_temporaries(run_dir: Path) -> None:
    """A checkpoint write killed midway (SIGKILL, a power cut) leaves ``.step-N.tmp-PID`` (a
    partial copy) or, between its two renames, ``.step-N.old-PID`` without ``step-N`` (the
    complete earlier one).  With the run's lock held no other writer is at work: the partial
    ones go, a complete one goes back under its name."""
    d = run_dir / CHECKPOINTS
    if not d.is_dir():
        return
    for p in d.iterdir():
        m = re.fullmatch(r"\.(step-\d+)\.(tmp|old)-\d+", p.name)
        if m is None:
            continue
        if m[2] == "old" and not (d / m[1]).exists():
            os.replace(p, d / m[1])
            log.warning("%s: restored from %s (a checkpoint write was killed between its renames)", d / m[1], p.name)
        else:
            shutil.rmtree(p, ignore_errors=True)
            log.info("%s: removed (a checkpoint write that never finished)", p)
