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

from specjax.kernels.cpu import matmul as cpu_matmul

# The weights the layers multiply by (through weight_einsum): switched. Norms and biases are small:
# stacked once per pass and indexed.
MATMUL_WEIGHTS = frozenset({"wq", "wk", "wv", "wqkv", "wo", "w_gate", "w_up", "w_gate_up", "w_down", "fc1",
                            "fc2"})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """A weight as XLA reads it (``plain``, [K..., N...]) and packed for the CPU matmul kernel
    (``packed``, [P, K, CW], ``specjax.kernels.cpu.matmul.pack``). Only the step programs see these
    (``specjax.decoding.programs.step_params``): 2 to ``KERNEL_MAX_ROWS`` rows are multiplied by
    ``packed``, one row (XLA's vector product is faster there) and more rows by ``plain``;
    float16 panels (a drafter's weights, ``FeatureDrafter.step_params``) take one row too: half the
    bytes beat XLA's float32 vector product (576 x 8192 head: 0.19 vs 0.60 ms, Xeon)."""

    plain: jax.Array
    packed: jax.Array


# Rows the CPU kernel multiplies: from 2 (one row: XLA's vector product is faster) up to this many.
# Past it YNNPACK catches up (2 Intel Xeon cores, SmolLM2 passes: batch 8 x 17 nodes = 136 rows
# 235.7 vs 233.0 ms, batch 16 x 17 = 272 rows 455.6 vs 433.0; below it the kernel wins, 20-40% at
# 2-68 rows).
KERNEL_MAX_ROWS = 128


def matmul_rows(flat: jax.Array, w) -> jax.Array:
    """flat [K] or [M, K] @ w ([K..., N...] or a PackedWeight) -> [N] or [M, N]."""
    if isinstance(w, PackedWeight):
        n = int(np.prod(w.plain.shape)) // flat.shape[-1]
        if flat.dtype == jnp.float32 and w.packed.dtype == jnp.float16 and flat.ndim == 1:
            return cpu_matmul.matmul(flat[None], w.packed, n)[0]  # half the bytes beat XLA's vector product
        if flat.ndim == 2 and 2 <= flat.shape[0] <= KERNEL_MAX_ROWS and flat.dtype == jnp.float32:
            return cpu_matmul.matmul(flat, w.packed, n)
        w = w.plain
    return product(flat, w.reshape(flat.shape[-1], -1))


def product(x: jax.Array, w: jax.Array, spec: str | None = None) -> jax.Array:
    """``x @ w`` (or ``jnp.einsum(spec, x, w)``). A float32 activation meeting a bfloat16 weight is a
    *bfloat16 dot*: x is rounded to bfloat16 and the products are summed in float32, the output float32.
    Without this rule JAX would widen the weight instead, a float32 dot (no faster than float32 weights).
    Only a model whose matmul weights alone are bfloat16 meets it (``teacher_params``: the LLM's features
    for drafter training); a model loaded as bfloat16 runs bfloat16 activations, and float32 ones float32."""
    if x.dtype == jnp.float32 and w.dtype == jnp.bfloat16:
        x = x.astype(jnp.bfloat16)
        out = jnp.float32
    else:
        out = None
    if spec is None:
        return jnp.matmul(x, w, preferred_element_type=out)
    return jnp.einsum(spec, x, w, preferred_element_type=out)


def bfloat16_matmul_weights(params: dict) -> dict:
    """``params`` with every layer's matmul weights (``MATMUL_WEIGHTS``) stored as bfloat16 and everything
    else (embeddings, norms, biases, the head) as it was: the layers' dots then run as bfloat16 dots with
    float32 sums (``product``) while activations, norms, attention and the head stay float32. On CPUs with
    bfloat16 matrix units (AMX, AVX512-BF16) such dots run several times faster than float32 ones."""
    layers = params["layers"]

    def cast(lp: dict) -> dict:
        return {n: (v.astype(jnp.bfloat16) if n in MATMUL_WEIGHTS else v) for n, v in lp.items()}

    return {**params, "layers": tuple(map(cast, layers)) if isinstance(layers, (tuple, list)) else cast(layers)}


def dense(x: jax.Array, w) -> jax.Array:
    """x [..., K] @ w ([K, N], or a ``PackedWeight`` of one) -> [..., N]: through the CPU kernel where
    ``matmul_rows`` takes the rows."""
    if not isinstance(w, PackedWeight):
        return product(x, w)
    rows = x.reshape(-1, x.shape[-1])
    flat = rows[0] if rows.shape[0] == 1 else rows
    return matmul_rows(flat, w).reshape(x.shape[:-1] + (-1,))


@dataclasses.dataclass(frozen=True)
class LayerSwitch:
    """One weight of every layer (each its own buffer) and the layer the scan is at."""

    buffers: tuple
    index: jax.Array


def weight_einsum(spec: str, x: jax.Array, w) -> jax.Array:
    """``jnp.einsum(spec, x, w)`` for a weight array or a ``LayerSwitch``. The specs the layers use
    contract x's trailing dims with w's leading ones, in order ("btd,dhk->bthk", "bthk,hkd->btd")."""
    if not isinstance(w, LayerSwitch):
        return product(x, w, spec)
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
    out = jax.lax.switch(w.index, [lambda a, b=b: matmul_rows(a, b) for b in w.buffers], flat)
    first = w.buffers[0]
    return out.reshape(lead + (first.plain if isinstance(first, PackedWeight) else first).shape[contracted:])


def packed_layer(lp: dict) -> bool:
    """Whether a layer's weights are a step program's packed ones (``PackedWeight``, see
    ``specjax.decoding.programs.step_params``): where the CPU kernels are on, for attention too."""
    w = lp.get("wqkv", lp.get("wq"))
    return isinstance(w, LayerSwitch) and isinstance(w.buffers[0], PackedWeight)


def switched_layers(layer_params) -> tuple[dict, dict]:
    """Split per-layer dicts -> (matmul weights: name -> tuple of L buffers, the rest: name -> stacked [L, ...])."""
    first = layer_params[0]
    large = {n: tuple(lp[n] for lp in layer_params) for n in first if n in MATMUL_WEIGHTS}
    small = {n: jnp.stack([lp[n] for lp in layer_params]) for n in first if n not in MATMUL_WEIGHTS}
    return large, small


def layer_view(large: dict, small: dict, i: jax.Array) -> dict:
    """Layer i's weights as the layer functions read them."""
    return {**{n: LayerSwitch(b, i) for n, b in large.items()}, **{n: s[i] for n, s in small.items()}}
