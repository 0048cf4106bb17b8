"""Per-layer weights read in place inside the scanned layer loop.

A scan over stacked weights slices layer i out of each [L, ...] buffer, and XLA:CPU materialises
that dynamic slice: every pass copies all layer weights (~424 MB for SmolLM2) before multiplying by
them. Over split weights (one buffer per layer, ``specjax.models.params.split_layers``) the loop
stays one scan and each matmul picks its layer's own buffer with a ``lax.switch`` over the L
buffers: nothing is copied, and only the matmuls are compiled L times. Measured on a 2-core EPYC
(SmolLM2, scripts/bench_layer_layout.py): a one-token pass 0.67x the stacked pass's time, compiled
in 5.2 s instead of 2.3 s; unrolling the layers over split buffers (the earlier way) ran as fast but
compiled every layer separately, 12-15 s per pass program."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

# The weights the layers multiply by (through weight_einsum): switched. Norms and biases are small:
# stacked once per pass and indexed.
MATMUL_WEIGHTS = frozenset({"wq", "wk", "wv", "wqkv", "wo", "w_gate", "w_up", "w_gate_up", "w_down", "fc1",
                            "fc2"})


@dataclasses.dataclass(frozen=True)
class LayerSwitch:
    """One weight of every layer (each its own buffer) and the layer the scan is at."""

    buffers: tuple
    index: jax.Array


def weight_einsum(spec: str, x: jax.Array, w) -> jax.Array:
    """``jnp.einsum(spec, x, w)`` for a weight array or a ``LayerSwitch``. The specs the layers use
    contract x's trailing dims with w's leading ones, in order ("btd,dhk->bthk", "bthk,hkd->btd")."""
    if not isinstance(w, LayerSwitch):
        return jnp.einsum(spec, x, w)
    inputs, _ = spec.split("->")
    x_dims, w_dims = inputs.split(",")
    contracted = len(x_dims) - len(set(x_dims) - set(w_dims))
    assert x_dims[len(x_dims) - contracted:] == w_dims[:contracted], spec
    lead, inner = x.shape[:x.ndim - contracted], x.shape[x.ndim - contracted:]
    rows = int(np.prod(lead))
    # The switch's operand as a matrix, or a vector for one row: XLA:CPU then compiles no copy kernels
    # around each branch's dot (a one-row matrix got two, per branch per weight: 240 kernels in a
    # decode step's program, about a third of its compile time), and the vector product ran faster.
    flat = x.reshape(int(np.prod(inner))) if rows == 1 else x.reshape(rows, int(np.prod(inner)))
    out = jax.lax.switch(w.index, [lambda a, b=b: a @ b.reshape(a.shape[-1], -1) for b in w.buffers], flat)
    return out.reshape(lead + w.buffers[0].shape[contracted:])


def switched_layers(layer_params) -> tuple[dict, dict]:
    """Split per-layer dicts -> (matmul weights: name -> tuple of L buffers, the rest: name -> stacked [L, ...])."""
    first = layer_params[0]
    large = {n: tuple(lp[n] for lp in layer_params) for n in first if n in MATMUL_WEIGHTS}
    small = {n: jnp.stack([lp[n] for lp in layer_params]) for n in first if n not in MATMUL_WEIGHTS}
    return large, small


def layer_view(large: dict, small: dict, i: jax.Array) -> dict:
    """Layer i's weights as the layer functions read them."""
    return {**{n: LayerSwitch(b, i) for n, b in large.items()}, **{n: s[i] for n, s in small.items()}}
