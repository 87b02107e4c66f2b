"""Corpus metrics, each with its signature: BLEU, chrF, TER through sacrebleu;
ROUGE-1/2/L through Google's rouge-score package (the ROUGE-1.5.5 reimplementation).

BLEU = min(1, e^{1 - r/c}) * exp(sum_{n=1}^{4} w_n log p_n)   (docs/model.md (42))
ROUGE-N/L: F1 of n-gram / longest-common-subsequence overlap, per sentence,
averaged over the corpus (x100), Porter stemming on, as summarization papers report it,
over tokens of every script (:class:`AllScriptsTokenizer`).
TER = (edits + shifts) / reference words, summed over the lines of at most
TER_MAX_WORDS words (its shift search grows faster than the line; longer lines
are left out of TER with a warning naming them, and the signature says so).
"""

from __future__ import annotations

import logging
import re
import unicodedata
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

from sacrebleu.metrics import BLEU, CHRF, TER

METRICS = ("bleu", "chrf", "ter", "rouge")
TER_MAX_WORDS = 1000  # TER scores lines of at most this many words (hypothesis and each reference)
log = logging.getLogger("s2s")


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
        if name == "rouge":
            out.extend(rouge_scores(hyps, refs))
            continue
        if name == "ter":
            ter = ter_score(hyps, refs)
            out.extend([ter] if ter is not None else [])
            continue
        metric = {"bleu": BLEU, "chrf": CHRF}[name]()
        result = metric.corpus_score(list(hyps), [list(r) for r in refs])
        out.append(Score(name=name, score=round(result.score, 2),
                         signature=str(metric.get_signature()), details=str(result)))
    return out


def ter_score(hyps: Sequence[str], refs: Sequence[Sequence[str]],
              max_words: int = TER_MAX_WORDS) -> Optional[Score]:
    """Corpus TER over the lines whose hypothesis and references all have at most
    ``max_words`` words; the others are skipped with a warning (None when none is left)."""
    too_long = [i for i, h in enumerate(hyps)
                if max(len(h.split()), *(len(r[i].split()) for r in refs)) > max_words]
    if too_long:
        shown = ", ".join(str(i + 1) for i in too_long[:10]) + (", ..." if len(too_long) > 10 else "")
        log.warning("TER: line%s %s skipped: over %d words (TER's shift search grows faster than the line); "
                    "BLEU and chrF score every line", "s" if len(too_long) > 1 else "", shown, max_words)
    skip = set(too_long)
    keep = [i for i in range(len(hyps)) if i not in skip]
    if not keep:
        log.warning("TER: no line of at most %d words, not scored", max_words)
        return None
    metric = TER()
    result = metric.corpus_score([hyps[i] for i in keep], [[r[i] for i in keep] for r in refs])
    details = str(result) + (f" ({len(too_long)} of {len(hyps)} lines over {max_words} words skipped)"
                             if too_long else "")
    return Score(name="ter", score=round(result.score, 2),
                 signature=f"{metric.get_signature()}|maxwords:{max_words}", details=details)


def corpus_bleu(hyps: Sequence[str], refs: Sequence[str]) -> float:
    """sacrebleu BLEU (13a tokenization) of one reference stream."""
    return BLEU().corpus_score(list(hyps), [list(refs)]).score


class AllScriptsTokenizer:
    """ROUGE tokens in every script: lowercased runs of letters and digits (Unicode), each
    CJK ideograph, kana or other unspaced-script character (Thai, Lao, Khmer, Myanmar) a
    token of its own; the Porter stemmer applies to ASCII words longer than 3 letters, as
    rouge-score's default tokenizer does (which keeps only a-z0-9 and so drops Cyrillic,
    Greek, Chinese... entirely, and cuts "Straße" into "stra" and "e")."""

    NAME = "unicode-words+cjk-chars"
    _TOKEN = re.compile(
        r"[\u0e00-\u0eff\u1000-\u109f\u1780-\u17ff\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff"
        r"\uf900-\ufaff\U00020000-\U0002fa1f]"  # one character: Thai, Lao, Myanmar, Khmer, kana, CJK
        r"|(?:(?![\u0e00-\u0eff\u1000-\u109f\u1780-\u17ff\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff"
        r"\uf900-\ufaff\U00020000-\U0002fa1f])[^\W_])+")  # a run of other letters/digits
    _ASCII_WORD = re.compile(r"[a-z]{4,}")

    def __init__(self) -> None:
        from nltk.stem import porter

        self.stemmer = porter.PorterStemmer()

    def tokenize(self, text: str) -> list[str]:
        tokens = self._TOKEN.findall(unicodedata.normalize("NFKC", text).lower())
        return [self.stemmer.stem(t) if self._ASCII_WORD.fullmatch(t) else t for t in tokens]


def rouge_scores(hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> list[Score]:
    """Mean ROUGE-1, ROUGE-2, ROUGE-L F1 (x100) with stemming; with several
    reference streams, each sentence counts its best-matching reference."""
    from importlib.metadata import version

    from rouge_score import rouge_scorer

    kinds = ("rouge1", "rouge2", "rougeL")
    scorer = rouge_scorer.RougeScorer(list(kinds), tokenizer=AllScriptsTokenizer())
    sums = {k: [0.0, 0.0, 0.0] for k in kinds}  # precision, recall, F1
    for i, hyp in enumerate(hyps):
        per_ref = [scorer.score(r[i], hyp) for r in refs]
        for k in kinds:
            best = max((s[k] for s in per_ref), key=lambda s: s.fmeasure)
            for n, value in enumerate(best):
                sums[k][n] += value
    n = max(len(hyps), 1)
    sig = (f"rouge-score:{version('rouge-score')}|stemmer:porter-ascii|tokenizer:{AllScriptsTokenizer.NAME}"
           f"|f1:mean|nrefs:{len(refs)}")
    return [Score(name=k, score=round(100 * f / n, 2), signature=sig,
                  details=f"P {100 * p / n:.2f} R {100 * r / n:.2f} F1 {100 * f / n:.2f}")
            for k, (p, r, f) in sums.items()]
