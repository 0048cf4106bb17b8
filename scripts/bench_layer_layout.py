"""Benchmark: stacked vs split layer weights, side by side in one process (both scanned; the split
layout's matmuls switch between per-layer buffers, see ``specjax.models.weights``).

The same weights in both layouts (``specjax.models.params.split_layers``); every measurement
alternates the two layouts round by round so a noisy machine slows both alike. Reported per layout:
compile seconds and warm milliseconds of one LLM tree pass (block-only, as the speculative loop runs
it) at 1/5/17 nodes and batch 1 and 4 over a 256-token prefix; end-to-end tokens/s of greedy
incremental decoding and of lookup speculation (lookup + tree budget) on prompts of several
task kinds. Generated tokens of the two layouts must be identical; the tree-pass logits' largest
difference is printed (XLA may fuse the two programs differently: last-bit float32 differences).

    python scripts/bench_layer_layout.py --rounds 5
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import _bench_common as common  # noqa: E402

TASKS = os.path.join(os.path.dirname(__file__), "data", "task_kinds.jsonl")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rounds", type=common.positive_int, default=5, help="alternating rounds per measurement")
    ap.add_argument("--nodes", type=common.int_list(), default=[1, 5, 17], help="comma-separated")
    ap.add_argument("--batch-sizes", type=common.int_list(), default=[1, 4], help="comma-separated")
    ap.add_argument("--prompts-file", type=common.existing_file, default=TASKS)
    ap.add_argument("--num-prompts", type=common.positive_int, default=4)
    ap.add_argument("--max-new-tokens", type=common.positive_int, default=64)
    args = ap.parse_args()
    # read before the model loads and the tree passes run: a bad file fails in seconds, not minutes
    prompts = [r["prompt"] for r in common.load_prompts(args.prompts_file, args.num_prompts,
                                                         stride=max(1, 16 // args.num_prompts))]

    import jax
    import jax.numpy as jnp
    import numpy as np

    import specjax
    from specjax.models.cache import init_cache
    from specjax.models.params import split_layers
    from specjax.speculation.commit import tree_forward
    from specjax.speculation.tree import from_parents

    common.print_header("stacked vs split layer weights, float32")
    stacked = specjax.load_model(args.model, progress=False, split_layers=False)
    cfg = stacked.config
    models = {"stacked": stacked, "split": stacked._replace(params=split_layers(stacked.params))}

    def timed(fn, rounds):
        """{layout: median seconds}, the layouts alternating within each round."""
        samples = {name: [] for name in models}
        for _ in range(rounds):
            for name in models:
                t0 = time.perf_counter()
                fn(name)
                samples[name].append(time.perf_counter() - t0)
        return {name: float(np.median(s)) for name, s in samples.items()}

    print(f"\n# one tree pass (block-only), {args.rounds} alternating rounds, median ms; compile s")
    print(f"{'batch':>5} {'nodes':>5} {'stacked ms':>11} {'split ms':>9} {'split/stacked':>13} "
          f"{'compile stacked':>16} {'compile split':>14} {'max logit diff':>15}")
    prefix = 256
    for b in args.batch_sizes:
        for n in args.nodes:
            cache = init_cache(cfg, b, prefix + n)
            cache = cache.replace(k=jnp.full_like(cache.k, 0.01), v=jnp.full_like(cache.v, 0.01),
                                  length=jnp.full((b,), prefix, jnp.int32))
            tree = from_parents([[1 + i for i in range(n)]] * b, [[-1] + list(range(n - 1))] * b, n_max=n)
            compiled, compile_s = {}, {}
            for name, m in models.items():
                fn = jax.jit(lambda p, t, c: tree_forward(p, t, c, cfg, "xla", block_only=True).logits)
                t0 = time.perf_counter()
                compiled[name] = fn.lower(m.params, tree, cache).compile()
                compile_s[name] = time.perf_counter() - t0
            outs = {name: np.asarray(c(models[name].params, tree, cache)) for name, c in compiled.items()}
            diff = float(np.max(np.abs(outs["stacked"] - outs["split"])))
            t = timed(lambda name: jax.block_until_ready(compiled[name](models[name].params, tree, cache)),
                      args.rounds)
            print(f"{b:>5} {n:>5} {t['stacked'] * 1e3:>11.1f} {t['split'] * 1e3:>9.1f} "
                  f"{t['split'] / t['stacked']:>13.2f} {compile_s['stacked']:>16.1f} {compile_s['split']:>14.1f} "
                  f"{diff:>15.2e}",
                  flush=True)

    lookup = specjax.Bound(specjax.LookupDrafter())
    configs = {"incremental": {"mode": "incremental"},
               "lookup + budget": dict(drafters=[lookup], budget="auto")}
    print(f"\n# end to end, batch 1, greedy, {len(prompts)} prompts x {args.max_new_tokens} new tokens, "
          f"generation seconds without compilation, {args.rounds} alternating rounds (median per prompt)")
    for label, kw in configs.items():
        first, tokens, seconds = {}, {name: 0 for name in models}, {name: 0.0 for name in models}
        for name, m in models.items():
            t0 = time.perf_counter()
            for p in prompts:
                specjax.generate(m, [p], max_new_tokens=args.max_new_tokens, **kw)
            first[name] = time.perf_counter() - t0
        for p in prompts:
            results = {}

            def run(name, p=p):
                results[name] = specjax.generate(models[name], [p], max_new_tokens=args.max_new_tokens,
                                                 on_tokens=lambda i, ids: None, **kw)
                run.seconds.setdefault(name, []).append(results[name].stats["seconds"])

            run.seconds = {}
            timed(run, args.rounds)
            if results["stacked"].token_ids != results["split"].token_ids:
                raise SystemExit(f"{label}: tokens differ between layouts for prompt {p[:60]!r}")
            for name in models:
                tokens[name] += len(results[name].token_ids[0])
                seconds[name] += float(np.median(run.seconds[name]))
        rate = {name: tokens[name] / seconds[name] for name in models}
        print(f"{label:>28}: stacked {rate['stacked']:6.2f} tok/s, split {rate['split']:6.2f} tok/s "
              f"= {rate['split'] / rate['stacked']:.2f}x; first calls (compile + run) stacked "
              f"{first['stacked']:.0f} s, split {first['split']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
