"""Attention over the KV cache with explicit metadata (no baked-in causal mask).

The T tokens of a forward pass write their K/V to scratch slots ``length[b] + slots[b, i]``
(``slots`` defaults to ``0..T-1``). Query i of request b may attend to

* every committed position ``s < length[b]`` (the prefix), and
* scratch slot ``length[b] + j`` iff bit j of its mask row is set.

``AttentionMeta.ancestor`` carries the mask rows as uint32 bit words (bit j of word j // 32): for
a token tree, j is the query's own node or one of its ancestors. The tree region then spans
``32 * W`` slots, so a pass may score just one frontier of a larger tree whose other nodes were
written by earlier passes (SSM drafting). ``None`` means causal over the T tokens (j <= i): the
chain used by prefill and incremental decoding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.attention.meta import AttentionMeta, visibility_mask


def attend_xla(q: jax.Array, k: jax.Array, v: jax.Array, meta: AttentionMeta, scale: float) -> jax.Array:
    """q: [B, T, H, Dh]; k, v: [B, S, KVH, Dh] (one layer's cache, block already written).

    Returns [B, T, H, Dh]. Softmax in float32. Non-finite K/V (NaN-poisoned unused slots, or a
    token whose activations overflowed) reach exactly the queries that attend to them, as NaN
    outputs, exactly as in incremental decoding: they are zeroed before the matmuls (0 * NaN would
    leak them into every query of the request) and re-imposed on the queries that see them.
    """
    batch, num_tokens, heads, head_dim = q.shape
    max_len, kv_heads = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    mask = visibility_mask(meta, num_tokens, max_len)  # [B, T, S]
    kv_ok = jnp.all(jnp.isfinite(k), axis=-1) & jnp.all(jnp.isfinite(v), axis=-1)  # [B, S, KVH]
    k = jnp.where(kv_ok[..., None], k, 0)
    v = jnp.where(kv_ok[..., None], v, 0)
    sees_bad = jnp.einsum("bts,bsk->btk", mask.astype(jnp.float32), (~kv_ok).astype(jnp.float32)) > 0
    qg = q.reshape(batch, num_tokens, kv_heads, groups, head_dim)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.promote_types(q.dtype, jnp.float32))
    scores = scores * scale
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    sees_something = jnp.any(mask, axis=-1)[:, None, None, :, None]  # [B, 1, 1, T, 1]
    probs = jnp.where(sees_something, probs, 0.0).astype(v.dtype)  # a row that sees nothing outputs 0
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    out = jnp.where(sees_bad[:, :, :, None, None], jnp.nan, out)
    return out.reshape(batch, num_tokens, heads, head_dim)
