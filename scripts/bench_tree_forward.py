"""Benchmark: wall time of one LLM forward over a token tree of N nodes at a fixed prefix.

The ratio time(N) / time(1) is the "price of the tree" that speculation trades against acceptance.
XLA path and Pallas kernel (interpret mode on CPU, compiled Triton on GPU), side by side.

    python scripts/bench_tree_forward.py --prefix 256 --sizes 1,2,4,8,16,32,64 --out bench_out/tree_forward.png
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import _bench_common as common  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prefix", type=common.positive_int, default=256)
    ap.add_argument("--sizes", type=common.int_list(), default=[1, 2, 4, 8, 16, 32, 64], help="comma-separated")
    ap.add_argument("--impls", default="xla,pallas", help="comma-separated tree attention impls")
    ap.add_argument("--repeats", type=common.positive_int, default=5)
    ap.add_argument("--out", default="bench_out/tree_forward.png")
    args = ap.parse_args()
    common.require_plotting()
    from specjax.attention.tree import IMPLS

    impls = args.impls.split(",")
    unknown = [impl for impl in impls if impl not in IMPLS]
    if unknown:
        ap.error(f"--impls: unknown {unknown}; choose from {', '.join(IMPLS)}")

    import jax
    import jax.numpy as jnp
    import numpy as np

    import specjax
    from specjax.models.cache import init_cache
    from specjax.speculation.commit import tree_forward
    from specjax.speculation.tree import from_parents

    common.print_header("one tree forward of the LLM, wall time vs tree size")
    model = specjax.load_model(args.model, progress=False)
    cfg = model.config
    sizes = args.sizes
    rng = np.random.RandomState(0)
    max_len = args.prefix + max(sizes)
    cache = init_cache(cfg, 1, max_len)
    cache = cache.replace(k=jnp.asarray(rng.randn(*cache.k.shape).astype(np.float32) * 0.1),
                          v=jnp.asarray(rng.randn(*cache.v.shape).astype(np.float32) * 0.1),
                          length=jnp.asarray([args.prefix], jnp.int32))
    fwd = jax.jit(tree_forward, static_argnames=("cfg", "impl"))
    times: dict[str, list[float]] = {impl: [] for impl in impls}
    print(f"# prefix {args.prefix}, batch 1, float32, median of {args.repeats} runs after one warm-up")
    print(f"{'N':>4} " + " ".join(f"{impl + ' ms':>12} {impl + ' x1':>9}" for impl in impls))
    for n in sizes:
        # A bushy tree: node i hangs under node (i - 1) // 2 (depth ~log2 N), tokens random.
        parents = [-1] + [(i - 1) // 2 for i in range(1, n)]
        tree = from_parents([rng.randint(0, cfg.vocab_size, n).tolist()], [parents], n_max=n)
        row = []
        for impl in impls:
            jax.block_until_ready(fwd(model.params, tree, cache, cfg=cfg, impl=impl))
            samples = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                jax.block_until_ready(fwd(model.params, tree, cache, cfg=cfg, impl=impl))
                samples.append(time.perf_counter() - t0)
            times[impl].append(float(np.median(samples)))
            row.append(f"{times[impl][-1] * 1e3:>12.1f} {times[impl][-1] / times[impl][0]:>9.2f}")
        print(f"{n:>4} " + " ".join(row), flush=True)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for impl in impls:
        ax1.plot(sizes, [t * 1e3 for t in times[impl]], marker="o", label=impl)
        ax2.plot(sizes, [t / times[impl][0] for t in times[impl]], marker="o", label=impl)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tree size N (nodes)")
        ax.grid(alpha=0.3)
        ax.legend()
    ax1.set_ylabel("ms per tree forward")
    ax2.set_ylabel("time(N) / time(1)  (price of the tree)")
    fig.suptitle(f"{args.model}: one tree forward, prefix {args.prefix}, float32, {common.machine().split(';')[0]}",
                 fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"# plot: {args.out}")


if __name__ == "__main__":
    main()
