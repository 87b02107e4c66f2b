#!/usr/bin/env bash
# Quality per wall clock: s2s's recipe against fairseq's standard transformer recipe, same machine,
# same data, same tokenization, same model shape, same training time (issue 16, item 4).
#
#   bash benchmarks/fairseq_quality.sh [--minutes 15] [--work DIR] [--s2s-run DIR] [--python PY]
#
# What it does, in order:
#   1. `s2s tokenizer train` + `s2s prepare` recipes/ddtp-en-de.yaml (into WORK): the cleaned, deduplicated
#      training pairs (prepared/.../train.{src,tgt}.txt) and the SentencePiece model both engines use.
#   2. Unless --s2s-run names an existing run: `s2s train recipes/ddtp-en-de.yaml --set train.max_time=Nm`.
#   3. A separate virtualenv WORK/fairseq-venv with torch (the pinned CPU wheel), numpy < 2, hydra-core 1.3,
#      omegaconf 2.3, cython, bitarray, sacrebleu, sentencepiece, and fairseq-fixed 0.12.3.1 built with
#      `pip install --no-build-isolation --no-deps` (fairseq 0.12's own pins do not install on Python 3.11+).
#   4. fairseq-preprocess (joined dictionary) on the same SentencePiece pieces, then fairseq-train for the same
#      N minutes (--stop-time-hours) with fairseq's standard recipe at the reference shape: 3+3 layers,
#      d_model 256, FFN 1024, 4 heads, pre-norm, shared embeddings, Adam (0.9, 0.98), lr 1e-3, inverse-sqrt
#      with 500 warmup updates, 4,096-token batches, label smoothing 0.1, dropout 0.1, on the CPU.
#   5. Both translate the 1,000 test sentences at beam 5 (fairseq-generate --beam 5, its default length
#      penalty; s2s translate --beam 5) and sacrebleu 13a scores them against the raw references.
# The last line is one JSON object: {"s2s_bleu", "fairseq_bleu", "ratio", "s2s_updates", "fairseq_updates",
# "minutes", "cpu"}.  Run it with nothing else on the machine: both trainings are timed by the wall clock.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD

MINUTES=15
WORK=bench/fairseq-quality
S2S_RUN=""
PY=${PYTHON:-.venv/bin/python}
TORCH=${TORCH:-torch==2.13.0}
while [ $# -gt 0 ]; do
  case "$1" in
    --minutes) MINUTES=$2; shift 2 ;;
    --work) WORK=$2; shift 2 ;;
    --s2s-run) S2S_RUN=$2; shift 2 ;;
    --python) PY=$2; shift 2 ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "fairseq_quality.sh: error: unknown argument $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")
S2S=("$PY" -m s2s)
RECIPE=$WORK/ddtp-en-de.yaml
log() { echo "fairseq_quality: $*" >&2; }

# 1. data and tokenizer (the recipe's relative paths resolve inside WORK)
cp recipes/ddtp-en-de.yaml "$RECIPE"
ln -sfn "$REPO/data" "$WORK/data"
cd "$WORK"
PREP=prepared/ddtp-en-de
if [ ! -f "$PREP/meta.json" ]; then
  log "s2s tokenizer train + prepare"
  PYTHONPATH=$REPO "${S2S[@]}" tokenizer train "$RECIPE" >&2
  PYTHONPATH=$REPO "${S2S[@]}" prepare "$RECIPE" >&2
fi

# 2. s2s
if [ -z "$S2S_RUN" ]; then
  S2S_RUN=$WORK/s2s-run
  rm -rf "$S2S_RUN"
  log "s2s train, $MINUTES minutes"
  PYTHONPATH=$REPO "${S2S[@]}" train "$RECIPE" -o "$S2S_RUN" --set "train.max_time=${MINUTES}m" >&2
fi
S2S_RUN=$(cd "$S2S_RUN" && pwd)
zcat data/ddtp-en-de/test.en.gz | PYTHONPATH=$REPO "${S2S[@]}" translate -m "$S2S_RUN" --beam 5 > s2s.test.hyp
S2S_BLEU=$(zcat data/ddtp-en-de/test.de.gz | PYTHONPATH=$REPO "${S2S[@]}" score s2s.test.hyp - --metric bleu \
           | awk '/^BLEU/ {print $2; exit}')
S2S_UPDATES=$(tail -n 1 "$S2S_RUN/metrics.jsonl" | "$PY" -c 'import json,sys; print(json.loads(sys.stdin.read())["step"])')

# 3. fairseq's own environment
VENV=$WORK/fairseq-venv
if [ ! -x "$VENV/bin/fairseq-train" ]; then
  log "installing fairseq-fixed 0.12.3.1 into $VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet "$TORCH" "numpy<2" "hydra-core>=1.3,<1.4" "omegaconf>=2.3,<2.4" cython bitarray \
    sacrebleu sentencepiece regex tqdm scikit-learn packaging
  "$VENV/bin/pip" install --quiet --no-build-isolation --no-deps fairseq-fixed==0.12.3.1
fi
# torch >= 2.6 loads checkpoints weights-only by default; fairseq 0.12's checkpoints hold argparse objects
export TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1

# 4. the same pieces, fairseq's binarization and training
FS=$WORK/fairseq
mkdir -p "$FS"
"$VENV/bin/python" - "$PREP" "$FS" <<'EOF'
import sys
import sentencepiece as spm
prep, out = sys.argv[1], sys.argv[2]
sp = spm.SentencePieceProcessor(model_file=f"{prep}/spm.model")
for split in ("train", "dev", "test"):
    for side, lang in (("src", "en"), ("tgt", "de")):
        with open(f"{prep}/{split}.{side}.txt", encoding="utf-8") as f, \
             open(f"{out}/{split}.{lang}", "w", encoding="utf-8") as g:
            for line in f:
                g.write(" ".join(sp.encode(line.rstrip("\n"), out_type=str)) + "\n")
EOF
rm -rf "$FS/bin" "$FS/ckpt"
"$VENV/bin/fairseq-preprocess" --source-lang en --target-lang de --trainpref "$FS/train" --validpref "$FS/dev" \
  --testpref "$FS/test" --destdir "$FS/bin" --joined-dictionary --workers 2 >&2
log "fairseq-train, $MINUTES minutes"
"$VENV/bin/fairseq-train" "$FS/bin" --cpu --arch transformer --share-all-embeddings \
  --encoder-layers 3 --decoder-layers 3 --encoder-embed-dim 256 --decoder-embed-dim 256 \
  --encoder-ffn-embed-dim 1024 --decoder-ffn-embed-dim 1024 --encoder-attention-heads 4 --decoder-attention-heads 4 \
  --encoder-normalize-before --decoder-normalize-before \
  --optimizer adam --adam-betas '(0.9, 0.98)' --lr 1e-3 --lr-scheduler inverse_sqrt --warmup-updates 500 \
  --warmup-init-lr 1e-07 --max-tokens 4096 --criterion label_smoothed_cross_entropy --label-smoothing 0.1 \
  --dropout 0.1 --weight-decay 0.0 --clip-norm 0.0 --seed 1 \
  --stop-time-hours "$("$VENV/bin/python" -c "print($MINUTES / 60)")" --max-epoch 1000 \
  --save-dir "$FS/ckpt" --no-epoch-checkpoints --log-format simple --log-interval 50 2>&1 | tee "$FS/train.log" >&2
FS_UPDATES=$(grep -o 'num_updates [0-9]*' "$FS/train.log" | tail -n 1 | awk '{print $2}')

# 5. fairseq's test translations, detokenized, scored by the same sacrebleu call
"$VENV/bin/fairseq-generate" "$FS/bin" --cpu --path "$FS/ckpt/checkpoint_last.pt" --gen-subset test --beam 5 \
  --batch-size 64 --remove-bpe sentencepiece > "$FS/generate.out"
grep '^H-' "$FS/generate.out" | sed 's/^H-//' | sort -n -k1,1 | cut -f3 > fairseq.test.hyp
FS_BLEU=$(zcat data/ddtp-en-de/test.de.gz | PYTHONPATH=$REPO "${S2S[@]}" score fairseq.test.hyp - --metric bleu \
          | awk '/^BLEU/ {print $2; exit}')

CPU=$(lscpu | sed -n 's/^Model name: *//p' | head -n 1)
printf '%-10s %8s %8s\n' engine updates BLEU
printf '%-10s %8s %8s\n' s2s "$S2S_UPDATES" "$S2S_BLEU" fairseq "$FS_UPDATES" "$FS_BLEU"
"$PY" -c "import json,sys; s,f=float(sys.argv[1]),float(sys.argv[2]); print(json.dumps({'s2s_bleu': s, \
'fairseq_bleu': f, 'ratio': round(s/f, 3) if f else None, 's2s_updates': int(sys.argv[3]), \
'fairseq_updates': int(sys.argv[4] or 0), 'minutes': float(sys.argv[5]), 'cpu': sys.argv[6]}))" \
  "$S2S_BLEU" "$FS_BLEU" "$S2S_UPDATES" "${FS_UPDATES:-0}" "$MINUTES" "$CPU"
