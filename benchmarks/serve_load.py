"""Serving under concurrent load: `s2s serve` against `s2s translate` on the same sentences.

Starts ``s2s serve -m MODEL --port 0`` on loopback (127.0.0.1 only), warms it
with one request, then sends the ddtp-en-de test sentences one per request
from ``--clients`` concurrent clients (each a keep-alive connection that sends
its next sentence as soon as the answer to the last one is in) until
``--requests`` requests have been answered, and stops the server with
SIGTERM.  In the same run ``s2s translate`` translates the same sentences from
a file with the same threads and beam; its lines/s counts decoding only (the
wall time minus that of the same command on one line, its start-up), as the
server's start-up is outside its timing too.

Reports requests/s, p50/p99 latency, the server's batches (mean texts per
batch), the ratio of the server's requests/s to translate's lines/s, and how
many of the server's outputs equal translate's.  Not a timed test: the
machines are shared and noisy; only ratios within one run mean something.
The last line is one JSON object.

    python benchmarks/serve_load.py --model exp/qs
    python benchmarks/serve_load.py --model exp/qs --clients 32 --requests 500 --threads 2
    python benchmarks/serve_load.py --model exp/qs --min-len 20   # a barely trained model
    python benchmarks/serve_load.py --model exp/qs --precision auto   # the torch-free search (both)
"""

import argparse
import gzip
import http.client
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEST = REPO / "data" / "ddtp-en-de" / "test.en.gz"


def s2s_command(*args) -> list[str]:
    return [sys.executable, "-m", "s2s", *map(str, args)]


def environment() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def time_translate(model: str, lines: list[str], threads: int, beam: list[str]) -> tuple[float, float, list[str]]:
    """(seconds for all lines, seconds for one line, outputs) of `s2s translate -i FILE`."""
    with tempfile.TemporaryDirectory() as tmp:
        results = []
        for name, chunk in (("one", lines[:1]), ("all", lines)):
            src, out = Path(tmp) / f"{name}.en", Path(tmp) / f"{name}.de"
            src.write_text("".join(x + "\n" for x in chunk), encoding="utf-8")
            start = time.perf_counter()
            subprocess.run(s2s_command("-q", "translate", "-m", model, "-i", src, "-o", out,
                                       "--threads", threads, *beam), check=True, env=environment())
            results.append(time.perf_counter() - start)
        outputs = out.read_text(encoding="utf-8").splitlines()
    return results[1], results[0], outputs


class Client(threading.Thread):
    """One keep-alive connection sending the next unsent sentence until ``total`` are sent."""

    next_index = 0
    lock = threading.Lock()

    def __init__(self, port: int, lines: list[str], total: int, beam: dict, answers: dict):
        super().__init__(daemon=True)
        self.port, self.lines, self.total, self.beam, self.answers = port, lines, total, beam, answers
        self.latencies: list[float] = []
        self.failures: list[str] = []

    def run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        while True:
            with Client.lock:
                k = Client.next_index
                Client.next_index += 1
            if k >= self.total:
                break
            i = k % len(self.lines)
            body = json.dumps({"texts": [self.lines[i]], **self.beam})
            start = time.perf_counter()
            try:
                conn.request("POST", "/translate", body, {"Content-Type": "application/json"})
                response = conn.getresponse()
                data = response.read()
            except (OSError, http.client.HTTPException) as e:
                self.failures.append(f"request {k}: {e}")
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
                continue
            self.latencies.append(time.perf_counter() - start)
            if response.status != 200:
                self.failures.append(f"request {k}: HTTP {response.status} {data[:200]!r}")
            else:
                self.answers[i] = json.loads(data)["translations"][0]["text"]
        conn.close()


def get(port: int, path: str) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", path)
    out = json.loads(conn.getresponse().read())
    conn.close()
    return out


def load_server(model: str, lines: list[str], clients: int, total: int, threads: int,
                beam: dict, serve_args: list[str], window_ms: float) -> dict:
    proc = subprocess.Popen(s2s_command("serve", "-m", model, "--port", 0, "--threads", threads,
                                        "--window-ms", window_ms, *serve_args),
                            stderr=subprocess.PIPE, text=True, env=environment())
    try:
        said = []  # the server's stderr up to the line with its address (its precision's lines before it)
        while not (match := re.search(r"http://127\.0\.0\.1:(\d+)", said[-1] if said else "")):
            line = proc.stderr.readline()
            if not line:  # the server ended without serving
                raise SystemExit(f"serve_load: the server did not start: {''.join(said)}")
            said.append(line)
        tail: list[str] = []  # the rest, drained as it comes (so that the server never blocks on it)
        drain = threading.Thread(target=lambda: tail.extend(proc.stderr), daemon=True)
        drain.start()
        port = int(match.group(1))
        Client.next_index = 0
        Client(port, lines, 1, beam, {}).run()  # warm-up: one request before the clock starts
        before = get(port, "/health")
        Client.next_index = 0
        answers: dict[int, str] = {}
        pool = [Client(port, lines, total, beam, answers) for _ in range(clients)]
        start = time.perf_counter()
        for c in pool:
            c.start()
        for c in pool:
            c.join()
        seconds = time.perf_counter() - start
        after = get(port, "/health")
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(120)
        drain.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    latencies = sorted(x for c in pool for x in c.latencies)
    failures = [f for c in pool for f in c.failures]
    batches = after["batches"] - before["batches"]
    return {"seconds": seconds, "latencies": latencies, "failures": failures, "answers": answers,
            "batches": batches, "texts": after["texts"] - before["texts"], "exit_code": code,
            "native_search": any("searched without torch" in line for line in said), "server_said": tail}


def percentile(sorted_values: list[float], q: float) -> float:
    """The q-quantile by the nearest-rank rule: the ceil(q * n)-th smallest value."""
    if not sorted_values:
        return float("nan")
    return sorted_values[max(1, math.ceil(q * len(sorted_values))) - 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="Model directory.")
    ap.add_argument("--clients", type=int, default=32, help="Concurrent clients.")
    ap.add_argument("--requests", type=int, default=1000, help="Requests in all (one sentence each).")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the server and of translate.")
    ap.add_argument("--beam", type=int, default=None, help="Beam size (default: the model's).")
    ap.add_argument("--window-ms", type=float, default=5.0, help="The server's batching window.")
    ap.add_argument("--precision", default="fp32", help="--precision of both (auto: the torch-free search "
                                                        "where this CPU has its products).")
    ap.add_argument("--quantize", default=None, help="--quantize of both (int8).")
    ap.add_argument("--min-len", type=int, default=None,
                    help="decode.min_len for both (an untrained model's outputs otherwise end at once).")
    args = ap.parse_args()
    if args.clients < 1 or args.requests < 1:
        raise SystemExit("serve_load: --clients and --requests must be >= 1")

    with gzip.open(TEST, "rt", encoding="utf-8") as f:
        lines = [x.rstrip("\n") for x in f]
    sent = lines[:args.requests]  # the sentences the requests carry (repeated if more requests than lines)
    beam_args = [] if args.beam is None else ["--beam", str(args.beam)]
    beam_key = {} if args.beam is None else {"beam": args.beam}
    serve_args = ["--precision", args.precision] + ([] if args.quantize is None else ["--quantize", args.quantize])
    beam_args += serve_args  # (translate takes the same two options)
    if args.min_len is not None:
        beam_args += ["--min-len", str(args.min_len)]
        serve_args += ["--set", f"decode.min_len={args.min_len}"]

    print(f"s2s translate on {len(sent)} sentences ({args.threads} threads) ...", file=sys.stderr)
    t_all, t_one, reference = time_translate(args.model, sent, args.threads, beam_args)
    translate_lines_s = len(sent) / max(t_all - t_one, 1e-9)
    print(f"s2s serve: {args.requests} requests from {args.clients} clients ...", file=sys.stderr)
    run = load_server(args.model, sent, args.clients, args.requests, args.threads, beam_key, serve_args,
                      args.window_ms)
    answered = len(run["latencies"])
    req_s = answered / run["seconds"]
    p50, p99 = percentile(run["latencies"], 0.50) * 1000, percentile(run["latencies"], 0.99) * 1000
    identical = sum(1 for i, text in run["answers"].items() if text == reference[i])
    result = {
        "model": args.model, "clients": args.clients, "requests": args.requests, "threads": args.threads,
        "beam": args.beam, "min_len": args.min_len, "window_ms": args.window_ms, "precision": args.precision,
        "quantize": args.quantize, "native_search": run["native_search"],
        "server_req_s": round(req_s, 2), "p50_ms": round(p50, 1), "p99_ms": round(p99, 1),
        "batches": run["batches"], "texts_per_batch": round(run["texts"] / max(run["batches"], 1), 2),
        "failures": len(run["failures"]), "server_exit_code": run["exit_code"],
        "translate_lines_s": round(translate_lines_s, 2), "translate_wall_s": round(t_all, 2),
        "translate_startup_s": round(t_one, 2),
        "ratio_server_to_translate": round(req_s / translate_lines_s, 3),
        "identical_outputs": identical, "compared_outputs": len(run["answers"]),
    }
    for f in run["failures"][:5]:
        print(f"failure: {f}", file=sys.stderr)
    if run["failures"] or run["exit_code"] != 143:  # what the server said after its address
        print("".join(run["server_said"][-40:]), end="", file=sys.stderr)
    print(f"{'':24s}{'sentences/s':>12s}{'p50 ms':>9s}{'p99 ms':>9s}")
    print(f"{'s2s translate (file)':24s}{translate_lines_s:12.1f}{'':>9s}{'':>9s}")
    print(f"{f's2s serve ({args.clients} clients)':24s}{req_s:12.1f}{p50:9.1f}{p99:9.1f}")
    print(f"server/translate = {req_s / translate_lines_s:.3f}; {run['batches']} batches, "
          f"{result['texts_per_batch']} texts each; {identical}/{len(run['answers'])} outputs identical "
          f"to translate's; {len(run['failures'])} failures")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
