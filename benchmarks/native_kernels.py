"""The torch-free search's product kernels side by side, and CTranslate2 in the same rounds.

``s2s translate``'s torch-free route (s2s.native_search) multiplies with one of the kernels of
s2s/model/native_linear.c, AMX's tiles (amx_bf16) or AVX512-BF16's vdpbf16ps (avx512_bf16), or
with s2s/model/native_int8.c's int8 products (int8, ``--quantize int8``: VNNI's vpdpbusd where the
CPU has it, else AVX2's vpmaddubsw; the products' rows name which).  This
script times each kernel this CPU has (an Intel Xeon with AMX has all three) on the same model and
sentences, steady state (the model loaded, translation alone), one thread, greedy and beam 5, and
CTranslate2 int8 and fp32 in the same rounds, on the instructions it picks and, with
``--ct2-isa best,AVX2``, capped to others (``CT2_FORCE_CPU_ISA``: what it runs on a CPU that has
only those).  The configurations take turns round by round (``--rounds``, >= 3), and the median
with min and max is kept.  Not a timed test: only ratios within one run mean something.  Prints a
table and, last, one JSON line.

``--products`` times the kernels' products alone instead, one thread, at a decoding step's shapes
(rows x depth x columns, W rotated through more than the core's caches as a step's matrices are),
in microseconds a call and multiply-adds a second (int8: x's quantization and the bf16 store
included; each call through ctypes, about 1 us).

    python benchmarks/native_kernels.py --model exp/ref
    python benchmarks/native_kernels.py --model exp/qs --lines 500 --rounds 5 --ct2-isa best,AVX2
    python benchmarks/native_kernels.py --products
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
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data" / "ddtp-en-de"
KERNELS = {"amx_bf16": 1, "avx512_bf16": 2, "int8": 0}  # native_linear.c's ISA_*; 0: native_int8.c's
PRODUCT_SHAPES = ((1, 256, 768), (8, 256, 768), (64, 256, 256), (64, 256, 768), (64, 1024, 256), (64, 256, 1024),
                  (64, 192, 4000), (320, 256, 8000))  # rows x depth (K) x columns (N)

S2S_SCRIPT = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from s2s import native_search
from s2s.workers import TranslatorSpec
model, src, kernel, beam, batch, cap = sys.argv[2], sys.argv[3], *map(int, sys.argv[4:8])
lines = open(src, encoding="utf-8").read().splitlines()
decode = {"beam": beam, "batch_size": batch, "batch_tokens": 1_000_000, "length_penalty": "power", "alpha": 1.0,
          "stop": "early", "max_len_a": 0.0, "max_len_b": cap}
arithmetic = {"precision": "fp32", "quantize": "int8"} if kernel == 0 else {"precision": "bf16"}
spec = TranslatorSpec(models=(model,), overrides=decode, device="cpu", **arithmetic)
engine = native_search.engine_for(spec)
if engine is None or (kernel and native_search.library().s2s_bf16_linear_use(kernel) != kernel):
    print(json.dumps({"skip": True}))
    sys.exit(0)
engine.translate_lines(lines[:64], range(1, 65), None)  # warm-up
t0 = time.perf_counter()
out, tokens = engine.translate_lines(lines, range(1, len(lines) + 1), None)
print(json.dumps({"seconds": time.perf_counter() - t0, "out": out}))
"""

CT2_SCRIPT = """
import json, sys, time, ctranslate2, sentencepiece as spm
ct2_dir, src, compute, beam, batch, cap = sys.argv[1], sys.argv[2], sys.argv[3], *map(int, sys.argv[4:7])
sp = spm.SentencePieceProcessor(model_file=ct2_dir + "/spm.model")
lines = open(src, encoding="utf-8").read().splitlines()
tr = ctranslate2.Translator(ct2_dir, device="cpu", compute_type=compute, inter_threads=1, intra_threads=1)
pieces = [sp.encode(x, out_type=str) + ["</s>"] for x in lines]
tr.translate_batch(pieces[:64], beam_size=beam, max_batch_size=batch)  # warm-up
t0 = time.perf_counter()
res = tr.translate_batch(pieces, beam_size=beam, max_batch_size=batch, length_penalty=1.0, max_decoding_length=cap)
seconds = time.perf_counter() - t0
print(json.dumps({"seconds": seconds, "out": [sp.decode(r.hypotheses[0]) for r in res]}))
"""


def run(cmd: list[str], env: dict) -> dict:
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        sys.exit(f"native_kernels: {' '.join(cmd[:3])} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def time_products(rounds: int) -> None:
    """--products: each kernel's products at PRODUCT_SHAPES, one thread, the best of ``rounds``."""
    import ctypes
    import random
    import time
    from array import array

    sys.path.insert(0, str(REPO))
    from s2s import native_search

    lib = native_search.library()
    if lib is None:
        sys.exit("native_kernels: the search's library is not built here")
    rng = random.Random(0)
    result = {}
    print(f"{'kernel':<14} {'rows x K x N':>16} {'us':>9} {'GMAC/s':>8}")
    for kernel, isa in KERNELS.items():
        if isa and lib.s2s_bf16_linear_use(isa) != isa or not isa and not lib.s2s_i8_linear_available():
            continue
        if not isa:  # (which instructions: native_int8.c's s2s_i8_linear_available)
            kernel = {1: "int8_avx2", 2: "int8_vnni"}[lib.s2s_i8_linear_available()]
        for M, K, N in PRODUCT_SHAPES:
            copies = max(1, (64 << 20) // (N * K))  # (W's copies rotated: 64 MiB of fp32 W, past the caches)
            W, Ws = array("f", (rng.gauss(0, 0.05) for _ in range(N * K))), []
            for _ in range(copies):
                if isa:
                    P = (ctypes.c_uint16 * (-(-N // 16) * (K // 32) * 512))()
                    lib.s2s_pack_f32(W.buffer_info()[0], N, K, P)
                else:
                    Wq, scale = (ctypes.c_int8 * (N * K))(), (ctypes.c_float * N)()
                    lib.s2s_i8_quantize_rows(W.buffer_info()[0], N, K, Wq, scale)
                    P = (ctypes.c_uint8 * lib.s2s_i8_packed_bytes(N, K))()
                    lib.s2s_i8_pack(Wq, scale, None, N, K, P)
                Ws.append(P)
            x = (ctypes.c_uint16 * (M * K))(*(0x3f80 + rng.randrange(-200, 200) for _ in range(M * K)))
            y = (ctypes.c_uint16 * (M * N))()
            calls = max(copies, int(2e9 / (M * N * K)))
            best = float("inf")
            for _ in range(rounds):
                t0 = time.perf_counter()
                for i in range(calls):
                    if isa:
                        lib.s2s_bf16_linear(x, K, M, N, K, Ws[i % copies], None, 0, y, N)
                    else:
                        lib.s2s_i8_linear(x, K, M, N, K, Ws[i % copies], None, 0, y, None, N)
                best = min(best, (time.perf_counter() - t0) / calls)
            key = f"{kernel} {M}x{K}x{N}"
            result[key] = {"us": round(best * 1e6, 1), "gmac_s": round(M * N * K / best / 1e9, 1)}
            print(f"{kernel:<14} {f'{M} x {K} x {N}':>16} {best * 1e6:>9.1f} {M * N * K / best / 1e9:>8.1f}")
        if isa:
            lib.s2s_bf16_linear_use(0)
    print(json.dumps({"products": result, "threads": 1}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--products", action="store_true", help="the kernels' products alone (no model)")
    ap.add_argument("--lines", type=int, default=1000, help="test sentences (data/ddtp-en-de/test)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--no-ct2", action="store_true", help="the s2s kernels alone")
    ap.add_argument("--ct2-isa", default="best", help="CTranslate2's instructions, comma-separated: best "
                                                      "(its own pick), AVX512, AVX2, AVX, NEON ...")
    args = ap.parse_args()
    if args.products:
        os.environ["OMP_NUM_THREADS"] = "1"
        time_products(args.rounds)
        return
    if args.model is None:
        ap.error("--model is required (or --products)")

    import sacrebleu

    with gzip.open(DATA / "test.en.gz", "rt", encoding="utf-8") as f:
        src_lines = f.read().splitlines()[:args.lines]
    with gzip.open(DATA / "test.de.gz", "rt", encoding="utf-8") as f:
        refs = f.read().splitlines()[:args.lines]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    sys.path.insert(0, str(REPO))
    from s2s.modeldir import load_spec

    cfg, tok = load_spec(args.model)[:2]  # one output-length cap for both engines, as decode_speed.py gives them
    cap = max(int(cfg.decode.max_len_a * len(tok.encode_src([x])[0]) + cfg.decode.max_len_b) for x in src_lines)
    with tempfile.TemporaryDirectory(prefix="native-kernels-") as tmp:
        work = Path(tmp)
        src = work / "src.txt"
        src.write_text("\n".join(src_lines) + "\n", encoding="utf-8")
        configs = [("s2s", k) for k in KERNELS]
        if not args.no_ct2:
            ct2 = work / "ct2"
            subprocess.run([sys.executable, "-m", "s2s", "-q", "export", "ct2", "-m", str(args.model), "-o", str(ct2)],
                           check=True, env={**env, "PYTHONPATH": str(REPO)})
            configs += [("ct2", f"{compute} {isa}") for compute in ("int8", "float32")
                        for isa in args.ct2_isa.split(",")]
        rows: dict = {}
        for search, beam in (("greedy", 1), ("beam5", 5)):
            for rnd in range(args.rounds):
                for engine, what in configs:
                    key = f"{engine} {what} {search}"
                    if rows.get(key) == "skip":
                        continue
                    print(f"native_kernels: round {rnd + 1}/{args.rounds}: {key}", file=sys.stderr)
                    if engine == "s2s":
                        got = run([sys.executable, "-c", S2S_SCRIPT, str(REPO), str(args.model), str(src),
                                   str(KERNELS[what]), str(beam), str(args.batch), str(cap)], env)
                    else:
                        compute, isa = what.split()
                        capped = env if isa == "best" else {**env, "CT2_FORCE_CPU_ISA": isa}
                        got = run([sys.executable, "-c", CT2_SCRIPT, str(work / "ct2"), str(src), compute, str(beam),
                                   str(args.batch), str(cap)], capped)
                    if got.get("skip"):
                        rows[key] = "skip"
                        continue
                    row = rows.setdefault(key, {"seconds": [], "bleu": None})
                    row["seconds"].append(got["seconds"])
                    row["bleu"] = round(sacrebleu.corpus_bleu(got["out"], [refs]).score, 2)
    print(f"{'configuration':<32} {'sent/s median':>14} {'(min-max)':>16} {'BLEU':>6}")
    result = {}
    for key, row in rows.items():
        if row == "skip":
            continue
        rates = [args.lines / s for s in row["seconds"]]
        result[key] = {"sent_s": round(statistics.median(rates), 1), "min": round(min(rates), 1),
                       "max": round(max(rates), 1), "bleu": row["bleu"]}
        r = result[key]
        spread = f"({r['min']}-{r['max']})"
        print(f"{key:<32} {r['sent_s']:>14.1f} {spread:>16} {r['bleu']:>6.2f}")
    print(json.dumps({"model": str(args.model), "lines": args.lines, "threads": 1, "rows": result}))


if __name__ == "__main__":
    main()
