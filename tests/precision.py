"""Tolerances from measurement, never from a constant tuned on one CPU.

A float32 result is compared with a float64 reference of the same math (specjax's own model run in
float64, or transformers' in float64), and its error is bounded by a *floor* measured in the same
test: the float32 error of another, trusted route to the same numbers (e.g. the full causal
recompute, or transformers in float32). ``FACTOR`` allows for the different summation orders of
two correct float32 routes; ``ulps`` for values so exact that the floor itself is zero. A real bug
(a wrong position, a wrong mask, a missing term) lands orders of magnitude outside, and each test
that uses these bounds keeps a mutation showing it.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

FACTOR = 4.0


def ulps(reference: np.ndarray, n: float = 8.0) -> float:
    """n float32 units in the last place of the largest magnitude in ``reference``."""
    return n * float(np.finfo(np.float32).eps) * max(1.0, float(np.abs(reference).max()))


def error(got, reference) -> float:
    return float(np.abs(np.asarray(got, np.float64) - np.asarray(reference, np.float64)).max())


def bound(reference, *floors: float) -> float:
    """The tolerance for a float32 route against the float64 ``reference``: FACTOR x the largest
    floor measured in the same test, and never below a few float32 ulps of the values."""
    return max(FACTOR * max(floors, default=0.0), ulps(reference))


def assert_within(got, reference, *floors: float, what: str = "") -> None:
    err, tol = error(got, reference), bound(reference, *floors)
    assert err <= tol, f"{what}: error {err:.3g} vs float64 reference exceeds {tol:.3g} (floors {floors})"


@contextlib.contextmanager
def float64():
    """Trace and run in float64 (jax's x64 mode) inside the block (also specjax's entry points, which
    otherwise run in 32-bit types whatever the x64 switch says)."""
    from specjax.x32 import keep_64_bit

    with jax.enable_x64(True), keep_64_bit():
        yield


def params64(params):
    """Params as float64 arrays (call inside ``float64()``)."""
    return jax.tree.map(lambda a: jnp.asarray(np.asarray(a, np.float64)), params)


def logits64(model, token_lists) -> list[np.ndarray]:
    """specjax's full-sequence logits in float64: the reference for its float32 routes."""
    from specjax.decoding.incremental import full_logits

    width = max(len(t) for t in token_lists)
    padded = np.zeros((len(token_lists), width), np.int32)
    for i, t in enumerate(token_lists):
        padded[i, :len(t)] = t
    with float64():
        out = np.asarray(full_logits(params64(model.params), jnp.asarray(padded), cfg=model.config))
    assert out.dtype == np.float64
    return [out[i, :len(t)] for i, t in enumerate(token_lists)]
