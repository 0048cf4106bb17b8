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

from specjax.models.cache import KVCache
from specjax.models.layers import sequential_layers
from specjax.models.output import select_positions

AXIS = "pp"


def _split(x, axis: int, groups: int):
    """[..., B, ...] -> [..., B / groups, groups, ...]: request b goes to group b % groups."""
    return x.reshape(x.shape[:axis] + (x.shape[axis] // groups, groups) + x.shape[axis + 1:])


def _broadcast_sum(x, cpu: bool):
    """psum over "pp" of a value only one stage holds (the others hold exact zeros): a broadcast. XLA:CPU
    (jax 0.10) aborts the whole process compiling a bfloat16 all-reduce ("Invalid binary instruction opcode
    copy"), so on CPU the sum runs in float32; adding zeros makes it exact either way."""
    if cpu and x.dtype == jnp.bfloat16:
        return jax.lax.psum(x.astype(jnp.float32), AXIS).astype(x.dtype)
    return jax.lax.psum(x, AXIS)


def _merge(x, axis: int):
    return x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2:])


def pipeline_layers(layer_fn, h, layer_params, cache: KVCache, per_request, parallel, capture_layers=(),
                    logits_indices=None):
    """The pipelined twin of ``sequential_layers`` over ``parallel.mesh``'s "pp" axis.

    h: [B, T, D] (replicated over pp, requests over dp); layer_params: stacked [L, ...] split over pp; cache k/v:
    [L, B, S, KVH, Dh] split over pp; per_request: pytree of [B, ...] arrays (positions, attention
    metadata). Returns (h [B, T, D], k, v, captured) like ``sequential_layers``: the stage that owns a
    listed layer captures its input at ``logits_indices`` [B, K] (None = every position); one psum
    over "pp" gathers them (the other stages hold exact zeros there).
    """
    stages = parallel.pp
    batch_axis = parallel.request_axis
    cpu = parallel.mesh.devices.flat[0].platform == "cpu"
    groups = parallel.num_microbatches(h.shape[0] // parallel.replicas)
    batch, width = h.shape[:2]
    positions = logits_indices if logits_indices is not None else jnp.zeros((batch, 1), jnp.int32)
    every = logits_indices is None

    def stage_fn(h, layer_params, k_all, v_all, per_request, positions):
        stage = jax.lax.axis_index(AXIS)
        hm, km, vm = _split(h, 0, groups), _split(k_all, 1, groups), _split(v_all, 1, groups)
        reqm = jax.tree.map(lambda x: _split(x, 0, groups), per_request)
        posm = _split(positions, 0, groups)
        first_layer = stage * k_all.shape[0]  # global index of this stage's first layer

        def tick(t, carry):
            received, km, vm, out, capm = carry
            group = t - stage
            valid = (group >= 0) & (group < groups)
            g = jnp.clip(group, 0, groups - 1)
            take = lambda x, axis: jax.lax.dynamic_index_in_dim(x, g, axis, keepdims=False)  # noqa: E731
            x = jnp.where(stage == 0, take(hm, 1), received)
            k_g, v_g = take(km, 2), take(vm, 2)
            idx = take(posm, 1)
            y, k_new, v_new, cap = sequential_layers(
                layer_fn, x, layer_params, k_g, v_g, jax.tree.map(lambda a: take(a, 1), reqm), capture_layers,
                lambda a: a if every else select_positions(a, idx), first_layer)
            # Bubble ticks may write back unmasked: before a stage's first group arrives it writes
            # garbage to group 0's scratch slots, which group 0 overwrites (same slots) before any
            # read; after its last group it recomputes group M - 1 from identical inputs, writing
            # identical values. Masking would cost a copy of the group's cache slice per tick.
            km = jax.lax.dynamic_update_index_in_dim(km, k_new, g, 2)
            vm = jax.lax.dynamic_update_index_in_dim(vm, v_new, g, 2)
            last = valid & (stage == stages - 1)
            out = jax.lax.dynamic_update_index_in_dim(out, jnp.where(last, y, take(out, 1)), g, 1)
            if capture_layers:
                capm = jax.lax.dynamic_update_index_in_dim(capm, jnp.where(valid, cap, take(capm, 2)), g, 2)
            received = jax.lax.ppermute(y, AXIS, [(s, s + 1) for s in range(stages - 1)])
            return received, km, vm, out, capm

        picked = (width if every else positions.shape[1])
        capm = jnp.zeros((len(capture_layers), hm.shape[0], groups, picked, hm.shape[-1]), hm.dtype)
        carry = (jnp.zeros_like(hm[:, 0]), km, vm, jnp.zeros_like(hm), capm)
        _, km, vm, out, capm = jax.lax.fori_loop(0, groups + stages - 1, tick, carry)
        # Only the last stage wrote ``out`` (and only a layer's own stage its capture); the others
        # add exact zeros, so these sums are broadcasts.
        out, capm = _broadcast_sum(out, cpu), _broadcast_sum(capm, cpu)
        return _merge(out, 0), _merge(km, 1), _merge(vm, 1), _merge(capm, 1)

    # "pp" and the request axis are manual (each dp replica pipelines its own requests); "tp" is automatic.
    rows, cache_spec = P(batch_axis), P(AXIS, batch_axis)
    run = jax.shard_map(stage_fn, mesh=parallel.mesh,
                        in_specs=(rows, P(AXIS), cache_spec, cache_spec, rows, rows),
                        out_specs=(rows, cache_spec, cache_spec, P(None, batch_axis)),
                        axis_names={AXIS} | ({batch_axis} if batch_axis else set()), check_vma=False)
    h, k_all, v_all, captured = run(h, layer_params, cache.k, cache.v, per_request, positions)
    return h, k_all, v_all, (captured if capture_layers else None)
