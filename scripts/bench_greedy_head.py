"""Benchmark: the greedy head kernel (``specjax.kernels.cpu.greedy_head``) against what greedy
verification computed before it, on the LLM's real head and real final hidden states.

The rows are the LLM's final hidden states (final norm applied) at every prompt position of the
first ``--num-prompts`` prompts: what the head reads in a tree pass. Printed: how many columns the
kernel recomputes exactly per row (those whose bound reaches the top), and the warm time of
(a) the float32 matmul kernel's logits, then ``first_argmax`` and ``finite_rows`` (the tree pass
and greedy verification before stop 59) and (b) the greedy head, at several row counts (tree
nodes), the two alternating. Their decisions must be identical. Then the same for seeded verification
at temperature 1: (c) the float32 logits, ``seeded_tokens`` and ``finite_rows`` against (d) the kernel's
sampled decision (``sampled_decision``), each row reading one of 5 rows of Gumbel noise (a tree of
depth 4).

    python scripts/bench_greedy_head.py
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
    ap.add_argument("--prompts-file", type=common.existing_file, default=common.DEFAULT_PROMPTS)
    ap.add_argument("--num-prompts", type=common.positive_int, default=12)
    ap.add_argument("--rows", type=common.int_list(), default=[1, 4, 8, 17],
                    help="rows (tree nodes) per call, comma-separated")
    ap.add_argument("--calls", type=common.positive_int, default=300,
                    help="timed calls per measurement (after 30 warm ones)")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    import specjax
    from specjax.decoding.incremental import prefill
    from specjax.decoding.programs import step_params
    from specjax.decoding.sampling import SamplingArrays, SamplingParams, finite_rows, first_argmax, seeded_tokens
    from specjax.kernels import cpu as cpu_kernels
    from specjax.kernels.cpu import greedy_head
    from specjax.kernels.cpu import matmul as cpu_matmul
    from specjax.models.cache import init_cache
    from specjax.models.common import rms_norm
    from specjax.models.params import GREEDY_HEAD, TIED_HEAD

    common.print_header("greedy head kernel vs float32 logits + argmax + finiteness")
    if cpu_kernels.matmul_status() is not None:
        sys.exit(f"the CPU kernels are not available here: {cpu_kernels.matmul_status()}")
    prompts = [r["prompt"] for r in common.load_prompts(args.prompts_file, args.num_prompts)]  # before the model
    model = specjax.load_model(args.model, progress=False)
    cfg = model.config
    params = step_params(model.params, decides=True)
    if GREEDY_HEAD not in params:
        sys.exit("the step params carry no greedy head here (a float32 model on one CPU device with the kernels on)")
    rows = []
    for ids in specjax.api.encode_prompts(model, prompts):
        n = len(ids)
        _, _, hidden = prefill(model.params, jnp.asarray([ids], jnp.int32), jnp.asarray([n]),
                               init_cache(cfg, 1, n + 64), cfg, hidden=(cfg.num_layers,))
        rows.append(np.asarray(rms_norm(hidden[0, :n, 0], model.params["final_norm"], cfg.norm_eps)))
    x = np.concatenate(rows)
    head = params[GREEDY_HEAD]
    f32 = params["lm_head" if "lm_head" in params else TIED_HEAD].packed
    vocab = head.rows.shape[0]

    approx = np.asarray(cpu_matmul.matmul(jnp.asarray(x), head.packed, vocab), np.float64)
    bound = np.linalg.norm(x.astype(np.float64), axis=1)[:, None] * np.asarray(head.err, np.float64)[None]
    rechecked = ((approx + bound) >= (approx - bound).max(axis=1, keepdims=True)).sum(axis=1)
    print(f"{len(x)} rows ({len(prompts)} prompts' positions): |x| median "
          f"{np.median(np.linalg.norm(x, axis=1)):.1f}, bound |x| err_j median {np.median(bound):.4f}; "
          f"columns recomputed per row: mean {rechecked.mean():.2f}, p99 {np.percentile(rechecked, 99):.0f}, "
          f"max {rechecked.max()}")

    before = jax.jit(lambda x, w: (lambda lg: (first_argmax(lg), finite_rows(lg)))(cpu_matmul.matmul(x, w, vocab)))
    after = jax.jit(greedy_head.greedy_decision)

    def timed(fn, *a):
        for _ in range(30):
            jax.block_until_ready(fn(*a))
        t0 = time.perf_counter()
        for _ in range(args.calls):
            out = fn(*a)
        jax.block_until_ready(out)
        return (time.perf_counter() - t0) / args.calls * 1e3

    print("rows  float32 logits + first_argmax + finite_rows (ms)  greedy head (ms)  ratio")
    for m in args.rows:
        xs = jnp.asarray(x[:m])
        want, got = before(xs, f32), after(xs, head)
        if not all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(want, got)):
            sys.exit(f"decisions differ at {m} rows")
        a, b = [], []
        for _ in range(3):  # alternating, so a drifting machine slows both alike
            a.append(timed(before, xs, f32))
            b.append(timed(after, xs, head))
        print(f"{m:4d}  {np.median(a):48.2f}  {np.median(b):16.2f}  {np.median(b) / np.median(a):5.2f}")

    noise = jax.random.gumbel(jax.random.key(0), (5, vocab), jnp.float32)

    def seeded_before(x, w, noise, row):
        logits = cpu_matmul.matmul(x, w, vocab)
        sampling = SamplingArrays.from_params([SamplingParams(temperature=1.0)] * x.shape[0])
        return seeded_tokens(logits, sampling, noise[row]), finite_rows(logits)

    seeded_before = jax.jit(seeded_before)
    seeded_after = jax.jit(lambda x, h, noise, row: greedy_head.sampled_decision(
        x, h, jnp.ones((x.shape[0],), jnp.float32), noise, row))
    print("rows  seeded, temperature 1: float32 logits + seeded_tokens + finite_rows (ms)  sampled head (ms)  ratio")
    for m in args.rows:
        xs, row = jnp.asarray(x[:m]), jnp.arange(m, dtype=jnp.int32) % 5
        want, got = seeded_before(xs, f32, noise, row), seeded_after(xs, head, noise, row)
        if not all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(want, got)):
            sys.exit(f"seeded decisions differ at {m} rows")
        a, b = [], []
        for _ in range(3):
            a.append(timed(seeded_before, xs, f32, noise, row))
            b.append(timed(seeded_after, xs, head, noise, row))
        print(f"{m:4d}  {np.median(a):71.2f}  {np.median(b):17.2f}  {np.median(b) / np.median(a):5.2f}")


if __name__ == "__main__":
    main()
