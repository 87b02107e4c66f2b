"""Does the score of `s2s translate --scores` rank lines by quality?

Translates the ddtp-en-de test set (1,000 sentences) with a model, scores each
output line against its reference with sentence-level chrF (sacrebleu), sorts
the lines by a score and reports the mean chrF of the best-scored tenth, the
worst-scored tenth and all lines, and Spearman's rank correlation between the
score and chrF.  Three scores of the same hypotheses, side by side:

* mean log p per token, (1/m) sum_t log p(y_t)   (docs/model.md (51)): what
  ``--scores`` prints (``s2s.output.confidence``);
* the search's score, log p / lp(m)   (docs/model.md (30)): what beam search
  ranks by and ``--nbest`` prints;
* log p itself, unnormalised.

The hypotheses are those of ``Translator.translate_lines``, the library call
under ``s2s translate``, with the model's own decode settings unless ``--beam``
says otherwise.  Prints a table and, last, one JSON line.

    python benchmarks/confidence.py --model /work/bench/exp/ref
    python benchmarks/confidence.py --model exp/ddtp-en-de --lines 200 --threads 2
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from pathlib import Path
from typing import Callable, Sequence

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data" / "ddtp-en-de"


def ranks(x: Sequence[float]) -> list[float]:
    """R(x)_i = 1 + the number of x_j < x_i + (the number of other x_j == x_i) / 2:
    1-based ranks, tied values sharing the mean of the ranks they span."""
    order = sorted(range(len(x)), key=lambda i: x[i])
    r = [0.0] * len(x)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and x[order[end + 1]] == x[order[start]]:
            end += 1
        for k in range(start, end + 1):
            r[order[k]] = (start + end) / 2 + 1
        start = end + 1
    return r


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """rho = cov(R(x), R(y)) / (sd(R(x)) * sd(R(y))): Pearson's correlation of the ranks
    (:func:`ranks`, ties averaged); 0.0 when either side is constant."""
    rx, ry = ranks(x), ranks(y)
    n = len(rx)
    mx, my = sum(rx) / n, sum(ry) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx = sum((a - mx) ** 2 for a in rx)
    vy = sum((b - my) ** 2 for b in ry)
    return cov / (vx * vy) ** 0.5 if vx and vy else 0.0


def tenths(score: Sequence[float], quality: Sequence[float]) -> tuple[float, float, float]:
    """(mean quality of the best-scored tenth, of the worst-scored tenth, of all lines):
    the n // 10 lines of highest and of lowest score (ties kept in input order)."""
    n = len(score)
    k = max(1, n // 10)
    order = sorted(range(n), key=lambda i: -score[i])

    def mean(idx: Sequence[int]) -> float:
        return sum(quality[i] for i in idx) / len(idx)

    return mean(order[:k]), mean(order[-k:]), mean(range(n))


def read_gz(path: Path, n: int) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        lines = [line.rstrip("\n") for line in f]
    return lines[:n] if n else lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True, help="Model directory.")
    ap.add_argument("--src", type=Path, default=DATA / "test.en.gz")
    ap.add_argument("--ref", type=Path, default=DATA / "test.de.gz")
    ap.add_argument("--lines", type=int, default=0, help="The first N lines (0: all).")
    ap.add_argument("--beam", type=int, default=None, help="Beam size (default: the model's decode.beam).")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default).")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    from sacrebleu.metrics import CHRF

    from s2s.metrics import corpus_scores
    from s2s.output import confidence
    from s2s.translate import Translator

    src, ref = read_gz(args.src, args.lines), read_gz(args.ref, args.lines)
    if len(src) != len(ref):
        raise SystemExit(f"{args.src} has {len(src)} lines but {args.ref} has {len(ref)}")
    decode = {} if args.beam is None else {"beam": args.beam}
    translator = Translator.from_dirs([args.model], args.device, decode=decode, threads=args.threads)
    start = time.perf_counter()
    found = list(translator.translate_lines(src))
    seconds = time.perf_counter() - start
    hyps = [t.text for t in found]
    best = [t.hypotheses[0] if t.hypotheses else None for t in found]

    chrf = CHRF()
    quality = [chrf.sentence_score(h, [r]).score for h, r in zip(hyps, ref)]
    scores: dict[str, Callable] = {
        "mean log p per token (51), --scores": confidence,
        "search score log p / lp(m) (30)": lambda h: 0.0 if h is None else h.score,
        "log p": lambda h: 0.0 if h is None else h.log_prob,
    }
    rows = {}
    for name, fn in scores.items():
        s = [fn(h) for h in best]
        top, bottom, everything = tenths(s, quality)
        rows[name] = {"best_tenth_chrf": round(top, 2), "worst_tenth_chrf": round(bottom, 2),
                      "all_chrf": round(everything, 2), "spearman": round(spearman(s, quality), 3)}
    corpus = {s.name: s.score for s in corpus_scores(hyps, [ref], ("bleu", "chrf"))}
    d = translator.decode

    print(f"{len(src)} lines, beam {d.beam}, alpha {d.alpha} ({d.length_penalty}), "
          f"{seconds:.1f} s; corpus BLEU {corpus['bleu']}, chrF {corpus['chrf']}")
    print(f"{'score':<40} {'best 10%':>9} {'worst 10%':>10} {'all':>7} {'Spearman':>9}   (sentence chrF)")
    for name, r in rows.items():
        print(f"{name:<40} {r['best_tenth_chrf']:>9.2f} {r['worst_tenth_chrf']:>10.2f} "
              f"{r['all_chrf']:>7.2f} {r['spearman']:>9.3f}")
    print(json.dumps({"model": str(args.model), "lines": len(src), "beam": d.beam, "alpha": d.alpha,
                      "length_penalty": d.length_penalty, "seconds": round(seconds, 1),
                      "corpus": corpus, "scores": rows}))


if __name__ == "__main__":
    main()
