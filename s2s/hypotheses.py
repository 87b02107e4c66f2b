"""What a search finds and a translation is, without torch: the length penalty lp(m), a
:class:`Hypothesis` (its tokens, score and log p) and a :class:`Translation` (an input line's
hypotheses, best first, and their texts).

    score(y) = (1 / lp(m)) * sum_{t=1}^{m} log p(y_t | y_<t, x)       (docs/model.md (30))

m counts every scored token of y, the final </s> included.  torch's search (s2s.search), the
torch-free search (s2s.native_search), the documents' joining of sentences (s2s.documents) and
the output formats (s2s.output) share them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


def length_penalty(m, alpha: float, kind: str = "gnmt"):
    """lp(m) = ((5 + m) / 6)^alpha   (gnmt, the default; Wu et al. 2016; docs/model.md (31))
    lp(m) = m^alpha                 (power: fairseq, Hugging Face, CTranslate2)
    lp(m) = 1                       (none)

    ``m`` may be a number or a tensor (none: ones of its shape).
    """
    if kind == "gnmt":
        return ((5.0 + m) / 6.0) ** alpha
    if kind == "power":
        return m ** alpha
    if kind == "none":
        return 1.0 if isinstance(m, (int, float)) else m * 0 + 1.0
    raise ValueError(f"unknown length penalty {kind!r}")


@dataclass
class Hypothesis:
    tokens: list[int]  # y_1..y_{m-1}, without the final </s>
    score: float  # length-normalized: log_prob / lp(m)
    log_prob: float  # sum of log p over the m tokens, </s> included
    alignment: Optional[list[tuple[int, int]]] = None  # (source index, target index) pairs, on request
    m: Optional[int] = None  # tokens scored, if not len(tokens) + 1 (a line joined from sentences: one </s> each)


@dataclass
class Translation:
    line_no: int  # 1-based line number in the input
    hypotheses: list[Hypothesis]  # best first; empty for an empty input line
    texts: list[str]  # detokenized hypotheses

    @property
    def text(self) -> str:
        return self.texts[0] if self.texts else ""

    @property
    def confidence(self) -> float:
        """The best hypothesis's confidence, the score ``--scores`` prints (s2s.output.confidence)."""
        from s2s.output import confidence

        return confidence(self.hypotheses[0] if self.hypotheses else None)
