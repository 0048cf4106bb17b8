"""Per-token cost of candidate SSM shapes relative to the LLM on this machine (batch 1, float32).

Random weights (cost does not depend on them): each candidate is a small LLaMA sharing the LLM's
vocabulary, timed by incremental decoding of N tokens after a short prompt, warm, interleaved with
the LLM; prints ms per token and the ratio to the LLM. "vocab" = the rows of the LM head the SSM
scores (a shortlist of the most frequent tokens shrinks the 49k-row head that dominates a tiny model).

    python scripts/bench_ssm_cost.py --max-new-tokens 64 --repeats 3
    python scripts/bench_ssm_cost.py --ssm smollm2-ssm-a --no-candidates   # a trained SSM (real weights)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import _bench_common as common  # noqa: E402

# name: (layers, width, heads, kv heads, MLP hidden, vocab rows); None vocab = the LLM's
CANDIDATES = {
    "L1-D256": (1, 256, 4, 2, 768, None),
    "L2-D256": (2, 256, 4, 2, 768, None),
    "L4-D256": (4, 256, 4, 2, 768, None),
    "L2-D384": (2, 384, 6, 2, 1024, None),
    "L2-D256-v16k": (2, 256, 4, 2, 768, 16384),
    "L4-D384-v16k": (4, 384, 6, 2, 1024, 16384),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ssm", action="append", default=[], help="also time this SSM (registered name or path)")
    ap.add_argument("--no-candidates", action="store_true", help="skip the random-weight candidate shapes")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    import specjax
    from specjax.decoding.incremental import generate_incremental_jit
    from specjax.models import init_params
    from specjax.speculation.loop import greedy_sampling

    common.print_header("SSM candidates: per-token cost vs the LLM (batch 1, float32, greedy decode)")
    llm = specjax.load_model(args.model, progress=False)
    models = {"LLM": (llm.config, llm.params)}
    for name in args.ssm:
        ssm = specjax.load_model(name, progress=False)
        models[name] = (ssm.config, ssm.params)
    for name, (layers, width, heads, kv, mlp, vocab) in ({} if args.no_candidates else CANDIDATES).items():
        cfg = dataclasses.replace(llm.config, num_layers=layers, hidden_size=width, num_heads=heads,
                                  num_kv_heads=kv, head_dim=width // heads, intermediate_size=mlp,
                                  vocab_size=vocab or llm.config.vocab_size, tie_word_embeddings=True)
        models[name] = (cfg, init_params(cfg, jax.random.key(0)))
    prompt = jnp.asarray(np.arange(1, 17, dtype=np.int32)[None, :])
    n = args.max_new_tokens

    def run(cfg, params):
        t0 = time.perf_counter()
        out = generate_incremental_jit(params, prompt, jnp.asarray([16]), jnp.asarray([n]), greedy_sampling(1),
                                       cfg=cfg, cache_len=16 + n, max_out=n)
        jax.block_until_ready(out.tokens)
        return time.perf_counter() - t0

    for cfg, params in models.values():
        run(cfg, params)  # compile
    times = {name: [] for name in models}
    for _ in range(args.repeats):
        for name, (cfg, params) in models.items():
            times[name].append(run(cfg, params))
    llm_ms = 1e3 * min(times["LLM"]) / n
    print(f"{'model':>14} {'params (M)':>10} {'ms/token':>9} {'x LLM':>7}")
    for name, (cfg, params) in models.items():
        ms = 1e3 * min(times[name]) / n
        size = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params)) / 1e6
        print(f"{name:>14} {size:10.2f} {ms:9.2f} {ms / llm_ms:7.3f}")


if __name__ == "__main__":
    main()
