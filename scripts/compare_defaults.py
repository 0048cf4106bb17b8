"""Side by side: the candidate default drafters under the tree budget (the lookup drafter alone; the
corpus drafter over the shipped corpus of the LLM's own answers; the feature drafter + lookup) and
incremental decoding, end to end and decoding alone (batch 1, greedy or ``--temperature T`` under the
seeded verifier, one prompt at a time, chat template). Repetitions alternate the order of the
configurations, so a drifting machine does not favour one; every output must equal the first
configuration's (the script exits 1 otherwise).
Choosing the default (``registry._FEATURE_DEFAULT``, ``registry._CORPUS_DEFAULT``) rests on this
comparison.

    python scripts/compare_defaults.py --which 1 --max-new-tokens 128 --repetitions 2

``--which K`` takes the K-th prompt of every task kind of the prompts file (default
``scripts/data/task_kinds.jsonl``, two per kind): 0 and 1 give its two halves. ``--drafters`` adds a
configuration of ``--drafter`` specs joined by `` + `` (each step's whole tree), e.g. members and their
merge at an equal node count:

    python scripts/compare_defaults.py --configs "feature + lookup" --drafters "feature:auto,nodes=32" \
        --drafters "lookup:depth=8,branches=4" --drafters "corpus:auto,depth=8,branches=4"
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import _bench_common as common  # noqa: E402

MEMBERS = ("lookup", "corpus", "feature", "feature + lookup", "feature + corpus")  # the drafter sets compared


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_task_kind_args(ap)
    ap.add_argument("--feature", default="auto", help="the feature drafter (name or directory)")
    ap.add_argument("--corpus", default="auto", help="the corpus drafter's corpus (auto, a shipped name or a path)")
    ap.add_argument("--configs", help="comma-separated configuration names to run (default: all), e.g. "
                    "'incremental,lookup + budget,corpus + budget'")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy; > 0: sampling, prompt i with seed i, under the default (seeded) verifier, whose "
                         "outputs equal seeded incremental sampling's")
    ap.add_argument("--drafters", action="append", default=[], metavar="SPEC[ + SPEC ...]",
                    help="an extra configuration (repeatable): --drafter specs joined by ' + ', every step's "
                         "whole tree, e.g. 'feature:auto,nodes=32' or 'lookup:depth=8,branches=4'; ending in "
                         "' + budget' it runs under the tree budget, e.g. 'feature:DIR + lookup:auto + budget' "
                         "(a candidate drafter beside the default)")
    args = ap.parse_args()
    # Each drafter set runs under the budget ("... + budget") or with its whole tree every step.
    valid = ["incremental"] + [f"{m}{b}" for b in (" + budget", "") for m in MEMBERS]
    names = ["incremental", "lookup + budget", "corpus + budget", "feature + lookup + budget",
             "feature + corpus + budget"]
    if args.configs:
        unknown = [c for c in args.configs.split(",") if c not in valid]
        if unknown:
            sys.exit(f"--configs: unknown {unknown}; choose from {valid}")
        names = args.configs.split(",")
    elif args.drafters:
        names = []
    from specjax.speculation.drafters import FACTORIES

    extra = {}  # --drafters: ([(kind, arg), ...], budgeted) per configuration, checked before the model loads
    for spec in args.drafters:
        parts = [part.strip() for part in spec.split(" + ")]
        budgeted = parts[-1] == "budget"
        extra[spec] = ([part.partition(":")[::2] for part in (parts[:-1] if budgeted else parts)], budgeted)
        if not extra[spec][0]:
            sys.exit(f"--drafters {spec!r}: no drafter before ' + budget'")
        unknown = [kind for kind, _ in extra[spec][0] if kind not in FACTORIES]
        if unknown:
            sys.exit(f"--drafters {spec!r}: unknown drafter {unknown}; each is KIND:ARG, KIND one of "
                     f"{sorted(FACTORIES)}")

    import jax

    import specjax
    from specjax.speculation.drafters import corpus as corpus_drafter
    from specjax.speculation.drafters.feature import from_arg
    from specjax.speculation.drafters.lookup import LookupDrafter

    mode = "greedy" if args.temperature == 0 else f"temperature {args.temperature:g}, seeded"
    common.print_header(f"default drafters, side by side (batch 1, {mode})")
    chosen, kinds = common.one_per_kind(args.prompts_file, args.which)
    llm = specjax.load_model("smollm2-135m-instruct", progress=False)
    prompts = specjax.api.encode_prompts(llm, [r["prompt"] for r in chosen])
    def used(drafter: str) -> bool:  # load only the drafters the chosen configurations use
        return any(drafter in name for name in names)

    feature = from_arg(args.feature, llm, load=True, expansion=None, draft="topk") if used("feature") else None
    corpus = corpus_drafter.from_arg(args.corpus, llm, load=True, expansion=None, draft="topk") \
        if used("corpus") else None
    lookup = specjax.Bound(LookupDrafter())
    single = {"lookup": lookup, "corpus": corpus, "feature": feature}
    every = {"incremental": {"mode": "incremental"}}
    for m in MEMBERS:
        drafters = [single[d] for d in m.split(" + ")]
        every.update({m: {"drafters": drafters}, f"{m} + budget": {"drafters": drafters, "budget": "auto"}})
    configs = {name: every[name] for name in names}
    for spec, (parts, budgeted) in extra.items():
        configs[spec] = {"drafters": [FACTORIES[kind](arg or "auto", llm, load=True, expansion=None, draft="topk")
                                      for kind, arg in parts], **({"budget": "auto"} if budgeted else {})}
    print(f"# {len(prompts)} prompts ({', '.join(kinds)}), {args.max_new_tokens} new tokens")
    reference, mismatches = {}, 0
    for rep in range(args.repetitions):
        for name in (list(configs) if rep % 2 == 0 else list(configs)[::-1]):
            kw = configs[name]
            specjax.generate(llm, [prompts[0]], max_new_tokens=8, sampling=specjax.SamplingParams(args.temperature),
                             **kw)  # compile, measure cost tables
            tokens = seconds = prefill = passes = 0
            nodes, by_kind_tpp = set(), []
            for i, ids in enumerate(prompts):
                sampling = specjax.SamplingParams(temperature=args.temperature, seed=i)
                res = specjax.generate(llm, [ids], max_new_tokens=args.max_new_tokens, on_tokens=lambda i, t: None,
                                       sampling=sampling, **kw)
                out = res.token_ids[0]
                mismatches += reference.setdefault(i, out) != out
                tokens += len(out)
                seconds += res.stats["seconds"]
                prefill += res.stats["prefill_seconds"]
                passes += res.stats["llm_passes"]
                nodes.add(res.stats.get("tree_nodes", 1))
                by_kind_tpp.append(f"{chosen[i].get('category', '?')} {len(out) / max(res.stats['llm_passes'], 1):.2f}")
            # the prefill emits each request's first token: the decode rate counts the rest
            print(f"rep {rep}  {name:<26} tokens/pass {tokens / max(passes, 1):.2f}  end to end "
                  f"{tokens / seconds:6.2f} tok/s  decoding {(tokens - len(prompts)) / (seconds - prefill):6.2f} tok/s"
                  f"  prefill {prefill / len(prompts):.3f} s/prompt  tree nodes {sorted(nodes)}", flush=True)
            print(f"      tokens/pass by kind: {', '.join(by_kind_tpp)}", flush=True)
            jax.clear_caches()
    print(f"# outputs different from the first configuration's: {mismatches}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
