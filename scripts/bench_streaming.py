"""Streamed (``on_tokens``) against one-program generation: ms per LLM pass and tok/s for the default
drafters under the tree budget, or incremental decoding, over one prompt per task kind, alternating
the order each repetition; with the passes the budget ran at each level (batch 1, chat template).

    python scripts/bench_streaming.py --temperature 1 --repetitions 2
    python scripts/bench_streaming.py --mode incremental

Streaming calls the same loop in chunks of up to 8 passes (``specjax.decoding.host_step``); what is
left between the two columns is a call's fresh temporaries per chunk and the host's work (fetching
the reports, ``on_tokens``) sharing the cores with XLA.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import _bench_common as common  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_task_kind_args(ap)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: seeded sampling, prompt i seed i")
    ap.add_argument("--mode", choices=("default", "incremental"), default="default")
    args = ap.parse_args()

    import specjax
    from specjax.speculation.drafters.feature import from_arg
    from specjax.speculation.drafters.lookup import LookupDrafter

    common.print_header(f"streamed vs one program ({args.mode}, temperature {args.temperature:g}, batch 1)")
    chosen, kinds = common.one_per_kind(args.prompts_file, args.which)
    llm = specjax.load_model("smollm2-135m-instruct", progress=False)
    prompts = specjax.api.encode_prompts(llm, [r["prompt"] for r in chosen])
    if args.mode == "incremental":
        kw = {"mode": "incremental"}
    else:
        kw = {"drafters": [from_arg("auto", llm, load=True, expansion=None, draft="topk"),
                           specjax.Bound(LookupDrafter())], "budget": "auto"}
    print(f"# {len(prompts)} prompts ({', '.join(kinds)}), {args.max_new_tokens} new tokens")
    for rep in range(args.repetitions):
        for stream in ((True, False) if rep % 2 == 0 else (False, True)):
            on_tokens = (lambda i, ids: None) if stream else None
            specjax.generate(llm, [prompts[0]], max_new_tokens=8, sampling=specjax.SamplingParams(args.temperature),
                             on_tokens=on_tokens, **kw)  # compile, measure cost tables
            tokens = passes = 0
            seconds = 0.0
            levels = None
            for i, ids in enumerate(prompts):
                res = specjax.generate(llm, [ids], max_new_tokens=args.max_new_tokens, on_tokens=on_tokens,
                                       sampling=specjax.SamplingParams(temperature=args.temperature, seed=i), **kw)
                tokens += len(res.token_ids[0])
                seconds += res.stats["seconds"]
                passes += res.stats["llm_passes"]
                if "budget" in res.stats:
                    at = res.stats["budget"]["passes_at_level"]
                    levels = at if levels is None else [a + b for a, b in zip(levels, at)]
            name = "streamed" if stream else "one program"
            print(f"rep {rep}  {name:<12} {1000 * seconds / passes:6.2f} ms/pass  {tokens / seconds:6.2f} tok/s  "
                  f"tokens/pass {tokens / passes:.2f}", flush=True)
            if levels is not None:
                nodes = res.stats["budget"]["tree_nodes"]
                print("      passes at level (nodes: passes): "
                      + ", ".join(f"{n}: {p}" for n, p in zip(nodes, levels) if p), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
