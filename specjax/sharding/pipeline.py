"""Pipeline parallelism: contiguous layer stages over the mesh axis "pp" with shard_map + ppermute.

Stage s holds layers ``[s * L/P, (s + 1) * L/P)`` and their KV cache (stage-local: the cache's
layer axis is split like the weights). The batch is cut into M request groups (microbatches,
strided: request b is in group b % M, which keeps each group's rows spread over dp). At tick t,
stage s runs group t - s through its layers and ppermutes the activations to stage s + 1; after
M + P - 1 ticks the last stage holds every group's output, and one psum over "pp" hands it to all
stages (the other stages contribute exact zeros). Ticks outside [0, M) for a stage are the pipeline
bubble: they compute on a clamped group, their output is ignored and their cache writes are harmless
(see ``tick``).

"pp" and "dp" are manual inside the shard_map (each dp replica pipelines its own requests); "tp"
stays automatic, so tensor parallelism inside a stage is the same GSPMD partitioning as without a
pipeline. ``sequential_layers`` (one scan over
all layers) is the reference the pipeline is tested against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from specjax.cache import KVCache

AXIS = "pp"


def sequential_layers(layer_fn, h, layer_params, k_all, v_all, per_request):
    """Run ``layer_fn(h, lp, k_all, v_all, i, per_request) -> (h, k_all, v_all)`` over the stacked layers.

    The whole cache rides in the carry and each layer scatters only its new block into it, so a
    forward pass never copies the cache (a scanned-out cache would be rebuilt on every call).
    """

    def body(carry, xs):
        h, k_all, v_all = carry
        lp, i = xs
        return layer_fn(h, lp, k_all, v_all, i, per_request), None

    (h, k_all, v_all), _ = jax.lax.scan(body, (h, k_all, v_all), (layer_params, jnp.arange(k_all.shape[0])))
    return h, k_all, v_all


def _split(x, axis: int, groups: int):
    """[..., B, ...] -> [..., B / groups, groups, ...]: request b goes to group b % groups."""
    return x.reshape(x.shape[:axis] + (x.shape[axis] // groups, groups) + x.shape[axis + 1:])


def _merge(x, axis: int):
    return x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2:])


def pipeline_layers(layer_fn, h, layer_params, cache: KVCache, per_request, parallel):
    """The pipelined twin of ``sequential_layers`` over ``parallel.mesh``'s "pp" axis.

    h: [B, T, D] (replicated over pp, requests over dp); layer_params: stacked [L, ...] split over pp; cache k/v:
    [L, B, S, KVH, Dh] split over pp; per_request: pytree of [B, ...] arrays (positions, attention
    metadata). Returns (h [B, T, D], cache) like ``sequential_layers``.
    """
    stages = parallel.pp
    batch_axis = parallel.request_axis
    groups = parallel.num_microbatches(h.shape[0] // parallel.replicas)

    def stage_fn(h, layer_params, k_all, v_all, per_request):
        stage = jax.lax.axis_index(AXIS)
        hm, km, vm = _split(h, 0, groups), _split(k_all, 1, groups), _split(v_all, 1, groups)
        reqm = jax.tree.map(lambda x: _split(x, 0, groups), per_request)

        def tick(t, carry):
            received, km, vm, out = carry
            group = t - stage
            valid = (group >= 0) & (group < groups)
            g = jnp.clip(group, 0, groups - 1)
            take = lambda x, axis: jax.lax.dynamic_index_in_dim(x, g, axis, keepdims=False)  # noqa: E731
            x = jnp.where(stage == 0, take(hm, 1), received)
            k_g, v_g = take(km, 2), take(vm, 2)
            y, k_new, v_new = sequential_layers(layer_fn, x, layer_params, k_g, v_g,
                                                jax.tree.map(lambda a: take(a, 1), reqm))
            # Bubble ticks may write back unmasked: before a stage's first group arrives it writes
            # garbage to group 0's scratch slots, which group 0 overwrites (same slots) before any
            # read; after its last group it recomputes group M - 1 from identical inputs, writing
            # identical values. Masking would cost a copy of the group's cache slice per tick.
            km = jax.lax.dynamic_update_index_in_dim(km, k_new, g, 2)
            vm = jax.lax.dynamic_update_index_in_dim(vm, v_new, g, 2)
            last = valid & (stage == stages - 1)
            out = jax.lax.dynamic_update_index_in_dim(out, jnp.where(last, y, take(out, 1)), g, 1)
            received = jax.lax.ppermute(y, AXIS, [(s, s + 1) for s in range(stages - 1)])
            return received, km, vm, out

        carry = (jnp.zeros_like(hm[:, 0]), km, vm, jnp.zeros_like(hm))
        _, km, vm, out = jax.lax.fori_loop(0, groups + stages - 1, tick, carry)
        # Only the last stage wrote ``out``; the others add exact zeros, so this is a broadcast.
        out = jax.lax.psum(out, AXIS)
        return _merge(out, 0), _merge(km, 1), _merge(vm, 1)

    # "pp" and the request axis are manual (each dp replica pipelines its own requests); "tp" is automatic.
    rows, cache_spec = P(batch_axis), P(AXIS, batch_axis)
    run = jax.shard_map(stage_fn, mesh=parallel.mesh,
                        in_specs=(rows, P(AXIS), cache_spec, cache_spec, rows),
                        out_specs=(rows, cache_spec, cache_spec),
                        axis_names={AXIS} | ({batch_axis} if batch_axis else set()), check_vma=False)
    h, k_all, v_all = run(h, layer_params, cache.k, cache.v, per_request)
    return h, k_all, v_all


def run_layers(layer_fn, h, layer_params, cache: KVCache, per_request, parallel=None):
    """Sequential scan, or the pipeline when ``parallel`` has pp > 1 (schedule "pipeline"). Returns (h, cache)."""
    if parallel is not None and parallel.pipelined:
        h, k_all, v_all = pipeline_layers(layer_fn, h, layer_params, cache, per_request, parallel)
    else:
        h, k_all, v_all = sequential_layers(layer_fn, h, layer_params, cache.k, cache.v, per_request)
    return h, cache.replace(k=k_all, v=v_all)
