"""Running the layers: one ``lax.scan`` over stacked or split weights
(``specjax.models.params.split_layers``), or the pipeline of a mesh.

The model families call ``run_layers``; a ``parallel`` object (``specjax.sharding.Parallel``) whose
``pipelined`` is true supplies ``run_pipeline`` (shard_map + ppermute stages, tested against the
scan). The models never import the sharding package: it depends on them, not the other way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.models.cache import KVCache
from specjax.models.output import capture, select_positions
from specjax.models.weights import layer_view, switched_layers


def sequential_layers(layer_fn, h, layer_params, k_all, v_all, per_request, capture_layers=None, select=None,
                      first_layer=0):
    """Run ``layer_fn(h, lp, k_all, v_all, i, per_request) -> (h, k_all, v_all)`` over the layers in one
    scan: over stacked weights (``lp`` = layer i's slices), or over split ones (a tuple of per-layer
    dicts; ``lp`` holds ``specjax.models.weights.LayerSwitch`` entries that the layer's matmuls read
    in place).

    The whole cache rides in the carry and each layer scatters only its new block into it, so a
    forward pass never copies the cache (a scanned-out cache would be rebuilt on every call).
    ``capture_layers`` (static layer indices < L): the input of each listed layer, through
    ``select`` (the logits positions), is returned as [n, B, K, D] (None when nothing is asked);
    ``first_layer`` is the global index of the first stacked layer (a pipeline stage's offset).
    """
    buffers = None
    if capture_layers:
        picked = select(h)
        buffers = jnp.zeros((len(capture_layers),) + picked.shape, picked.dtype)
    if isinstance(layer_params, (tuple, list)):
        # Split layout (``params.split_layers``): each matmul reads its layer's own buffer; slicing a
        # stacked buffer would first copy it (see specjax.models.weights).
        if len(layer_params) != k_all.shape[0]:  # the scan's xs would refuse the mismatch; so does this
            raise ValueError(f"{len(layer_params)} split layers for a cache of {k_all.shape[0]} layers")
        large, small = switched_layers(layer_params)

        def switched_body(carry, i):
            h, k_all, v_all, buffers = carry
            buffers = capture(buffers, first_layer + i, h, capture_layers, select)
            h, k_all, v_all = layer_fn(h, layer_view(large, small, i), k_all, v_all, i, per_request)
            return (h, k_all, v_all, buffers), None

        (h, k_all, v_all, buffers), _ = jax.lax.scan(switched_body, (h, k_all, v_all, buffers),
                                                      jnp.arange(k_all.shape[0]))
        return h, k_all, v_all, buffers

    def body(carry, xs):
        h, k_all, v_all, buffers = carry
        lp, i = xs
        buffers = capture(buffers, first_layer + i, h, capture_layers, select)
        h, k_all, v_all = layer_fn(h, lp, k_all, v_all, i, per_request)
        return (h, k_all, v_all, buffers), None

    (h, k_all, v_all, buffers), _ = jax.lax.scan(body, (h, k_all, v_all, buffers),
                                                  (layer_params, jnp.arange(k_all.shape[0])))
    return h, k_all, v_all, buffers


def run_layers(layer_fn, h, layer_params, cache: KVCache, per_request, parallel=None, hidden=None,
               logits_indices=None, block_only: bool = False):
    """The layers (``sequential_layers``: one scan over stacked or split weights), or ``parallel.run_pipeline`` when it
    pipelines (pp > 1, stacked weights only). Returns (h, cache, captured):
    captured [n, B, K, D] holds the inputs of the layers < L listed in ``hidden`` (None if none).

    ``block_only``: the cache is only read (the layers see it through ``per_request``'s last item) and
    the returned "cache" holds just this pass's K/V, [L, B, T, KVH, Dh]. A pass inside ``lax.switch``
    (the tree budget) that wrote into the shared cache would make XLA copy the whole cache on every
    step (measured: 2 x 400 MB per step at 8 requests, 2.5x the step's own time); the caller commits
    what it keeps. The pipeline writes its stage-local caches: it is not block-only (callers check
    ``parallel.pipelined``)."""
    layers = tuple(i for i in hidden if i < k_layers(cache)) if hidden else ()
    if block_only:
        if parallel is not None and parallel.pipelined:
            raise ValueError("block_only passes do not run through the pipeline")
        shape = cache.k.shape[:2] + h.shape[1:2] + cache.k.shape[3:]
        h, k_blk, v_blk, captured = sequential_layers(
            layer_fn, h, layer_params, jnp.zeros(shape, cache.k.dtype), jnp.zeros(shape, cache.v.dtype),
            tuple(per_request) + ((cache.k, cache.v),), layers, lambda x: select_positions(x, logits_indices))
        return h, cache.replace(k=k_blk, v=v_blk), captured
    if parallel is not None and parallel.pipelined:
        if isinstance(layer_params, (tuple, list)):
            raise ValueError("the pipeline splits stacked layer weights across stages: pass stacked params "
                             "(specjax.models.params.stack_layers)")
        h, k_all, v_all, captured = parallel.run_pipeline(layer_fn, h, layer_params, cache, per_request, layers,
                                                          logits_indices)
    else:
        h, k_all, v_all, captured = sequential_layers(layer_fn, h, layer_params, cache.k, cache.v, per_request,
                                                      layers, lambda x: select_positions(x, logits_indices))
    return h, cache.replace(k=k_all, v=v_all), captured


def k_layers(cache: KVCache) -> int:
    return cache.k.shape[0]


def hidden_output(hidden, captured, final_h, num_layers: int):
    """[B, K, len(hidden), D]: the captured layer inputs and, for index L, the final hidden state."""
    if not hidden:
        return None
    rows, j = [], 0
    for i in hidden:
        if i == num_layers:
            rows.append(final_h)
        else:
            rows.append(captured[j])
            j += 1
    return jnp.stack(rows, axis=2)
