"""Steady-state decoding speed of one s2s tree (levers 3 and 4 of issue 15), and A/B of trees.

Run with PYTHONPATH set to the tree to measure (so an older commit can be
measured against a newer one with the same script); the model is loaded and,
with --compile, warmed on the first --warmup lines (that time is the compile
time, reported on its own); then every input line is translated and timed.
The last line printed is one JSON object.

    PYTHONPATH=$PWD python benchmarks/decode_step_levers.py -m MODEL \\
        -i data/ddtp-en-de/test.en.gz --beam 5 --threads 1 -o out.txt

``--profile torch`` (the top operators by self CPU time) or ``--profile python``
(cProfile's top functions by internal time) prints where the timed translation
spends its time, to stderr.

``--trees A B ...`` compares trees (e.g. ``git archive COMMIT | tar -x -C A``):
each round runs every tree at every ``--beams`` width in a process of its own
(PYTHONPATH=tree, the same options), interleaved so a busy machine slows each
alike; the outputs of every tree must be byte-identical to the first tree's.
Prints sentences/s as median (min-max) per tree and beam, the last line one JSON
object.

    python benchmarks/decode_step_levers.py -m MODEL -i data/ddtp-en-de/test.en.gz \\
        --limit 300 --threads 1 --trees /tmp/before /tmp/after --rounds 3 --beams 5,1 -o /tmp/ab
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def read(path: str, limit: int) -> list[str]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        lines = [line.rstrip("\n") for line in f]
    return lines[:limit] if limit else lines


def profiled(kind: str, run):
    """run() under the torch profiler or cProfile, its summary on stderr; returns run()'s value."""
    if kind == "torch":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = run()
        events = prof.key_averages()
        print(events.table(sort_by="self_cpu_time_total", row_limit=30), file=sys.stderr)
        calls = sum(e.count for e in events if e.key.startswith("aten::"))
        print(f"aten operator calls: {calls}", file=sys.stderr)
        return out
    import cProfile
    import pstats

    pr = cProfile.Profile()
    out = pr.runcall(run)
    pstats.Stats(pr, stream=sys.stderr).sort_stats("tottime").print_stats(30)
    return out


def measure(args) -> None:
    import torch

    from s2s.translate import Translator

    torch.set_num_threads(args.threads)
    lines = read(args.input, args.limit)
    overrides = dict(beam=args.beam, nbest=1, batch_tokens=args.batch_tokens)
    if args.compile:
        overrides["compile"] = True
    translator = Translator.from_dir(args.model, **overrides)
    translator.set_arithmetic(args.precision, args.quantize)
    warm_s = 0.0
    if args.compile:
        start = time.perf_counter()
        translator.translate(lines[:args.warmup])
        warm_s = time.perf_counter() - start
    start, cpu_start = time.perf_counter(), time.process_time()
    out = profiled(args.profile, lambda: translator.translate(lines)) if args.profile else translator.translate(lines)
    steady_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    with open(args.output, "w", encoding="utf-8") as f:
        f.writelines(line + "\n" for line in out)
    print(json.dumps({"beam": args.beam, "precision": args.precision, "quantize": args.quantize,
                      "compile": args.compile, "lines": len(lines), "warmup_s": round(warm_s, 2),
                      "steady_s": round(steady_s, 2), "sent_s": round(len(lines) / steady_s, 2),
                      "cpu_s": round(cpu_s, 2), "sent_per_cpu_s": round(len(lines) / cpu_s, 2)}))


def compare(args) -> None:
    """Interleaved rounds of every tree at every beam, outputs checked byte for byte."""
    out_dir = Path(args.output)
    out_dir.mkdir(parents=True, exist_ok=True)
    beams = [int(b) for b in args.beams.split(",")]
    trees = [str(Path(t).resolve()) for t in args.trees]
    sent_s: dict[tuple[int, int], list[float]] = {(i, b): [] for i in range(len(trees)) for b in beams}
    cpu: dict[tuple[int, int], list[float]] = {key: [] for key in sent_s}  # sentences per CPU second
    for r in range(args.rounds):
        for beam in beams:
            order = list(enumerate(trees))
            for i, tree in order if r % 2 == 0 else order[::-1]:  # alternate who runs first
                out = out_dir / f"tree{i}.beam{beam}.txt"
                cmd = [sys.executable, __file__, "-m", args.model, "-i", args.input, "-o", str(out),
                       "--beam", str(beam), "--threads", str(args.threads), "--limit", str(args.limit),
                       "--batch-tokens", str(args.batch_tokens), "--precision", args.precision]
                res = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": tree}, capture_output=True,
                                     text=True, check=True)
                rec = json.loads(res.stdout.strip().splitlines()[-1])
                sent_s[(i, beam)].append(rec["sent_s"])
                cpu[(i, beam)].append(rec["sent_per_cpu_s"])
                first = out_dir / f"tree0.beam{beam}.txt"
                same = not first.exists() or out.read_bytes() == first.read_bytes()
                print(json.dumps({"round": r + 1, "tree": tree, "beam": beam, "sent_s": rec["sent_s"],
                                  "sent_per_cpu_s": rec["sent_per_cpu_s"],
                                  "identical_to_tree0": same}), flush=True)
                if not same:
                    raise SystemExit(f"{tree}: beam {beam} output differs from {trees[0]}'s")
    summary = {}
    for (i, beam), xs in sent_s.items():
        key, cs = f"tree{i} beam{beam}", cpu[(i, beam)]
        summary[key] = {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs,
                        "cpu_median": statistics.median(cs), "cpu_min": min(cs), "cpu_max": max(cs)}
        print(f"{key} ({trees[i]}): {statistics.median(xs):.2f} sent/s ({min(xs):.2f}-{max(xs):.2f}), "
              f"{statistics.median(cs):.2f} sent/CPU-s ({min(cs):.2f}-{max(cs):.2f}), {len(xs)} rounds")
    print(json.dumps(summary))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-i", "--input", required=True)
    ap.add_argument("-o", "--output", required=True, help="the output file (with --trees: a folder)")
    ap.add_argument("--beam", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--limit", type=int, default=0, help="first N lines only (0: all)")
    ap.add_argument("--batch-tokens", type=int, default=4096, help="decode.batch_tokens")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--quantize", default=None)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--warmup", type=int, default=64, help="lines translated before timing (--compile)")
    ap.add_argument("--profile", choices=["torch", "python"], default=None,
                    help="print where the timed translation spends its time (stderr)")
    ap.add_argument("--trees", nargs="+", default=None, help="compare these trees (A/B), see above")
    ap.add_argument("--rounds", type=int, default=3, help="--trees: interleaved rounds")
    ap.add_argument("--beams", default="5,1", help="--trees: beam widths, comma-separated")
    args = ap.parse_args()
    compare(args) if args.trees else measure(args)


if __name__ == "__main__":
    main()
