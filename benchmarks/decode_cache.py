"""What the decoder caches buy: incremental decoding vs. recomputing the prefix.

Runs greedy decoding of the same sentences two ways in one process and
reports the ratio (not a timed test; the machines are shared and noisy):

  cached     s2s's path: cross-attention K/V computed once from H_enc, the
             self-attention K/V grow by one position per step;
  recompute  the naive path: at every step the whole prefix goes through
             the teacher-forced decoder again (O(T^2) decoder work).

Both must produce identical outputs; the script checks that too.

    python benchmarks/decode_cache.py                   # random reference-size model
    python benchmarks/decode_cache.py --model exp/quickstart --sentences 200
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from s2s.config import DecodeConfig, ModelConfig
from s2s.model import EncoderState, Seq2SeqTransformer
from s2s.search import ModelDecoder, SpecialIds, greedy_search
from s2s.tokenizer import BOS_ID, EOS_ID, PAD_ID


class RecomputeDecoder:
    """A StepDecoder without caches: re-runs the full decoder over the prefix at every step."""

    def __init__(self, model: Seq2SeqTransformer, src: torch.Tensor):
        self.model = model
        self.enc = model.encode(src)
        self.prefix = torch.empty((src.size(0), 0), dtype=torch.long)

    def step(self, y_prev: torch.Tensor) -> torch.Tensor:
        self.prefix = torch.cat([self.prefix, y_prev], dim=1)
        logits, _ = self.model.decode(self.prefix, self.enc)
        return torch.log_softmax(logits[:, -1].float(), dim=-1)

    def select(self, index: torch.Tensor, group=None) -> None:
        e = self.enc
        self.enc = EncoderState(src=e.src.index_select(0, index), src_mask=e.src_mask.index_select(0, index),
                                h_enc=e.h_enc.index_select(0, index))
        self.prefix = self.prefix.index_select(0, index)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a trained model directory (default: random reference-size model)")
    ap.add_argument("--sentences", type=int, default=64)
    ap.add_argument("--src-len", type=int, default=20)
    ap.add_argument("--max-len", type=int, default=40, help="output length (random models never stop early)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.model:
        from s2s.modeldir import load_model_dir

        model = load_model_dir(args.model).model
    else:
        cfg = ModelConfig(d_model=256, heads=4, enc_layers=3, dec_layers=3, d_ff=1024, dropout=0.0)
        model = Seq2SeqTransformer(cfg, 8000, 8000).eval()
    V = model.src_embed.num_embeddings
    src = torch.randint(4, V, (args.sentences, args.src_len))
    src[:, -1] = EOS_ID
    max_len = torch.full((args.sentences,), args.max_len)
    s = DecodeConfig(beam=1, nbest=1, alpha=0.0)
    ids = SpecialIds(bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID)
    results, seconds = {}, {}
    with torch.inference_mode():
        for name, make in (("cached", ModelDecoder), ("recompute", RecomputeDecoder)):
            t0 = time.perf_counter()
            results[name] = greedy_search(make(model, src), max_len, s, ids)
            seconds[name] = time.perf_counter() - t0
    same = all(a[0].tokens == b[0].tokens for a, b in zip(results["cached"], results["recompute"]))
    tokens = sum(len(h[0].tokens) + 1 for h in results["cached"])
    print(f"{'path':10s} {'seconds':>8s} {'tokens/s':>10s}")
    for name in ("cached", "recompute"):
        print(f"{name:10s} {seconds[name]:8.2f} {tokens / seconds[name]:10.0f}")
    print(f"identical outputs: {same}")
    print(json.dumps({"cached_tok_s": round(tokens / seconds["cached"]),
                      "recompute_tok_s": round(tokens / seconds["recompute"]),
                      "speedup": round(seconds["recompute"] / seconds["cached"], 2),
                      "identical": same}))
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
