"""The LLM over a token tree in one pass, and committing the accepted path to the cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.attention import resolve_impl
from specjax.attention.meta import AttentionMeta
from specjax.config import ModelConfig
from specjax.models import ForwardOutput, SeededHead, TokenOutput, forward
from specjax.models.cache import KVCache
from specjax.speculation.tree import TokenTree


def tree_forward(params, tree: TokenTree, cache: KVCache, cfg: ModelConfig, impl: str = "auto", parallel=None,
                 hidden: tuple[int, ...] | None = None, block_only: bool = False,
                 greedy: bool = False, seeded: SeededHead | None = None) -> ForwardOutput | TokenOutput:
    """ForwardOutput: logits [B, N, V] for every node, the cache with the tree's K/V in scratch slots
    ``[length, length + N)`` (slot = node index), and the hidden states ``hidden`` asks for at every
    node. Node positions are ``length + depth`` (RoPE angles for LLaMA, learned-position rows for
    OPT), never the slot index. ``length`` is unchanged. ``greedy``: a ``TokenOutput``, each node's
    argmax and finiteness in place of its logits; ``seeded`` (a ``SeededHead``): each node's seeded sample
    and finiteness (``specjax.models.forward``).

    ``block_only``: ``cache`` is left as it is and the output's cache holds only the nodes' K/V,
    [L, B, N, KVH, Dh] (node order); ``commit_rows`` commits the accepted path from it. The
    speculative loop passes this way: it keeps the tree pass from writing the shared cache inside the
    budget's ``lax.switch``. (The Pallas kernel and the pipeline read the tree from the cache: they
    write it there, then the block is gathered from it.)
    """
    positions = cache.length[:, None] + tree.depth
    meta = AttentionMeta(lengths=cache.length, ancestor=tree.ancestor, impl=impl)
    writes = resolve_impl(impl) == "pallas" or (parallel is not None and parallel.pipelined)
    out = forward(params, tree.tokens, positions, cache, meta, cfg, parallel=parallel, hidden=hidden,
                  block_only=block_only and not writes, greedy=greedy, seeded=seeded)
    if block_only and writes:
        rows = jnp.arange(cache.batch)[:, None]
        slots = cache.length[:, None] + jnp.arange(tree.tokens.shape[1])[None, :]
        out = out._replace(cache=KVCache(k=out.cache.k[:, rows, slots], v=out.cache.v[:, rows, slots],
                                         length=cache.length))
    return out


def commit_path(cache: KVCache, path: jax.Array, num_keep: jax.Array) -> KVCache:
    """Move the accepted path's K/V from scratch slots to contiguous positions and advance length.

    path: [B, P] node ids in depth order, path[:, 0] = 0 (the root), -1 padding; num_keep: [B] =
    nodes to commit (root + accepted, <= P). Node path[b, d] moves from slot length + path[b, d] to
    position length + d. A pure gather + scatter into the (donated) cache: no host round trip and no
    full-cache copy. Gathering every row before scattering makes overlapping moves safe.
    """
    rows = jnp.arange(path.shape[0])[:, None]
    src = cache.length[:, None] + jnp.maximum(path, 0)  # [B, P]
    return commit_rows(cache, cache.k[:, rows, src], cache.v[:, rows, src], num_keep)


def commit_rows(cache: KVCache, k_rows: jax.Array, v_rows: jax.Array, num_keep: jax.Array) -> KVCache:
    """Write the path's K/V rows [L, B, P, KVH, Dh] (depth order; from the cache's scratch slots or
    from a block-only pass) to positions ``length + d`` for ``d < num_keep`` and advance length."""
    width = k_rows.shape[2]
    rows = jnp.arange(k_rows.shape[1])[:, None]
    keep = jnp.arange(width)[None, :] < num_keep[:, None]
    dst = jnp.where(keep, cache.length[:, None] + jnp.arange(width)[None, :], cache.max_len)  # drop the rest
    k = cache.k.at[:, rows, dst].set(k_rows.astype(cache.k.dtype), mode="drop")
    v = cache.v.at[:, rows, dst].set(v_rows.astype(cache.v.dtype), mode="drop")
    return KVCache(k=k, v=v, length=cache.length + num_keep.astype(jnp.int32))
