"""How `s2s prepare` scales with the corpus: time and peak memory at 1x, 10x and 30x.

The corpora are the shipped DDTP training pairs (data/ddtp-en-de/train.*.gz,
45,010 pairs) repeated k times; copy i > 0 of every non-empty line gets the
token ` {i}` appended on both sides, so deduplication keeps the copies and the
10x corpus really holds 10x the distinct pairs.  Each size runs
`s2s prepare` (train split only, the quickstart recipe's cleaning rules) in a
subprocess and reports its wall time and peak RSS: the largest single
process (wait4's ru_maxrss, pool workers included) and the whole process tree
(summed PSS, sampled every 0.1 s).  The tokenizer is trained once on the 1x
corpus (not timed), or copied with --tokenizer from a prepared directory.

    python benchmarks/prepare_scale.py                          # 1x, 10x, 30x
    python benchmarks/prepare_scale.py --scales 1 10 --tokenizer prepared/quickstart

The last line is a JSON object with every figure and the ratios to 1x.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data" / "ddtp-en-de"
RECIPE = REPO / "recipes" / "quickstart.yaml"


def make_corpus(directory: Path, k: int) -> int:
    """train.en / train.de: the shipped pairs, k times, copy i with ' {i}' appended."""
    directory.mkdir(parents=True, exist_ok=True)
    n = 0
    for lang in ("en", "de"):
        with gzip.open(DATA / f"train.{lang}.gz", "rt", encoding="utf-8") as f:
            lines = [line.rstrip("\n") for line in f]
        with open(directory / f"train.{lang}", "w", encoding="utf-8") as out:
            for i in range(k):
                suffix = f" {i}" if i else ""
                out.writelines((line + suffix if line.strip() else line) + "\n" for line in lines)
        n = len(lines) * k
    return n


def tree_pss(pid: int) -> int:
    """Summed PSS in bytes of ``pid`` and its descendants (Linux /proc): pages the forked
    pool workers share with their parent count once, split between them."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("Pss:")) * 1024
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError, StopIteration):
            continue
    return total


def run_prepare(corpus: Path, prep: Path, workers: int) -> dict:
    cmd = [sys.executable, "-m", "s2s", "prepare", str(RECIPE), "-j", str(workers), "--set",
           f"data.train={corpus}/train", "--set", "data.dev=", "--set", "data.test=",
           "--set", f"data.dir={prep}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak_tree, done = 0, threading.Event()

    def sample() -> None:
        nonlocal peak_tree
        while not done.wait(0.1):
            peak_tree = max(peak_tree, tree_pss(proc.pid))
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = proc.stdout.read(), proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        sys.exit(f"prepare_scale: s2s prepare failed on {corpus}:\n{err}")
    kept = json.loads((prep / "meta.json").read_text())["splits"]["train"]
    return {"seconds": round(seconds, 2), "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
            "peak_tree_pss_mb": round(peak_tree / 2**20, 1), "kept": kept, "table": out.strip()}


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scales", type=int, nargs="+", default=[1, 10, 30], help="corpus multiples (first: base)")
    ap.add_argument("--workers", type=int, default=0, help="`s2s prepare -j` (0: one per core)")
    ap.add_argument("--tokenizer", type=Path, help="a prepared directory whose tokenizer to copy "
                    "(default: train the quickstart tokenizer on the 1x corpus)")
    ap.add_argument("--workdir", type=Path, help="where the corpora go (default: a temporary directory)")
    args = ap.parse_args()

    work = args.workdir or Path(tempfile.mkdtemp(prefix="prepare_scale-"))
    tok_dir = work / "tokenizer"
    if args.tokenizer:
        shutil.rmtree(tok_dir, ignore_errors=True)
        shutil.copytree(args.tokenizer, tok_dir, ignore=shutil.ignore_patterns("*.npy", "*.txt", "meta.json"))
    elif not (tok_dir / "tokenizer.json").exists():
        make_corpus(work / "x1", 1)
        subprocess.run([sys.executable, "-m", "s2s", "tokenizer", "train", str(RECIPE), "--set",
                        f"data.train={work}/x1/train", "--set", f"data.dir={tok_dir}"], check=True,
                       env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL)
    print(f"CPU: {cpu_model()}, {len(os.sched_getaffinity(0))} cores; workdir {work}", flush=True)
    results = {}
    for k in args.scales:
        corpus = work / f"x{k}"
        pairs = make_corpus(corpus, k)
        prep = work / f"prep{k}"
        shutil.rmtree(prep, ignore_errors=True)
        shutil.copytree(tok_dir, prep)
        r = run_prepare(corpus, prep, args.workers)
        r["pairs"] = pairs
        results[k] = r
        print(f"{k:>3}x  {pairs:>9,} pairs  kept {r['kept']:>9,}  {r['seconds']:>8.1f} s  "
              f"peak RSS {r['peak_rss_mb']:>7.1f} MB (process tree PSS {r['peak_tree_pss_mb']:.1f} MB)", flush=True)
        shutil.rmtree(prep)
        shutil.rmtree(corpus)
    base = results[args.scales[0]]
    ratios = {f"{k}x": {"time": round(r["seconds"] / base["seconds"], 2),
                        "memory": round(r["peak_rss_mb"] / base["peak_rss_mb"], 3),
                        "tree_memory": round(r["peak_tree_pss_mb"] / base["peak_tree_pss_mb"], 3)}
              for k, r in results.items() if k != args.scales[0]}
    for name, r in ratios.items():
        print(f"{name} / {args.scales[0]}x: time {r['time']:.2f}x, peak RSS {r['memory']:.3f}x "
              f"(process tree PSS {r['tree_memory']:.3f}x)")
    print(json.dumps({"cpu": cpu_model(), "cores": len(os.sched_getaffinity(0)), "workers": args.workers,
                      "results": {f"{k}x": {key: v for key, v in r.items() if key != "table"}
                                  for k, r in results.items()},
                      "ratios": ratios}))


if __name__ == "__main__":
    main()
