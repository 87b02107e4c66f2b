"""Training speed side by side: s2s fp32 (one process of 2 threads, and 2 data-parallel
processes of 1 thread, as train.procs: 2 runs them) and bf16 against Hugging Face's
MarianMTModel on the same model shape, the same batches and the same cores, in one run.

The reference model of recipes/ddtp-en-de.yaml (3+3 layers, d_model 256, FFN 1024,
4 heads, joint vocabulary 8000, tied, dropout 0.1, label smoothing 0.1) on
ddtp-en-de batches of at most 4096 padded tokens.  Every engine runs as its own
process (or processes) on the same batches (saved once by this script) and times
whole updates: forward, label-smoothed loss, backward, gradient clipping, AdamW.
s2s runs through its Trainer's own ``train_step`` (``s2s_bf16`` is ``train.precision: bf16``: a
bf16 copy of the fp32 master weights made once per update, s2s.precision.Bf16Copy); MarianMTModel (post-norm, its
only layout) gets the same loss, clipping and AdamW in a plain loop, as a user runs it
(``hf_fp32``) and with s2s's allocator settings (``hf_fp32_keep``: the allocator ``s2s train``
starts with, s2s.allocator.training_environ, and freed memory kept for the next update), to show
what those settings are worth.  The s2s engines' processes start with the allocator ``s2s train``
starts with (mimalloc where installed); ``s2s_fp32_glibc`` and ``s2s_bf16_glibc`` (by name in
``--engines`` only) are ``s2s_fp32`` and ``s2s_bf16`` with glibc's malloc, to show what that is worth.  The
``s2s_fp32_2x1`` engine (and ``s2s_bf16_2x1``, by name in ``--engines`` only) is two ranks
of one gloo process group (one thread each), every update one batch per rank and one
all-reduce; its tokens/s are those of both ranks together over the slower rank's time.
The s2s engines multiply through torch's BLAS (``train.gemm: torch``);
``s2s_fp32_openblas`` (by name in ``--engines`` only: one process of ``--threads`` threads,
which ``auto`` never gives OpenBLAS) and
``s2s_fp32_2x1_openblas`` (what ``auto`` picks for one-thread processes on a CPU not made by
Intel) through OpenBLAS (``train.gemm: openblas``, s2s.model.gemm).  ``s2s_fp32_compile`` and
``s2s_bf16_compile`` (by name in ``--engines`` only) are ``s2s_fp32`` and ``s2s_bf16`` with
``train.compile: true``: their warmup updates run twice, compiling, and that time is printed on its own.

Measured properly on a shared machine: the engines take turns round by round
(``--rounds``, at least 3), each round times ``--updates`` (>= 20) updates after
``--warmup`` (20) untimed ones, and the table gives the median tokens/s over the rounds
with the min and max beside it (the spread says how far a rerun may land).  The warmup
is long because a long run's steady state is what is measured: bf16 products go through
oneDNN, which builds a kernel for each new shape on first use (s2s.model.gemm), and a
training run has met its shapes after its first few dozen updates.  With glibc's malloc a
bf16 trainer's memory still grows for about 150 updates after that, and on a virtual machine
the first touch of each new page is slow; mimalloc, which the s2s engines start with as
``s2s train`` does, keeps it flat.  ``--warmup 100`` (the s2s engines alone: ``--engines
s2s_fp32,s2s_bf16``) times the steady state (benchmarks/README.md: on an AMD EPYC Zen 5 with mimalloc, bf16
2.38x fp32 at the default warmup and 2.56x after 100 updates).

Tokens are source + target tokens, padding excluded.  Model FLOPs utilization
(MFU) = 3 x the matmul FLOPs of the forward pass (output projection included,
embedding lookups excluded, counted on each sentence's real length) per second,
divided by the matmul peak of the precision the engine trains in, measured in the
same run (best of several 4096x1024x1024 matmuls on all ``--threads`` cores).

Prints a table and, last, one JSON line with "<engine>_tok_s" (median),
"<engine>_tok_s_min"/"_max", "mfu_<engine>", "matmul_peak_gflops_fp32"/"_bf16" and the
ratios to MarianMTModel.  On a CPU without native bf16 matmuls (no AVX-512 BF16 or AMX)
bf16 trains slower than fp32 (oneDNN converts it to fp32; the bf16 matmul peak measured here
is low) and takes long, so bf16 is left out there (its keys null) unless ``--slow-bf16``
times 2 updates.

    python benchmarks/train_speed.py            # 3 rounds of 20 timed updates per engine
    python benchmarks/train_speed.py --quick    # one round of 8: a smoke test, not a measurement
    python benchmarks/train_speed.py --engines s2s_fp32,s2s_bf16 --slow-bf16   # only these two

transformers is not an s2s dependency: when it cannot be imported, the script
installs it into its own directory (benchmarks/.hf-env, ``pip --target``) that only
the Hugging Face engine's process adds to its path, after this environment's packages.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RECIPE = REPO / "recipes" / "ddtp-en-de.yaml"
HF_ENV = REPO / "benchmarks" / ".hf-env"
ENGINES = ("s2s_fp32", "s2s_fp32_2x1", "s2s_fp32_openblas", "s2s_fp32_2x1_openblas", "s2s_bf16", "s2s_bf16_2x1",
           "s2s_fp32_compile", "s2s_bf16_compile", "s2s_fp32_glibc", "s2s_bf16_glibc", "hf_fp32", "hf_fp32_keep")
DEFAULT_ENGINES = ("s2s_fp32", "s2s_fp32_2x1", "s2s_fp32_2x1_openblas", "s2s_bf16",
                   "hf_fp32", "hf_fp32_keep")  # compile and 1 x N OpenBLAS: by name only
PRECISION = {"s2s_fp32": "fp32", "s2s_fp32_2x1": "fp32", "s2s_fp32_openblas": "fp32",
             "s2s_fp32_2x1_openblas": "fp32", "s2s_bf16": "bf16", "s2s_bf16_2x1": "bf16", "s2s_fp32_compile": "fp32",
             "s2s_bf16_compile": "bf16", "s2s_fp32_glibc": "fp32", "s2s_bf16_glibc": "bf16", "hf_fp32": "fp32",
             "hf_fp32_keep": "fp32"}
# the s2s engines' train.gemm (s2s.model.gemm): torch's BLAS unless the name says openblas
GEMM = {e: "openblas" if e.endswith("_openblas") else "torch" for e in ENGINES}
PROCS = {e: 2 if "_2x1" in e else 1 for e in ENGINES}  # data-parallel processes of one thread


# --------------------------------------------------------------------------- #
# FLOPs and the matmul peak
# --------------------------------------------------------------------------- #

def forward_matmul_flops(s: int, t: int, d: int, d_ff: int, n_enc: int, n_dec: int, vocab: int) -> int:
    """Matmul FLOPs (2 per multiply-add) of one sentence pair's forward pass, |x| = s, |y| = t:

        encoder layer  8 s d^2 (Q, K, V, O) + 4 s d d_ff (FFN) + 4 s^2 d (QK^T, AV)
        decoder layer  8 t d^2 (self Q, K, V, O) + 4 t^2 d (self QK^T, AV)
                       + 4 t d^2 + 4 s d^2 (cross Q, O; K, V from H_enc) + 4 t s d (cross QK^T, AV)
                       + 4 t d d_ff (FFN)
        output         2 t d V (z_t = h_t W_U)
    """
    enc = 8 * s * d * d + 4 * s * d * d_ff + 4 * s * s * d
    dec = 8 * t * d * d + 4 * t * t * d + 4 * t * d * d + 4 * s * d * d + 4 * t * s * d + 4 * t * d * d_ff
    return n_enc * enc + n_dec * dec + 2 * t * d * vocab


def matmul_peak_gflops(dtype: torch.dtype, repeats: int = 10) -> float:
    """Best GFLOP/s of a (4096 x 1024) @ (1024 x 1024) matmul in ``dtype``."""
    a = torch.randn(4096, 1024).to(dtype)
    b = torch.randn(1024, 1024).to(dtype)
    for _ in range(2):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * 4096 * 1024 * 1024 / best / 1e9


def cpu_has_native_bf16() -> bool:
    """AVX-512 BF16 or AMX (lscpu's avx512_bf16 / amx_bf16): what ``train.precision: auto``
    picks bf16 for (s2s.precision.auto_precision)."""
    from s2s.precision import auto_precision

    return auto_precision(torch.device("cpu"))[0] == "bf16"


# --------------------------------------------------------------------------- #
# Engines (each in its own process)
# --------------------------------------------------------------------------- #

def load_batches(path: Path):
    from s2s.data import Batch

    return [Batch(src, tgt_in, tgt_out, n_src, n_tgt) for src, tgt_in, tgt_out, n_src, n_tgt in torch.load(path)]


def run_s2s(precision: str, batches, warmup: int, threads: int, compile: bool = False, gemm: str = "torch") -> float:
    """Seconds of len(batches) - warmup updates through the s2s Trainer.  Under a process
    group (RANK/WORLD_SIZE set) each update takes one batch per rank: this rank's share.
    ``compile`` (train.compile): the warmup batches run twice, the first time compiling
    (a graph for the first shape, then one with dynamic shapes); that time goes to stderr."""
    from s2s.config import load_config
    from s2s.distributed import World, shard
    from s2s.trainer import make_trainer

    cfg = load_config(RECIPE, [f"train.precision={precision}", f"train.threads={threads}",
                               f"train.compile={str(compile).lower()}", f"train.gemm={gemm}"])
    with tempfile.TemporaryDirectory() as tmp:
        trainer = make_trainer(cfg, Path(tmp) / "run", show_progress=False)
        world: World = trainer.world
        groups = [batches[i:i + world.size] for i in range(0, len(batches), world.size)]

        def update(group):
            return trainer.train_step(shard(group, world))[0]

        if compile:
            t0 = time.perf_counter()
            for group in groups[:warmup]:
                update(group)
            print(f"train.compile: the first {warmup} updates (compiling) took {time.perf_counter() - t0:.0f} s",
                  file=sys.stderr)
        return _timed(update, groups, warmup)


def run_hf(batches, warmup: int, threads: int) -> float:
    """Seconds of len(batches) - warmup updates of MarianMTModel with s2s's loss, clipping and AdamW."""
    import torch.nn.functional as F
    from transformers import MarianConfig, MarianMTModel

    from s2s.config import load_config

    torch.set_num_threads(threads)
    torch.manual_seed(1)
    cfg = load_config(RECIPE)
    m, tc = cfg.model, cfg.train
    config = MarianConfig(
        vocab_size=cfg.tokenizer.vocab_size, decoder_vocab_size=cfg.tokenizer.vocab_size, d_model=m.d_model,
        encoder_layers=m.enc_layers, decoder_layers=m.dec_layers, encoder_attention_heads=m.heads,
        decoder_attention_heads=m.heads, encoder_ffn_dim=m.d_ff, decoder_ffn_dim=m.d_ff,
        activation_function=m.activation, dropout=m.dropout, attention_dropout=m.attention_dropout,
        activation_dropout=m.activation_dropout, max_position_embeddings=1024, scale_embedding=m.scale_embeddings,
        share_encoder_decoder_embeddings=True, tie_word_embeddings=True, pad_token_id=0, eos_token_id=3,
        decoder_start_token_id=2)
    model = MarianMTModel(config)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=tc.lr, betas=(tc.adam_beta1, tc.adam_beta2),
                            eps=tc.adam_eps, weight_decay=tc.weight_decay, foreach=True)

    def step(b):
        out = model(input_ids=b.src, attention_mask=(b.src != 0).long(), decoder_input_ids=b.tgt_in,
                    decoder_attention_mask=(b.tgt_in != 0).long())
        V = out.logits.size(-1)
        loss = F.cross_entropy(out.logits.reshape(-1, V), b.tgt_out.reshape(-1), ignore_index=0,
                               reduction="sum", label_smoothing=tc.label_smoothing)
        (loss / b.n_tgt_tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.clip_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return _timed(step, batches, warmup)


def _timed(step, batches, warmup: int) -> float:
    for b in batches[:warmup]:
        step(b)
    t0 = time.perf_counter()
    for b in batches[warmup:]:
        loss = step(b)
    float(loss)  # wait for the last update
    return time.perf_counter() - t0


def engine_main(args) -> None:
    if args.site:
        sys.path.append(args.site)
    procs = int(os.environ.get("WORLD_SIZE", "1"))
    batches = load_batches(args.batches)[:(args.warmup + args.count) * procs]
    if args.engine.startswith("hf_fp32"):
        if args.engine == "hf_fp32_keep":
            from s2s.allocator import keep_freed_memory

            keep_freed_memory()  # s2s's own setting, for comparison (s2s.allocator)
        seconds = run_hf(batches, args.warmup, args.threads)
    else:
        seconds = run_s2s(PRECISION[args.engine], batches, args.warmup, args.threads,
                          compile=args.engine.endswith("_compile"), gemm=GEMM[args.engine])
    print(json.dumps({"seconds": seconds}))


def run_engine(engine: str, path: Path, args, count: int, site: str) -> float:
    """Seconds of ``count`` timed updates of ``engine``, in its own process(es); for the
    data-parallel engine the slower rank's (both wait for each other at every update)."""
    procs = PROCS[engine]
    threads = args.threads // procs
    cmd = [sys.executable, __file__, "--engine", engine, "--batches", str(path), "--warmup", str(args.warmup),
           "--threads", str(threads), "--site", site, "--count", str(count)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if engine.endswith("_glibc"):
        env["S2S_MALLOC"] = "glibc"  # glibc's malloc as the process starts (s2s.allocator)
    elif engine.startswith("s2s") or engine == "hf_fp32_keep":
        from s2s.allocator import training_environ

        env = training_environ(env) or env  # the allocator `s2s train` starts itself with
    if procs > 1:
        from s2s.distributed import free_port

        env.update({"WORLD_SIZE": str(procs), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    ranks = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)} if procs > 1 else env)
             for r in range(procs)]
    seconds = []
    for rank in ranks:
        out, err = rank.communicate()
        if rank.returncode:
            sys.exit(f"train_speed: {engine} failed:\n{err[-3000:]}")
        seconds.append(json.loads(out.strip().splitlines()[-1])["seconds"])
        for line in err.splitlines():
            if line.startswith("train.compile:"):
                print(f"{engine}: {line}", file=sys.stderr)
    return max(seconds)


def hf_site() -> str:
    """"" when transformers imports here; else benchmarks/.hf-env, where it is installed on first
    use (``pip --target``; the engine appends it to sys.path, so this environment's torch is kept)."""
    try:
        import transformers  # noqa: F401

        return ""
    except ImportError:
        pass
    if not (HF_ENV / "transformers").is_dir():
        print(f"train_speed: installing transformers into {HF_ENV}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(HF_ENV), "transformers"],
                       check=True)
    return str(HF_ENV)


# --------------------------------------------------------------------------- #
# The side-by-side run
# --------------------------------------------------------------------------- #

def ensure_prepared() -> None:
    from s2s.config import load_config

    if not (REPO / load_config(RECIPE).data.dir / "meta.json").is_file():
        for stage in (["tokenizer", "train"], ["prepare"]):
            subprocess.run([sys.executable, "-m", "s2s", *stage, str(RECIPE)], cwd=REPO, check=True)


def sample_batches(n: int, seed: int):
    """n batches of the recipe's training data, as its trainer would cut them (max_tokens 4096)."""
    from s2s.config import load_config
    from s2s.data import BinDataset, token_batches

    cfg = load_config(RECIPE)
    data = BinDataset(REPO / cfg.data.dir, "train")
    order = token_batches(data.src_lens, data.tgt_lens, cfg.train.max_tokens, np.random.default_rng(seed))
    return [data.batch(idx) for idx in order[:n]], cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one round of 8 timed updates: a smoke test")
    ap.add_argument("--updates", type=int, default=20, help="timed updates per engine and round")
    ap.add_argument("--warmup", type=int, default=20, help="untimed updates before each engine's timed ones")
    ap.add_argument("--rounds", type=int, default=3, help="engines take turns this many times; median kept")
    ap.add_argument("--threads", type=int, default=2, help="cores: threads of one process, or processes x 1")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--slow-bf16", action="store_true",
                    help="time s2s bf16 even on a CPU without native bf16 matmuls (2 updates, minutes)")
    ap.add_argument("--engines", default=",".join(DEFAULT_ENGINES),
                    help=f"the engines to time, comma-separated, among {', '.join(ENGINES)} (default: all but "
                         "the compile engines and 1 x N OpenBLAS); ratios need hf_fp32")
    ap.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)
    ap.add_argument("--batches", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--site", default="", help=argparse.SUPPRESS)
    ap.add_argument("--count", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine:
        return engine_main(args)
    if args.quick:
        args.updates, args.rounds, args.warmup = 8, 1, 2
    os.chdir(REPO)
    ensure_prepared()
    n_procs = PROCS
    batches, cfg = sample_batches(2 * (args.warmup + args.updates), args.seed)
    m = cfg.model
    torch.set_num_threads(args.threads)
    native_bf16 = cpu_has_native_bf16() or torch.cuda.is_available()
    # without native bf16 matmuls (AVX-512 BF16 / AMX) a bf16 update takes about a minute on a CPU:
    # bf16 is left out (its keys null) unless --slow-bf16 asks for 2 timed updates anyway
    chosen = args.engines.split(",")
    unknown = sorted(set(chosen) - set(ENGINES))
    if unknown:
        sys.exit(f"train_speed: --engines: {', '.join(unknown)} not among {', '.join(ENGINES)}")
    engines = [e for e in ENGINES if e in chosen and (PRECISION[e] != "bf16" or native_bf16 or args.slow_bf16)]
    if args.threads < 2:
        engines = [e for e in engines if PROCS[e] == 1]
    count = {e: args.updates for e in ENGINES}
    if not native_bf16:
        count.update({e: 2 for e in ENGINES if PRECISION[e] == "bf16"})
    # the batches an engine's timed updates take: n_procs of them per update
    timed = {e: batches[args.warmup * n_procs[e]:(args.warmup + n) * n_procs[e]] for e, n in count.items()}
    tokens = {e: sum(b.n_src_tokens + b.n_tgt_tokens for b in t) for e, t in timed.items()}
    tgt_tokens = {e: sum(b.n_tgt_tokens for b in t) for e, t in timed.items()}
    flops = {e: 3 * sum(forward_matmul_flops(int(s), int(t), m.d_model, m.d_ff, m.enc_layers, m.dec_layers,
                                             cfg.tokenizer.vocab_size)
                        for b in bs for s, t in zip((b.src != 0).sum(1), (b.tgt_out != 0).sum(1)))
             for e, bs in timed.items()}
    peak = {"fp32": matmul_peak_gflops(torch.float32),
            "bf16": matmul_peak_gflops(torch.bfloat16, repeats=10 if native_bf16 else 2)
            if any(PRECISION[e] == "bf16" for e in engines) else float("nan")}
    site = {e: hf_site() if e.startswith("hf_") else "" for e in engines}
    seconds: dict[str, list[float]] = {e: [] for e in engines}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "batches.pt"
        torch.save([(b.src, b.tgt_in, b.tgt_out, b.n_src_tokens, b.n_tgt_tokens) for b in batches], path)
        for r in range(args.rounds):
            for engine in engines:
                s = run_engine(engine, path, args, count[engine], site[engine])
                print(f"round {r + 1}: {engine} {tokens[engine] / s:,.0f} tokens/s", file=sys.stderr)
                seconds[engine].append(s)

    def num(x: float, digits: int = 0):
        return None if x != x else round(x, digits) if digits else round(x)  # NaN: not measured

    nan = float("nan")
    # tokens/s of every round; the median is the figure, min and max its spread
    rates = {e: sorted(tokens[e] / s for s in seconds[e]) if e in engines else [nan] for e in ENGINES}
    rate = {e: float(np.median(rates[e])) for e in ENGINES}
    mfu = {e: rate[e] * flops[e] / tokens[e] / 1e9 / peak[PRECISION[e]] if e in engines else nan for e in ENGINES}
    hf = rate["hf_fp32"]  # NaN when not timed: the ratios are null
    result = {}
    for e in ENGINES:
        result.update({f"{e}_tok_s": num(rate[e]), f"{e}_tok_s_min": num(rates[e][0]),
                       f"{e}_tok_s_max": num(rates[e][-1]),
                       f"{e}_tgt_tok_s": num(rate[e] * tgt_tokens[e] / tokens[e]),
                       f"mfu_{e}": num(mfu[e], 3), f"{e}_over_hf": num(rate[e] / hf, 2)})
    result.update({"matmul_peak_gflops_fp32": num(peak["fp32"], 1), "matmul_peak_gflops_bf16": num(peak["bf16"], 1),
                   "updates": {e: count[e] for e in engines}, "rounds": args.rounds, "warmup": args.warmup,
                   "tokens_per_batch": round(tokens["s2s_fp32"] / args.updates),
                   "threads": args.threads, "bf16_native": native_bf16})
    print(f"{args.rounds} rounds of {args.updates} timed updates (after {args.warmup}) per engine, batches of "
          f"~{result['tokens_per_batch']:,} tokens (source + target, no padding), {args.threads} cores; "
          f"matmul peak fp32 {peak['fp32']:.0f} / bf16 {peak['bf16']:.0f} GFLOP/s")
    if not any(PRECISION[e] == "bf16" for e in engines):
        print("bf16: left out, this CPU has no native bf16 matmul (run with --slow-bf16 to time it anyway)")
    print("| engine | precision | procs x threads | tokens/s (median) | min - max | target tokens/s | MFU "
          "| vs HF fp32 |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for e in engines:
        split = f"{n_procs[e]} x {args.threads // n_procs[e]}"
        vs_hf = "-" if hf != hf else f"{rate[e] / hf:.2f}x"
        print(f"| {e} | {PRECISION[e]} | {split} | {rate[e]:,.0f} | {rates[e][0]:,.0f} - {rates[e][-1]:,.0f} | "
              f"{rate[e] * tgt_tokens[e] / tokens[e]:,.0f} | {mfu[e]:.0%} | {vs_hf} |")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
