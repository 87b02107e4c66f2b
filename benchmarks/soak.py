"""Soak test: nothing lost over a long stream, nothing lost over many crashes.

Three checks, run against the real ``s2s`` command in subprocesses (not a timed
test; it takes minutes):

  stream   200,000 lines (the 1,000 test sentences with some edge cases,
           drawn in a seeded random order) piped through ``s2s translate``:
           exactly one output line per input line, each equal to that
           sentence's translation in a separate 1,000-line run (so order is
           kept), and the peak RSS of the 200,000-line run against the peak
           RSS of the 1,000-line one (target: within 1.5x).
  crash    a training run killed with SIGKILL at random moments (10 times by
           default), resumed with --resume after each kill, then run to the
           end: its final weights must equal, bit for bit, those of the same
           run never interrupted.
  bulk     ``s2s translate -i FILE -o OUT --resume`` on 20,000 of those lines,
           killed with SIGKILL (its process group) at a random moment after
           each newly saved chunk (--kills times), resumed after each kill,
           then run to the end: OUT must equal, byte for byte, the output of
           the same command never interrupted and of one without --resume
           (whose time it also reports).

With no --model, a tiny model is trained first on the shipped ddtp-en-de data
(the check is about streaming, not quality).  Exits non-zero when a check fails.

    python benchmarks/soak.py                   # all three checks, ~20 min on 2 cores
    python benchmarks/soak.py --lines 20000 --kills 3      # a shorter run
    python benchmarks/soak.py --model exp/quickstart --skip-crash
    python benchmarks/soak.py --model exp/quickstart --skip-stream --skip-crash --bulk-lines 1000 --bulk-chunk-lines 100
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data" / "ddtp-en-de"
S2S = [sys.executable, "-m", "s2s"]

TINY = """\
seed: 7
tokenizer: {{vocab_size: 1000}}
data: {{src_lang: en, tgt_lang: de, train: {work}/train, dev: {work}/dev, dir: {work}/prep}}
model: {{d_model: 64, heads: 4, enc_layers: 1, dec_layers: 1, d_ff: 128}}
train: {{max_steps: {steps}, validate_every: 10, log_every: 5, dev_bleu_sentences: 0,
        best_metric: loss, max_tokens: 1500, threads: 1, lr: 0.003, warmup_steps: 20}}
decode: {{beam: 1, max_len_a: 1.0, max_len_b: 5}}
"""

# lines a user may pipe in beside ordinary text
EDGE_LINES = ["", "   ", "\t", "🙂 emoji only 🙂", "שלום עולם (right to left)", "中文 混合 text",
              "a\x00b NUL inside", "package " * 400]


def gz_lines(path: Path, n: int) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for _, line in zip(range(n), f)]


def run_measured(args: list[str], stdin_lines=None, stdin_file=None, collect=True):
    """Run ``s2s ARGS``; stream ``stdin_lines`` in on a thread, read stdout as it comes.
    Returns (exit code, stdout lines, stderr, peak RSS in MiB, seconds)."""
    t0 = time.time()
    stdin = open(stdin_file, "rb") if stdin_file else subprocess.PIPE
    proc = subprocess.Popen(S2S + args, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def feed():
        for line in stdin_lines:
            proc.stdin.write((line + "\n").encode("utf-8"))
        proc.stdin.close()

    feeder = threading.Thread(target=feed, daemon=True) if stdin_lines is not None else None
    if feeder:
        feeder.start()
    err_chunks: list[bytes] = []
    err_reader = threading.Thread(target=lambda: err_chunks.append(proc.stderr.read()), daemon=True)
    err_reader.start()
    out = [raw.decode("utf-8").rstrip("\n") for raw in proc.stdout] if collect else None
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    err_reader.join()
    if feeder:
        feeder.join()
    return proc.returncode, out, b"".join(err_chunks).decode("utf-8", "replace"), usage.ru_maxrss / 1024, \
        time.time() - t0


def cli(*args: str) -> None:
    r = subprocess.run(S2S + [str(a) for a in args], capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"soak: `s2s {' '.join(map(str, args))}` failed:\n{r.stderr}")


def make_experiment(work: Path, steps: int) -> Path:
    """The shipped corpus as plain files, a tiny config, tokenizer and prepared data."""
    for split, n in (("train", 20000), ("dev", 200)):
        for lang in ("en", "de"):
            (work / f"{split}.{lang}").write_text("\n".join(gz_lines(DATA / f"{split}.{lang}.gz", n)) + "\n",
                                                  encoding="utf-8")
    cfg = work / "tiny.yaml"
    cfg.write_text(TINY.format(work=work, steps=steps))
    cli("tokenizer", "train", cfg)
    cli("prepare", cfg)
    return cfg


# --------------------------------------------------------------------------- #
def soak_stream(model: Path, n_lines: int, work: Path, seed: int) -> dict:
    pool = gz_lines(DATA / "test.en.gz", 1000)
    pool = pool[:1000 - len(EDGE_LINES)] + EDGE_LINES
    print(f"stream: translating the {len(pool)} distinct lines alone ...", file=sys.stderr)
    small = work / "pool.txt"
    small.write_text("\n".join(pool) + "\n", encoding="utf-8")
    code, ref, err, rss_small, secs_small = run_measured(["translate", "-m", str(model), "--input", str(small)])
    if code:
        sys.exit(f"soak: translate failed:\n{err}")
    reference = dict(zip(pool, ref))
    rng = random.Random(seed)
    order = [rng.randrange(len(pool)) for _ in range(n_lines)]
    print(f"stream: piping {n_lines:,} lines through `s2s translate` ...", file=sys.stderr)
    code, out, err, rss_big, secs = run_measured(["translate", "-m", str(model)],
                                                 stdin_lines=(pool[i] for i in order))
    if code:
        sys.exit(f"soak: translate failed on the stream:\n{err}")
    wrong = [k for k, (i, got) in enumerate(zip(order, out)) if got != reference[pool[i]]]
    return {"lines_in": n_lines, "lines_out": len(out), "mismatched_lines": len(wrong),
            "first_mismatch": wrong[0] + 1 if wrong else None,
            "seconds": round(secs, 1), "lines_per_s": round(n_lines / secs),
            "peak_rss_mib_1000": round(rss_small), "peak_rss_mib_stream": round(rss_big),
            "rss_ratio": round(rss_big / rss_small, 3),
            "ok": len(out) == n_lines and not wrong and rss_big <= 1.5 * rss_small}


# --------------------------------------------------------------------------- #
def final_weights(run: Path) -> dict:
    from safetensors.torch import load_file

    from s2s.checkpoint import list_checkpoints

    return load_file(str(list_checkpoints(run)[-1] / "model.safetensors"))


def soak_crash(cfg: Path, work: Path, kills: int, seed: int) -> dict:
    from s2s.checkpoint import list_checkpoints
    from s2s.modeldir import load_model_dir

    print("crash: the uninterrupted run ...", file=sys.stderr)
    t0 = time.time()
    cli("train", cfg, "-o", work / "straight")
    straight_secs = time.time() - t0
    rng = random.Random(seed)
    run = work / "killed"
    landed = []
    for k in range(kills):
        proc = subprocess.Popen(S2S + ["train", str(cfg), "-o", str(run), "--resume"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.5, straight_secs * 0.35))  # from start-up to well into training
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        ckpts = list_checkpoints(run)
        landed.append(int(ckpts[-1].name.split("-")[1]) if ckpts else 0)
        print(f"crash: kill {k + 1}/{kills}: newest checkpoint step {landed[-1]}", file=sys.stderr)
    r = subprocess.run(S2S + ["train", str(cfg), "-o", str(run), "--resume"], capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"soak: the final resume failed:\n{r.stderr}")
    a, b = final_weights(work / "straight"), final_weights(run)
    identical = a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)
    load_model_dir(run)  # the run directory is a loadable model whose checksum matches
    return {"kills": kills, "newest_checkpoint_step_after_each_kill": landed,
            "final_step": int(list_checkpoints(run)[-1].name.split("-")[1]),
            "identical_to_uninterrupted": identical, "ok": identical}


# --------------------------------------------------------------------------- #
def soak_bulk(model: Path, n_lines: int, work: Path, kills: int, seed: int, chunk_lines: int) -> dict:
    """`translate --resume` killed with SIGKILL at random moments (the whole process group, as
    a power cut would), resumed after each kill, then run to the end: its output must equal,
    byte for byte, that of the same command never interrupted."""
    pool = gz_lines(DATA / "test.en.gz", 1000)
    pool = pool[:1000 - len(EDGE_LINES)] + EDGE_LINES
    rng = random.Random(seed)
    src = work / "bulk.en"
    src.write_text("".join(pool[rng.randrange(len(pool))] + "\n" for _ in range(n_lines)), encoding="utf-8")
    timed = {}
    chunk = ["--chunk-lines", str(chunk_lines)]
    for name, extra in (("plain", []), ("resume", ["--resume", *chunk])):
        print(f"bulk: {n_lines:,} lines, uninterrupted, {name} ...", file=sys.stderr)
        t0 = time.time()
        cli("translate", "-m", model, "-i", src, "-o", work / f"bulk-{name}.de", *extra)
        timed[name] = time.time() - t0
    out = work / "bulk.de"
    command = S2S + ["translate", "-m", str(model), "-i", str(src), "-o", str(out), "--resume", *chunk]
    state = work / ".bulk.de.s2s-partial" / "state.json"

    def lines_saved() -> int:
        try:
            return json.loads(state.read_text())["lines_done"]
        except (OSError, ValueError, KeyError):
            return 0

    chunk_secs = timed["resume"] * min(1.0, chunk_lines / n_lines)
    saved: list[int] = []
    for k in range(kills):  # each run is killed after it saved one more chunk, at a random moment of the next
        before = lines_saved()
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        while proc.poll() is None and lines_saved() <= before:
            time.sleep(0.05)
        time.sleep(rng.uniform(0, chunk_secs))
        if proc.poll() is not None:
            print(f"bulk: run {k + 1} ended before its kill", file=sys.stderr)
            break
        os.killpg(proc.pid, signal.SIGKILL)  # the process group: the workers too, as a power cut
        proc.wait()
        saved.append(lines_saved())
        print(f"bulk: kill {k + 1}/{kills}: {saved[-1]:,} lines saved", file=sys.stderr)
    r = subprocess.run(command, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"soak: the final --resume failed:\n{r.stderr}")
    straight = (work / "bulk-plain.de").read_bytes()
    identical = out.read_bytes() == straight == (work / "bulk-resume.de").read_bytes()
    return {"lines": n_lines, "kills": kills, "lines_saved_after_each_kill": saved,
            "seconds_plain": round(timed["plain"], 1), "seconds_resume": round(timed["resume"], 1),
            "identical_to_uninterrupted": identical, "partial_removed": not state.parent.exists(),
            "ok": identical and not state.parent.exists()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="a trained model directory for the stream check")
    ap.add_argument("--lines", type=int, default=200_000)
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--steps", type=int, default=200, help="training steps of the tiny model")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--skip-stream", action="store_true")
    ap.add_argument("--skip-crash", action="store_true")
    ap.add_argument("--bulk-lines", type=int, default=20_000)
    ap.add_argument("--bulk-chunk-lines", type=int, default=1000, help="translate --chunk-lines in the bulk check")
    ap.add_argument("--skip-bulk", action="store_true")
    args = ap.parse_args()
    report = {}
    with tempfile.TemporaryDirectory(prefix="s2s-soak-") as tmp:
        work = Path(tmp)
        cfg = make_experiment(work, args.steps) if not (args.model and args.skip_crash) else None
        model = args.model
        if model is None and not (args.skip_stream and args.skip_bulk):
            print("training the tiny model ...", file=sys.stderr)
            cli("train", cfg, "-o", work / "model")
            model = work / "model"
        if not args.skip_stream:
            report["stream"] = soak_stream(model, args.lines, work, args.seed)
            print(json.dumps(report["stream"]), file=sys.stderr)
        if not args.skip_bulk:
            report["bulk"] = soak_bulk(model, args.bulk_lines, work, args.kills, args.seed, args.bulk_chunk_lines)
            print(json.dumps(report["bulk"]), file=sys.stderr)
        if not args.skip_crash:
            crash_cfg = work / "crash.yaml"
            crash_cfg.write_text(cfg.read_text().replace(f"max_steps: {args.steps}", "max_steps: 120")
                                 .replace("validate_every: 10", "validate_every: 4"))
            report["crash"] = soak_crash(crash_cfg, work, args.kills, args.seed)
    print(json.dumps(report))
    sys.exit(0 if all(r["ok"] for r in report.values()) else 1)


if __name__ == "__main__":
    main()
