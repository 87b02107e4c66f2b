"""Steady-state decoding speed of one s2s tree (levers 3 and 4 of issue 15).

Run with PYTHONPATH set to the tree to measure (so an older commit can be
measured against a newer one with the same script); the model is loaded and,
with --compile, warmed on the first --warmup lines (that time is the compile
time, reported on its own); then every input line is translated and timed.
The last line printed is one JSON object.

    PYTHONPATH=$PWD python benchmarks/decode_step_levers.py -m MODEL \\
        -i data/ddtp-en-de/test.en.gz --beam 5 --threads 1 -o out.txt
"""

from __future__ import annotations

import argparse
import gzip
import json
import time


def read(path: str, limit: int) -> list[str]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        lines = [line.rstrip("\n") for line in f]
    return lines[:limit] if limit else lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-i", "--input", required=True)
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--beam", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--limit", type=int, default=0, help="first N lines only (0: all)")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--quantize", default=None)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--warmup", type=int, default=64, help="lines translated before timing (--compile)")
    args = ap.parse_args()

    import torch

    from s2s.translate import Translator

    torch.set_num_threads(args.threads)
    lines = read(args.input, args.limit)
    overrides = dict(beam=args.beam, nbest=1)
    if args.compile:
        overrides["compile"] = True
    translator = Translator.from_dir(args.model, **overrides)
    translator.set_arithmetic(args.precision, args.quantize)
    warm_s = 0.0
    if args.compile:
        start = time.perf_counter()
        translator.translate(lines[:args.warmup])
        warm_s = time.perf_counter() - start
    start = time.perf_counter()
    out = translator.translate(lines)
    steady_s = time.perf_counter() - start
    with open(args.output, "w", encoding="utf-8") as f:
        f.writelines(line + "\n" for line in out)
    print(json.dumps({"beam": args.beam, "precision": args.precision, "quantize": args.quantize,
                      "compile": args.compile, "lines": len(lines), "warmup_s": round(warm_s, 2),
                      "steady_s": round(steady_s, 2), "sent_s": round(len(lines) / steady_s, 2)}))


if __name__ == "__main__":
    main()
