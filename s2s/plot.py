"""Pictures as PNG: training curves of a run (``s2s plot``) and a cross-attention
matrix (``s2s align``)."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from s2s.errors import S2SError
from s2s.outdir import looks_like_run
from s2s.textio import atomic_write, read_lines

ALIGN_MAX_PIECES = 100  # `s2s align` draws at most this many pieces per axis (<= 4,700 x 4,150 pixels)
log = logging.getLogger("s2s")


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if run_dir.is_file():
        raise S2SError(f"{run_dir}: is a file; plot takes a training run directory "
                       "(the one holding metrics.jsonl)")
    if not path.is_file():
        if looks_like_run(run_dir):  # stopped before its first log line
            raise S2SError(f"{path}: no logged steps yet")
        raise S2SError(f"{path}: not found; is {run_dir} a training run?")
    rows = []
    for n, line in enumerate(read_lines(path), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise S2SError(f"{path}:{n}: not a JSON line") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise S2SError(f"{path}:{n}: no \"step\" in this line; not an s2s metrics file")
        rows.append(row)
    return rows


@dataclass
class Curves:
    """What ``s2s plot`` draws, read from a run directory."""

    train: list[dict]  # metrics.jsonl rows with "loss"
    dev: list[dict]  # rows with "dev_loss"
    lr_steps: list[int]  # every update 1..last logged step
    lr: list[float]  # the schedule at each of them (or the logged values when there is no config)
    best_step: Optional[int]  # the step whose weights the run keeps as its model


def read_curves(run: Path) -> Curves:
    rows = read_metrics(run)
    train = [r for r in rows if "loss" in r]
    dev = [r for r in rows if "dev_loss" in r]
    if not train and not dev:
        raise S2SError(f"{run / 'metrics.jsonl'}: no logged steps yet")
    last = max(r["step"] for r in rows)
    lr_steps, lr = list(range(1, last + 1)), schedule(run, last)
    if lr is not None and any(not math.isclose(r["lr"], lr[r["step"] - 1], rel_tol=1e-3)
                              for r in train if "lr" in r and 1 <= r["step"] <= last):
        lr = None  # the config is not the one those steps ran with (train.lr changed on --resume)
    if lr is None:  # no readable config, or not the run's: the logged values
        lr_steps, lr = [r["step"] for r in train if "lr" in r], [r["lr"] for r in train if "lr" in r]
    return Curves(train, dev, lr_steps, lr, kept_step(run, dev))


def schedule(run: Path, last: int) -> Optional[list[float]]:
    """lr(s) of the run's own config for s = 1..last (the schedule is a pure function of the step)."""
    from s2s.config import load_config
    from s2s.trainer import inverse_sqrt_lr

    try:
        tc = load_config(run / "config.yaml").train
    except S2SError:
        return None
    return [inverse_sqrt_lr(s, tc.lr, tc.warmup_steps) for s in range(1, last + 1)]


def kept_step(run: Path, dev: list[dict]) -> Optional[int]:
    """The step of the weights the run keeps: model.json's, else the last validation marked best."""
    try:
        step = json.loads((run / "model.json").read_text(encoding="utf-8")).get("step")
        if isinstance(step, int):
            return step
    except (OSError, ValueError, AttributeError):
        pass
    best = [r["step"] for r in dev if r.get("best")]
    return best[-1] if best else None


def plot_run(run_dir: str | Path, out: Optional[str | Path] = None) -> Path:
    """Draw train and dev loss, dev BLEU and the learning rate against the update step,
    with the kept best step marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = Path(run_dir)
    c = read_curves(run)
    fig, (ax_loss, ax_bleu, ax_lr) = plt.subplots(1, 3, figsize=(15, 4))
    ax_loss.plot([r["step"] for r in c.train], [r["loss"] for r in c.train], label="train (label-smoothed)")
    ax_loss.plot([r["step"] for r in c.dev], [r["dev_loss"] for r in c.dev], "o-", label="dev NLL")
    ax_loss.set(title="loss per target token", xlabel="update")
    bleu = [r for r in c.dev if "dev_bleu" in r]
    ax_bleu.plot([r["step"] for r in bleu], [r["dev_bleu"] for r in bleu], "o-", color="tab:green")
    ax_bleu.set(title="dev BLEU", xlabel="update")
    if c.best_step is not None:
        for ax in (ax_loss, ax_bleu):
            ax.axvline(c.best_step, color="tab:purple", linestyle="--", linewidth=1,
                       label=f"kept model (step {c.best_step})")
        kept = [r for r in bleu if r["step"] == c.best_step]
        if kept:
            ax_bleu.plot([c.best_step], [kept[0]["dev_bleu"]], "*", color="tab:purple", markersize=14)
        ax_bleu.legend()
    ax_loss.legend()
    ax_lr.plot(c.lr_steps, c.lr, color="tab:red")
    ax_lr.set(title="learning rate", xlabel="update")
    fig.suptitle(str(run))
    fig.tight_layout()
    return write_png(fig, Path(out) if out else run / "curves.png")


def plot_attention(A, src_pieces: list[str], tgt_pieces: list[str], out: str | Path, title: str) -> Path:
    """A heatmap of A (T, S): target pieces down, source pieces across, each row summing to 1.
    At most ALIGN_MAX_PIECES pieces per axis are drawn (the first ones), with a warning."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    T, S = len(tgt_pieces), len(src_pieces)
    if max(T, S) > ALIGN_MAX_PIECES:
        cut = [f"the first {ALIGN_MAX_PIECES} of {n} {side} pieces"
               for n, side in ((S, "source"), (T, "target")) if n > ALIGN_MAX_PIECES]
        log.warning("align: drawing %s (at most %d per axis)", " and ".join(cut), ALIGN_MAX_PIECES)
        title += f" ({', '.join(cut)})"
        T, S = min(T, ALIGN_MAX_PIECES), min(S, ALIGN_MAX_PIECES)
        A, src_pieces, tgt_pieces = A[:T, :S], src_pieces[:S], tgt_pieces[:T]
    fig, ax = plt.subplots(figsize=(max(4.0, 0.45 * S + 2), max(3.0, 0.4 * T + 1.5)))
    image = ax.imshow(A, cmap="Blues", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(S), src_pieces, rotation=60, ha="right", fontsize=8)
    ax.set_yticks(range(T), tgt_pieces, fontsize=8)
    ax.set(xlabel="source", ylabel="target", title=title)
    fig.colorbar(image, ax=ax, fraction=0.04)
    fig.tight_layout()
    return write_png(fig, Path(out))


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_png(fig, target: Path) -> Path:
    """Save ``fig`` as ``target``, which may replace a PNG image but no other file (a run's
    metrics.jsonl, a text the user named by mistake)."""
    import matplotlib.pyplot as plt

    if target.is_file() and target.stat().st_size:
        with open(target, "rb") as f:
            if f.read(len(PNG_SIGNATURE)) != PNG_SIGNATURE:
                raise S2SError(f"{target}: exists and is not a PNG image; not replaced (choose another -o)")
    with atomic_write(target, "wb", follow_links=True) as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)
    return target
