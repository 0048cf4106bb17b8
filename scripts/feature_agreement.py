"""Held-out agreement by depth of feature drafters on hand-written prompts (issue 17).

A training run's held-out split comes from the same prompt generator as its training data, so it
measures how well a drafter learned that generator's answers, not what it meets in use: the stop-44
drafter agreed with the LLM at depth 1 on 0.53 of the split's positions but on 0.41 of the shared dev
prompts' (hand-written, never in training). This script measures the latter, side by side for every
drafter given: the LLM's greedy continuations of a prompts file (chat template; made once under
``--workdir`` by ``specjax.boost.feature_tune.eval_prompt_set``, which ``feature-tune --eval-prompts``
uses too), their features, and ``depth_agreement`` (the drafter fed its own features, depth 1..6),
overall and by the prompts' ``category``, with the share of continuation tokens each drafter's
vocabulary can name. A fused (EAGLE-3-style) drafter's layers are computed once beside g.

    python scripts/feature_agreement.py --drafter feature:auto --drafter feature:/path/to/other \
        --prompts-file ../shared/data/dev_prompts.jsonl --max-new-tokens 128 --workdir bench_out/agreement
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import _bench_common as common  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", action="append", required=True,
                    help="feature:NAME or feature:PATH (repeatable; side by side on the same continuations)")
    ap.add_argument("--prompts-file", default=common.DEFAULT_PROMPTS, help="hand-written prompts (.jsonl)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--depths", type=int, default=6)
    ap.add_argument("--workdir", default="bench_out/agreement", help="where the continuations and features are kept")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    bad = [d for d in args.drafter if not d.startswith("feature:")]
    if bad:
        sys.exit(f"--drafter must be feature:NAME or feature:PATH, got {bad}")
    common.print_header("feature drafter agreement by depth on hand-written prompts")
    import specjax
    from specjax.boost.feature_corpus import CorpusPlan
    from specjax.boost.feature_data import vocabulary_coverage
    from specjax.boost.feature_train import depth_agreement
    from specjax.boost.feature_tune import eval_prompt_set
    from specjax.speculation.drafters.feature import from_arg

    records = common.load_prompts(args.prompts_file, None)
    llm = specjax.load_model("smollm2-135m-instruct", progress=False)
    plan = dataclasses.replace(CorpusPlan(), max_new_tokens=args.max_new_tokens)
    sets = {}

    def data_for(layers):  # the same continuations; a fused drafter's raw layers stored beside g
        if layers not in sets:
            sets[layers] = eval_prompt_set(llm, args.workdir, [r["prompt"] for r in records], plan,
                                           categories=[str(r.get("category", "?")) for r in records],
                                           log=lambda *_: None, layers=layers)
        return sets[layers]

    data = data_for(())
    print(f"# {len(data)} prompts of {args.prompts_file}, {data.continuation_tokens()} continuation tokens "
          f"(max {args.max_new_tokens} each)")
    results = {}
    for spec in args.drafter:
        bound = from_arg(spec.split(":", 1)[1], llm, load=True, expansion=None, draft="topk")
        data = data_for(bound.drafter.config.raw_layers)
        coverage = vocabulary_coverage(data, bound.drafter.config.draft_vocab)
        agreement = depth_agreement(bound.params, data, bound.drafter.config, steps=args.depths,
                                    window=args.max_new_tokens + args.depths + 8)
        results[spec] = {"coverage": coverage, **agreement}
        print(f"{spec}: vocabulary covers {coverage:.3f} of the continuation tokens")
        print("  " + f"{'':16s}" + "".join(f"   d{d + 1}  " for d in range(args.depths)))
        for name in ["all"] + list(data.part_names):
            if name in agreement:
                print(f"  {name:16s}" + "".join(f"{a:7.3f}" for a in agreement[name]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
