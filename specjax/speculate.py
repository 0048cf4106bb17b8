"""Speculators: token trees drafted by small speculative models (SSMs).

* Expansion-based: one SSM, a static expansion configuration <k1, ..., km>; at depth i every
  frontier node gets k_i children. The topology is static, so its parent/depth/ancestor arrays are
  built once on the host; the SSM scores a whole frontier per forward pass with tree attention.
  Children are the SSM's top-k (greedy drafting; every entry's law is recorded as one-hot, -1).
* Sequence-based: expansion <1, ..., 1>. Incremental decoding: the empty tree (root only).
* Merge-based: several SSMs each draft their own tree; ``merge_trees`` builds the tree that holds
  every proposed token sequence exactly once as a node, while each proposal stays its own child
  entry in draw order (paper Definition 3.2).

Keeping SSM caches in step with the LLM: each step an SSM re-reads a fixed chain of the last
``m + 1`` committed tokens ending at the root (m = its tree depth). A step commits at most m + 1
tokens, so this chain always covers every token the SSM has not processed (an accepted leaf at
maximum depth, the bonus token, or a merged path another SSM proposed) with static shapes; the
chain's logits at the root give the depth-1 children.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax.attention import AttentionMeta, causal_meta
from specjax.cache import KVCache
from specjax.config import ModelConfig
from specjax.errors import InputError
from specjax.models import forward
from specjax.tree import TokenTree, ancestor_bits, from_parents


@dataclasses.dataclass(frozen=True)
class Expansion:
    """Static expansion configuration <k1, ..., km> and its tree topology (BFS order)."""

    widths: tuple[int, ...]

    def __post_init__(self):
        if not self.widths:
            raise InputError("expansion config is empty; use mode 'incremental' for no speculation")
        bad = [k for k in self.widths if not isinstance(k, (int, np.integer)) or k < 1]
        if bad:
            raise InputError(f"expansion widths must be positive ints, got {list(self.widths)}")

    @property
    def depth(self) -> int:
        return len(self.widths)

    @property
    def frontier_sizes(self) -> list[int]:
        sizes, f = [], 1
        for k in self.widths:
            f *= k
            sizes.append(f)
        return sizes

    @property
    def num_nodes(self) -> int:
        return 1 + sum(self.frontier_sizes)

    def topology(self) -> tuple[list[int], list[list[int]]]:
        """(parent per node, node ids per depth) with node 0 the root."""
        parents, levels = [-1], [[0]]
        for k in self.widths:
            level = []
            for p in levels[-1]:
                for _ in range(k):
                    level.append(len(parents))
                    parents.append(p)
            levels.append(level)
        return parents, levels

    @classmethod
    def parse(cls, text: str) -> "Expansion":
        try:
            widths = tuple(int(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise InputError(f"expansion must be comma-separated ints like 1,1,3,1, got {text!r}") from None
        return cls(widths)


def static_tree(expansion: Expansion, batch: int, tokens: jax.Array) -> TokenTree:
    """The expansion's static topology as a TokenTree carrying ``tokens`` [B, N]."""
    parents, _ = expansion.topology()
    t = from_parents([[0] * len(parents)], [parents], n_max=len(parents))
    rep = lambda x: jnp.broadcast_to(x, (batch,) + x.shape[1:])  # noqa: E731
    return TokenTree(tokens=tokens, parent=rep(t.parent), depth=rep(t.depth), valid=rep(t.valid),
                     ancestor=rep(t.ancestor), children=rep(t.children), law_row=rep(t.law_row))


def chain_logits(params, cfg: ModelConfig, cache: KVCache, history: jax.Array, length: jax.Array,
                 chain: int) -> tuple[jax.Array, KVCache]:
    """Re-read the ``chain`` tokens ending at the root (position ``length``) and return the root's
    logits [B, V]. Writes their K/V at their positions; slots past the root get scratch values that
    the frontier passes overwrite before anything reads them."""
    start = jnp.maximum(length - chain + 1, 0)
    idx = start[:, None] + jnp.arange(chain)[None, :]
    tokens = jnp.take_along_axis(history, jnp.minimum(idx, history.shape[1] - 1), axis=1)
    logits, cache = forward(params, tokens, idx, cache, causal_meta(start), cfg,
                            logits_indices=(length - start)[:, None])
    return logits[:, 0], cache


def draft_expansion(params, cfg: ModelConfig, cache: KVCache, history: jax.Array, length: jax.Array,
                    expansion: Expansion, impl: str = "auto") -> tuple[jax.Array, KVCache]:
    """Greedy (top-k) expansion drafting. Returns tree tokens [B, N] (root = history[length])."""
    batch = history.shape[0]
    parents, levels = expansion.topology()
    n = len(parents)
    tree = static_tree(expansion, batch, jnp.zeros((batch, n), jnp.int32))
    root = jnp.take_along_axis(history, length[:, None], axis=1)[:, 0]
    tokens = jnp.zeros((batch, n), jnp.int32).at[:, 0].set(root)
    logits, cache = chain_logits(params, cfg, cache, history, length, expansion.depth + 1)
    frontier_logits = logits[:, None, :]  # [B, |frontier|, V]
    for depth, k in enumerate(expansion.widths):
        children = np.asarray(levels[depth + 1])  # static ids, grouped by parent in frontier order
        top = jax.lax.top_k(frontier_logits, k)[1]  # [B, |frontier|, k], best first (draw order)
        tokens = tokens.at[:, children].set(top.reshape(batch, -1).astype(jnp.int32))
        if depth + 1 == expansion.depth:
            break  # the deepest frontier needs no SSM pass: nothing is drafted below it
        meta = AttentionMeta(lengths=length, ancestor=tree.ancestor[:, children],
                             slots=jnp.broadcast_to(jnp.asarray(children, jnp.int32), (batch, len(children))),
                             region=n, impl=impl)
        positions = length[:, None] + depth + 1
        frontier_logits, cache = forward(params, tokens[:, children], jnp.broadcast_to(positions, (batch, len(children))),
                                         cache, meta, cfg)
    return tokens, cache


def merge_trees(token_sets: list[jax.Array], expansions: list[Expansion]) -> TokenTree:
    """Merge several drafted trees (same root) into one: each distinct token sequence becomes exactly
    one node; every proposal remains a child entry (duplicates allowed) in draw order (SSM order,
    then node order). Jittable; node count padded to 1 + sum(N_s - 1)."""
    max_nodes = 1 + sum(e.num_nodes - 1 for e in expansions)
    # Entry slots per node: all candidates in the worst case (sampled drafts may repeat a token among
    # one SSM's siblings, so several drafted nodes can merge and pool their children's entries).
    max_entries = max_nodes - 1
    # Candidates in depth-major order so every parent is merged before its children.
    cands = []  # (set index, node id, parent id, depth)
    for s, e in enumerate(expansions):
        parents, levels = e.topology()
        for d, level in enumerate(levels[1:], start=1):
            for node in level:
                cands.append((d, s, node, parents[node]))
    cands.sort()
    root = token_sets[0][:, 0]

    def merge_one(toks_per_set, root_tok):
        tokens = jnp.zeros((max_nodes,), jnp.int32).at[0].set(root_tok)
        parent = jnp.full((max_nodes,), -1, jnp.int32)
        valid = jnp.zeros((max_nodes,), bool).at[0].set(True)
        children = jnp.full((max_nodes, max_entries), -1, jnp.int32)
        num_entries = jnp.zeros((max_nodes,), jnp.int32)
        count = jnp.int32(1)
        own_to_merged = [jnp.zeros((e.num_nodes,), jnp.int32) for e in expansions]  # node 0 -> 0
        for _, s, node, par in cands:
            tok = toks_per_set[s][node]
            mp = own_to_merged[s][par]
            same = valid & (parent == mp) & (tokens == tok)
            exists = jnp.any(same)
            m = jnp.where(exists, jnp.argmax(same), count)
            tokens = jnp.where(exists, tokens, tokens.at[count].set(tok))
            parent = jnp.where(exists, parent, parent.at[count].set(mp))
            valid = jnp.where(exists, valid, valid.at[count].set(True))
            count = count + (~exists).astype(jnp.int32)
            children = children.at[mp, num_entries[mp]].set(m)  # one entry per proposal
            num_entries = num_entries.at[mp].add(1)
            own_to_merged[s] = own_to_merged[s].at[node].set(m)
        return tokens, parent, valid, children

    tokens, parent, valid, children = jax.vmap(merge_one)(list(token_sets), root)
    depth = _depths(parent)
    return TokenTree(tokens=tokens, parent=parent, depth=depth, valid=valid, ancestor=ancestor_bits(parent, valid),
                     children=children, law_row=jnp.full(children.shape, -1, jnp.int32))


def _depths(parent: jax.Array) -> jax.Array:
    def one(par):
        def body(i, d):
            return d.at[i].set(jnp.where(par[i] >= 0, d[jnp.maximum(par[i], 0)] + 1, 0))

        return jax.lax.fori_loop(0, par.shape[0], body, jnp.zeros_like(par))

    return jax.vmap(one)(parent)
