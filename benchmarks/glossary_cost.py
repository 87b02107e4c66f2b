"""The cost of terminology: beam search with a glossary (constrained decoding, s2s.constraints)
against the same search without one, on the ddtp-en-de test set.

One process loads the model once; the first ``--sentences`` lines of
data/ddtp-en-de/test.en.gz are translated with and without the glossary,
alternating which goes first, for ``--rounds`` rounds (>= 3 for figures; a busy
machine slows both alike), and each condition reports sentences/s (median, min,
max over the rounds), BLEU (sacrebleu 13a against test.de.gz; decoding is
deterministic, so one value), BLEU on the sentences that received a constraint,
and the fraction of constraints satisfied: of the (sentence, target term) pairs
the glossary asks for, the share whose target pieces occur in a row in the
output (what the search enforces) and whose target term occurs in the output
text.  The run without the glossary gives the same fractions for comparison.

The glossary is extracted from the references, so keeping it should help:

1. a word co-occurrence table of the prepared training data (``--data``:
   train.src.txt and train.tgt.txt, the pairs the model trained on): words are
   runs of word characters (``\\w+``, case kept) of at least 4 characters; for
   the source words of the test sources, c(s), c(t) and c(s, t) count sentence
   pairs (once per pair), and dice(s, t) = 2 c(s, t) / (c(s) + c(t)), as
   s2s.shortlist's table does for pieces;
2. each such source word s keeps its best target word t* = argmax_t dice(s, t)
   when c(s, t*) >= 3, dice(s, t*) >= ``--min-dice``, t* is not a word of the
   training sources (seen there twice or more: copied names, numbers and their
   neighbours, "Midnight" for "Commander") and t* is not among the 100 most
   frequent target words (function words are not terminology);
3. the pair (s, t*) enters the glossary when t* occurs (whole word) in the
   reference of every test sentence whose source contains s (whole word).

Each entry is thus one source word -> one target word, right for this test set
by construction; a term the model would not have produced costs BLEU nothing
and may gain it, so the BLEU difference measures what the constraints cost the
rest of the sentence plus what the right terms gain.

    python benchmarks/glossary_cost.py --model exp/ddtp-en-de --data prepared/ddtp-en-de
    python benchmarks/glossary_cost.py --model M --data D --sentences 300 --rounds 3 --glossary-out g.tsv
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DATA = REPO / "data" / "ddtp-en-de"
WORD = re.compile(r"\w+")


def words(line: str, min_chars: int = 4) -> set[str]:
    return {w for w in WORD.findall(line) if len(w) >= min_chars}


def has_word(line: str, w: str) -> bool:
    return re.search(r"(?<!\w)" + re.escape(w) + r"(?!\w)", line) is not None


def extract_glossary(train_src: list[str], train_tgt: list[str], test_src: list[str], test_ref: list[str],
                     min_dice: float = 0.3, min_pairs: int = 3, frequent: int = 100) -> dict[str, str]:
    """The glossary of the module docstring: source word -> target word."""
    wanted = set().union(*(words(s) for s in test_src))
    c_s: Counter = Counter()
    c_t: Counter = Counter()
    c_st: Counter = Counter()
    tokens_t: Counter = Counter()
    source_vocab: Counter = Counter()
    for src, tgt in zip(train_src, train_tgt):
        source_vocab.update(words(src))
        s_words = words(src) & wanted
        t_words = words(tgt)
        tokens_t.update(WORD.findall(tgt))
        c_t.update(t_words)
        c_s.update(s_words)
        c_st.update((s, t) for s in s_words for t in t_words)
    function_words = {w for w, _ in tokens_t.most_common(frequent)}
    best: dict[str, tuple[float, str]] = {}
    for (s, t), n in c_st.items():
        if n < min_pairs or source_vocab[t] >= 2 or t in function_words:
            continue
        dice = 2 * n / (c_s[s] + c_t[t])
        if dice >= min_dice and (s not in best or dice > best[s][0]):
            best[s] = (dice, t)
    glossary = {}
    for s, (_, t) in sorted(best.items()):
        refs = [ref for src, ref in zip(test_src, test_ref) if has_word(src, s)]
        if refs and all(has_word(ref, t) for ref in refs):
            glossary[s] = t
    return glossary


def read(path: Path, n: int = 0) -> list[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        lines = f.read().splitlines()
    return lines[:n] if n else lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="model directory (trained on --data)")
    ap.add_argument("--data", required=True, help="its prepared data directory (train.src.txt, train.tgt.txt)")
    ap.add_argument("--sentences", type=int, default=1000, help="first N test sentences (0: all)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--beam", type=int, default=0, help="beam (0: the model's decode.beam)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--min-dice", type=float, default=0.3)
    ap.add_argument("--glossary-out", default="", help="also keep the extracted glossary here")
    args = ap.parse_args()

    from s2s.config import replace
    from s2s.constraints import unmet_constraints
    from s2s.glossary import load_glossary
    from s2s.metrics import corpus_bleu
    from s2s.translate import Translator

    logging.getLogger("s2s").setLevel(logging.ERROR)  # the unmet-term warnings are counted below
    data = Path(args.data)
    src, ref = read(DATA / "test.en.gz", args.sentences), read(DATA / "test.de.gz", args.sentences)
    started = time.perf_counter()
    terms = extract_glossary(read(data / "train.src.txt"), read(data / "train.tgt.txt"), src, ref, args.min_dice)
    extract_s = time.perf_counter() - started
    path = Path(args.glossary_out) if args.glossary_out else Path(tempfile.mkdtemp()) / "glossary.tsv"
    path.write_text("".join(f"{s}\t{t}\n" for s, t in terms.items()), encoding="utf-8")
    glossary = load_glossary(path)

    overrides = {"beam": args.beam} if args.beam else {}
    tr = Translator.from_dirs([args.model], "cpu", decode=overrides, threads=args.threads)
    plain_decode = tr.decode
    conditions = {"plain": plain_decode, "glossary": replace(plain_decode, "decode.", glossary=str(path))}
    per_line = [glossary.targets_in(s) for s in src]
    asked = [(i, term) for i, ts in enumerate(per_line) for term in ts]
    pieces = {term: tr.tok.encode_tgt([term])[0][:-1] for _, term in asked}
    touched = [i for i, ts in enumerate(per_line) if ts]

    times: dict[str, list[float]] = {c: [] for c in conditions}
    outputs: dict[str, list] = {}
    for r in range(args.rounds):
        order = list(conditions) if r % 2 == 0 else list(conditions)[::-1]
        for name in order:
            tr.decode = conditions[name]
            t0 = time.perf_counter()
            found = list(tr.translate_lines(src))
            times[name].append(time.perf_counter() - t0)
            outputs[name] = found
            print(f"round {r + 1} {name}: {len(src) / times[name][-1]:.2f} sentences/s", file=sys.stderr)

    rows = {}
    for name, found in outputs.items():
        texts = [t.text for t in found]
        by_pieces = sum(not unmet_constraints(found[i].hypotheses[0].tokens if found[i].hypotheses else [],
                                              [pieces[term]]) for i, term in asked)
        by_text = sum(term in texts[i] for i, term in asked)
        rate = [len(src) / s for s in times[name]]
        rows[name] = {
            "sent_s_median": round(statistics.median(rate), 2), "sent_s_min": round(min(rate), 2),
            "sent_s_max": round(max(rate), 2), "bleu": round(corpus_bleu(texts, ref), 2),
            "bleu_constrained_sentences": round(corpus_bleu([texts[i] for i in touched],
                                                            [ref[i] for i in touched]), 2),
            "constraints_met_pieces": round(by_pieces / max(len(asked), 1), 4),
            "constraints_met_text": round(by_text / max(len(asked), 1), 4),
        }
    print(f"{len(src)} sentences, {args.rounds} rounds, beam {plain_decode.beam}, {args.threads} thread(s); "
          f"glossary: {len(terms)} entries (extracted in {extract_s:.1f} s), {len(asked)} constraints "
          f"in {len(touched)} sentences")
    print(f"{'':10} {'sent/s median (min-max)':>26} {'BLEU':>6} {'BLEU constr.':>13} "
          f"{'met (pieces)':>13} {'met (text)':>11}")
    for name, row in rows.items():
        print(f"{name:10} {row['sent_s_median']:>12.2f} ({row['sent_s_min']:.2f}-{row['sent_s_max']:.2f})"
              f"{'':>4} {row['bleu']:>6.2f} {row['bleu_constrained_sentences']:>13.2f} "
              f"{row['constraints_met_pieces']:>13.2%} {row['constraints_met_text']:>11.2%}")
    print(json.dumps({"sentences": len(src), "rounds": args.rounds, "beam": plain_decode.beam,
                      "threads": args.threads, "glossary_entries": len(terms), "constraints": len(asked),
                      "constrained_sentences": len(touched), "conditions": rows}))


if __name__ == "__main__":
    main()
