"""KVCache: the static-shape key/value cache, an immutable pytree passed in and returned."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specjax.config import ModelConfig

# Logical axes of the cache leaves (used by specjax.sharding).
CACHE_AXES = ("layers", "batch", "seq", "kv_heads", "head_dim")
LENGTH_AXES = ("batch",)


@struct.dataclass
class KVCache:
    """k, v: [layers, batch, max_len, kv_heads, head_dim]. length: [batch] int32 = committed positions.

    Positions ``< length[b]`` hold committed K/V. A forward pass over T new tokens writes their K/V
    to the scratch slots ``[length[b], length[b] + T)`` and leaves ``length`` unchanged: the caller
    decides what to commit (all of them for prefill/decode, one tree path for verification).
    """

    k: jax.Array
    v: jax.Array
    length: jax.Array

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def batch(self) -> int:
        return self.k.shape[1]


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32,
               poison: bool = False) -> KVCache:
    """An empty cache. ``poison=True`` fills it with NaN so any read of an unwritten slot shows up."""
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    fill = jnp.nan if poison else 0.0
    return KVCache(k=jnp.full(shape, fill, dtype), v=jnp.full(shape, fill, dtype),
                   length=jnp.zeros((batch,), jnp.int32))


def cache_logical_axes() -> KVCache:
    return KVCache(k=CACHE_AXES, v=CACHE_AXES, length=LENGTH_AXES)
