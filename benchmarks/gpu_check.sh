#!/usr/bin/env bash
# The GPU check: one script, under 8 minutes on one H200.
#
#   bash benchmarks/gpu_check.sh               # on a machine with a CUDA GPU
#   bash benchmarks/gpu_check.sh --cpu-smoke   # the same steps, tiny, on the CPU (.ci/run; a few minutes)
#   bash benchmarks/gpu_check.sh --fetch-wheels DIR   # only download, for a GPU machine without network,
#                                              # the wheels its Python lacks (GPU_CHECK_WHEELS below)
#
# Steps (each prints a "== gpu_check:" line).  A failed step is reported and the steps that do not need
# it still run (a GPU machine's minutes are scarce): the exit status is non-zero if any step failed.
#   1. environment: a virtualenv $GPU_CHECK_VENV (default .venv-gpu) with $TORCH_SPEC, s2s and its test
#      extras (ctranslate2, transformers); or, with GPU_CHECK_PYTHON=/path/to/python, that interpreter
#      as it is (for machines without network and for CI, which has .venv already), with the wheels in
#      GPU_CHECK_WHEELS=DIR, if given, installed beside it (pip --no-index --target; made where there is
#      network by --fetch-wheels DIR: ctranslate2 for CPython $GPU_CHECK_WHEELS_PYTHON, default 3.12)
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
# decode.json and train-*.json (each benchmark's last line); GPU_CHECK_RESULTS=DIR (new or empty)
# also copies those (not the data and model) there when the script ends, whether it passed, failed or was stopped by
# SIGTERM (under a time limit: `timeout -s TERM`, not SIGKILL, which no script outlives).  Relative
# paths in these variables and --fetch-wheels are the checkout's: the script runs from its root.
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
  --fetch-wheels)
    [[ -n ${2:-} ]] || { echo "gpu_check: error: --fetch-wheels needs a directory" >&2; exit 2; }
    # ctranslate2 alone: the GPU machines' image has torch, transformers and s2s's other needs
    # (numpy and pyyaml, ctranslate2's own, among them); 4.8.5 is the one whose cuBLAS calls were
    # checked against CUDA 13's (benchmarks/decode_speed.py, ct2_cuda_environ)
    exec "${GPU_CHECK_PYTHON:-python3}" -m pip download --quiet --no-deps --only-binary=:all: --implementation cp \
      --python-version "${GPU_CHECK_WHEELS_PYTHON:-3.12}" --platform manylinux_2_27_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$2" "${CT2_SPEC:-ctranslate2==4.8.5}" ;;
  "") ;;
  *) echo "gpu_check: error: unknown argument '$1' (--cpu-smoke or --fetch-wheels DIR)" >&2; exit 2 ;;
esac
if [[ $SMOKE == 1 ]]; then DEVICE=cpu; else DEVICE=cuda; fi
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
RESULTS=
if [[ -n ${GPU_CHECK_RESULTS:-} ]]; then
  if [[ -d $GPU_CHECK_RESULTS && -n $(ls -A "$GPU_CHECK_RESULTS") ]]; then  # never over a user's files
    echo "gpu_check: error: GPU_CHECK_RESULTS=$GPU_CHECK_RESULTS is not empty (give a new or empty folder)" >&2
    exit 2
  fi
  mkdir -p "$GPU_CHECK_RESULTS"
  RESULTS=$(cd "$GPU_CHECK_RESULTS" && pwd)
fi
TMP_OUT=
if [[ $SMOKE == 1 && -z ${GPU_CHECK_OUT:-} ]]; then
  OUT=$(mktemp -d -t s2s-gpu-check-XXXXXX)
  TMP_OUT=$OUT
else
  OUT=${GPU_CHECK_OUT:-gpu-check}
  mkdir -p "$OUT"
fi
OUT=$(cd "$OUT" && pwd)
finish() {
  if [[ -n $RESULTS ]]; then cp "$OUT"/*.log "$OUT"/*.json "$RESULTS"/ 2>/dev/null || true; fi
  if [[ -n $TMP_OUT ]]; then rm -rf "$TMP_OUT"; fi
}
trap finish EXIT
step() { echo "== gpu_check: $* ($(date -u +%H:%M:%S))"; }
FAILED=()
failed() { echo "gpu_check: error: $*" >&2; FAILED+=("$*"); }

# 1. environment ---------------------------------------------------------------------------------
step "environment"
if [[ -n ${GPU_CHECK_WHEELS:-} && -z ${GPU_CHECK_PYTHON:-} ]]; then
  echo "gpu_check: error: GPU_CHECK_WHEELS is for an interpreter as it is: set GPU_CHECK_PYTHON too" >&2; exit 2
fi
if [[ -n ${GPU_CHECK_PYTHON:-} ]]; then
  PY=$GPU_CHECK_PYTHON
  if [[ -n ${GPU_CHECK_WHEELS:-} ]]; then
    compgen -G "$GPU_CHECK_WHEELS/*.whl" > /dev/null \
      || { echo "gpu_check: error: GPU_CHECK_WHEELS=$GPU_CHECK_WHEELS holds no .whl file" >&2; exit 2; }
    if "$PY" -m pip --version > /dev/null 2>&1; then
      "$PY" -m pip install --quiet --no-index --no-deps --no-compile --upgrade --target "$OUT/site" \
        "$GPU_CHECK_WHEELS"/*.whl
    else  # an interpreter without pip: a wheel is a zip laid out as site-packages
      for whl in "$GPU_CHECK_WHEELS"/*.whl; do "$PY" -m zipfile -e "$whl" "$OUT/site"; done
    fi
    export PYTHONPATH=$OUT/site${PYTHONPATH:+:$PYTHONPATH}
  fi
else
  VENV=${GPU_CHECK_VENV:-.venv-gpu}
  [[ -x $VENV/bin/python ]] || python3 -m venv "$VENV"
  # shellcheck disable=SC2086  # TORCH_SPEC may carry pip options (--index-url ...)
  "$VENV/bin/pip" install --quiet $TORCH_SPEC
  "$VENV/bin/pip" install --quiet -e ".[test]"
  PY=$VENV/bin/python
fi
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
TESTS_RUN=1
"$PY" - "$DEVICE" <<'EOF' || { rc=$?; (( rc == 3 )) || exit "$rc"; TESTS_RUN=0; failed "no tests: pytest or hypothesis missing"; }
import sys, torch
device = sys.argv[1]
if device == "cuda" and not torch.cuda.is_available():
    sys.exit(f"gpu_check: error: torch {torch.__version__} sees no CUDA GPU (CUDA build: {torch.version.cuda}); "
             "set TORCH_SPEC to a CUDA build or run with --cpu-smoke")
print(f"torch {torch.__version__}, device {torch.cuda.get_device_name(0) if device == 'cuda' else 'cpu'}")
import importlib
def missing(names):
    out = []
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            out.append(name)
    return out
# s2s's needs that an interpreter as it is (GPU_CHECK_PYTHON) may lack: carry them in GPU_CHECK_WHEELS
lacks = missing(("numpy", "sentencepiece", "sacrebleu", "typer", "rich", "yaml", "safetensors"))
if lacks:
    sys.exit(f"gpu_check: error: {sys.executable} cannot import {', '.join(lacks)}")
lacks_for_tests = missing(("pytest", "hypothesis"))
try:
    import ctranslate2
    print(f"ctranslate2 {ctranslate2.__version__} ({ctranslate2.__file__})")
except ImportError:
    print("ctranslate2 is not installed: no CTranslate2 rows")
if lacks_for_tests:  # the other steps can still run
    print(f"gpu_check: error: {sys.executable} cannot import {', '.join(lacks_for_tests)}", file=sys.stderr)
    sys.exit(3)
EOF

# 2. tests on the device ---------------------------------------------------------------------------
if [[ $SMOKE == 1 ]]; then
  TESTS=${GPU_CHECK_TESTS:-tests/test_search.py::test_beam_one_equals_greedy_on_a_model}
else
  # the files with device tests (the whole suite, GPU_CHECK_TESTS=tests, may not fit the 8 minutes)
  TESTS=${GPU_CHECK_TESTS:-tests/test_model.py tests/test_search.py tests/test_workers.py}
fi
step "tests with S2S_TEST_DEVICE=$DEVICE: $TESTS"
if [[ $TESTS_RUN == 1 ]]; then
  # shellcheck disable=SC2086  # TESTS is a list of pytest arguments
  if ! S2S_TEST_DEVICE=$DEVICE "$PY" -m pytest -q -p no:cacheprovider $TESTS > "$OUT/tests.log" 2>&1; then
    grep -E "^(FAILED|ERROR) " "$OUT/tests.log" || true
    failed "tests failed ($OUT/tests.log)"
  fi
  tail -n 1 "$OUT/tests.log"
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
  if ! "$PY" -m s2s -q train "$CONFIG" -o "$MODEL" "${SETS[@]}" "${TRAIN_SETS[@]}" > "$OUT/train.log" 2>&1; then
    tail -n 20 "$OUT/train.log" >&2
    failed "training failed ($OUT/train.log)"
  fi
fi

# 4. decoding against CTranslate2 ------------------------------------------------------------------
if [[ $SMOKE == 1 ]]; then
  DECODE=(--sentences 20 --rounds 1 --cores 1 --batch 8 --engines s2s,ct2 --memory-lines 60)
else
  DECODE=(--sentences 1000 --rounds 1 --batch 64 --memory-lines 0 --process-timeout 240)
fi
step "decoding: benchmarks/decode_speed.py --device $DEVICE ${DECODE[*]}"
if [[ ! -f $MODEL/model.safetensors ]]; then
  failed "decoding not run: no trained model in $MODEL"
else
  # its table and JSON line even where an s2s configuration failed (it exits non-zero after them)
  "$PY" benchmarks/decode_speed.py --model "$MODEL" --device "$DEVICE" "${DECODE[@]}" > "$OUT/decode.log" \
    2> "$OUT/decode-stderr.log" && decoded=1 || decoded=0
  grep -v '^{' "$OUT/decode.log" || true
  if tail -n 1 "$OUT/decode.log" | grep -q '^{'; then tail -n 1 "$OUT/decode.log" > "$OUT/decode.json"; fi
  if [[ $decoded == 0 ]]; then
    tail -n 20 "$OUT/decode-stderr.log" >&2
    failed "decode_speed.py failed ($OUT/decode-stderr.log)"
  fi
fi

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
    failed "gpu_train_speed.py --shape $shape failed"
  fi
done
if (( ${#FAILED[@]} )); then
  step "done, ${#FAILED[@]} step(s) failed: $(IFS=';'; echo "${FAILED[*]}"); results in $OUT"
  exit 1
fi
step "done: results in $OUT"
