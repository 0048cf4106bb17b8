"""Attention metadata: committed lengths, an optional ancestor bitmask, and the visibility mask it defines."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class AttentionMeta:
    lengths: jax.Array  # [B] int32, committed positions per request
    ancestor: jax.Array | None = None  # [B, T, W] uint32 bit words, or None for causal
    slots: jax.Array | None = None  # [B, T] int32 tree slot of each token; None = 0..T-1
    region: int | None = struct.field(pytree_node=False, default=None)  # tree slots (N); None = T
    impl: str = struct.field(pytree_node=False, default="auto")  # tree attention: auto | xla | pallas


def causal_meta(lengths: jax.Array) -> AttentionMeta:
    return AttentionMeta(lengths=lengths.astype(jnp.int32), ancestor=None)


def visibility_mask(meta: AttentionMeta, num_tokens: int, max_len: int) -> jax.Array:
    """bool [B, T, S] over cache slots: the committed prefix plus the allowed scratch slots."""
    rel = jnp.arange(max_len)[None, None, :] - meta.lengths[:, None, None]  # [B, 1, S]
    prefix = rel < 0
    if meta.ancestor is None:
        causal = (rel >= 0) & (rel <= jnp.arange(num_tokens)[None, :, None])
        return prefix | causal
    words = meta.ancestor.shape[-1]
    idx = jnp.broadcast_to(jnp.clip(rel // 32, 0, words - 1), (rel.shape[0], num_tokens, max_len))
    word = jnp.take_along_axis(meta.ancestor, idx, axis=2)  # [B, T, S]
    bit = (word >> (jnp.maximum(rel, 0) % 32).astype(jnp.uint32)) & jnp.uint32(1)
    region = meta.region or num_tokens
    return prefix | ((rel >= 0) & (rel < region) & (bit > 0))
