"""Training speed on one device, s2s against Hugging Face's MarianMTModel on the same shape and batches:
tokens/s and model FLOPs utilization (MFU) against the device's bf16 peak.

    python benchmarks/gpu_train_speed.py CONFIG --device cuda --precision bf16 --max-tokens 25000
    python benchmarks/gpu_train_speed.py recipes/ddtp-en-de.yaml --device cuda --shape base

CONFIG's prepared data (``s2s tokenizer train`` and ``s2s prepare`` done; ``--set`` overrides
as in ``s2s train``) gives the batches: at most ``--max-tokens`` padded tokens each, cut as
the trainer cuts them.  ``--shape base`` is a transformer-base (6+6 layers, d_model 512, FFN
2048, 8 heads) on the same vocabulary; ``--shape config`` keeps CONFIG's model.  s2s runs
through its Trainer's own ``train_step`` (bf16: a bf16 copy of the fp32 master weights
made once per update, s2s.precision.Bf16Copy; on CUDA: fused AdamW skipping non-finite
updates on the device, batches in pinned memory copied without blocking, no host sync per
update); MarianMTModel (post-norm, its only layout) gets the same label-smoothed loss,
clipping and AdamW in a plain loop, under bf16 autocast (the usual way to train it in
bf16).  Each engine's updates after ``--warmup`` are timed, the device synchronised at
both ends.

Tokens are source + target tokens, padding excluded.  MFU = 3 x the forward pass's matmul
FLOPs (benchmarks/train_speed.py's ``forward_matmul_flops``, on each sentence's real length)
per second / the peak: ``--peak-tflops`` (default on CUDA: 989, the dense bf16 peak of an
H100/H200 SXM), or on a CPU the matmul peak measured in this run.  Last line: one JSON object.
benchmarks/gpu_check.sh runs it for the reference model and the transformer-base.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from train_speed import forward_matmul_flops, matmul_peak_gflops  # noqa: E402

BASE = ["model.enc_layers=6", "model.dec_layers=6", "model.d_model=512", "model.d_ff=2048", "model.heads=8"]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(step, batches, warmup: int, device: torch.device) -> float:
    """Seconds of the updates after the first ``warmup``."""
    for b in batches[:warmup]:
        step(b)
    synchronize(device)
    t0 = time.perf_counter()
    for b in batches[warmup:]:
        step(b)
    synchronize(device)
    return time.perf_counter() - t0


def run_s2s(cfg, batches, warmup: int) -> float:
    from s2s.trainer import make_trainer

    with tempfile.TemporaryDirectory() as tmp:
        trainer = make_trainer(cfg, Path(tmp) / "run", show_progress=False)
        pinned = [b.pinned(trainer.device.type == "cuda") for b in batches]  # as the trainer's prefetcher does
        return timed(lambda b: trainer.train_step([b]), pinned, warmup, trainer.device)


def run_marian(cfg, batches, warmup: int, device: torch.device) -> float:
    """MarianMTModel of the same shape: the same loss, clipping and AdamW, the same autocast."""
    import torch.nn.functional as F
    from transformers import MarianConfig, MarianMTModel

    m, tc, V = cfg.model, cfg.train, cfg.tokenizer.vocab_size
    torch.manual_seed(cfg.seed)
    model = MarianMTModel(MarianConfig(
        vocab_size=V, decoder_vocab_size=V, d_model=m.d_model, encoder_layers=m.enc_layers,
        decoder_layers=m.dec_layers, encoder_attention_heads=m.heads, decoder_attention_heads=m.heads,
        encoder_ffn_dim=m.d_ff, decoder_ffn_dim=m.d_ff, activation_function=m.activation, dropout=m.dropout,
        attention_dropout=m.attention_dropout, activation_dropout=m.activation_dropout,
        max_position_embeddings=1024, scale_embedding=m.scale_embeddings, share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True, pad_token_id=0, eos_token_id=3, decoder_start_token_id=2)).to(device).train()
    fused = {"fused": True} if device.type == "cuda" else {"foreach": True}
    opt = torch.optim.AdamW(model.parameters(), lr=tc.lr, betas=(tc.adam_beta1, tc.adam_beta2), eps=tc.adam_eps,
                            weight_decay=tc.weight_decay, **fused)
    bf16 = tc.precision == "bf16"

    def step(b):
        b = b.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=b.src, attention_mask=(b.src != 0).long(), decoder_input_ids=b.tgt_in,
                           decoder_attention_mask=(b.tgt_in != 0).long()).logits
            loss = F.cross_entropy(logits.float().reshape(-1, V), b.tgt_out.reshape(-1), ignore_index=0,
                                   reduction="sum", label_smoothing=tc.label_smoothing)
        (loss / b.n_tgt_tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.clip_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return timed(step, batches, warmup, device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", type=Path, help="a recipe whose data is prepared")
    ap.add_argument("--set", action="append", default=[], help="a config override (repeatable)")
    ap.add_argument("--shape", choices=("config", "base"), default="config")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
    ap.add_argument("--max-tokens", type=int, default=25000, help="padded tokens per batch")
    ap.add_argument("--updates", type=int, default=30, help="timed updates per engine")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--engines", default="s2s,hf", help="s2s, hf or both")
    ap.add_argument("--peak-tflops", type=float, default=0.0,
                    help="the device's peak (0: 989 on CUDA, the H100/H200 SXM dense bf16; measured on a CPU)")
    args = ap.parse_args()

    from s2s.config import load_config
    from s2s.data import BinDataset, token_batches
    from s2s.device import resolve_device

    overrides = [*args.set, *(BASE if args.shape == "base" else []), f"train.device={args.device}",
                 f"train.precision={args.precision}", f"train.max_tokens={args.max_tokens}"]
    cfg = load_config(args.config, overrides)
    device = resolve_device(args.device)
    data = BinDataset(Path(cfg.data.dir), "train")
    order = token_batches(data.src_lens, data.tgt_lens, args.max_tokens, np.random.default_rng(cfg.seed))
    batches = [data.batch(idx) for idx in order[:args.warmup + args.updates]]
    if len(batches) <= args.warmup:
        sys.exit(f"gpu_train_speed: only {len(batches)} batches of {args.max_tokens} tokens in {cfg.data.dir}")
    timed_batches = batches[args.warmup:]
    m = cfg.model
    tokens = sum(b.n_src_tokens + b.n_tgt_tokens for b in timed_batches)
    flops = 3 * sum(forward_matmul_flops(int(s), int(t), m.d_model, m.d_ff, m.enc_layers, m.dec_layers,
                                         cfg.tokenizer.vocab_size)
                    for b in timed_batches for s, t in zip((b.src != 0).sum(1), (b.tgt_out != 0).sum(1)))
    if args.peak_tflops:
        peak = args.peak_tflops * 1e12
    elif device.type == "cuda":
        peak = 989e12
    else:
        peak = matmul_peak_gflops(torch.bfloat16 if args.precision == "bf16" else torch.float32, 3) * 1e9
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "shape": f"{m.enc_layers}+{m.dec_layers} d_model {m.d_model} FFN {m.d_ff} heads {m.heads}",
              "precision": args.precision, "tokens_per_update": round(tokens / len(timed_batches)),
              "updates": len(timed_batches), "peak_tflops": round(peak / 1e12, 2)}
    for engine in args.engines.split(","):
        seconds = run_s2s(cfg, batches, args.warmup) if engine == "s2s" else run_marian(cfg, batches, args.warmup,
                                                                                      device)
        result[f"{engine}_tok_s"] = round(tokens / seconds)
        result[f"{engine}_mfu"] = round(flops / seconds / peak, 4)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if "s2s_tok_s" in result and "hf_tok_s" in result:
        result["s2s_over_hf"] = round(result["s2s_tok_s"] / result["hf_tok_s"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
