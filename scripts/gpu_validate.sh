#!/usr/bin/env bash
# The GPU checks in one run, from the repository root of a checkout on a GPU machine whose Python
# has jax (CUDA), flax, optax, orbax, chex, transformers and torch (the device image has them):
#   1. the environment (GPU, versions);
#   2. the compiled Pallas tree kernel and the tree/incremental equivalence tests on the GPU
#      (tiny models; tests that need SmolLM2's GGUF skip, it cannot travel);
#   3. speculative == incremental end to end on SmolLM2's architecture, greedy and seeded;
#   4. the engine table (scripts/bench_engine.py) against torch on CUDA, float32 and bfloat16.
# Steps 3-4 use SmolLM2-135M's architecture with random weights (scripts/random_weights_model.py):
# timings depend on shapes only. Each step has its own time limit, so one hang cannot eat the run.
# Measured on an H100 (stop 47): env ~15 s, kernels (the Pallas tests) 96 s, the f32 table just over
# 230 s (it was stopped there before its last row); each specjax.generate
# configuration compiles for about 70 s there, so the lossless step (7 of them) needs ~9 min: give it
# a call of its own (STEPS=lossless, LOSSLESS_SECONDS=560).
#
#   OUT=gpu_out scripts/gpu_validate.sh                      # env kernels f32: ~6-7 min, one call
#   STEPS="bf16 tests" OUT=gpu_out scripts/gpu_validate.sh   # others (the model step runs when needed)
# Exits 1 when any step failed or ran out of time (each step's log says which).
set -uo pipefail
OUT=${OUT:-gpu_out}
STEPS=${STEPS:-env kernels f32}
FAILED=""
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_MEM_FRACTION=0.45
PY=${PYTHON:-python3}
MODEL=/tmp/smollm2-random
step() { echo "=== $1 ($(date +%T))"; }
check() { [ "$1" -eq 0 ] || FAILED="$FAILED $2"; }  # $1: the step's exit status (first command of its pipe)
model() {
  [ -f $MODEL/model.safetensors ] && return
  step "random-weight SmolLM2-135M"
  timeout 120 $PY scripts/random_weights_model.py --config scripts/data/smollm2-135m-config.json --out $MODEL 2>&1 | tail -1
}
table() {  # $1 dtype, $2 name
  model; step "engine table, $1"
  timeout "${BENCH_SECONDS:-300}" $PY scripts/bench_engine.py --model $MODEL --dtype "$1" \
    --json-out "$OUT/engine_$2.json" --plot "$OUT/engine_$2.png" 2>&1 | grep -v "Loading weights" | tee "$OUT/engine_$2.txt"
  check "${PIPESTATUS[0]}" "$2"
}
for s in $STEPS; do
  case $s in
    env) step environment
      { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
        $PY -c 'import jax, jaxlib, flax, torch, transformers, sys; print("python", sys.version.split()[0], "jax",
jax.__version__, "jaxlib", jaxlib.__version__, "flax", flax.__version__, "torch", torch.__version__,
"transformers", transformers.__version__, jax.devices())'
        nproc; } 2>&1 | tee "$OUT/env.txt" ;;
    kernels) step "compiled tree kernel and tree-pass tests"
      timeout "${TEST_SECONDS:-150}" $PY -m pytest -q -p no:cacheprovider -k "pallas or lowers" \
        tests/test_tree_attention.py tests/test_tree_forward.py 2>&1 | tee "$OUT/kernels.txt" | tail -30
      check "${PIPESTATUS[0]}" kernels ;;
    lossless) model; step "lossless end to end (SmolLM2 architecture, random weights)"
      timeout "${LOSSLESS_SECONDS:-560}" $PY scripts/check_lossless.py --model $MODEL 2>&1 | tee "$OUT/lossless.txt"
      check "${PIPESTATUS[0]}" lossless ;;
    f32) table float32 f32 ;;
    bf16) table bfloat16 bf16 ;;
    tests) step "speculative and transformers-equivalence tests"
      timeout "${TEST_SECONDS:-120}" $PY -m pytest -q -p no:cacheprovider \
        tests/test_speculative.py tests/test_hf_equivalence.py 2>&1 | tee "$OUT/tests.txt" | tail -30
      check "${PIPESTATUS[0]}" tests ;;
    *) echo "unknown step $s (env kernels lossless f32 bf16 tests)"; exit 2 ;;
  esac
done
step "done${FAILED:+, failed:$FAILED}"
[ -z "$FAILED" ]
