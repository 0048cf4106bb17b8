"""The LLM over a token tree in one pass, and committing the accepted path to the cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.attention.meta import AttentionMeta
from specjax.config import ModelConfig
from specjax.models import ForwardOutput, forward
from specjax.models.cache import KVCache
from specjax.speculation.tree import TokenTree


def tree_forward(params, tree: TokenTree, cache: KVCache, cfg: ModelConfig, impl: str = "auto", parallel=None,
                 hidden: tuple[int, ...] | None = None) -> ForwardOutput:
    """ForwardOutput: logits [B, N, V] for every node, the cache with the tree's K/V in scratch slots
    ``[length, length + N)`` (slot = node index), and the hidden states ``hidden`` asks for at every
    node. Node positions are ``length + depth`` (RoPE angles for LLaMA, learned-position rows for
    OPT), never the slot index. ``length`` is unchanged.
    """
    positions = cache.length[:, None] + tree.depth
    meta = AttentionMeta(lengths=cache.length, ancestor=tree.ancestor, impl=impl)
    return forward(params, tree.tokens, positions, cache, meta, cfg, parallel=parallel, hidden=hidden)


def commit_path(cache: KVCache, path: jax.Array, num_keep: jax.Array) -> KVCache:
    """Move the accepted path's K/V from scratch slots to contiguous positions and advance length.

    path: [B, P] node ids in depth order, path[:, 0] = 0 (the root), -1 padding; num_keep: [B] =
    nodes to commit (root + accepted, <= P). Node path[b, d] moves from slot length + path[b, d] to
    position length + d. A pure gather + scatter into the (donated) cache: no host round trip and no
    full-cache copy. Gathering every row before scattering makes overlapping moves safe.
    """
    batch, width = path.shape
    rows = jnp.arange(batch)[:, None]
    src = cache.length[:, None] + jnp.maximum(path, 0)  # [B, P]
    keep = jnp.arange(width)[None, :] < num_keep[:, None]
    dst = jnp.where(keep, cache.length[:, None] + jnp.arange(width)[None, :], cache.max_len)  # drop the rest
    k_rows = cache.k[:, rows, src]  # [L, B, P, KVH, Dh]
    v_rows = cache.v[:, rows, src]
    k = cache.k.at[:, rows, dst].set(k_rows, mode="drop")
    v = cache.v.at[:, rows, dst].set(v_rows, mode="drop")
    return KVCache(k=k, v=v, length=cache.length + num_keep.astype(jnp.int32))
