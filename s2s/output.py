"""What ``s2s translate`` writes for each input line: text rows, scores, JSON lines.

    text                  TEXT [||| j-t ...]                              one row per input line
    --nbest K             LINE ||| TEXT ||| SEARCH_SCORE [||| j-t ...]    one row per hypothesis
    --scores              either of those rows, then a TAB and SCORE (`cut -f1` removes it)
    --format jsonl        {"text": ..., "score": ..., "alignment": [[j, t], ...],
                           "nbest": [{"text": ..., "score": ..., "alignment": ...}, ...]}

SCORE, the line's confidence, is the mean log-probability per token of the
hypothesis, :func:`mean_log_prob` (docs/model.md (51)); SEARCH_SCORE is the
beam score the search ranks by, log p / lp(m) (+ cp) (docs/model.md (30)).
Both are written to 4 decimals, in JSON too: the digits past those depend on
which lines share a batch (padding changes the float sums), so with them the
output would change with --workers or, in ``s2s serve``, with the requests
that arrive together.
A JSON line always has text and score, ``alignment`` with --alignments and
``nbest`` (best first) with more than one hypothesis or an explicit --nbest:
the object ``s2s serve`` answers for a text with ``"scores": true``.  An empty
input line has the empty output, scored 0 (log 1).

No torch here: the parent process of ``--workers`` checks the format before
any model loads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from s2s.errors import S2SError

if TYPE_CHECKING:
    from s2s.hypotheses import Hypothesis, Translation

FORMATS = ("text", "jsonl")
SCORE_DECIMALS = 4  # scores are written to 4 decimals: the digits after those change with a line's batch


def mean_log_prob(log_prob: float, m: int) -> float:
    """s̄(y) = (1/m) · Σ_{t=1}^{m} log p̂(y_t | y_<t, x)   (docs/model.md (51))

    ``log_prob`` the sum over the m scored tokens of y, the final </s> included."""
    return log_prob / m


def confidence(h: Optional["Hypothesis"]) -> float:
    """The score ``--scores`` prints for a hypothesis: :func:`mean_log_prob` of its
    m = len(tokens) + 1 tokens (</s> counted; h.m where set: a line of several sentences
    counts each one's </s>); 0.0 (log 1) for an empty input's None."""
    return 0.0 if h is None else mean_log_prob(h.log_prob, h.m or len(h.tokens) + 1)


def check_format(name: str) -> None:
    if name not in FORMATS:
        raise S2SError(f"--format: {name!r} is not text or jsonl")


@dataclass(frozen=True)
class OutputFormat:
    """How each input line is written (see the module docstring)."""

    nbest: bool = False  # a row (jsonl: an "nbest" entry) per hypothesis
    alignments: bool = False  # the hypotheses carry alignments (Translator.alignments)
    scores: bool = False  # text rows end in TAB and the confidence
    format: str = "text"  # text | jsonl

    def __post_init__(self) -> None:
        check_format(self.format)

    @property
    def shows_scores(self) -> bool:
        """Whether any score is written: --scores, n-best rows (their search score), or JSON
        (always a score).  Without one a greedy search may skip normalizing its steps
        (``Translator.scores``)."""
        return self.scores or self.nbest or self.format == "jsonl"


def hypothesis_json(text: str, h: Optional["Hypothesis"], scores: bool, alignments: bool) -> dict:
    """One hypothesis as JSON: text, and on request its score and its (j, t) alignment pairs."""
    out: dict[str, Any] = {"text": text}
    if scores:
        out["score"] = round(confidence(h), SCORE_DECIMALS)
    if alignments:
        out["alignment"] = [[j, t] for j, t in (h.alignment or [])] if h is not None else []
    return out


def translation_json(t: "Translation", nbest: bool, scores: bool, alignments: bool) -> dict:
    """An input line's object: its best hypothesis's fields, and with ``nbest`` every
    hypothesis's, best first, under "nbest"."""
    hyps = list(zip(t.texts, t.hypotheses)) or [("", None)]
    out = hypothesis_json(*hyps[0], scores, alignments)
    if nbest:
        out["nbest"] = [hypothesis_json(text, h, scores, alignments) for text, h in hyps]
    return out


# line ends to some readers (Python's str.splitlines, older JavaScript) that JSON leaves raw (it
# escapes those below U+0020 itself); escaped, so that a jsonl row is one line to every reader
_LINE_ENDS = str.maketrans({c: f"\\u{ord(c):04x}" for c in "\x85\u2028\u2029"})


def json_line(obj: Any) -> str:
    """``obj`` as one line of UTF-8 JSON (a jsonl row), its newline included."""
    return json.dumps(obj, ensure_ascii=False).translate(_LINE_ENDS) + "\n"


def format_translation(t: "Translation", fmt: OutputFormat = OutputFormat()) -> str:
    """The output of one input line, each row ending in a newline."""
    if fmt.format == "jsonl":
        return json_line(translation_json(t, fmt.nbest, True, fmt.alignments))

    def aligned(h: Optional["Hypothesis"]) -> str:  # " ||| 0-0 1-2 ..." with --alignments
        if not fmt.alignments:
            return ""
        return " ||| " + " ".join(f"{j}-{t}" for j, t in (h.alignment or [] if h else []))

    def scored(h: Optional["Hypothesis"]) -> str:  # "\t-0.1234" with --scores
        return f"\t{confidence(h):.{SCORE_DECIMALS}f}" if fmt.scores else ""

    if not fmt.nbest:
        h = t.hypotheses[0] if t.hypotheses else None
        return t.text + aligned(h) + scored(h) + "\n"
    if t.hypotheses:
        return "".join(f"{t.line_no - 1} ||| {text} ||| {h.score:.4f}{aligned(h)}{scored(h)}\n"
                       for text, h in zip(t.texts, t.hypotheses))
    return f"{t.line_no - 1} |||  ||| 0.0000{aligned(None)}{scored(None)}\n"
