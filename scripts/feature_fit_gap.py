"""A feature drafter's agreement on sequences it was trained on against held-out ones (issue 17).

Whether more data or more capacity (and training steps) is the lever: a drafter that agrees with the LLM
on its own training sequences barely more than on held-out sequences of the same kind underfits, and
more data of that kind will not lift it much; a wide gap says it memorises, and data would. The corpus
is split as the drafter's last training run split it (its metadata records the plan and seed; the split
is checked as ``feature-tune --init-from`` checks it), the LLM's features are the stored ones, and
agreement is ``depth_agreement``'s (the drafter fed its own features, by depth) on the split groups
asked for: every held-out sequence of theirs and a seeded sample of their training sequences.

    python scripts/feature_fit_gap.py --drafter models/smollm2-feature --corpus feature-out/feature-corpus \
        --exclude-prompts ../shared/data/dev_prompts.jsonl --exclude-prompts scripts/data/task_kinds.jsonl \
        --exclude-prompts scripts/data/other_tasks.jsonl --groups written-f,written-g --train-sample 700 \
        --teacher-dots bfloat16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import _bench_common as common  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", default="smollm2-feature", help="registered name or directory of a trained drafter")
    ap.add_argument("--corpus", required=True, help="the corpus directory it was trained on (with its features)")
    ap.add_argument("--exclude-prompts", action="append", default=[],
                    help="the prompt files its training run held out (--exclude-prompts and --eval-prompts there), "
                         "so the corpus's prompts are the run's; repeatable")
    ap.add_argument("--groups", required=True, help="comma-separated split groups (templates, requests, written, "
                                                    "written-b, ...): their features are loaded")
    ap.add_argument("--held-out", type=float, default=0.02, help="the run's --held-out")
    ap.add_argument("--teacher-dots", choices=("float32", "bfloat16"), default=None,
                    help="which stored LLM features to read (default: the drafter's run's, as its metadata records "
                         "since stop 88; float32 where it does not say: give it for earlier drafters)")
    ap.add_argument("--train-sample", type=int, default=700, help="training sequences evaluated (seeded sample)")
    ap.add_argument("--depths", type=int, default=6)
    ap.add_argument("--seed", type=int, default=1, help="seed of the training sample")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    if args.train_sample < 1 or args.depths < 1:
        sys.exit(f"--train-sample and --depths must be >= 1, got {args.train_sample} and {args.depths}")
    common.print_header("feature drafter agreement: training sequences against held-out ones")
    import numpy as np

    import specjax
    from specjax.boost.feature_corpus import CorpusPlan
    from specjax.boost.feature_train import sequence_agreement, summarise_agreement
    from specjax.boost.feature_tune import check_train_groups, corpus_split, plan_groups, start_from
    from specjax.io.feature_checkpoint import read_feature_meta
    from specjax.io.prompts import read_prompts_file
    from specjax.speculation.drafters.feature import feature_drafter_path

    saved_cfg, _, meta = read_feature_meta(feature_drafter_path(args.drafter))
    trained = meta.get("trained") or {}
    if not {"plan", "train"} <= set(trained):
        sys.exit(f"{args.drafter}: its metadata does not record its training run (plan, seed)")
    plan = CorpusPlan(**{k: tuple(v) if isinstance(v, list) else v for k, v in trained["plan"].items()})
    groups = check_train_groups(plan, tuple(args.groups.split(",")))
    covered = trained.get("train_groups") or plan_groups(plan)  # what its last run trained on
    if any(g not in covered for g in groups):
        sys.exit(f"--groups {args.groups}: {args.drafter}'s last run trained on {', '.join(covered)} only; the "
                 f"sequences of other groups were not its training sequences, so their gap would read as underfitting")
    exclude = [p for path in args.exclude_prompts
               for p in read_prompts_file(path, flag="--exclude-prompts", allow_token_ids=False, plain_lines=True)]
    llm = specjax.load_model("smollm2-135m-instruct", progress=False)
    seed = trained["train"]["seed"]
    dots = args.teacher_dots or trained.get("teacher_dots", "float32")
    train, held, counts = corpus_split(llm, args.corpus, plan, exclude=exclude, held_out=args.held_out, seed=seed,
                                       raw_layers=saved_cfg.raw_layers, teacher_dots=dots, train_groups=groups,
                                       progress=False, log=lambda *a: None)
    cfg, params = start_from(args.drafter, llm, counts, seed)  # refuses a drafter trained under another split
    pick = np.sort(np.random.default_rng(args.seed).choice(len(train), min(args.train_sample, len(train)),
                                                           replace=False))
    print(f"# {args.drafter} ({cfg.layers} decoder layer(s)); groups {', '.join(groups)}: "
          + ", ".join(f"{g} {counts[g]['train']} train / {counts[g]['held_out']} held out" for g in groups))
    window = max(plan.max_new_tokens, plan.passage_tokens) + args.depths + 8
    results = {}
    for label, data in (("held_out", held), ("train_sample", train.subset(pick))):
        started = time.perf_counter()
        hits, n = sequence_agreement(params, data, cfg, steps=args.depths, window=window)
        results[label] = {"sequences": len(data), **summarise_agreement(hits, n, data.parts, data.part_names)}
        row = results[label]
        print(f"{label:12s} {row['sequences']:5d} sequences {row['positions']:7d} positions  "
              + " ".join(f"d{d + 1} {a:.3f}" for d, a in enumerate(row["all"]))
              + f"  ({time.perf_counter() - started:.0f} s)")
        for name in data.part_names:
            if name in row:
                print(f"  {name:22s}" + " ".join(f"{a:7.3f}" for a in row[name]))
    gap = [t - h for t, h in zip(results["train_sample"]["all"], results["held_out"]["all"])]
    print("gap (train - held out) " + " ".join(f"d{d + 1} {g:+.3f}" for d, g in enumerate(gap)))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"drafter": args.drafter, "groups": list(groups), **results, "gap": gap,
                       "plan": dataclasses.asdict(plan)}, f, indent=1)


if __name__ == "__main__":
    main()
