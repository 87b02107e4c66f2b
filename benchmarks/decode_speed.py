"""Decoding speed side by side: s2s (fp32, bf16, int8) against CTranslate2 (fp32, int8)
on the same weights, the same sentences, batches and threads, in one run.

Each engine runs as its own process (the whole process is timed: start-up,
model loading, reading, decoding, writing), so peak RSS is per engine.  On
the ddtp-en-de test set, beam 5 and greedy, batches of 64 sentences, 2
threads, one output-length cap for every engine and sentence (the largest
a*|x|+b of the model's decode settings over the sentences: CTranslate2 takes
one cap per call, not one per sentence), the same
length penalty everywhere (m^alpha with alpha = 1, the form CTranslate2 has)
and the same rule for ending a sentence's beam search: s2s's ``decode.stop: early``
(stop once no live beam would win by ending at the next step), as
CTranslate2 (which stops when its top beam ends) and Hugging Face generate's
default do.  Not a timed test: the machines are shared and noisy; only ratios
within one run mean something.

Prints a table and, last, one JSON line with "<engine>_<search>_sent_s",
"<engine>_<search>_tok_s", "<engine>_<search>_rss_mib" and "<engine>_<search>_bleu"
for each engine (s2s_fp32, s2s_bf16, s2s_int8, ct2_fp32, ct2_int8, hf) and
search (beam5, greedy).  Hugging Face generate runs on ``s2s export hf`` of the
model (transformers installed as benchmarks/train_speed.py does); an
architecture no Hugging Face family has (the pre-norm, sinusoidal reference
model among them) leaves its keys null, with the reason on stderr.

    python benchmarks/decode_speed.py --model exp/ddtp-en-de
    python benchmarks/decode_speed.py --model exp/qs --quick      # 200 sentences
    python benchmarks/decode_speed.py --model exp/qs --engines s2s_fp32,ct2_fp32   # those two only
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data" / "ddtp-en-de"
ENGINES = ("s2s_fp32", "s2s_bf16", "s2s_int8", "ct2_fp32", "ct2_int8", "hf")

CT2_SCRIPT = """
import sys, ctranslate2, sentencepiece as spm
model, src, out, beam, batch, threads, cap = sys.argv[1:8]
sp = spm.SentencePieceProcessor(model_file=model + "/spm.model")
tr = ctranslate2.Translator(model, device="cpu", inter_threads=1, intra_threads=int(threads))
lines = open(src, encoding="utf-8").read().splitlines()
pieces = [sp.encode(x, out_type=str) for x in lines]
res = tr.translate_batch(pieces, max_batch_size=int(batch), beam_size=int(beam), length_penalty=1.0,
                         max_decoding_length=int(cap), suppress_sequences=[["<s>"], ["<pad>"]])
with open(out, "w", encoding="utf-8") as f:
    for r in res:
        f.write(sp.decode(r.hypotheses[0]) + "\\n")
"""

HF_SCRIPT = """
import sys
hf_dir, model_dir, src, out, beam, batch, threads, cap, repo, site = sys.argv[1:11]
sys.path.insert(0, repo)
if site:  # transformers installed by train_speed.hf_site: after this environment's packages
    sys.path.append(site)
import torch
from transformers import AutoModelForSeq2SeqLM
from pathlib import Path
from s2s.modeldir import load_spec
batch = int(batch)
torch.set_num_threads(int(threads))
tok = load_spec(Path(model_dir))[1]  # s2s's own ids: its vocabulary, prefix and </s>
model = AutoModelForSeq2SeqLM.from_pretrained(hf_dir).eval()
ids = tok.encode_src(open(src, encoding="utf-8").read().splitlines())
order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
outs = [""] * len(ids)
with torch.inference_mode():
    for start in range(0, len(order), batch):
        rows = order[start:start + batch]
        width = max(len(ids[i]) for i in rows)
        x = torch.tensor([ids[i] + [tok.pad_id] * (width - len(ids[i])) for i in rows])
        y = model.generate(input_ids=x, attention_mask=(x != tok.pad_id).long(), num_beams=int(beam),
                           do_sample=False, length_penalty=1.0, early_stopping=False, max_new_tokens=int(cap))
        for i, hyp in zip(rows, y.tolist()):
            outs[i] = tok.decode_tgt(hyp)
with open(out, "w", encoding="utf-8") as f:
    f.write("".join(o + "\\n" for o in outs))
"""


def export_hf(model: Path, out: Path) -> bool:
    """``s2s export hf``; False (the reason on stderr) where no Hugging Face family fits."""
    done = subprocess.run([sys.executable, "-m", "s2s", "export", "hf", "-m", str(model), "-o", str(out)],
                          capture_output=True, text=True)
    if done.returncode:
        why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        print(f"decode_speed: no Hugging Face generate rows: {why}", file=sys.stderr)
    return done.returncode == 0


def run_timed(cmd: list[str]) -> tuple[float, float]:
    """Run ``cmd``; return (seconds, peak RSS in MiB) of the whole process."""
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.time() - t0
    if os.waitstatus_to_exitcode(status):
        sys.exit(f"decode_speed: `{' '.join(cmd)}` failed:\n{proc.stderr.read().decode()}")
    return seconds, usage.ru_maxrss / 1024


def count_tokens(sp, path: Path) -> int:
    return sum(len(sp.encode(line)) + 1 for line in path.read_text(encoding="utf-8").splitlines())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="a trained s2s model directory")
    ap.add_argument("--sentences", type=int, default=1000)
    ap.add_argument("--quick", action="store_true", help="200 sentences")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64, help="sentences per batch")
    ap.add_argument("--engines", default=",".join(ENGINES),
                    help="comma-separated subset of " + ", ".join(ENGINES) + " (the others' keys are null)")
    args = ap.parse_args()
    chosen = args.engines.split(",")
    if not set(chosen) <= set(ENGINES):
        ap.error(f"--engines: unknown {sorted(set(chosen) - set(ENGINES))}")
    n = 200 if args.quick else args.sentences

    import sacrebleu
    import sentencepiece as spm

    from s2s.modeldir import load_spec

    decode = load_spec(args.model)[0].decode  # the config only: no weights to load
    with tempfile.TemporaryDirectory(prefix="s2s-decode-") as tmp:
        work = Path(tmp)
        src, ref = work / "test.en", work / "test.de"
        for path, name in ((src, "test.en.gz"), (ref, "test.de.gz")):
            with gzip.open(DATA / name, "rt", encoding="utf-8") as f:
                path.write_text("".join(line for _, line in zip(range(n), f)), encoding="utf-8")
        refs = ref.read_text(encoding="utf-8").splitlines()
        sp = spm.SentencePieceProcessor(model_file=str(args.model / "spm.model"))
        cap = max(int(decode.max_len_a * len(sp.encode(x)) + decode.max_len_b)
                  for x in src.read_text(encoding="utf-8").splitlines())

        engines: dict[str, object] = {}
        try:
            import ctranslate2  # noqa: F401

            for q in [q for q in ("fp32", "int8") if f"ct2_{q}" in chosen]:
                out = work / f"ct2-{q}"
                subprocess.run([sys.executable, "-m", "s2s", "export", "ct2", "-m", str(args.model), "-o", str(out),
                                *(["--quantization", "int8"] if q == "int8" else [])], check=True,
                               capture_output=True)
                engines[f"ct2_{q}"] = out
        except ImportError:
            print("decode_speed: ctranslate2 is not installed; its rows are skipped", file=sys.stderr)
        hf_site_dir = None  # where transformers imports from ("" = this environment)
        if "hf" in chosen and export_hf(args.model, work / "hf"):
            from train_speed import hf_site

            try:
                hf_site_dir = hf_site()
            except subprocess.CalledProcessError:
                print("decode_speed: transformers could not be installed; no Hugging Face rows", file=sys.stderr)

        results: dict[str, object] = {}
        rows = []
        for search, beam in (("beam5", 5), ("greedy", 1)):
            runs = {}
            for mode, flags in (("s2s_fp32", []), ("s2s_bf16", ["--precision", "bf16"]),
                                ("s2s_int8", ["--quantize", "int8"])):
                if mode not in chosen:
                    continue
                hyp = work / f"{mode}-{search}.txt"
                runs[mode] = (hyp, [sys.executable, "-m", "s2s", "-q", "translate", "-m", str(args.model),
                                    "--input", str(src), "-o", str(hyp), "--beam", str(beam),
                                    "--threads", str(args.threads), "--set", f"decode.batch_size={args.batch}",
                                    "--batch-tokens", "1000000", "--set", "decode.length_penalty=power",
                                    "--alpha", "1.0", "--set", "decode.stop=early", "--max-len-a", "0",
                                    "--max-len-b", str(cap), *flags])
            for mode, model_dir in engines.items():
                hyp = work / f"{mode}-{search}.txt"
                runs[mode] = (hyp, [sys.executable, "-c", CT2_SCRIPT, str(model_dir), str(src), str(hyp),
                                    str(beam), str(args.batch), str(args.threads), str(cap)])
            if hf_site_dir is not None:
                hyp = work / f"hf-{search}.txt"
                runs["hf"] = (hyp, [sys.executable, "-c", HF_SCRIPT, str(work / "hf"), str(args.model), str(src),
                                    str(hyp), str(beam), str(args.batch), str(args.threads), str(cap),
                                    str(REPO), hf_site_dir])
            for mode, (hyp, cmd) in runs.items():
                print(f"decode_speed: {mode} {search} ...", file=sys.stderr)
                seconds, rss = run_timed(cmd)
                hyps = hyp.read_text(encoding="utf-8").splitlines()
                bleu = sacrebleu.corpus_bleu(hyps, [refs]).score
                tokens = count_tokens(sp, hyp)
                key = f"{mode}_{search}"
                results.update({f"{key}_sent_s": round(n / seconds, 1), f"{key}_tok_s": round(tokens / seconds),
                                f"{key}_rss_mib": round(rss), f"{key}_bleu": round(bleu, 2)})
                rows.append((mode, search, n / seconds, tokens / seconds, rss, bleu))
            for mode in ENGINES:  # left out, or no Hugging Face family for this model
                for key in ("sent_s", "tok_s", "rss_mib", "bleu"):
                    results.setdefault(f"{mode}_{search}_{key}", None)

    print(f"{'engine':10s} {'search':7s} {'sent/s':>8s} {'tok/s':>8s} {'RSS MiB':>8s} {'BLEU':>6s}")
    for mode, search, sent_s, tok_s, rss, bleu in rows:
        print(f"{mode:10s} {search:7s} {sent_s:8.1f} {tok_s:8.0f} {rss:8.0f} {bleu:6.2f}")
    for search in ("beam5", "greedy"):
        for other in ("ct2_fp32", "hf"):
            base = results.get(f"{other}_{search}_sent_s")
            if base and results[f"s2s_fp32_{search}_sent_s"]:
                results[f"s2s_fp32_vs_{other}_{search}"] = round(results[f"s2s_fp32_{search}_sent_s"] / base, 3)
    results.update({"sentences": n, "threads": args.threads, "batch": args.batch, "max_output_tokens": cap,
                    "model": str(args.model)})
    print(json.dumps(results))


if __name__ == "__main__":
    main()
