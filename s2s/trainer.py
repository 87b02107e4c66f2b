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
newest complete one exactly where it stopped.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import platform
import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from s2s import __version__
from s2s.config import ExperimentConfig, replace, to_dict
from s2s.distributed import all_reduce_update, init_world, launch_local, process_split, shard
from s2s.data import BinDataset, Batch, data_signature, token_batches, tokenizer_fingerprint
from s2s.errors import Interrupted, S2SError
from s2s.metrics import corpus_bleu
from s2s.model import S2SModel
from s2s.checkpoint import (TrainState, list_checkpoints, load_newest_intact, restart_advice,
                            save_checkpoint)
from s2s.modeldir import (CONFIG, META, WEIGHTS, build_model, copy_tokenizer, load_model_dir, load_weights,
                          read_meta, save_model_dir, write_config)
from s2s.outdir import check_run_dir, lock_run_dir
from s2s.textio import atomic_write, file_sha256, read_lines
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


def label_smoothed_nll(logits: Tensor, target: Tensor, epsilon: float, pad_id: int = PAD_ID) -> Tensor:
    """sum over non-pad t of (1-eps)(-log p_t(y_t)) + eps * (1/V) sum_v (-log p_t(v)).

    logits (B, T, V), target (B, T) (or only the real positions: (n, V), (n,))
    -> scalar sum (divide by the token count for the mean).  eps = 0 gives the plain NLL.
    """
    V = logits.size(-1)
    return F.cross_entropy(logits.reshape(-1, V).float(), target.reshape(-1), ignore_index=pad_id,
                           reduction="sum", label_smoothing=epsilon)


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
# Progress on stderr
# --------------------------------------------------------------------------- #

def clock(seconds: float) -> str:
    """H:MM:SS."""
    secs = max(0, int(seconds))
    return f"{secs // 3600}:{secs % 3600 // 60:02d}:{secs % 60:02d}"


def progress_line(step: int, total_steps: Optional[int], elapsed: float, max_seconds: float,
                  loss: Optional[float], info: str = "") -> str:
    """What the bar says: the step (of max_steps), time used and left of max_time, the last loss."""
    parts = [f"step {step:,}" + (f"/{total_steps:,}" if total_steps else "")]
    if math.isfinite(max_seconds):
        parts.append(f"{clock(elapsed)} used, {clock(max_seconds - elapsed)} left of {clock(max_seconds)}")
    else:
        parts.append(clock(elapsed))
    if loss is not None:
        parts.append(f"loss {loss:.3f}")
    if info:
        parts.append(info)
    return " | ".join(parts)


class Progress:
    """A rich progress bar when stderr is a terminal, else a log line every ``log_every`` steps.

    The bar fills by steps against train.max_steps, else by time against train.max_time,
    and from the first step on shows the step, time used and left, and that update's loss
    (redrawn at most 4 times a second, so reading the loss costs one host sync per redraw)."""

    REDRAW_SECONDS = 0.25

    def __init__(self, total_steps: Optional[int], max_seconds: float, enabled: bool, console=None):
        self.enabled = enabled
        self.total = total_steps
        self.max_seconds = max_seconds
        self._bar = None
        self._by_time = not total_steps and math.isfinite(max_seconds)
        self._loss: Optional[float] = None
        self._info = ""
        self._drawn = -math.inf
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, Progress as RichProgress, TextColumn

            console = console or Console(stderr=True)
            if console.is_terminal:
                self._bar = RichProgress(TextColumn("[bold]train"), BarColumn(), TextColumn("{task.fields[info]}"),
                                         console=console, transient=False)
                total = max_seconds if self._by_time else total_steps
                self._task = self._bar.add_task("train", total=total, info="")
                self._bar.start()

    def eta(self, step: int, elapsed: float, rate: float) -> str:
        left = []
        if self.total:
            left.append((self.total - step) / max(rate, 1e-9))
        if math.isfinite(self.max_seconds):
            left.append(self.max_seconds - elapsed)
        if not left:
            return "?"
        return clock(min(left))

    def step(self, step: int, elapsed: float, loss: Callable[[], float]) -> None:
        """After every update: redraw the bar (throttled) with this update's loss."""
        if self._bar is None or time.monotonic() - self._drawn < self.REDRAW_SECONDS:
            return
        self._loss = loss()
        self._draw(step, elapsed)

    def _draw(self, step: int, elapsed: float) -> None:
        self._drawn = time.monotonic()
        self._bar.update(self._task, completed=min(elapsed, self.max_seconds) if self._by_time else step,
                         info=progress_line(step, self.total, elapsed, self.max_seconds, self._loss, self._info))
        self._bar.refresh()  # print this frame now, not at rich's next timed refresh

    def update(self, step: int, info: str, elapsed: float = 0.0) -> None:
        if self._bar is not None:
            self._info = info
            self._draw(step, elapsed)
        elif self.enabled:
            log.info("step %d | %s", step, info)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


# --------------------------------------------------------------------------- #
# The trainer
# --------------------------------------------------------------------------- #

def package_versions() -> dict:
    import sacrebleu
    import sentencepiece

    return {"s2s": __version__, "python": platform.python_version(), "torch": torch.__version__,
            "numpy": np.__version__, "sentencepiece": sentencepiece.__version__,
            "sacrebleu": sacrebleu.__version__, "platform": platform.platform()}


def check_prepared(cfg: ExperimentConfig) -> None:
    if not cfg.data.train:
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


class Trainer:
    def __init__(self, cfg: ExperimentConfig, run_dir: Path, show_progress: bool = True):
        cfg = resolve_tokenizer_config(cfg)
        self.cfg = cfg
        self.tc = cfg.train
        self.run_dir = run_dir
        self.world, self.device = init_world(self.tc.device)
        self.show_progress = show_progress and self.world.is_main
        if self.tc.threads:
            torch.set_num_threads(self.tc.threads)
        if (self.tc.precision == "bf16" and self.device.type == "cpu"
                and not torch.ops.mkldnn._is_mkldnn_bf16_supported()):
            log.warning("train.precision: this CPU has no native bf16 matmul (AVX-512 BF16 or AMX); "
                        "bf16 will run much slower than fp32")
        torch.manual_seed(cfg.seed)
        check_prepared(cfg)
        self.data_dir = Path(cfg.data.dir)
        self.tok = Tokenizer.load(self.data_dir, cfg.tokenizer, cfg.data)
        ids = {"pad_id": self.tok.pad_id, "bos_id": self.tok.bos_id}
        self.train_data = BinDataset(self.data_dir, "train", **ids)
        self.dev_data = BinDataset(self.data_dir, "dev", **ids) if cfg.data.dev else None
        self.model: S2SModel = build_model(cfg, self.tok).to(self.device)
        if self.tc.init_from:
            init = Path(self.tc.init_from)
            load_weights(self.model, init / WEIGHTS, read_meta(init).get("sha256"))
        # the module that trains: the model itself, or its torch.compile'd graph (same parameters)
        self.train_model = torch.compile(self.model, dynamic=True) if self.tc.compile else self.model
        self.teacher = self.load_teacher() if self.tc.distill.teacher else None
        fused = {"fused": True} if self.device.type == "cuda" else {"foreach": True}
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=self.tc.lr, betas=(self.tc.adam_beta1, self.tc.adam_beta2),
            eps=self.tc.adam_eps, weight_decay=self.tc.weight_decay, **fused)
        self.state = TrainState()
        self._signal: Optional[int] = None
        self.tensorboard = None  # a SummaryWriter while running, when tensorboard is installed

    def load_teacher(self) -> S2SModel:
        """The distillation teacher: frozen, in eval mode, with the student's tokenizer."""
        from s2s.config import load_config

        directory = Path(self.tc.distill.teacher)
        read_meta(directory)  # a model directory, or a one-line error saying what it is not
        theirs = load_config(directory / CONFIG)
        if tokenizer_fingerprint(theirs, directory) != tokenizer_fingerprint(self.cfg, self.data_dir):
            raise S2SError(f"train.distill.teacher: {directory} has another tokenizer than "
                           f"{self.data_dir}; the student must use the teacher's vocabulary")
        teacher = load_model_dir(directory, self.device)
        for p in teacher.model.parameters():
            p.requires_grad_(False)
        return teacher.model.eval()

    # ---- bookkeeping ------------------------------------------------- #
    def write_metrics(self, record: dict) -> None:
        """One line of metrics.jsonl; the numbers also go to TensorBoard when it is installed."""
        with open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        if self.tensorboard is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.tensorboard.add_scalar(f"{'dev' if key.startswith('dev') else 'train'}/{key}",
                                                value, record["step"])
            self.tensorboard.flush()

    @staticmethod
    def open_tensorboard(run_dir: Path):
        """A SummaryWriter on RUN_DIR/tensorboard, or None when tensorboard is not installed."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            return None
        return SummaryWriter(str(run_dir / "tensorboard"))

    def batching(self) -> dict:
        batching = {"seed": self.cfg.seed, "train.max_tokens": self.tc.max_tokens,
                    "train.update_freq": self.tc.update_freq, "data.dir": str(self.data_dir)}
        if self.world.size > 1:
            batching["world_size"] = self.world.size
        return batching

    def seed_rank(self) -> None:
        """Ranks other than 0 draw their own dropout masks: a seed of (seed, rank, step).
        (All ranks built the same initial weights from ``seed`` before this.)"""
        if self.world.rank:
            torch.manual_seed(int(np.random.SeedSequence([self.cfg.seed, self.world.rank,
                                                          self.state.step]).generate_state(1)[0]))

    def epoch_batches(self, epoch: int) -> list[np.ndarray]:
        """The batch order of an epoch: a pure function of (seed, epoch)."""
        rng = np.random.default_rng([self.cfg.seed, epoch])
        self.train_data.epoch = epoch
        return token_batches(self.train_data.src_lens, self.train_data.tgt_lens, self.tc.max_tokens, rng)

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16,
                              enabled=self.tc.precision == "bf16")

    # ---- one update -------------------------------------------------- #
    def train_step(self, batches: list[Batch]) -> tuple[Tensor, bool, tuple[int, int]]:
        """Forward/backward over this rank's batches of the update, one AdamW update.

        Returns the summed label-smoothed loss, whether the update was applied
        (a non-finite loss or gradient skips it), and the update's (target,
        source + target) token counts; over all ranks when data-parallel.
        """
        self.model.train()
        n_tgt = sum(b.n_tgt_tokens for b in batches)
        n_all = n_tgt + sum(b.n_src_tokens for b in batches)
        total = torch.zeros((), device=self.device)
        # one process: gradients of L / n_tokens; data-parallel: of L, divided after the all-reduce
        scale = n_tgt if self.world.size == 1 else 1
        for b in batches:
            total += self.forward_backward(b.to(self.device), scale)
        if self.world.size > 1:
            summed = all_reduce_update(self.model.parameters(),
                                       torch.stack([total, torch.tensor(float(n_tgt)), torch.tensor(float(n_all))]))
            total, n_tgt, n_all = summed[0], int(summed[1]), int(summed[2])
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.div_(max(n_tgt, 1))
        lr = inverse_sqrt_lr(self.state.step + 1, self.tc.lr, self.tc.warmup_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        max_norm = self.tc.clip_norm if self.tc.clip_norm > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        ok = bool(torch.isfinite(grad_norm + total))  # loss and gradient, one host sync
        if ok:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total, ok, (n_tgt, n_all)

    def forward_backward(self, b: Batch, n_tokens: int) -> Tensor:
        """Loss and gradients of one batch (gradients scaled by 1/n_tokens of the update).

        A batch that runs out of memory is split in two halves with a warning
        naming its size (recursively; one sentence that does not fit is an error).
        """
        try:
            lam = self.tc.coverage_weight
            keep = b.tgt_out != self.tok.pad_id  # (B, T): scores only at real targets
            target = b.tgt_out[keep]  # (n,)
            with self.autocast():
                if lam:
                    logits, a = self.train_model(b.src, b.tgt_in, return_attention=True, keep=keep)  # a (B, T, S)
                else:
                    logits = self.train_model(b.src, b.tgt_in, keep=keep)  # (n, V)
            if self.teacher is None:
                loss = label_smoothed_nll(logits, target, self.tc.label_smoothing, self.tok.pad_id)
            else:
                with torch.no_grad(), self.autocast():
                    teacher_logits = self.teacher(b.src, b.tgt_in, keep=keep)
                kd = self.tc.distill
                loss = distillation_loss(logits, teacher_logits, target, kd.lambda_, kd.temperature,
                                         self.tc.label_smoothing, self.tok.pad_id)
            objective = loss + lam * coverage_loss(a.float(), keep) if lam else loss
            (objective / n_tokens).backward()
            return loss.detach()
        except RuntimeError as e:  # torch.OutOfMemoryError on a GPU; a failed allocation on the CPU
            if not isinstance(e, torch.OutOfMemoryError) and "can't allocate memory" not in str(e):
                raise
            logits = a = loss = objective = None  # drop the references before retrying
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            shape = f"{len(b)} sentences x {b.src.size(1)} source / {b.tgt_in.size(1)} target tokens"
            if len(b) == 1:
                raise S2SError(f"step {self.state.step + 1}: out of memory on one sentence ({shape}); "
                               "lower data.max_tokens_per_sentence") from None
            log.warning("step %d: a batch of %s ran out of memory; splitting it in two",
                        self.state.step + 1, shape)
            first, second = b.halves()
            return self.forward_backward(first, n_tokens) + self.forward_backward(second, n_tokens)

    # ---- validation -------------------------------------------------- #
    @torch.inference_mode()
    def dev_loss(self) -> float:
        """Mean token NLL (no smoothing) over the dev split."""
        self.model.eval()
        nll, n = 0.0, 0
        for idx in token_batches(self.dev_data.src_lens, self.dev_data.tgt_lens, self.tc.max_tokens):
            b = self.dev_data.batch(idx).to(self.device)
            with self.autocast():
                logits = self.model(b.src, b.tgt_in)
            nll += float(label_smoothed_nll(logits, b.tgt_out, 0.0, self.tok.pad_id))
            n += b.n_tgt_tokens
        return nll / max(n, 1)

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
        self.write_metrics(record)
        log.info("validation | step %d | %s%s", self.state.step,
                 " | ".join(f"{k} {v}" for k, v in record.items() if k.startswith("dev")),
                 " | new best" if better else "")
        return record

    # ---- the loop ---------------------------------------------------- #
    def _on_signal(self, signum, frame) -> None:
        if self._signal is not None:  # a second Ctrl-C: stop now
            raise KeyboardInterrupt
        self._signal = signum
        log.warning("%s received: finishing this step and writing a checkpoint",
                    signal.Signals(signum).name)

    def start(self, resume: bool) -> None:
        ckpts = list_checkpoints(self.run_dir)
        has_run = bool(ckpts) or (self.run_dir / META).exists()
        if has_run and not resume:
            raise S2SError(f"{self.run_dir}: already holds a training run; pass --resume to continue it "
                           "or -o to choose another directory")
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise S2SError(f"{self.run_dir}: exists and is not a directory")
        try:
            if self.world.is_main:
                self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise S2SError(f"{self.run_dir}: cannot create the run directory ({e.strerror})") from None
        if resume and ckpts:
            old = self.run_dir / CONFIG
            if old.is_file():
                from s2s.config import load_config

                before, now = to_dict(load_config(old))["model"], to_dict(self.cfg)["model"]
                for key in now:
                    if before[key] != now[key]:
                        raise S2SError(f"{old}: model.{key} differs from the run being resumed")
            for p in Tokenizer.all_files(self.data_dir, self.cfg.tokenizer, self.cfg.data):
                mine = self.run_dir / p.name
                if mine.is_file() and file_sha256(mine) != file_sha256(p):
                    raise S2SError(f"{p}: the tokenizer changed since {self.run_dir} started; "
                                   "resume with the original tokenizer or start a new run")
            self.state = load_newest_intact(self.run_dir, self.model, self.optimizer)
            batching = self.batching()
            for key, value in self.state.batching.items():
                if batching[key] != value:
                    raise S2SError(f"{key}: {batching[key]} differs from the run being resumed "
                                   f"({value}); the data position would not match")
        elif resume:
            log.info("%s: no checkpoint to resume from; starting a new run", self.run_dir)
        self.state.batching = self.batching()
        self.seed_rank()
        if self.world.is_main:
            write_config(self.run_dir, self.cfg)
            copy_tokenizer(self.cfg, self.data_dir, self.run_dir)
            with atomic_write(self.run_dir / "env.json") as f:
                json.dump(package_versions(), f, indent=2)

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

    @contextlib.contextmanager
    def claim_run_dir(self):
        """Rank 0 checks that the run directory is new, empty or a run directory of its own,
        and holds its lock until training ends (s2s.outdir); when that fails, every rank stops."""
        with contextlib.ExitStack() as held:
            error = None
            if self.world.is_main:
                try:
                    check_run_dir(self.run_dir)
                    held.enter_context(lock_run_dir(self.run_dir))
                except S2SError as e:
                    error = e
            if self.world.any(error is not None):
                raise error or S2SError(f"{self.run_dir}: rank 0 could not take the run directory")
            yield

    def run(self, resume: bool = False) -> Path:
        """Train, holding the run directory's lock throughout."""
        with self.claim_run_dir():
            return self._run(resume)

    def _run(self, resume: bool) -> Path:
        self.start(resume)
        main = self.world.is_main
        self.tensorboard = self.open_tensorboard(self.run_dir) if main else None
        tc, st = self.tc, self.state
        ending = [signal.SIGINT, signal.SIGTERM]
        if signal.getsignal(signal.SIGHUP) != signal.SIG_IGN:  # under nohup hangups stay ignored
            ending.append(signal.SIGHUP)
        handlers = {s: signal.signal(s, self._on_signal) for s in ending}
        progress = Progress(tc.max_steps or None, tc.max_seconds, self.show_progress)
        self._base_elapsed, self._started = st.elapsed, time.time()
        last_val = st.validations[-1]["seconds"] if st.validations else 0.0
        if resume and self.finished(last_val):
            log.warning("%s: nothing to train: %s", self.run_dir, self.limit_reached(last_val))
        window = LogWindow()
        bad_steps = 0
        validated_at = st.validations[-1]["step"] if st.validations else -1
        per_update = tc.update_freq * self.world.size
        prefetch = Prefetcher(lambda group: [self.train_data.batch(idx) for idx in shard(group, self.world)])
        try:
            while not self.should_stop(last_val):
                batches = self.epoch_batches(st.epoch)
                while st.batch < len(batches) and not self.should_stop(last_val):
                    group = batches[st.batch:st.batch + per_update]
                    data = prefetch.take((st.epoch, st.batch), group)
                    st.batch += len(group)
                    if st.batch < len(batches):  # built on a thread while this update computes
                        prefetch.ahead((st.epoch, st.batch), batches[st.batch:st.batch + per_update])
                    loss, ok, counts = self.train_step(data)
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
                    window.add(loss, *counts)
                    progress.step(st.step, self.elapsed(), lambda loss=loss, n=counts[0]: float(loss) / max(n, 1))
                    if st.step % tc.log_every == 0:
                        if main:
                            self.log_progress(window, progress)
                        window = LogWindow()
                    if st.step % tc.validate_every == 0:
                        if main:
                            last_val = self.validate()["seconds"]
                            self.checkpoint()
                        validated_at = st.step
                if st.batch >= len(batches):
                    st.epoch, st.batch = st.epoch + 1, 0
            if main:
                if self._signal is None and validated_at != st.step:
                    self.validate()
                self.checkpoint()
            self.world.barrier()  # no rank leaves before the last checkpoint is written
        finally:
            prefetch.close()
            progress.close()
            if self.tensorboard is not None:
                self.tensorboard.close()
            for s, h in handlers.items():
                signal.signal(s, h)
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

    def log_progress(self, window: "LogWindow", progress: Progress) -> None:
        """One metrics.jsonl line and a progress update: the mean loss since the last one."""
        st = self.state
        seconds = max(time.time() - window.started, 1e-9)
        mean = float(window.loss) / max(window.tgt_tokens, 1)  # the only host sync of the window
        rate = window.all_tokens / seconds
        lr = self.optimizer.param_groups[0]["lr"]
        elapsed = self.elapsed()
        self.write_metrics({"step": st.step, "epoch": st.epoch, "loss": round(mean, 4), "lr": lr,
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
    built for the same position, or builds them now."""

    def __init__(self, build):
        self._build = build
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="s2s-batches")
        self._position: Optional[tuple[int, int]] = None
        self._future: Optional[Future] = None

    def ahead(self, position: tuple[int, int], group: list[np.ndarray]) -> None:
        self._position, self._future = position, self._pool.submit(self._build, group)

    def take(self, position: tuple[int, int], group: list[np.ndarray]) -> list[Batch]:
        if self._future is not None and self._position == position:
            future, self._future, self._position = self._future, None, None
            return future.result()
        return self._build(group)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


@dataclass
class LogWindow:
    """Loss and token counts accumulated between two log lines."""

    loss: Tensor | float = 0.0  # summed label-smoothed loss, kept on the device
    tgt_tokens: int = 0
    all_tokens: int = 0  # source + target, padding excluded
    steps: int = 0
    started: float = field(default_factory=time.time)

    def add(self, loss: Tensor, tgt_tokens: int, all_tokens: int) -> None:
        self.loss = self.loss + loss
        self.tgt_tokens += tgt_tokens
        self.all_tokens += all_tokens
        self.steps += 1


def _head(it, k: int):
    for i, x in enumerate(it):
        if i >= k:
            return
        yield x


def train(cfg: ExperimentConfig, run_dir: Optional[str | Path] = None, resume: bool = False,
          show_progress: bool = True) -> Path:
    """Train a model as ``cfg`` describes; return the run (= model) directory.
    With train.procs > 1 (or auto) the data-parallel ranks run as processes of their own."""
    target = run_dir or cfg.output_dir
    if not target:
        raise S2SError("output_dir: no run directory; set output_dir in the config or pass -o RUN_DIR")
    procs, threads = process_split(cfg)
    if procs > 1:
        launch_local("train", cfg, Path(target), resume, show_progress, procs, threads)
        return Path(target)
    return Trainer(cfg, Path(target), show_progress).run(resume)
