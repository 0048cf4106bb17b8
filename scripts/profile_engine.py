"""Profile: where one prefill pass and one decode step of the LLM spend their time.

For each context length, the model's real pieces are jitted one by one on the real weights and the
shapes of that pass (layer 0's weights, the full-size cache buffer), timed warm, and multiplied by
the number of layers; the whole forward is timed the same way, and the remainder (norms, residuals,
the layer loop, dispatch) is what the pieces do not explain. The last column is the weight matmuls'
achieved GFLOP/s (2 x tokens x layer weights, plus the LM head on one row, over the whole pass), computed
from the shapes: XLA's HLO cost analysis counts a scanned layer body once, not once per layer.

    python scripts/profile_engine.py --contexts 64,512,2048

A prefill row is one pass over ``min(context, PREFILL_CHUNKS[0])`` new tokens (prompts are read in
PREFILL_CHUNKS[0]-token chunks: the row shows the last chunk, attending to ``context - chunk`` committed
tokens); a decode row is one token at ``context`` tokens of committed context.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import _bench_common as common  # noqa: E402


def _best(fn, repeats: int) -> float:
    """Best of ``repeats`` warm runs, seconds (the first call compiles)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--contexts", type=common.int_list(), default=[64, 512, 2048], help="comma-separated")
    ap.add_argument("--cache-len", type=common.positive_int, default=4096,
                    help="cache buffer slots (unused ones must cost nothing)")
    ap.add_argument("--repeats", type=common.positive_int, default=5)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    import specjax
    from specjax.attention.meta import causal_meta
    from specjax.attention.xla import attend
    from specjax.decoding.incremental import PREFILL_CHUNKS
    from specjax.decoding.programs import prefill_kernel_enabled
    from specjax.kernels.cpu import prefill_attention
    from specjax.models import forward
    from specjax.models.cache import init_cache
    from specjax.models.common import apply_rope, rms_norm, rope_inv_freq, write_block
    from specjax.models.params import take_layers

    common.print_header("profile_engine")
    # the prefill kernel needs AVX-512F beyond what the step kernels need: decide as prefill() does
    kernels = prefill_kernel_enabled()
    print(f"# prefill attention: {'specjax CPU prefill kernel' if kernels else 'XLA'}; decode attention: XLA "
          f"(the step programs' own kernels are profiled by `specjax tree-cost`)")
    model = specjax.load_model(args.model, dtype="float32", progress=False)
    cfg, params = model.config, model.params
    lp = jax.tree.map(lambda a: a[0], take_layers(params, [0]))
    inv_freq = rope_inv_freq(cfg)
    rng = np.random.default_rng(0)

    def qkv(lp, x, positions):
        x = rms_norm(x, lp["attn_norm"], cfg.norm_eps)
        q = apply_rope(jnp.einsum("btd,dhk->bthk", x, lp["wq"]), positions, inv_freq)
        k = apply_rope(jnp.einsum("btd,dhk->bthk", x, lp["wk"]), positions, inv_freq)
        return q, k, jnp.einsum("btd,dhk->bthk", x, lp["wv"])

    def mlp(lp, x):
        x = rms_norm(x, lp["mlp_norm"], cfg.norm_eps)
        gate = jnp.einsum("btd,df->btf", x, lp["w_gate"])
        up = jnp.einsum("btd,df->btf", x, lp["w_up"])
        return jnp.einsum("btf,fd->btd", jax.nn.silu(gate) * up, lp["w_down"])

    def head(params, x):
        x = rms_norm(x[:, -1:], params["final_norm"], cfg.norm_eps)
        return jnp.einsum("btd,vd->btv", x, params["embed"])

    def donated(fn, state, *args):
        """Time ``state = fn(state, *args)`` with the state donated, as the engine runs it (no copy)."""
        fn = jax.jit(fn, donate_argnums=0)
        holder = [state]

        def run():
            holder[0] = fn(holder[0], *args)
            jax.block_until_ready(holder[0])
        return run

    layers = cfg.num_layers
    matmuls = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
    layer_weights = layers * sum(int(np.prod(lp[w].shape)) for w in matmuls)
    print(f"{'pass':>8} {'context':>7} {'tokens':>6} | {'total ms':>8} | {'qkv+rope':>8} {'kv write':>8} "
          f"{'attend':>8} {'o-proj':>8} {'mlp':>8} {'lm head':>8} {'rest':>8} | {'GFLOP/s':>7}")
    for context in args.contexts:
        for kind in ("prefill", "decode"):
            if kind == "prefill":
                num_new = min(context, PREFILL_CHUNKS[0])
                committed = context - num_new
            else:
                num_new, committed = 1, context
            cache = init_cache(cfg, 1, args.cache_len)
            lengths = jnp.asarray([committed], jnp.int32)
            meta = causal_meta(lengths, cpu_prefill=kind == "prefill" and kernels)  # as prefill() marks it
            positions = committed + jnp.arange(num_new, dtype=jnp.int32)[None]
            tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, num_new)), jnp.int32)
            x = params["embed"][tokens]
            q, k, v = jax.jit(qkv)(lp, x, positions)
            attn = jnp.zeros(q.shape, q.dtype)
            if kind == "prefill" and kernels:  # the route prefill takes: the CPU prefill kernel
                attention = jax.jit(lambda q, k, v, kc, vc, i: prefill_attention.attend(
                    q, kc, vc, i, lengths, k, v, cfg.head_dim ** -0.5))
            else:
                attention = jax.jit(lambda q, k, v, kc, vc, i: attend(q, k, v, kc, vc, meta, cfg.head_dim ** -0.5,
                                                                      layer=i))
            parts = {
                "qkv+rope": (jax.jit(qkv), (lp, x, positions)),
                "attend": (attention, (q, k, v, cache.k, cache.v, jnp.int32(0))),
                "o-proj": (jax.jit(lambda lp, a: jnp.einsum("bthk,hkd->btd", a, lp["wo"])), (lp, attn)),
                "mlp": (jax.jit(mlp), (lp, x)),
            }
            ms = {name: 1e3 * layers * _best(lambda f=f, a=a: jax.block_until_ready(f(*a)), args.repeats)
                  for name, (f, a) in parts.items()}
            write = donated(lambda c, k: write_block(c, 0, k, lengths), jnp.zeros_like(cache.k[:1]), k)
            ms["kv write"] = 2e3 * layers * _best(write, args.repeats)  # K and V, one layer each
            ms["lm head"] = 1e3 * _best(lambda: jax.block_until_ready(jax.jit(head)(params, x)), args.repeats)

            def whole(cache, params, tokens, positions):
                return forward(params, tokens, positions, cache, meta, cfg,
                               logits_indices=jnp.asarray([[num_new - 1]])).cache
            total = 1e3 * _best(donated(whole, cache, params, tokens, positions), args.repeats)
            flops = 2 * (num_new * layer_weights + cfg.vocab_size * cfg.hidden_size)
            rest = total - sum(ms.values())
            print(f"{kind:>8} {context:>7} {num_new:>6} | {total:8.1f} | " +
                  " ".join(f"{ms[n]:8.1f}" for n in ("qkv+rope", "kv write", "attend", "o-proj", "mlp", "lm head"))
                  + f" {rest:8.1f} | {flops / total / 1e6:7.1f}")


if __name__ == "__main__":
    main()
