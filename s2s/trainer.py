"""Teacher-forced training: loss, schedule, loop, validation, checkpoints.

    decoder input = (<s>, y_1, ..., y_{m-1}),  targets = (y_1, ..., y_m)     (docs/model.md (22); done in Batch)
    L = (1/|y|) sum_t [(1-eps)(-log p_t(y_t)) + eps * mean_v(-log p_t(v))]  (label-smoothed mean token NLL)
        + (lambda/|y|) L_cov                                                 (train.coverage_weight)

A run directory (``-o RUN_DIR``) holds
    config.yaml, spm*.model, model.safetensors, model.json   the best model so far (a model directory)
    checkpoints/step-NNNNNNNN/                               the last ``keep_checkpoints`` training states
    metrics.jsonl, env.json                                   what happened, and with which versions
    train.lock                                                locked by the run training there (s2s.outdir)

A checkpoint holds the weights, the optimizer (AdamW moments), the torch RNG
state and the data position (epoch, batch), written into a temporary
directory that is renamed when complete; ``--resume`` continues from the
newest complete one exactly where it stopped (s2s.checkpoint).  What the run
reports (metrics.jsonl, env.json, the progress bar) is s2s.runlog.

:func:`make_trainer` sets up a run (threads and device, the prepared data, the
tokenizer, the datasets, the model, a distillation teacher); :class:`Trainer`
is the loop over :meth:`Trainer.updates`, the update step, validation and the
choice of the best model.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np
import torch
from torch import Tensor, nn

from s2s.allocator import keep_freed_memory, malloc_in_use, training_environ
from s2s.checkpoint import (
    TrainState,
    check_batching,
    check_resumable,
    list_checkpoints,
    load_newest_intact,
    remove_stale_temporaries,
    restart_advice,
    save_checkpoint,
)
from s2s.config import ExperimentConfig, TrainConfig, replace
from s2s.data import Batch, BinDataset, TrainingData, data_signature, token_batches, tokenizer_fingerprint
from s2s.distributed import World, all_reduce_update, init_world, launch_local, process_split, shard
from s2s.errors import Interrupted, S2SError
from s2s.loss import label_smoothed_nll
from s2s.metrics import corpus_bleu
from s2s.model import S2SModel
from s2s.model.gemm import resolve_gemm, use_openblas, use_row_blocks
from s2s.modeldir import (
    CONFIG,
    META,
    WEIGHTS,
    build_model,
    copy_tokenizer,
    load_model_dir,
    load_weights,
    read_meta,
    save_model_dir,
    write_config,
)
from s2s.outdir import check_run_dir, lock_run_dir
from s2s.precision import Bf16Copy, resolve_precision
from s2s.runlog import LogWindow, MetricsLog, Progress, write_env
from s2s.signals import signals_caught
from s2s.textio import read_lines
from s2s.tokenizer import PAD_ID, Tokenizer, resolve_tokenizer_config

log = logging.getLogger("s2s")

MAX_BAD_UPDATES = 20  # non-finite updates in a row before training gives up


class TrainingInterrupted(Interrupted):
    """SIGINT/SIGTERM/SIGHUP: the step finished and a checkpoint was written."""


# --------------------------------------------------------------------------- #
# Formulas
# --------------------------------------------------------------------------- #

def inverse_sqrt_lr(step: int, peak: float, warmup: int) -> float:
    """lr(s) = peak * min(s / warmup, sqrt(warmup / s))   for update s >= 1.

    Linear warmup to ``peak`` at s = warmup, then decay proportional to
    1/sqrt(s).  warmup = 0 keeps lr = peak.
    """
    if warmup == 0:
        return peak
    s = max(step, 1)
    return peak * min(s / warmup, math.sqrt(warmup / s))


def distillation_loss(student: Tensor, teacher: Tensor, target: Tensor, lam: float, T: float,
                      epsilon: float = 0.0, pad_id: int = PAD_ID) -> Tensor:
    """L_KD = (1 - lam) CE(y, p^s) + lam T^2 KL(p^t_T || p^s_T)   (docs/model.md (44)),

    p_T = softmax(z / T), summed over non-pad target positions.  student and
    teacher (B, T, V) scores, target (B, T) -> scalar sum.  CE is the label-smoothed
    NLL with ``epsilon`` (0: plain); lam = 0 gives exactly CE.
    """
    ce = label_smoothed_nll(student, target, epsilon, pad_id)
    if lam == 0:
        return ce
    log_ps = torch.log_softmax(student.float() / T, dim=-1)
    log_pt = torch.log_softmax(teacher.float() / T, dim=-1)
    kl = (log_pt.exp() * (log_pt - log_ps)).sum(-1)  # (B, T)
    return (1 - lam) * ce + lam * T * T * kl[target != pad_id].sum()


def is_new_best(value: Optional[float], loss: Optional[float], best_value: Optional[float],
                best_loss: Optional[float], higher_is_better: bool) -> bool:
    """A validation's dev score ``value`` beats the best so far: higher (BLEU) or lower (loss);
    on a tie, the lower dev loss wins (a young model's dev BLEU is 0.0 at every validation
    while its dev loss falls).  No score yet (None) never wins; the first score always does."""
    if value is None:
        return False
    if best_value is None:
        return True
    if value != best_value:
        return value > best_value if higher_is_better else value < best_value
    return loss is not None and best_loss is not None and loss < best_loss


def coverage_loss(a: Tensor, tgt_mask: Tensor) -> Tensor:
    """L_cov = sum_t sum_j min(A_tj, c^t_j),   c^t = sum_{t' < t} A_t'   (docs/model.md (40)).

    a (B, T, S) attention over the source at each target position, tgt_mask
    (B, T) true at real (non-pad) target positions -> scalar sum over the batch.
    """
    c = a.cumsum(dim=1) - a  # (B, T, S): attention received before step t
    return (torch.minimum(a, c).sum(-1) * tgt_mask).sum()


# --------------------------------------------------------------------------- #
# Setting up a run
# --------------------------------------------------------------------------- #

def check_prepared(cfg: ExperimentConfig) -> None:
    """data.dir holds data prepared from this config's data settings with its tokenizer."""
    if not cfg.data.split_corpora("train"):
        raise S2SError("data.train: no training corpus configured")
    data_dir = Path(cfg.data.dir)
    meta_path = data_dir / "meta.json"
    if not meta_path.is_file():
        raise S2SError(f"{meta_path}: prepared data not found (run `s2s prepare CONFIG` first)")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, OSError) as e:
        raise S2SError(f"{meta_path}: corrupted ({e}); run `s2s prepare CONFIG` again") from None
    if not isinstance(meta, dict) or meta.get("data") != data_signature(cfg):
        raise S2SError(f"{data_dir}: prepared with other data settings or incompletely; "
                       "run `s2s prepare CONFIG` again")
    if meta.get("tokenizer") != tokenizer_fingerprint(cfg, data_dir):
        raise S2SError(f"{data_dir}: the data was prepared with another tokenizer; "
                       "run `s2s prepare CONFIG` again")


def setup_environment(tc: TrainConfig) -> tuple[World, torch.device]:
    """This process's rank and device (s2s.distributed; train.device), torch's threads
    (train.threads) and, training on the CPU, malloc keeping freed memory for the next
    update's tensors (s2s.allocator); the log says which allocator serves them."""
    world, device = init_world(tc.device)
    if tc.threads:
        torch.set_num_threads(tc.threads)
    if device.type == "cpu":
        keep_freed_memory()
        hint = ("" if training_environ(os.environ) is None else
                "; `s2s train` would start with mimalloc or huge pages (s2s.allocator.training_environ)")
        log.info("host memory: %s%s", malloc_in_use(), hint)
    return world, device


def skips_on_device(device: torch.device) -> bool:
    """Whether a non-finite update is skipped by the optimizer on the device (fused AdamW's
    found_inf) instead of by the host: on a GPU, where reading the finiteness back after
    every update would stall the queue of kernels.  The host then learns of skipped updates
    at the next log line (see :meth:`Trainer.check_skipped`)."""
    return device.type == "cuda"


def fused_adamw(device: torch.device) -> bool:
    """Whether AdamW updates every parameter in one fused kernel (``fused=True``) rather than
    torch's multi-tensor loops (``foreach``): on a GPU (where it also skips non-finite
    updates itself, see :func:`skips_on_device`) and on the CPU, where it reads and writes
    the weights and moments once: 4.1 ms against 16.9 ms for the reference model's 7.6M
    parameters (one step, 2 threads of an Intel Xeon with AMX)."""
    return device.type in ("cuda", "cpu")


def batch_objective(model: nn.Module, src: Tensor, tgt_in: Tensor, tgt_out: Tensor, pad_id: int,
                    epsilon: float, coverage_weight: float = 0.0, teacher_scores: Optional[Tensor] = None,
                    kd_lambda: float = 0.0, kd_temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """One batch's forward pass and (L, L + lambda L_cov): L the label-smoothed NLL summed over
    the real target positions, or with ``teacher_scores`` (n, V) the distillation loss.  The
    step train.compile runs through torch.compile (with its backward)."""
    keep = tgt_out != pad_id  # (B, T): scores only at real targets
    target = tgt_out[keep]  # (n,)
    if coverage_weight:
        logits, a = model(src, tgt_in, return_attention=True, keep=keep)  # (n, V), a (B, T, S)
    elif teacher_scores is None and not model.cfg.copy:  # the head and the loss in one pass (head_nll)
        h = model(src, tgt_in, keep=keep, head=False)  # (n, d_model)
        loss = model.head_nll(h, target, epsilon, pad_id)
        return loss, loss
    else:
        logits = model(src, tgt_in, keep=keep)  # (n, V)
    if teacher_scores is None:
        loss = label_smoothed_nll(logits, target, epsilon, pad_id)
    else:
        loss = distillation_loss(logits, teacher_scores, target, kd_lambda, kd_temperature, epsilon, pad_id)
    objective = loss + coverage_weight * coverage_loss(a.float(), keep) if coverage_weight else loss
    return loss, objective


def load_teacher(cfg: ExperimentConfig, data_dir: Path, device: torch.device) -> S2SModel:
    """The distillation teacher (train.distill.teacher): frozen, in eval mode, with the
    student's tokenizer."""
    from s2s.config import load_config

    directory = Path(cfg.train.distill.teacher)
    read_meta(directory)  # a model directory, or a one-line error saying what it is not
    theirs = load_config(directory / CONFIG)
    if tokenizer_fingerprint(theirs, directory) != tokenizer_fingerprint(cfg, data_dir):
        raise S2SError(f"train.distill.teacher: {directory} has another tokenizer than "
                       f"{data_dir}; the student must use the teacher's vocabulary")
    teacher = load_model_dir(directory, device)
    for p in teacher.model.parameters():
        p.requires_grad_(False)
    return teacher.model.eval()


def prepared_datasets(cfg: ExperimentConfig, tok: Tokenizer) -> tuple[TrainingData, Optional[TrainingData]]:
    """The prepared train and dev splits of data.dir (no dev split without data.dev)."""
    ids = {"pad_id": tok.pad_id, "bos_id": tok.bos_id}
    data_dir = Path(cfg.data.dir)
    dev = BinDataset(data_dir, "dev", **ids) if cfg.data.split_corpora("dev") else None
    return BinDataset(data_dir, "train", **ids), dev


Datasets = Callable[[ExperimentConfig, Tokenizer], tuple[TrainingData, Optional[TrainingData]]]


def make_trainer(cfg: ExperimentConfig, run_dir: Path, datasets: Datasets = prepared_datasets,
                 show_progress: bool = True) -> Trainer:
    """A Trainer for ``cfg`` writing ``run_dir``, training on what ``datasets(cfg, tokenizer)``
    returns (the prepared splits; denoised ones for pretraining): threads and device set, the
    prepared data checked, the model built from ``seed`` (and train.init_from), the teacher loaded."""
    cfg = resolve_tokenizer_config(cfg)
    world, device = setup_environment(cfg.train)
    torch.manual_seed(cfg.seed)
    check_prepared(cfg)
    data_dir = Path(cfg.data.dir)
    tok = Tokenizer.load(data_dir, cfg.tokenizer, cfg.data)
    train_data, dev_data = datasets(cfg, tok)
    model: S2SModel = build_model(cfg, tok).to(device)
    if cfg.train.init_from:
        init = Path(cfg.train.init_from)
        load_weights(model, init / WEIGHTS, read_meta(init).get("sha256"))
    teacher = load_teacher(cfg, data_dir, device) if cfg.train.distill.teacher else None
    return Trainer(cfg, run_dir, model, tok, train_data, dev_data, teacher, world, device, show_progress)


@contextlib.contextmanager
def claim_run_dir(run_dir: Path, world: World) -> Iterator[None]:
    """Rank 0 checks that the run directory is new, empty or a run directory of its own,
    and holds its lock until training ends (s2s.outdir); when that fails, every rank stops."""
    with contextlib.ExitStack() as held:
        error = None
        if world.is_main:
            try:
                check_run_dir(run_dir)
                held.enter_context(lock_run_dir(run_dir))
            except S2SError as e:
                error = e
        if world.any(error is not None):
            raise error or S2SError(f"{run_dir}: rank 0 could not take the run directory")
        yield


def open_run_dir(run_dir: Path, resume: bool, world: World) -> bool:
    """Create the run directory (rank 0); one holding a run is used only with ``resume``.
    Returns whether there are checkpoints to resume from."""
    ckpts = list_checkpoints(run_dir)
    has_run = bool(ckpts) or (run_dir / META).exists()
    if has_run and not resume:
        raise S2SError(f"{run_dir}: already holds a training run; pass --resume to continue it "
                       "or -o to choose another directory")
    if run_dir.exists() and not run_dir.is_dir():
        raise S2SError(f"{run_dir}: exists and is not a directory")
    try:
        if world.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise S2SError(f"{run_dir}: cannot create the run directory ({e.strerror})") from None
    if resume and not ckpts and (run_dir / META).exists():
        raise S2SError(f"{run_dir}: --resume: no checkpoint to resume from, and it holds a trained model "
                       f"({META}) that a new run would replace; choose another -o to train again (or, to "
                       f"start over here, remove {run_dir / META} yourself)")
    if resume and not ckpts:
        log.info("%s: no checkpoint to resume from; starting a new run", run_dir)
    return resume and bool(ckpts)


# --------------------------------------------------------------------------- #
# The trainer
# --------------------------------------------------------------------------- #

class Trainer:
    """The loop over :meth:`updates`, the update step, validation and the best model.
    Built by :func:`make_trainer`."""

    def __init__(self, cfg: ExperimentConfig, run_dir: Path, model: S2SModel, tok: Tokenizer,
                 train_data: TrainingData, dev_data: Optional[TrainingData] = None,
                 teacher: Optional[S2SModel] = None, world: World = World(),
                 device: torch.device = torch.device("cpu"), show_progress: bool = True):
        self.cfg, self.tc, self.run_dir = cfg, cfg.train, run_dir
        self.data_dir = Path(cfg.data.dir)
        self.world, self.device = world, device
        self.show_progress = show_progress and world.is_main
        self.tok, self.train_data, self.dev_data = tok, train_data, dev_data
        self.model, self.teacher = model, teacher
        self.precision = resolve_precision(self.tc.precision, device, "train.precision")
        # the weights the passes run on: the model's own (fp32), or their bf16 copy made once per
        # update, whose gradients flow back into the model's fp32 ones (the optimizer's master weights)
        self.bf16 = Bf16Copy(model) if self.precision == "bf16" else None
        self.work = model if self.bf16 is None else self.bf16.module
        if self.bf16 is not None and device.type == "cpu":
            use_row_blocks(self.work)  # oneDNN's bf16 kernels built once per row block, not per batch
        if self.precision == "fp32" and resolve_gemm(self.tc.gemm, device, "train.gemm") == "openblas":
            use_openblas(model)
            if self.tc.compile:
                log.warning("train.gemm openblas: train.compile's graphs multiply with torch's BLAS")
        elif self.tc.gemm == "openblas":
            log.warning("train.gemm openblas: %s precision multiplies with torch's BLAS (OpenBLAS is fp32 only)",
                        self.precision)
        # one batch's forward pass and loss: as written, or through torch.compile (train.compile)
        self.objective = torch.compile(batch_objective, dynamic=True) if self.tc.compile else batch_objective
        self.skip_on_device = skips_on_device(device)
        fused = {"fused": True} if fused_adamw(device) else {"foreach": True}
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=self.tc.lr, betas=(self.tc.adam_beta1, self.tc.adam_beta2),
            eps=self.tc.adam_eps, weight_decay=self.tc.weight_decay, **fused)
        # updates skipped on the device (skip_on_device): in all, and in a row at the last one
        self.skipped = torch.zeros((), device=device)
        self.skipped_in_a_row = torch.zeros((), device=device)
        self.adding_grads = False  # whether the last failed pass had begun adding to .grad (forward_backward)
        self.state = TrainState()
        self.metrics = MetricsLog(run_dir)
        self._signal: Optional[int] = None

    def batching(self) -> dict:
        return {"seed": self.cfg.seed, "train.max_tokens": self.tc.max_tokens,
                "train.update_freq": self.tc.update_freq, "data.dir": str(self.data_dir),
                "world_size": self.world.size}

    def seed_rank(self) -> None:
        """Ranks other than 0 draw their own dropout masks: a seed of (seed, rank, step).
        (All ranks built the same initial weights from ``seed`` before this.)"""
        if self.world.rank:
            torch.manual_seed(int(np.random.SeedSequence([self.cfg.seed, self.world.rank,
                                                          self.state.step]).generate_state(1)[0]))

    def epoch_batches(self, epoch: int) -> list[np.ndarray]:
        """The batch order of an epoch: a pure function of (seed, epoch)."""
        rng = np.random.default_rng([self.cfg.seed, epoch])
        return token_batches(self.train_data.src_lens, self.train_data.tgt_lens, self.tc.max_tokens, rng)

    def updates(self, stop: Callable[[], bool]) -> Iterator[list[Batch]]:
        """This rank's batches of each update, from the data position in ``self.state`` on, epoch
        after epoch; ``stop()`` is asked before each.  The position advances past an update's
        batches as they are handed out, to the next epoch after its last update.  The next
        update's batches are built on a thread while this one trains."""
        st = self.state
        per_update = self.tc.update_freq * self.world.size
        pin = self.device.type == "cuda"  # page-locked: copied to the GPU without waiting (non_blocking)
        prefetch = Prefetcher(lambda epoch, group: [self.train_data.batch(idx, epoch=epoch).pinned(pin)
                                                    for idx in shard(group, self.world)])
        order = self.epoch_batches(st.epoch)
        try:
            while True:
                if st.batch >= len(order):  # the epoch is done
                    st.epoch, st.batch = st.epoch + 1, 0
                    order = self.epoch_batches(st.epoch)
                if stop():
                    return
                group = order[st.batch:st.batch + per_update]
                data = prefetch.take((st.epoch, st.batch), group)
                st.batch += len(group)
                if st.batch < len(order):
                    prefetch.ahead((st.epoch, st.batch), order[st.batch:st.batch + per_update])
                yield data
        finally:
            prefetch.close()

    def autocast(self):
        """bf16 autocast for the passes without gradients (the teacher, the dev loss) in bf16 runs."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.precision == "bf16")

    # ---- one update -------------------------------------------------- #
    def train_step(self, batches: list[Batch]) -> tuple[Tensor, bool, tuple]:
        """Forward/backward over this rank's batches of the update, one AdamW update.

        Returns the summed label-smoothed loss, whether the update was applied
        (a non-finite loss or gradient skips it), and the update's token counts (target,
        source + target, target tokens in the loss); over all ranks when data-parallel.
        Where the device skips non-finite updates itself (:func:`skips_on_device`) nothing
        is read back: the update counts as applied here and :meth:`check_skipped` tells
        later; a skipped one's loss is 0, and so is its third count (a tensor on the device:
        the tokens of :meth:`LogWindow.mean_loss`).
        """
        if self.bf16 is not None:
            self.bf16.refresh()  # theta_16 = bf16(theta), once per update
        self.model.train()
        self.work.train()
        n_tgt = sum(b.n_tgt_tokens for b in batches)
        n_all = n_tgt + sum(b.n_src_tokens for b in batches)
        # one process: gradients of L / n_tokens; data-parallel: of L, divided after the all-reduce
        total = self.accumulate_gradients(batches, n_tgt if self.world.size == 1 else 1)
        if self.world.size > 1:
            summed = all_reduce_update(self.model.parameters(),
                                       torch.stack([total, total.new_tensor(float(n_tgt)),
                                                    total.new_tensor(float(n_all))]))
            total, n_tgt, n_all = summed[0], int(summed[1]), int(summed[2])
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.div_(max(n_tgt, 1))
        lr = inverse_sqrt_lr(self.state.step + 1, self.tc.lr, self.tc.warmup_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        max_norm = self.tc.clip_norm if self.tc.clip_norm > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        finite = torch.isfinite(grad_norm + total)  # loss and gradient
        if self.skip_on_device:
            bad = (~finite).float()
            self.optimizer.found_inf = bad  # fused AdamW leaves weights and moments as they are
            self.optimizer.step()
            self.skipped += bad
            self.skipped_in_a_row = (self.skipped_in_a_row + 1) * bad
            self.optimizer.zero_grad(set_to_none=True)
            return torch.where(finite, total, 0.0), True, (n_tgt, n_all, finite * n_tgt)  # tokens of the mean loss
        ok = bool(finite)  # one host sync (free on a CPU, which computes synchronously)
        if ok:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total, ok, (n_tgt, n_all, n_tgt)

    def check_skipped(self, reported: int) -> int:
        """Updates the device skipped (non-finite loss or gradient) since ``reported`` of them were
        warned about: one warning; an error after MAX_BAD_UPDATES in a row.  Returns the count
        so far.  (A host sync: called at log lines and validations only.)"""
        skipped, in_a_row = int(self.skipped), int(self.skipped_in_a_row)
        if skipped > reported:
            log.warning("step %d: %d update(s) with a non-finite loss or gradient skipped since the last "
                        "report (%d in all)", self.state.step, skipped - reported, skipped)
        if in_a_row >= MAX_BAD_UPDATES:
            raise S2SError(f"{self.run_dir}: {in_a_row} non-finite updates in a row up to step "
                           f"{self.state.step}; lower train.lr or check the data, "
                           f"then {restart_advice(self.run_dir)}")
        return skipped

    def accumulate_gradients(self, batches: list[Batch], n_tokens: int) -> Tensor:
        """The update's summed loss, and the gradients of its batches (scaled by 1/n_tokens) in .grad.

        A batch that runs out of memory is split in two halves with a warning naming its size
        (recursively; one sentence that does not fit is an error), and the update's gradient
        is the same (but for the dropout masks the halves draw).  A pass that failed before it
        began adding to the model's .grad leaves nothing behind; one that failed after (an fp32
        backward adds as it goes; a bf16 pass adds the bf16 copy's gradients once its backward
        is done) may have added part of its gradient, so the update's gradients are dropped and
        its batches run again from the first, the failed one in halves.
        """
        pending = list(batches)
        total = torch.zeros((), device=self.device)
        i = 0
        while i < len(pending):
            loss = self.forward_backward(pending[i].to(self.device, non_blocking=True), n_tokens)
            if loss is not None:
                total += loss
                i += 1
                continue
            pending[i:i + 1] = self.halves_of_too_big(pending[i])
            if self.adding_grads:  # part of the failed pass's gradient may be in .grad
                self.optimizer.zero_grad(set_to_none=True)
                total, i = torch.zeros((), device=self.device), 0
        return total

    def forward_backward(self, b: Batch, n_tokens: int) -> Optional[Tensor]:
        """The loss of one batch, its gradients (scaled by 1/n_tokens of the update) added to
        .grad; None when it ran out of memory (the bf16 copy's partial gradients dropped, the
        GPU's cached blocks freed; ``adding_grads`` says whether it had begun adding to the
        model's .grad)."""
        self.adding_grads = False
        try:
            return self._forward_backward(b, n_tokens)
        except RuntimeError as e:  # torch.OutOfMemoryError on a GPU; a failed allocation on the CPU
            if not isinstance(e, torch.OutOfMemoryError) and "can't allocate memory" not in str(e):
                raise
        # past the except block: its traceback, which held every frame of the failed pass and
        # their activations, is gone, so their memory is free before the halves run
        if self.bf16 is not None:
            for p in self.work.parameters():
                p.grad = None  # the failed pass's partial gradients
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return None

    def _forward_backward(self, b: Batch, n_tokens: int) -> Tensor:
        pad, kd = self.tok.pad_id, self.tc.distill
        teacher_scores = None
        if self.teacher is not None:
            with torch.no_grad(), self.autocast():
                teacher_scores = self.teacher(b.src, b.tgt_in, keep=b.tgt_out != pad)  # (n, V)
        loss, objective = self.objective(self.work, b.src, b.tgt_in, b.tgt_out, pad, self.tc.label_smoothing,
                                         self.tc.coverage_weight, teacher_scores, kd.lambda_, kd.temperature)
        self.adding_grads = self.bf16 is None  # an fp32 backward adds to .grad as it goes
        (objective / n_tokens).backward()
        if self.bf16 is not None:
            self.adding_grads = True
            self.bf16.accumulate_grads()  # grad theta += fp32(grad theta_16)
        return loss.detach()

    def halves_of_too_big(self, b: Batch) -> tuple[Batch, Batch]:
        """A batch that ran out of memory, in two halves with a warning; one sentence: an error."""
        shape = f"{len(b)} sentences x {b.src.size(1)} source / {b.tgt_in.size(1)} target tokens"
        if len(b) == 1:
            raise S2SError(f"step {self.state.step + 1}: out of memory on one sentence ({shape}); "
                           "lower data.max_tokens_per_sentence")
        log.warning("step %d: a batch of %s ran out of memory; splitting it in two", self.state.step + 1, shape)
        return b.halves()

    # ---- validation -------------------------------------------------- #
    @torch.inference_mode()
    def dev_loss(self) -> float:
        """Mean token NLL (no smoothing) over the dev split."""
        self.model.eval()
        nll, n = torch.zeros((), device=self.device), 0  # summed on the device, read once
        for idx in token_batches(self.dev_data.src_lens, self.dev_data.tgt_lens, self.tc.max_tokens):
            b = self.dev_data.batch(idx, epoch=0).to(self.device)  # the same batches (and noise) every time
            with self.autocast():
                logits = self.model(b.src, b.tgt_in)
            nll += label_smoothed_nll(logits, b.tgt_out, 0.0, self.tok.pad_id)
            n += b.n_tgt_tokens
        return float(nll) / max(n, 1)

    def dev_bleu(self) -> Optional[float]:
        k = self.tc.dev_bleu_sentences
        if not k:
            return None
        from s2s.translate import Translator

        src = list(_head(read_lines(self.data_dir / "dev.src.txt"), k))
        ref = list(_head(read_lines(self.data_dir / "dev.tgt.txt"), k))
        decode = replace(self.cfg.decode, "decode.", beam=self.tc.dev_beam, nbest=1)
        self.model.eval()
        hyps = Translator(self.model, self.tok, decode, self.device).translate(src)
        return corpus_bleu(hyps, ref)

    def validate(self) -> dict:
        t0 = time.time()
        record: dict = {"step": self.state.step, "epoch": self.state.epoch}
        if self.dev_data is not None:
            record["dev_loss"] = round(self.dev_loss(), 4)
            record["dev_ppl"] = round(math.exp(min(record["dev_loss"], 50)), 2)
            bleu = self.dev_bleu()
            if bleu is not None:
                record["dev_bleu"] = round(bleu, 2)
        record["seconds"] = round(time.time() - t0, 1)
        key = "dev_bleu" if self.tc.best_metric == "bleu" else "dev_loss"
        value = record.get(key)
        best = next((v for v in reversed(self.state.validations) if v.get("best")), {})
        better = is_new_best(value, record.get("dev_loss"), self.state.best_value, best.get("dev_loss"),
                             higher_is_better=key == "dev_bleu")
        if better or self.dev_data is None:
            self.state.best_value, self.state.best_step = value, self.state.step
            info = {"step": self.state.step, **{k: v for k, v in record.items() if k.startswith("dev")}}
            save_model_dir(self.run_dir, self.model, self.cfg, self.data_dir, info)
        record["best"] = better
        self.state.validations.append(record)
        self.metrics.write(record)
        log.info("validation | step %d | %s%s", self.state.step,
                 " | ".join(f"{k} {v}" for k, v in record.items() if k.startswith("dev")),
                 " | new best" if better else "")
        return record

    # ---- the run ----------------------------------------------------- #
    def _on_signal(self, signum, frame) -> None:
        if self._signal is not None:  # a second Ctrl-C: stop now
            raise KeyboardInterrupt
        self._signal = signum
        log.warning("%s received: finishing this step and writing a checkpoint",
                    signal.Signals(signum).name)

    def start(self, resume: bool) -> None:
        """A new run in the run directory, or (``resume``) the newest intact checkpoint of the
        same model, tokenizer and batching; then config, tokenizer and env.json are written."""
        if self.world.is_main:
            remove_stale_temporaries(self.run_dir)
        self.world.barrier()  # every rank lists the checkpoints as rank 0 left them
        if open_run_dir(self.run_dir, resume, self.world):
            check_resumable(self.run_dir, self.cfg, self.data_dir)
            self.state = load_newest_intact(self.run_dir, self.model, self.optimizer)
            check_batching(self.state.batching, self.batching())
        if self.world.is_main:  # what a killed run logged after its last checkpoint (or before any) goes
            self.metrics.keep_until(self.state.step)
        self.state.batching = self.batching()
        self.seed_rank()
        if self.world.is_main:
            write_config(self.run_dir, self.cfg)
            copy_tokenizer(self.cfg, self.data_dir, self.run_dir)
            write_env(self.run_dir)

    def elapsed(self) -> float:
        """Wall-clock seconds of the whole run, earlier (resumed) segments included."""
        return self._base_elapsed + time.time() - self._started

    def patience_spent(self) -> bool:
        """train.early_stopping: that many validations in a row brought no new best."""
        n = self.tc.early_stopping
        recent = self.state.validations[-n:] if n else []
        return bool(n) and len(recent) == n and not any(v["best"] for v in recent)

    def finished(self, last_val_seconds: float) -> bool:
        tc, st = self.tc, self.state
        elapsed = self.elapsed()
        return (self.patience_spent()
                or (tc.max_steps and st.step >= tc.max_steps)
                or (tc.max_epochs and st.epoch >= tc.max_epochs)
                or elapsed + last_val_seconds >= tc.max_seconds)

    def limit_reached(self, last_val_seconds: float) -> str:
        """Which limit ``finished`` hit, and the key that lifts it."""
        tc, st = self.tc, self.state
        if self.patience_spent():
            return (f"train.early_stopping: {tc.early_stopping} validations without a better dev "
                    f"{tc.best_metric}; raise train.early_stopping to continue")
        if tc.max_steps and st.step >= tc.max_steps:
            return f"train.max_steps={tc.max_steps} reached; raise train.max_steps to continue"
        if tc.max_epochs and st.epoch >= tc.max_epochs:
            return f"train.max_epochs={tc.max_epochs} reached; raise train.max_epochs to continue"
        return (f"the time budget train.max_time={tc.max_time} is used ({self.elapsed():.0f} s trained, "
                f"{last_val_seconds:.0f} s per validation); raise train.max_time to continue")

    def should_stop(self, last_val_seconds: float) -> bool:
        """Stop before the next update: a limit is reached or a signal came (on any rank)."""
        return self.world.any(self._signal is not None or self.finished(last_val_seconds))

    def run(self, resume: bool = False) -> Path:
        """Train, holding the run directory's lock throughout."""
        with claim_run_dir(self.run_dir, self.world):
            return self._run(resume)

    def _run(self, resume: bool) -> Path:
        self.start(resume)
        main = self.world.is_main
        tc, st = self.tc, self.state
        if main:
            self.metrics.open()
        progress = Progress(tc.max_steps or None, tc.max_seconds, self.show_progress)
        self._base_elapsed, self._started = st.elapsed, time.time()
        last_val = st.validations[-1]["seconds"] if st.validations else 0.0
        if resume and self.finished(last_val):
            log.warning("%s: nothing to train: %s", self.run_dir, self.limit_reached(last_val))
        window = LogWindow()
        bad_steps = 0
        skipped = 0  # updates the device skipped that were reported (skip_on_device)
        validated_at = st.validations[-1]["step"] if st.validations else -1
        updates = self.updates(lambda: self.should_stop(last_val))
        try:
            with signals_caught(self._on_signal), contextlib.closing(updates):
                for data in updates:
                    loss, ok, (_, n_all, n_in_loss) = self.train_step(data)
                    if not ok:
                        bad_steps += 1
                        log.warning("step %d: non-finite loss or gradient (batch %d of epoch %d), "
                                    "update skipped", st.step + 1, st.batch, st.epoch + 1)
                        if bad_steps >= MAX_BAD_UPDATES:
                            raise S2SError(f"{self.run_dir}: {bad_steps} non-finite updates in a row "
                                           f"after step {st.step}; lower train.lr or check the data, "
                                           f"then {restart_advice(self.run_dir)}")
                        continue
                    bad_steps = 0
                    st.step += 1
                    window.add(loss, n_all, n_in_loss)
                    progress.step(st.step, self.elapsed(),
                                  lambda loss=loss, n=n_in_loss: float(loss) / max(float(n), 1))
                    if self.skip_on_device and (st.step % tc.log_every == 0 or st.step % tc.validate_every == 0):
                        skipped = self.check_skipped(skipped)
                    if st.step % tc.log_every == 0:
                        if main:
                            self.log_progress(window, progress)
                        window = LogWindow()
                    if st.step % tc.validate_every == 0:
                        if main:
                            last_val = self.validate()["seconds"]
                            self.checkpoint()
                        validated_at = st.step
                if self.skip_on_device:
                    skipped = self.check_skipped(skipped)
                if main:
                    if self._signal is None and validated_at != st.step:
                        self.validate()
                    self.checkpoint()
                self.world.barrier()  # no rank leaves before the last checkpoint is written
        finally:
            progress.close()
            self.metrics.close()
        if self._signal is not None:
            name = signal.Signals(self._signal).name
            raise TrainingInterrupted(
                f"{self.run_dir}: stopped by {name} at step {st.step}; checkpoint written, "
                f"continue with `s2s train CONFIG -o {self.run_dir} --resume`", 128 + self._signal)
        st.elapsed = self.elapsed()
        if self.patience_spent():
            log.info("early stopping: %d validations without a better dev %s", tc.early_stopping,
                     tc.best_metric)
        log.info("done: %d steps, %.1f min; best %s %s at step %d; model in %s", st.step,
                 st.elapsed / 60, tc.best_metric, st.best_value, st.best_step, self.run_dir)
        return self.run_dir

    def log_progress(self, window: LogWindow, progress: Progress) -> None:
        """One metrics.jsonl line and a progress update: the mean loss since the last one."""
        st = self.state
        seconds = max(time.time() - window.started, 1e-9)
        mean = window.mean_loss()  # the window's host sync (its only one)
        rate = window.all_tokens / seconds
        lr = self.optimizer.param_groups[0]["lr"]
        elapsed = self.elapsed()
        self.metrics.write({"step": st.step, "epoch": st.epoch, "loss": round(mean, 4), "lr": lr,
                            "tok_s": round(rate), "elapsed": round(elapsed, 1)})
        eta = progress.eta(st.step, elapsed, window.steps / seconds)
        progress.update(st.step, f"mean loss {mean:.3f} | lr {lr:.2e} | {rate:,.0f} tok/s | ETA {eta}", elapsed)

    def checkpoint(self) -> None:
        """Rank 0's training state into checkpoints/step-N (atomically)."""
        self.state.elapsed = self.elapsed()
        save_checkpoint(self.run_dir, self.model, self.optimizer, self.state, self.tc.keep_checkpoints)


class Prefetcher:
    """Builds an update's batches on a background thread while the previous update
    computes (torch releases the GIL inside its kernels).  Batches are named by
    their data position (epoch, batch index): ``take`` returns those ``ahead``
    built for the same position, or builds them now; ``build(epoch, group)``."""

    def __init__(self, build: Callable[[int, list[np.ndarray]], list[Batch]]):
        self._build = build
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="s2s-batches")
        self._position: Optional[tuple[int, int]] = None
        self._future: Optional[Future] = None

    def ahead(self, position: tuple[int, int], group: list[np.ndarray]) -> None:
        self._position, self._future = position, self._pool.submit(self._build, position[0], group)

    def take(self, position: tuple[int, int], group: list[np.ndarray]) -> list[Batch]:
        if self._future is not None and self._position == position:
            future, self._future, self._position = self._future, None, None
            return future.result()
        return self._build(position[0], group)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def _head(it, k: int):
    for i, x in enumerate(it):
        if i >= k:
            return
        yield x


def run_dir_of_config(cfg: ExperimentConfig, run_dir: Optional[str | Path]) -> Path:
    """``-o RUN_DIR``, else the config's output_dir."""
    target = run_dir or cfg.output_dir
    if not target:
        raise S2SError("output_dir: no run directory; set output_dir in the config or pass -o RUN_DIR")
    return Path(target)


def run_training(command: str, cfg: ExperimentConfig, run_dir: Optional[str | Path], resume: bool,
                 show_progress: bool, datasets=None, trainer_cfg: Optional[ExperimentConfig] = None) -> Path:
    """``s2s train`` or ``s2s pretrain`` (``command``): one process, or with train.procs > 1 (or
    auto) the data-parallel ranks as processes of their own; return the run (= model) directory.
    ``datasets`` (default: the prepared splits) and ``trainer_cfg`` (default: ``cfg``) go to
    :func:`make_trainer`."""
    target = run_dir_of_config(cfg, run_dir)
    procs, threads = process_split(cfg)
    if procs > 1:
        launch_local(command, cfg, target, resume, show_progress, procs, threads)
        return target
    return make_trainer(trainer_cfg or cfg, target, datasets or prepared_datasets, show_progress).run(resume)


def train(cfg: ExperimentConfig, run_dir: Optional[str | Path] = None, resume: bool = False,
          show_progress: bool = True) -> Path:
    """Train a model as ``cfg`` describes; return the run (= model) directory.
    With train.procs > 1 (or auto) the data-parallel ranks run as processes of their own."""
    return run_training("train", cfg, run_dir, resume, show_progress)
