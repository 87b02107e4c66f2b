"""What a training run reports: metrics.jsonl (and TensorBoard), env.json, the progress bar.

    RUN/metrics.jsonl   one JSON line per log window ({"step", "epoch", "loss", "lr", "tok_s", "elapsed"})
                        and per validation ({"step", "epoch", "dev_loss", "dev_ppl", "dev_bleu",
                        "seconds", "best"})
    RUN/tensorboard/    the same numbers as scalars, when tensorboard is installed
    RUN/env.json        the versions of s2s, Python, torch and the libraries it trained with
"""

from __future__ import annotations

import json
import logging
import math
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
from torch import Tensor

from s2s import __version__
from s2s.textio import atomic_write

log = logging.getLogger("s2s")

METRICS = "metrics.jsonl"
ENV = "env.json"


# --------------------------------------------------------------------------- #
# Files
# --------------------------------------------------------------------------- #

def package_versions() -> dict:
    import sacrebleu
    import sentencepiece

    return {"s2s": __version__, "python": platform.python_version(), "torch": torch.__version__,
            "numpy": np.__version__, "sentencepiece": sentencepiece.__version__,
            "sacrebleu": sacrebleu.__version__, "platform": platform.platform()}


def write_env(run_dir: Path) -> None:
    """RUN/env.json: the package versions of this (segment of the) run."""
    with atomic_write(run_dir / ENV) as f:
        json.dump(package_versions(), f, indent=2)


def open_tensorboard(run_dir: Path):
    """A SummaryWriter on RUN_DIR/tensorboard, or None when tensorboard is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(run_dir / "tensorboard"))


def _logged_step(line: str) -> int:
    """A metrics.jsonl line's step (one that is not a step's record: 0, kept)."""
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return 0
    return step if isinstance(step, int) else 0


class MetricsLog:
    """Appends records to RUN/metrics.jsonl; while open, also to TensorBoard when it is installed."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.tensorboard = None  # a SummaryWriter between open() and close()

    def open(self) -> None:
        self.tensorboard = open_tensorboard(self.run_dir)

    def keep_until(self, step: int) -> None:
        """Drop the lines past ``step``: a run resumed from its checkpoint at ``step`` logs the
        steps after it again (a killed run had logged some of them; a new run, none is kept)."""
        path = self.run_dir / METRICS
        if not path.is_file():
            return
        text = path.read_text(encoding="utf-8", errors="replace")
        lines = text.splitlines(keepends=True)
        if lines and not lines[-1].endswith("\n"):
            lines.pop()  # torn by the kill: the next line would be glued to it
        kept = [line for line in lines if _logged_step(line) <= step]
        if "".join(kept) != text:
            with atomic_write(path) as f:
                f.writelines(kept)

    def write(self, record: dict) -> None:
        """One line of metrics.jsonl; the numbers also go to TensorBoard (train/KEY, dev/KEY)."""
        with open(self.run_dir / METRICS, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        if self.tensorboard is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.tensorboard.add_scalar(f"{'dev' if key.startswith('dev') else 'train'}/{key}",
                                                value, record["step"])
            self.tensorboard.flush()

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None


@dataclass
class LogWindow:
    """Loss and token counts accumulated between two log lines."""

    loss: Tensor | float = 0.0  # summed label-smoothed loss, kept on the device
    # the target tokens of that loss (not an update skipped on the device, which only it knows of)
    tgt_tokens: Tensor | int = 0
    all_tokens: int = 0  # source + target, padding excluded
    steps: int = 0
    started: float = field(default_factory=time.time)

    def add(self, loss: Tensor, all_tokens: int, tgt_tokens: Tensor | int) -> None:
        """One update's loss, its tokens, and the target tokens of its loss (0 where skipped)."""
        self.loss = self.loss + loss
        self.all_tokens += all_tokens
        self.tgt_tokens = self.tgt_tokens + tgt_tokens
        self.steps += 1

    def mean_loss(self) -> float:
        """The loss per target token over the window's applied updates (a host sync)."""
        if isinstance(self.tgt_tokens, Tensor):  # both on the device: read back together
            loss, tokens = torch.stack([self.loss.float(), self.tgt_tokens.float()]).tolist()
        else:
            loss, tokens = float(self.loss), self.tgt_tokens
        return loss / max(tokens, 1)


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
            from rich.progress import BarColumn, TextColumn
            from rich.progress import Progress as RichProgress

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


