#!/usr/bin/env bash
# The GPU check of docs/gpu.md, on a machine with a CUDA device, from the repository root:
#
#   [STAGES=kernels,sweep,bench,models,large] scripts/gpu_check.sh OUT_DIR TOKENIZER_DIR [WHEEL_DIR]
#
# OUT_DIR receives at most 8 files: tests_kernels.log, tests_models.log, gpu_check.log and the
# JSON files of `python -m contextdeque.eval.gpu_check` (sweep, env, bench_smollm2, calibration,
# bench_llama3_8b). TOKENIZER_DIR holds SmolLM2-135M-Instruct's tokenizer files (tokenizer.json,
# tokenizer_config.json, chat_template.jinja). WHEEL_DIR: wheels of packages the machine lacks,
# installed offline into /tmp/site. Each stage has its own time limit, so one that hangs leaves
# the others their time; the exit status is the number of stages that failed. STAGES picks stages:
# kernels (the kernel tests, every sweep variant's values included), sweep (the launch variants
# timed at 8,192 tokens; the fastest at the Llama-3-8B shape in bf16 is then used by the later
# stages through CONTEXTDEQUE_TRITON_LAUNCH), bench (env, SmolLM2 bench), models (the model tests
# on CUDA), large (the Llama-3-8B-architecture bench), calibrate (the replay's cost model measured
# on the device with SmolLM2's architecture: calibration.json).
set -u
STAGES=${STAGES:-kernels,sweep,models,large,bench,calibrate}
want() { case ",$STAGES," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
OUT=${1:?usage: scripts/gpu_check.sh OUT_DIR TOKENIZER_DIR [WHEEL_DIR]}
TOK=${2:?usage: scripts/gpu_check.sh OUT_DIR TOKENIZER_DIR [WHEEL_DIR]}
WHL=${3:-}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
failed=0

if [ -n "$WHL" ] && ls "$WHL"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHL"/*.whl || exit 99
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# contextdeque without a build step, in a copy of the checkout (this one stays untouched) where
# kernels/ and agents/ are linked inside the package, as the install maps them
OUT=$(cd "$OUT" && pwd) TOK=$(cd "$TOK" && pwd)
rm -rf /tmp/cdq-repo && mkdir -p /tmp/cdq-repo && cp -r contextdeque kernels agents tests pyproject.toml /tmp/cdq-repo/ \
  && ln -s ../kernels /tmp/cdq-repo/contextdeque/kernels && ln -s ../agents /tmp/cdq-repo/contextdeque/agents || exit 98
cd /tmp/cdq-repo || exit 98
export PYTHONPATH=/tmp/cdq-repo${PYTHONPATH:+:$PYTHONPATH}

{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/gpu_check.log"

# a stage of measurements (steps of contextdeque.eval.gpu_check) or of CUDA tests, under its time limit
measure() {
  timeout "$1" python3 -m contextdeque.eval.gpu_check "$OUT" --tokenizer-dir "$TOK" --steps "$2" \
    2>&1 | tee -a "$OUT/gpu_check.log" | grep '^\[gpu_check\]'
  [ "${PIPESTATUS[0]}" = 0 ] || failed=$((failed + 1))
}
cuda_tests() {
  local limit=$1 log=$2
  shift 2
  timeout "$limit" python3 -m pytest tests/test_cuda.py -m cuda -q -p no:cacheprovider "$@" >"$OUT/$log" 2>&1 || failed=$((failed + 1))
  tail -3 "$OUT/$log"
}

MODEL_TESTS="verify or window or materialize or relocation_runs"
# many Triton specializations, compiled in parallel processes
want kernels && cuda_tests 110 tests_kernels.log -n 12 -k "not ($MODEL_TESTS)"
if want sweep; then
  measure 150 sweep
  best=$(python3 -c "import json, sys; from contextdeque.eval.gpu_check import SWEEP_VARIANTS, best_variant
rows = json.load(open(sys.argv[1]))['rows']; name = best_variant(rows); print(name, json.dumps(SWEEP_VARIANTS[name]))" "$OUT/sweep.json" 2>/dev/null)
  if [ -n "$best" ]; then
    echo "fastest variant (Llama-3-8B shape, bf16): $best" | tee -a "$OUT/gpu_check.log"
    export CONTEXTDEQUE_TRITON_LAUNCH="${best#* }"
  fi
fi
want models && cuda_tests 90 tests_models.log -s --tb=short -k "$MODEL_TESTS"
# the benches outran 100-150 s on an H100 once anticipation was on by default (docs/gpu.md): with
# these limits a full run needs two device commands (STAGES=kernels,sweep,models, then large,bench)
want large && measure 300 llama3_8b
want bench && measure 240 env,smollm2
want calibrate && measure 150 calibrate
echo "gpu_check: $failed stage(s) failed"
exit $failed
