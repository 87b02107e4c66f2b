"""Workers x threads: `s2s translate` as 1 process x C threads against C processes x 1 thread.

    PYTHONPATH=. python benchmarks/workers_split.py -m exp/quickstart [--lines 1000] [--rounds 3]

Translates the first --lines ddtp-en-de test sentences, whole processes timed from the
outside (start-up, model loading and translation), the splits interleaved round by round
so that a busy machine slows each alike; prints one JSON line per run and, last, the
medians.  Then once, in this process, the steady state of one C-thread translator:
model loading and translation timed apart.  Not a timed test: the figures depend on the
machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--lines", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--beams", default="5,1")
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    with gzip.open(REPO / "data/ddtp-en-de/test.en.gz", "rt", encoding="utf-8") as f:
        lines = [line for _, line in zip(range(args.lines), f)]
    tmp = Path(tempfile.mkdtemp())
    src = tmp / "src.en"
    src.write_text("".join(lines), encoding="utf-8")
    splits = [(1, cores), (cores, 1)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    times: dict[str, list[float]] = {}
    outputs: dict[str, bytes] = {}
    for r in range(args.rounds):
        for beam in map(int, args.beams.split(",")):
            for workers, threads in splits:
                key = f"beam{beam} {workers}x{threads}"
                out = tmp / "out.txt"
                t0 = time.perf_counter()
                subprocess.run([sys.executable, "-m", "s2s", "translate", "-m", args.model, "-i", str(src),
                                "-o", str(out), "--beam", str(beam), "--workers", str(workers),
                                "--threads", str(threads), "--device", "cpu"], check=True, env=env)
                dt = time.perf_counter() - t0
                times.setdefault(key, []).append(dt)
                same = outputs.setdefault(f"beam{beam}", out.read_bytes()) == out.read_bytes()
                print(json.dumps({"round": r + 1, "run": key, "seconds": round(dt, 2),
                                  "sent_s": round(len(lines) / dt, 1), "same_output": same}), flush=True)
    medians = {k: round(statistics.median(v), 2) for k, v in times.items()}
    steady = steady_state(args.model, lines, cores)
    print(json.dumps({"cores": cores, "lines": len(lines), "median_seconds": medians,
                      "median_sent_s": {k: round(len(lines) / v, 1) for k, v in medians.items()},
                      **steady}))


def steady_state(model: str, lines: list[str], threads: int) -> dict:
    """One translator with ``threads`` threads in this process: loading and greedy translation apart."""
    t0 = time.perf_counter()
    import torch

    from s2s.translate import Translator

    torch.set_num_threads(threads)
    t1 = time.perf_counter()
    tr = Translator.from_dir(model, "cpu", beam=1)
    t2 = time.perf_counter()
    tr.translate(lines)
    t3 = time.perf_counter()
    return {"steady_import_s": round(t1 - t0, 2), "steady_load_s": round(t2 - t1, 2),
            "steady_greedy_translate_s": round(t3 - t2, 2)}


if __name__ == "__main__":
    main()
