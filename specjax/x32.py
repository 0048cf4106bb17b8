"""specjax's programs are written for JAX's default 32-bit types.

Under ``jax_enable_x64`` (a global switch that scientific JAX code often turns on) ``jnp.arange``, integer
literals and index arithmetic become int64, so every ``lax.while_loop`` carry that starts as int32 comes
back as int64 and tracing fails with a carry-type error that names no cause. The entry points a user
calls (the host API, the engine, the jittable cores) are wrapped with ``in_32_bit``: under x64 they take
64-bit inputs as their 32-bit types and run (and trace) with x64 off. Without x64 the wrapper only reads
the flag. ``keep_64_bit()`` lets a caller that means it (a float64 reference, as the tests compute) run the
same functions in 64-bit types.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import numpy as np

_KEEP_64 = contextvars.ContextVar("specjax_keep_64_bit", default=False)
_NARROW = {np.dtype(np.int64): np.int32, np.dtype(np.uint64): np.uint32, np.dtype(np.float64): np.float32}


def _narrow(x):
    """A 64-bit array (NumPy, JAX or a tracer) as its 32-bit type; anything else unchanged."""
    dtype = getattr(x, "dtype", None)
    if not isinstance(dtype, np.dtype) or dtype not in _NARROW or not hasattr(x, "astype"):
        return x  # PRNG key arrays have an extended dtype (not a np.dtype): kept as they are
    return x.astype(_NARROW[dtype])


def in_32_bit(fn):
    """``fn`` run with 64-bit types off, its 64-bit array arguments narrowed first (see the module)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not jax.config.jax_enable_x64 or _KEEP_64.get():
            return fn(*args, **kwargs)
        args, kwargs = jax.tree.map(_narrow, (args, kwargs))
        with jax.enable_x64(False):
            return fn(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def keep_64_bit():
    """Inside the block, ``in_32_bit`` functions run in whatever types JAX gives them (a float64 reference
    under ``jax.enable_x64(True)``); the loops' carries must then be 64-bit-safe for the calls made."""
    token = _KEEP_64.set(True)
    try:
        yield
    finally:
        _KEEP_64.reset(token)
