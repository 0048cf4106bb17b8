"""A float32 matmul for XLA:CPU over weights packed once at load: the weight matmuls of the decode and
tree passes (2 to ``specjax.models.weights.KERNEL_MAX_ROWS`` rows) on a CPU.

Why: XLA:CPU's matmul libraries repack the weight on every call and switch their threading at 8 rows, so on
2 Intel Xeon cores a tree pass of 17 nodes cost 2.5x a one-node pass, where streaming each weight once
should cost about the same. ``matmul.cc`` reads weights packed as panels ``[P, K, CW]`` (``CW`` columns
each, zero-padded; one contiguous stream per panel; from 9 rows on, 5 with AVX2, its next chunk is
prefetched while the current one is multiplied) and keeps a tile of the output in registers (4 rows x a
panel; with AVX2 2 rows x a panel, from 8 rows on 6 rows x half a panel); units of (panel, 64 rows) are
shared with XLA's intra-op thread pool through the XLA FFI. Measured side by side in one process (30
distinct 576 x 3072 weights, the fused gate/up projection of SmolLM2; ms, stop 39): 1 / 3 / 17 rows Eigen
6.6 / 9.2 / 19.9, YNNPACK 6.7 / 10.7 / 20.5, this kernel 8.1 / 7.9 / 12.5 (stop 41's prefetching of the next
chunk took 17 rows a further ~18% down, see ``matmul.cc``); it ties YNNPACK at 512 rows. One row stays with
XLA (its vector product is faster), so the step programs keep both copies of each weight
(``specjax.models.weights.PackedWeight``). Built and loaded by ``specjax.kernels.cpu.build``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax.kernels.cpu.build import library

TARGET = "specjax_cpu_matmul"  # float32 panels
TARGET_F16 = "specjax_cpu_matmul_f16"  # float16 panels
TARGETS = {jnp.dtype(jnp.float32): TARGET, jnp.dtype(jnp.float16): TARGET_F16}


def panel_width() -> int:
    """Columns per packed panel (64); builds the kernels if needed."""
    return int(library().specjax_cpu_matmul_panel_width())


def pack(w: jax.Array, contracted: int = 1, dtype=jnp.float32, past_float16: bool = False) -> jax.Array:
    """A weight whose leading ``contracted`` axes are multiplied ([K..., N...]) -> panels [P, K, CW]
    (K, N the products of those axes; columns past N zero) of ``dtype``: float32, or float16 (rounded
    to nearest; half the bytes each pass streams) for weights whose products need not be exact.
    ``past_float16``: take float16 weights past its range (inf once rounded), for a caller that handles
    them (the greedy head recomputes such columns exactly); otherwise they are refused."""
    if jnp.dtype(dtype) not in TARGETS:
        raise TypeError(f"the CPU matmul kernel packs float32 or float16 weights, not {jnp.dtype(dtype)}")
    if jnp.dtype(dtype) == jnp.float16 and not past_float16 and not isinstance(w, jax.core.Tracer):
        # rounded to float16, a weight past its range turns inf, and every product with it inf or NaN
        largest = float(jnp.max(jnp.abs(jnp.where(jnp.isfinite(w), w, 0)))) if w.size else 0.0
        if largest >= 65520.0:  # float16's largest finite value is 65504; from 65520 on it rounds to inf
            raise ValueError(f"a weight of {largest:.4g} is past float16's range ({np.finfo(np.float16).max:g}); "
                             f"pack it as float32")
    width = panel_width()
    k = int(np.prod(w.shape[:contracted]))
    n = int(np.prod(w.shape[contracted:]))
    panels = -(-n // width)
    return _pack(w.reshape(k, n), panels, width, jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _pack(w2d: jax.Array, panels: int, width: int, dtype) -> jax.Array:
    k, n = w2d.shape
    padded = jnp.pad(w2d.astype(dtype), ((0, 0), (0, panels * width - n)))
    return padded.reshape(k, panels, width).transpose(1, 0, 2)


def matmul(x: jax.Array, packed: jax.Array, n: int) -> jax.Array:
    """x [M, K] float32 @ the weight ``pack`` made ([K, n], float32 or float16 panels) -> [M, n] float32
    (float32 accumulation), on XLA:CPU."""
    if x.dtype != jnp.float32 or packed.dtype not in TARGETS:
        raise TypeError(f"the CPU matmul kernel multiplies float32 rows by float32 or float16 panels, got "
                        f"{x.dtype} x {packed.dtype}")
    width = panel_width()  # also registers the target before XLA lowers the call
    if (x.ndim != 2 or packed.ndim != 3 or packed.shape[1] != x.shape[1] or packed.shape[2] != width
            or packed.shape[0] != -(-n // width)):
        raise ValueError(f"x {x.shape} does not match packed weight {packed.shape} for {n} columns "
                         f"(panels of {width})")
    return jax.ffi.ffi_call(TARGETS[packed.dtype], jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))(x, packed)
