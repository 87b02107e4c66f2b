"""Corpus metrics through sacrebleu: BLEU, chrF, TER, each with its signature.

BLEU = min(1, e^{1 - r/c}) * exp(sum_{n=1}^{4} w_n log p_n)   (formula sheet, Lesson 10)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

from sacrebleu.metrics import BLEU, CHRF, TER

METRICS = ("bleu", "chrf", "ter")


@dataclass
class Score:
    name: str
    score: float
    signature: str
    details: str  # sacrebleu's one-line summary (precisions, BP, ratio, ...)

    def to_dict(self) -> dict:
        return asdict(self)


def corpus_scores(hyps: Sequence[str], refs: Sequence[Sequence[str]],
                  metrics: Sequence[str] = METRICS) -> list[Score]:
    """Score ``hyps`` against one or more reference streams (each as long as hyps)."""
    out = []
    for name in metrics:
        metric = {"bleu": BLEU, "chrf": CHRF, "ter": TER}[name]()
        result = metric.corpus_score(list(hyps), [list(r) for r in refs])
        out.append(Score(name=name, score=round(result.score, 2),
                         signature=str(metric.get_signature()), details=str(result)))
    return out


def corpus_bleu(hyps: Sequence[str], refs: Sequence[str]) -> float:
    """sacrebleu BLEU (13a tokenization) of one reference stream."""
    return BLEU().corpus_score(list(hyps), [list(refs)]).score
