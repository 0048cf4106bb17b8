"""The greedy decision of an LLM head on XLA:CPU: each row's first argmax of ``x @ W`` and whether all
its logits are finite, as the float32 matmul kernel's logits decide them, streaming the head as float16.

Why: greedy verification needs only that decision per tree node, yet computing SmolLM2's [576, 49152]
float32 head streams 113 MB per pass, and the argmax and finiteness checks read the 49152 logits of
every node twice more. ``greedy_head.cc`` multiplies by the head's float16 panels (half the bytes) and
bounds each approximate logit's distance from the exact one (``GreedyHead.err``, derived in float64
from the rounding here), then recomputes exactly, in the matmul kernel's own order of fused
multiply-adds, only the columns whose bounds reach the top: the decision is the float32 kernel's, bit
for bit (``tests/test_greedy_head.py``). Rows whose approximate logits are not all finite, or large
enough to overflow, are recomputed in full.

Seeded sampling's token is decided the same way, by the same target (``sampled_decision``): each row's
first argmax of its Gumbel-max scores fl(fl(l r) + g) (``specjax.decoding.sampling.gumbel_scores``: r the
request's inverse temperature, g its noise row), bounded from the approximate logits, the few columns
that can win recomputed exactly. At r = 1 that is the token ``seeded_tokens`` draws from the float32
kernel's logits, bit for bit; at other r XLA may fuse its product and sum into one FMA, which these two
roundings need not match, so callers use r in {0, 1} only."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax.kernels.cpu import matmul as cpu_matmul

TARGET = "specjax_cpu_greedy_head"

# Slack on the float64 bound: covers the rounding of the bound's own arithmetic many times over.
_SLACK = 1.0 + 2.0 ** -10
_ROW_BLOCK = 2048  # rows per block of column_errors' float64 temporaries (9 MB each at K = 576)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GreedyHead:
    """A head [K, N] as the greedy kernel reads it: ``packed`` float16 panels [P, K, CW]; ``rows`` the
    float32 head with one row per column [N, K] (a tied model's embedding itself); ``err`` [N] float32,
    the bound on |exact - approximate logit| per unit of |x| (see ``greedy_head.cc``)."""

    packed: jax.Array
    rows: jax.Array
    err: jax.Array


def column_errors(rows: np.ndarray) -> np.ndarray:
    """rows [N, K] float32 -> err [N] float32: |w_j - f16(w_j)| + gamma_K (|w_j| + |f16(w_j)|) (2-norms,
    float64), with slack, rounded up: |x . w_j| computed in float32 from either copy differs from the
    other by at most |x| err_j."""
    rows = np.asarray(rows, np.float32)
    k = rows.shape[1]
    u = 2.0 ** -24
    gamma = k * u / (1 - k * u)
    bound = np.empty(rows.shape[0], np.float64)
    # In blocks of rows: each row's bound is its own, and whole-head float64 temporaries (226 MB each for
    # SmolLM2) cost more in first-touch page faults than in arithmetic (2.15 s against 0.32 s in a process
    # that has loaded SmolLM2, 2-core EPYC VM), paid by every process that builds the head.
    # Weights past float16's range (inf when rounded) or NaN: inf or NaN bounds, whose rows the kernel
    # recomputes in full.
    with np.errstate(over="ignore", invalid="ignore"):
        for start in range(0, rows.shape[0], _ROW_BLOCK):
            w = rows[start:start + _ROW_BLOCK].astype(np.float64)
            half = rows[start:start + _ROW_BLOCK].astype(np.float16).astype(np.float64)
            norms = np.linalg.norm(w, axis=1) + np.linalg.norm(half, axis=1)
            bound[start:start + _ROW_BLOCK] = (np.linalg.norm(w - half, axis=1) + gamma * norms) * _SLACK
    return np.nextafter(bound.astype(np.float32), np.float32(np.inf))


def pack_head(head: jax.Array, rows: jax.Array | None = None) -> GreedyHead:
    """A head [K, N] float32 (the matmul's layout) -> its ``GreedyHead``. ``rows``: the same head as
    [N, K] where the model already holds it (a tied embedding); else the transpose is made once here."""
    if head.ndim != 2 or head.dtype != jnp.float32:
        raise TypeError(f"the greedy head kernel reads a float32 head [K, N], got {head.dtype} {head.shape}")
    if rows is None:
        rows = jnp.asarray(head.T)
    if rows.shape != head.shape[::-1] or rows.dtype != jnp.float32:
        raise ValueError(f"rows {rows.dtype} {rows.shape} are not the head {head.shape} transposed")
    err = jnp.asarray(column_errors(np.asarray(rows)))
    # columns past float16's range: their bound is inf, and the kernel computes those rows in full
    return GreedyHead(cpu_matmul.pack(head, 1, jnp.float16, past_float16=True), rows, err)


def greedy_decision(x: jax.Array, head: GreedyHead) -> tuple[jax.Array, jax.Array]:
    """x [M, K] float32 -> (ids [M] int32: each row's first argmax of its logits x @ W, the first NaN
    where one is NaN; finite [M] bool: all its logits finite), as ``first_argmax`` and ``finite_rows``
    decide on the float32 kernel's logits."""
    m, n = x.shape[0], head.rows.shape[0]
    return _decide(x, head, jnp.zeros((m,), jnp.float32), jnp.zeros((0, n), jnp.float32), jnp.zeros((m,), jnp.int32))


def sampled_decision(x: jax.Array, head: GreedyHead, inv_temperature: jax.Array, noise: jax.Array,
                     noise_row: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [M, K] float32, inv_temperature [M] float32 (0: the row decides greedily), noise [R, N] float32
    and noise_row [M] int32 (each sampled row's row of ``noise``, in [0, R)) -> (ids [M] int32, finite [M]
    bool): each sampled row's first argmax of fl(fl(l * inv_temperature) + noise[noise_row]) over its
    logits l = x @ W (the first NaN where one is NaN), each greedy row's as ``greedy_decision``. At
    inverse temperature 1 what ``seeded_tokens`` decides on the float32 kernel's logits (module
    docstring); no top-k / top-p: the caller decides those requests from the full logits."""
    m, n = x.shape[0], head.rows.shape[0]
    if (inv_temperature.shape != (m,) or inv_temperature.dtype != jnp.float32 or noise_row.shape != (m,)
            or noise_row.dtype != jnp.int32 or noise.ndim != 2 or noise.shape[1] != n or noise.dtype != jnp.float32):
        raise ValueError(f"sampled decision of {m} rows over {n} columns: got inv_temperature {inv_temperature.dtype} "
                         f"{inv_temperature.shape}, noise {noise.dtype} {noise.shape}, noise_row {noise_row.dtype} "
                         f"{noise_row.shape}")
    return _decide(x, head, inv_temperature, noise, noise_row)


def _decide(x, head: GreedyHead, inv_temperature, noise, noise_row) -> tuple[jax.Array, jax.Array]:
    if x.dtype != jnp.float32 or x.ndim != 2 or x.shape[1] != head.rows.shape[1]:
        raise ValueError(f"x {x.dtype} {x.shape} does not match the greedy head's rows {head.rows.shape}")
    cpu_matmul.panel_width()  # builds and registers the kernels before XLA lowers the call
    m, n = x.shape[0], head.rows.shape[0]
    call = jax.ffi.ffi_call(TARGET, (jax.ShapeDtypeStruct((m,), jnp.int32), jax.ShapeDtypeStruct((m,), jnp.bool_),
                                     jax.ShapeDtypeStruct((m, n), jnp.float32)))
    ids, finite, _ = call(x, head.packed, head.rows, head.err, inv_temperature, noise, noise_row)
    return ids, finite
