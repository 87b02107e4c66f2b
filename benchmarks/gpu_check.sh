#!/usr/bin/env bash
# The GPU check: one script, under 8 minutes on one H200.
#
#   bash benchmarks/gpu_check.sh               # on a machine with a CUDA GPU
#   bash benchmarks/gpu_check.sh --cpu-smoke   # the same steps, tiny, on the CPU (.ci/run; a few minutes)
#
# Steps (each prints a "== gpu_check:" line; the first failure stops the script, exit status non-zero):
#   1. environment: a virtualenv $GPU_CHECK_VENV (default .venv-gpu) with $TORCH_SPEC, s2s and its test
#      extras (ctranslate2, transformers); or, with GPU_CHECK_PYTHON=/path/to/python, that interpreter
#      as it is (nothing installed: for machines without network and for CI, which has .venv already)
#   2. tests with S2S_TEST_DEVICE=cuda (tests/conftest.py's `device` fixture: model forward/decode
#      equality, search on a model, translate --device); $GPU_CHECK_TESTS picks them (default: the
#      three files that hold device tests on the GPU, one device test in the smoke; "tests": all)
#   3. a model: the reference recipe (recipes/ddtp-en-de.yaml, 3+3, d_model 256) trained for
#      $GPU_CHECK_TRAIN_TIME (default 90s) in bf16 on the GPU; or $GPU_CHECK_MODEL, a trained model dir
#   4. decoding: benchmarks/decode_speed.py --device cuda, s2s fp32/bf16 against CTranslate2
#      float32/float16/bfloat16, batches of 64, beam 5 and greedy, 1,000 test sentences, one round
#   5. training speed: benchmarks/gpu_train_speed.py, the reference model and a transformer-base
#      (6+6, d_model 512, FFN 2048, 8 heads) at 25,000-token batches, s2s bf16 tokens/s and MFU
#      against the bf16 peak, beside MarianMTModel on the same GPU
# Everything lands in $GPU_CHECK_OUT (default gpu-check/; smoke: a temporary directory): the logs,
# decode.json and train-*.json (each benchmark's last line).
#
# TORCH_SPEC (default "torch==2.13.0") is what pip installs for torch: on the GPU machine it must be
# a CUDA build, e.g.
#   TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD

SMOKE=0
case "${1:-}" in
  --cpu-smoke) SMOKE=1 ;;
  "") ;;
  *) echo "gpu_check: error: unknown argument '$1' (only --cpu-smoke)" >&2; exit 2 ;;
esac
if [[ $SMOKE == 1 ]]; then DEVICE=cpu; else DEVICE=cuda; fi
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
if [[ $SMOKE == 1 && -z ${GPU_CHECK_OUT:-} ]]; then
  OUT=$(mktemp -d -t s2s-gpu-check-XXXXXX)
  trap 'rm -rf "$OUT"' EXIT
else
  OUT=${GPU_CHECK_OUT:-gpu-check}
  mkdir -p "$OUT"
fi
OUT=$(cd "$OUT" && pwd)
step() { echo "== gpu_check: $* ($(date -u +%H:%M:%S))"; }

# 1. environment ---------------------------------------------------------------------------------
step "environment"
if [[ -n ${GPU_CHECK_PYTHON:-} ]]; then
  PY=$GPU_CHECK_PYTHON
else
  VENV=${GPU_CHECK_VENV:-.venv-gpu}
  [[ -x $VENV/bin/python ]] || python3 -m venv "$VENV"
  # shellcheck disable=SC2086  # TORCH_SPEC may carry pip options (--index-url ...)
  "$VENV/bin/pip" install --quiet $TORCH_SPEC
  "$VENV/bin/pip" install --quiet -e ".[test]"
  PY=$VENV/bin/python
fi
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
"$PY" - "$DEVICE" <<'EOF'
import sys, torch
device = sys.argv[1]
if device == "cuda" and not torch.cuda.is_available():
    sys.exit(f"gpu_check: error: torch {torch.__version__} sees no CUDA GPU (CUDA build: {torch.version.cuda}); "
             "set TORCH_SPEC to a CUDA build or run with --cpu-smoke")
print(f"torch {torch.__version__}, device {torch.cuda.get_device_name(0) if device == 'cuda' else 'cpu'}")
EOF

# 2. tests on the device ---------------------------------------------------------------------------
if [[ $SMOKE == 1 ]]; then
  TESTS=${GPU_CHECK_TESTS:-tests/test_search.py::test_beam_one_equals_greedy_on_a_model}
else
  # the files with device tests (the whole suite, GPU_CHECK_TESTS=tests, may not fit the 8 minutes)
  TESTS=${GPU_CHECK_TESTS:-tests/test_model.py tests/test_search.py tests/test_workers.py}
fi
step "tests with S2S_TEST_DEVICE=$DEVICE: $TESTS"
# shellcheck disable=SC2086  # TESTS is a list of pytest arguments
if ! S2S_TEST_DEVICE=$DEVICE "$PY" -m pytest -q -x $TESTS 2>&1 | tail -n 15 | tee "$OUT/tests.log"; then
  echo "gpu_check: error: tests failed (see above)" >&2; exit 1
fi

# 3. a model to decode with ------------------------------------------------------------------------
if [[ $SMOKE == 1 ]]; then
  # tiny: 400 training pairs, a 300-piece vocabulary, d_model 32, 6 updates
  mkdir -p "$OUT/corpus"
  for split in train:400 dev:20; do
    for lang in en de; do
      (set +o pipefail; zcat "data/ddtp-en-de/${split%:*}.$lang.gz" | head -n "${split#*:}") \
        > "$OUT/corpus/${split%:*}.$lang"  # zcat stopped by head's early exit is fine
    done
  done
  CONFIG=$OUT/tiny.yaml
  cat > "$CONFIG" <<EOF
seed: 1
tokenizer: {vocab_size: 300}
data: {src_lang: en, tgt_lang: de, train: $OUT/corpus/train, dev: $OUT/corpus/dev, dir: $OUT/prep}
model: {d_model: 32, heads: 2, enc_layers: 1, dec_layers: 1, d_ff: 64}
train: {max_steps: 6, validate_every: 6, log_every: 1, dev_bleu_sentences: 4, warmup_steps: 4,
        max_tokens: 600, threads: 1}
decode: {beam: 2, max_len_a: 0, max_len_b: 8}  # untrained: every output runs to the cap
EOF
  SETS=()
  TRAIN_SETS=(--set train.device=cpu)
else
  CONFIG=recipes/ddtp-en-de.yaml
  SETS=(--set "data.dir=$OUT/prep")
  TRAIN_SETS=(--set "train.max_time=${GPU_CHECK_TRAIN_TIME:-90s}" --set train.device=cuda --set train.precision=bf16
              --set train.dev_bleu_sentences=100)
fi
step "data: tokenizer and prepare $CONFIG (the training-speed batches; the model's training data)"
"$PY" -m s2s -q tokenizer train "$CONFIG" "${SETS[@]}"
"$PY" -m s2s -q prepare "$CONFIG" "${SETS[@]}"
if [[ -n ${GPU_CHECK_MODEL:-} ]]; then
  MODEL=$GPU_CHECK_MODEL
  step "model: $MODEL (GPU_CHECK_MODEL)"
else
  MODEL=$OUT/model
  step "model: train $CONFIG into $MODEL"
  rm -rf "$MODEL"
  "$PY" -m s2s -q train "$CONFIG" -o "$MODEL" "${SETS[@]}" "${TRAIN_SETS[@]}" > "$OUT/train.log" 2>&1 \
    || { tail -n 20 "$OUT/train.log" >&2; echo "gpu_check: error: training failed" >&2; exit 1; }
fi

# 4. decoding against CTranslate2 ------------------------------------------------------------------
if [[ $SMOKE == 1 ]]; then
  DECODE=(--sentences 20 --rounds 1 --cores 1 --batch 8 --engines s2s,ct2 --memory-lines 60)
else
  DECODE=(--sentences 1000 --rounds 1 --batch 64 --memory-lines 0)
fi
step "decoding: benchmarks/decode_speed.py --device $DEVICE ${DECODE[*]}"
"$PY" benchmarks/decode_speed.py --model "$MODEL" --device "$DEVICE" "${DECODE[@]}" > "$OUT/decode.log" \
  || { echo "gpu_check: error: decode_speed.py failed" >&2; exit 1; }
grep -v '^{' "$OUT/decode.log"
tail -n 1 "$OUT/decode.log" > "$OUT/decode.json"

# 5. training speed against MarianMTModel ----------------------------------------------------------
if [[ $SMOKE == 1 ]]; then
  TRAIN=(--device cpu --precision fp32 --max-tokens 600 --updates 1 --warmup 1 --set train.threads=1)
else
  TRAIN=(--device cuda --precision bf16 --max-tokens 25000 --updates 30 --warmup 5 "${SETS[@]}")
fi
for shape in config base; do
  step "training speed: benchmarks/gpu_train_speed.py $CONFIG --shape $shape ${TRAIN[*]}"
  if ! "$PY" benchmarks/gpu_train_speed.py "$CONFIG" --shape "$shape" "${TRAIN[@]}" | tail -n 1 \
      | tee "$OUT/train-$shape.json"; then
    echo "gpu_check: error: gpu_train_speed.py failed" >&2; exit 1
  fi
done
step "done: results in $OUT"
