"""How well --split-sentences finds the sentences of paragraphs made of known sentences.

    PYTHONPATH=. python benchmarks/split_sentences.py [--k 3]

Takes the ddtp-en-de test lines of each side that end in . ! or ?, and asks
s2s.documents.sentence_spans (sentencex, the side's language rules): how many such lines it
leaves whole (the others hold more than one sentence, or it over-splits them); then, joining
k consecutive lines with one space into a paragraph, how many paragraphs it splits back into
exactly their k lines, how many exactly as it splits the k lines one by one (the joining
changed nothing), and of the rest how many have fewer pieces than that (a boundary between
two lines missed) or more (a boundary the joining made up); and how fast it splits.  No model
is involved.  Prints one JSON line per language.
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from pathlib import Path

from s2s.documents import sentence_spans

REPO = Path(__file__).resolve().parents[1]


def measure(lang: str, k: int) -> dict:
    with gzip.open(REPO / "data" / "ddtp-en-de" / f"test.{lang}.gz", "rt", encoding="utf-8") as f:
        lines = [line.strip() for line in f if line.strip().endswith((".", "!", "?"))]
    whole = sum(len(sentence_spans(line, lang)) == 1 for line in lines)
    paragraphs = [lines[i:i + k] for i in range(0, len(lines) - k + 1, k)]
    start = time.perf_counter()
    found = [[" ".join(p)[s:e] for s, e in sentence_spans(" ".join(p), lang)] for p in paragraphs]
    seconds = time.perf_counter() - start
    alone = [[line[s:e] for line in p for s, e in sentence_spans(line, lang)] for p in paragraphs]
    differ = [(f, a) for f, a in zip(found, alone) if f != a]
    return {"lang": lang, "lines": len(lines), "left_whole": whole, "k": k, "paragraphs": len(paragraphs),
            "split_back_exactly": sum(f == p for f, p in zip(found, paragraphs)),
            "as_its_lines_alone": len(paragraphs) - len(differ),
            "fewer": sum(len(f) < len(a) for f, a in differ), "more": sum(len(f) > len(a) for f, a in differ),
            "sentences_per_s": round(sum(len(p) for p in paragraphs) / seconds)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=3, help="sentences per paragraph")
    args = ap.parse_args()
    for lang in ("en", "de"):
        print(json.dumps(measure(lang, args.k)))


if __name__ == "__main__":
    main()
