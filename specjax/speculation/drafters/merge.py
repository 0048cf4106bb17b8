"""Merging drafted trees: every proposed token sequence becomes exactly one node, every proposal
stays its own child entry."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.speculation.expansion import Expansion
from specjax.speculation.tree import TokenTree, ancestor_bits


def merge_trees(token_sets: list[jax.Array], expansions: list[Expansion], entry_oks: list | None = None,
                law_rows: list | None = None, fault: str | None = None) -> TokenTree:
    """Merge several drafted trees (same root) into one: each distinct token sequence becomes exactly
    one node; every proposal remains a child entry (duplicates allowed) in draw order (SSM order,
    then node order). Jittable; node count padded to 1 + sum(N_s - 1).

    entry_oks[s] [B, N_s]: False = that draw does not exist (skipped). law_rows[s]: None (one-hot
    entries) or [B] bool; where True, an entry proposed by node i of set s under its parent p
    declares law row ``offset_s + p`` of the concatenated per-set law arrays (offset_s = sum of the
    earlier sets' N)."""
    max_nodes = 1 + sum(e.num_nodes - 1 for e in expansions)
    entry_oks = entry_oks or [None] * len(expansions)
    law_rows = law_rows or [None] * len(expansions)
    offsets = np.cumsum([0] + [e.num_nodes for e in expansions])[:-1]
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
    batch = token_sets[0].shape[0]
    root = token_sets[0][:, 0]
    oks = [jnp.ones(t.shape, bool) if o is None else o for t, o in zip(token_sets, entry_oks)]
    sampled = [jnp.zeros((batch,), bool) if r is None else r for r in law_rows]
    dedupe = fault == "dedupe_merged"

    def merge_one(toks_per_set, ok_per_set, sampled_per_set, root_tok):
        tokens = jnp.zeros((max_nodes,), jnp.int32).at[0].set(root_tok)
        parent = jnp.full((max_nodes,), -1, jnp.int32)
        valid = jnp.zeros((max_nodes,), bool).at[0].set(True)
        children = jnp.full((max_nodes, max_entries), -1, jnp.int32)
        law_row = jnp.full((max_nodes, max_entries), -1, jnp.int32)
        num_entries = jnp.zeros((max_nodes,), jnp.int32)
        count = jnp.int32(1)
        own_to_merged = [jnp.zeros((e.num_nodes,), jnp.int32) for e in expansions]  # node 0 -> 0
        own_ok = [jnp.ones((e.num_nodes,), bool) for e in expansions]  # drafted node exists (and its parent)
        for _, s, node, par in cands:
            tok = toks_per_set[s][node]
            mp = own_to_merged[s][par]
            here = own_ok[s][par] & ok_per_set[s][node]
            same = valid & (parent == mp) & (tokens == tok)
            exists = jnp.any(same)
            new = here & ~exists
            m = jnp.where(exists, jnp.argmax(same), count)
            tokens = jnp.where(new, tokens.at[count].set(tok), tokens)
            parent = jnp.where(new, parent.at[count].set(mp), parent)
            valid = jnp.where(new, valid.at[count].set(True), valid)
            count = count + new.astype(jnp.int32)
            add = here & ~exists if dedupe else here  # one entry per proposal (the mutant: per distinct token)
            slot = jnp.where(add, num_entries[mp], max_entries)  # out of range -> dropped
            children = children.at[mp, slot].set(m, mode="drop")
            row = jnp.where(sampled_per_set[s], offsets[s] + par, -1)
            law_row = law_row.at[mp, slot].set(row, mode="drop")
            num_entries = num_entries.at[mp].add(add.astype(jnp.int32))
            own_to_merged[s] = own_to_merged[s].at[node].set(m)
            own_ok[s] = own_ok[s].at[node].set(here)
        return tokens, parent, valid, children, law_row

    tokens, parent, valid, children, law_row = jax.vmap(merge_one)(list(token_sets), oks, sampled, root)
    depth = _depths(parent)
    return TokenTree(tokens=tokens, parent=parent, depth=depth, valid=valid, ancestor=ancestor_bits(parent, valid),
                     children=children, law_row=law_row)


def _depths(parent: jax.Array) -> jax.Array:
    def one(par):
        def body(i, d):
            return d.at[i].set(jnp.where(par[i] >= 0, d[jnp.maximum(par[i], 0)] + 1, 0))

        return jax.lax.fori_loop(0, par.shape[0], body, jnp.zeros_like(par))

    return jax.vmap(one)(parent)
