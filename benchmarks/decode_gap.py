"""Where s2s's decoding time goes against CTranslate2's, on one batch: the encoder,
a step of the full batch, and the tail of a batch whose rows have ended.

One batch of ``--batch`` test sentences of similar length (the length-sorted
test set from ``--offset``), one thread, greedy or ``--beam``, each engine run
``--runs`` times in turn in this one process:

* ``forced L``: every output forced to L tokens (s2s ``decode.min_len`` =
  ``max_len_b`` = L; CTranslate2 ``min_decoding_length`` = ``max_decoding_length``
  = L), for L = 1 (the encoder and one step) and L = ``--steps``; the
  difference over L - 1 is the time of one step of the whole batch;
* ``natural``: outputs end where the model ends them (the shared 166-token cap);
  the batch runs until its longest output ends, its rows leaving as they end.

Then s2s's steps of the natural run, timed one by one: how many, rows per step,
and the milliseconds of a step with all rows and with one row left.
Needs ``pip install ctranslate2``; writes the CTranslate2 model next to the
s2s one (``MODEL-ct2``) on first use.

    python benchmarks/decode_gap.py -m exp/ddtp-en-de
"""

from __future__ import annotations

import argparse
import gzip
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEST = REPO / "data" / "ddtp-en-de" / "test.en.gz"
CAP = 166


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", type=Path, required=True, help="a trained s2s model directory")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--offset", type=int, default=500, help="first sentence of the batch in length order")
    ap.add_argument("--steps", type=int, default=40, help="L of the forced run")
    ap.add_argument("--beam", type=int, default=1)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    import ctranslate2
    import sentencepiece as spm
    import torch

    import s2s.search
    from s2s.translate import Translator

    torch.set_num_threads(1)
    ct2_dir = args.model.with_name(args.model.name + "-ct2")
    if not (ct2_dir / "model.bin").is_file():
        subprocess.run([sys.executable, "-m", "s2s", "export", "ct2", "-m", str(args.model), "-o", str(ct2_dir)],
                       check=True, cwd=REPO)
    with gzip.open(TEST, "rt", encoding="utf-8") as f:
        lines = sorted((line.rstrip("\n") for line in f), key=len)
    src = lines[args.offset:args.offset + args.batch]
    sp = spm.SentencePieceProcessor(model_file=str(ct2_dir / "spm.model"))
    pieces = [sp.encode(x, out_type=str) + ["</s>"] for x in src]
    ct2 = ctranslate2.Translator(str(ct2_dir), device="cpu", compute_type="float32",
                                 inter_threads=1, intra_threads=1)
    common = dict(beam=args.beam, batch_size=args.batch, batch_tokens=10 ** 6, length_penalty="power", alpha=1.0,
                  stop="early", max_len_a=0.0)

    def s2s_ms(length: int, forced: bool) -> float:
        tr = Translator.from_dir(args.model, **common, max_len_b=length, min_len=length if forced else 0)
        tr.translate(src[:4])
        t0 = time.perf_counter()
        tr.translate(src)
        return (time.perf_counter() - t0) * 1e3

    def ct2_ms(length: int, forced: bool) -> float:
        kw = dict(beam_size=args.beam, max_batch_size=args.batch, length_penalty=1.0, max_decoding_length=length)
        if forced:
            kw["min_decoding_length"] = length
        ct2.translate_batch(pieces[:4], **kw)
        t0 = time.perf_counter()
        ct2.translate_batch(pieces, **kw)
        return (time.perf_counter() - t0) * 1e3

    runs = {(name, engine): [] for name in ("forced 1", f"forced {args.steps}", "natural") for engine in ("s2s", "ct2")}
    for _ in range(args.runs):
        for (name, engine), times in runs.items():
            length, forced = (CAP, False) if name == "natural" else (int(name.split()[1]), True)
            times.append((s2s_ms if engine == "s2s" else ct2_ms)(length, forced))
    print(f"# {args.model}: {args.batch} sentences from {args.offset} in length order, beam {args.beam}, "
          f"1 thread; ms, median (min-max) of {args.runs}")
    med = {}
    for name in ("forced 1", f"forced {args.steps}", "natural"):
        row = []
        for engine in ("s2s", "ct2"):
            t = runs[(name, engine)]
            med[(name, engine)] = statistics.median(t)
            row.append(f"{engine} {med[(name, engine)]:7.0f} ({min(t):.0f}-{max(t):.0f})")
        print(f"{name:10s} " + "  ".join(row) + f"  s2s/ct2 {med[(name, 's2s')] / med[(name, 'ct2')]:.2f}")
    for engine in ("s2s", "ct2"):
        step = (med[(f"forced {args.steps}", engine)] - med[("forced 1", engine)]) / (args.steps - 1)
        print(f"{engine}: one step of {args.batch * args.beam} rows {step:.1f} ms")

    rows, step_ms = [], []
    step = s2s.search.ModelDecoder.step

    def timed(self, y_prev):
        t0 = time.perf_counter()
        out = step(self, y_prev)
        step_ms.append((time.perf_counter() - t0) * 1e3)
        rows.append(y_prev.size(0))
        return out

    s2s.search.ModelDecoder.step = timed
    tr = Translator.from_dir(args.model, **common, max_len_b=CAP)
    t0 = time.perf_counter()
    tr.translate(src)
    total = (time.perf_counter() - t0) * 1e3
    full = [ms for r, ms in zip(rows, step_ms) if r == rows[0]]
    one = [ms for r, ms in zip(rows, step_ms) if r == 1]
    print(f"s2s natural: {len(rows)} steps, {sum(rows)} row-steps, {total:.0f} ms of which steps "
          f"{sum(step_ms):.0f} ms; a step of {rows[0]} rows {statistics.median(full):.1f} ms"
          + (f", of 1 row {statistics.median(one):.1f} ms" if one else ""))


if __name__ == "__main__":
    main()
