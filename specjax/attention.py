"""Attention over the KV cache with explicit metadata (no baked-in causal mask).

Query i of request b (one of the T tokens of this forward pass, whose K/V sit in the scratch slots
``[length[b], length[b] + T)``) may attend to

* every committed position ``s < length[b]`` (the prefix), and
* scratch slot ``length[b] + j`` iff ``block_mask[b, i, j]``.

``AttentionMeta.ancestor`` carries that block mask as uint32 bit words (bit j of word j // 32 of
row i set iff slot j is visible to i: for a token tree, j is i or an ancestor of i). ``None`` means
causal (j <= i), which is the chain case used by prefill and incremental decoding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class AttentionMeta:
    lengths: jax.Array  # [B] int32, committed positions per request
    ancestor: jax.Array | None = None  # [B, T, W] uint32 bit words, or None for causal
    impl: str = struct.field(pytree_node=False, default="auto")  # tree attention: auto | xla | pallas


def causal_meta(lengths: jax.Array) -> AttentionMeta:
    return AttentionMeta(lengths=lengths.astype(jnp.int32), ancestor=None)


def block_mask(meta: AttentionMeta, num_tokens: int) -> jax.Array:
    """bool [B, T, T]: may block token i see block token j."""
    batch = meta.lengths.shape[0]
    if meta.ancestor is None:
        causal = jnp.arange(num_tokens)[None, :] <= jnp.arange(num_tokens)[:, None]
        return jnp.broadcast_to(causal, (batch, num_tokens, num_tokens))
    j = jnp.arange(num_tokens)
    words = meta.ancestor[:, :, j // 32]  # [B, T, T]
    return ((words >> (j % 32).astype(jnp.uint32)) & jnp.uint32(1)).astype(bool)


def visibility_mask(meta: AttentionMeta, num_tokens: int, max_len: int) -> jax.Array:
    """bool [B, T, S] over cache slots: prefix, plus the block slots allowed by the block mask."""
    rel = jnp.arange(max_len)[None, None, :] - meta.lengths[:, None, None]  # [B, 1, S]
    in_block = (rel >= 0) & (rel < num_tokens)
    idx = jnp.broadcast_to(jnp.clip(rel, 0, num_tokens - 1), (rel.shape[0], num_tokens, max_len))
    allowed = jnp.take_along_axis(block_mask(meta, num_tokens), idx, axis=2)
    return (rel < 0) | (in_block & allowed)


def attend_xla(q: jax.Array, k: jax.Array, v: jax.Array, meta: AttentionMeta, scale: float) -> jax.Array:
    """q: [B, T, H, Dh]; k, v: [B, S, KVH, Dh] (one layer's cache, block already written).

    Returns [B, T, H, Dh]. Softmax in float32. Slots that no query may see are zeroed before use,
    so NaN-poisoned unused slots cannot leak through 0 * NaN.
    """
    batch, num_tokens, heads, head_dim = q.shape
    max_len, kv_heads = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    mask = visibility_mask(meta, num_tokens, max_len)  # [B, T, S]
    live = jnp.any(mask, axis=1)[:, :, None, None]  # [B, S, 1, 1]
    k = jnp.where(live, k, 0)
    v = jnp.where(live, v, 0)
    qg = q.reshape(batch, num_tokens, kv_heads, groups, head_dim)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    sees_something = jnp.any(mask, axis=-1)[:, None, None, :, None]  # [B, 1, 1, T, 1]
    probs = jnp.where(sees_something, probs, 0.0).astype(v.dtype)  # a row that sees nothing outputs 0
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(batch, num_tokens, heads, head_dim)
