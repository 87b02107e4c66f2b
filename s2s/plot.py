"""Pictures as PNG: training curves of a run (``s2s plot``) and a cross-attention
matrix (``s2s align``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from s2s.errors import S2SError
from s2s.textio import atomic_write, read_lines


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if run_dir.is_file():
        raise S2SError(f"{run_dir}: is a file; plot takes a training run directory "
                       "(the one holding metrics.jsonl)")
    if not path.is_file():
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


def plot_run(run_dir: str | Path, out: Optional[str | Path] = None) -> Path:
    """Draw train loss and dev loss, dev BLEU, and the learning rate against the update step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = Path(run_dir)
    rows = read_metrics(run)
    train = [r for r in rows if "loss" in r]
    dev = [r for r in rows if "dev_loss" in r]
    if not train and not dev:
        raise S2SError(f"{run / 'metrics.jsonl'}: no logged steps yet")
    fig, (ax_loss, ax_bleu, ax_lr) = plt.subplots(1, 3, figsize=(15, 4))
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="train (label-smoothed)")
    ax_loss.plot([r["step"] for r in dev], [r["dev_loss"] for r in dev], "o-", label="dev NLL")
    ax_loss.set(title="loss per target token", xlabel="update")
    ax_loss.legend()
    bleu = [r for r in dev if "dev_bleu" in r]
    ax_bleu.plot([r["step"] for r in bleu], [r["dev_bleu"] for r in bleu], "o-", color="tab:green")
    ax_bleu.set(title="dev BLEU", xlabel="update")
    ax_lr.plot([r["step"] for r in train], [r["lr"] for r in train], color="tab:red")
    ax_lr.set(title="learning rate", xlabel="update")
    fig.suptitle(str(run))
    fig.tight_layout()
    target = Path(out) if out else run / "curves.png"
    with atomic_write(target, "wb") as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)
    return target


def plot_attention(A, src_pieces: list[str], tgt_pieces: list[str], out: str | Path, title: str) -> Path:
    """A heatmap of A (T, S): target pieces down, source pieces across, each row summing to 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    T, S = len(tgt_pieces), len(src_pieces)
    fig, ax = plt.subplots(figsize=(max(4.0, 0.45 * S + 2), max(3.0, 0.4 * T + 1.5)))
    image = ax.imshow(A, cmap="Blues", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(S), src_pieces, rotation=60, ha="right", fontsize=8)
    ax.set_yticks(range(T), tgt_pieces, fontsize=8)
    ax.set(xlabel="source", ylabel="target", title=title)
    fig.colorbar(image, ax=ax, fraction=0.04)
    fig.tight_layout()
    target = Path(out)
    with atomic_write(target, "wb") as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)
    return target
