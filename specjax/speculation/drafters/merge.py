"""Merging the proposals of several drafters into one token tree: every proposed token sequence becomes
exactly one node, every proposal stays its own child entry (paper Definition 3.2)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.speculation.drafters.base import Proposal
from specjax.speculation.tree import TokenTree, ancestor_bits


def merged_size(proposals: list[Proposal]) -> int:
    return 1 + sum(p.tokens.shape[1] - 1 for p in proposals)


def merge_proposals(proposals: list[Proposal], static_parents: list | None = None,
                    fault: str | None = None, law_offsets: list[int] | None = None) -> TokenTree:
    """One tree holding every proposed token sequence exactly once as a node; each proposal remains a
    child entry of its (merged) parent, duplicates allowed, in draw order: drafter order, then node
    order. Jittable; the node count is padded to ``merged_size``. All proposals share the root.

    static_parents[s]: drafter s's parent array when it is static (expansion trees), which keeps the
    bookkeeping static; None = read ``proposal.parent`` (dynamic trees, parents before children).
    Entry law rows are offset into the concatenation of the proposals' ``laws`` (in drafter order,
    proposals without laws contributing no rows; ``law_offsets`` overrides the offsets when the
    stored laws are those of a larger set of proposals, e.g. before a tree budget cut). fault
    "dedupe_merged" (tests only) keeps one entry per distinct token instead of one per proposal.
    """
    max_nodes = merged_size(proposals)
    static_parents = static_parents or [None] * len(proposals)
    # Entry slots per node: every candidate in the worst case (sampled drafts may repeat a token among
    # one drafter's siblings, so several drafted nodes can merge and pool their children's entries).
    max_entries = max_nodes - 1
    rows = [0 if p.laws is None else p.laws.shape[1] for p in proposals]
    offsets = np.cumsum([0] + rows)[:-1] if law_offsets is None else np.asarray(law_offsets)
    dedupe = fault == "dedupe_merged"

    def merge_one(tokens_s, parent_s, ok_s, law_row_s):
        tokens = jnp.zeros((max_nodes,), jnp.int32).at[0].set(tokens_s[0][0])
        parent = jnp.full((max_nodes,), -1, jnp.int32)
        valid = jnp.zeros((max_nodes,), bool).at[0].set(True)
        children = jnp.full((max_nodes, max_entries), -1, jnp.int32)
        law_row = jnp.full((max_nodes, max_entries), -1, jnp.int32)
        num_entries = jnp.zeros((max_nodes,), jnp.int32)
        count = jnp.int32(1)
        merged = (tokens, parent, valid, children, law_row, num_entries, count)
        for s in range(len(proposals)):
            n = tokens_s[s].shape[0]
            parents = parent_s[s] if static_parents[s] is None else jnp.asarray(static_parents[s], jnp.int32)

            # One node per iteration, in a loop rather than unrolled: unrolled, every node of every
            # budget level became its own ~15 XLA ops (most of the 2,006 instructions in the largest
            # level's branch of the default SmolLM2 loop; as a loop its XLA compile went 28 -> 16 s).
            def add_node(i, carry, s=s, parents=parents):
                (tokens, parent, valid, children, law_row, num_entries, count), to_merged, exists_s = carry
                par = parents[i]
                tok = tokens_s[s][i]
                mp = to_merged[par]
                here = exists_s[par] & ok_s[s][i] & (par >= 0)
                same = valid & (parent == mp) & (tokens == tok)
                found = jnp.any(same)
                new = here & ~found
                m = jnp.where(found, jnp.argmax(same), count).astype(jnp.int32)
                tokens = jnp.where(new, tokens.at[count].set(tok), tokens)
                parent = jnp.where(new, parent.at[count].set(mp), parent)
                valid = jnp.where(new, valid.at[count].set(True), valid)
                count = count + new.astype(jnp.int32)
                add = here & ~found if dedupe else here  # one entry per proposal (the fault: per distinct token)
                slot = jnp.where(add, num_entries[mp], max_entries)  # out of range -> dropped
                children = children.at[mp, slot].set(m, mode="drop")
                row = law_row_s[s][i]
                law_row = law_row.at[mp, slot].set(jnp.where(row >= 0, row + offsets[s], -1), mode="drop")
                num_entries = num_entries.at[mp].add(add.astype(jnp.int32))
                to_merged = to_merged.at[i].set(m)
                exists_s = exists_s.at[i].set(here)
                return (tokens, parent, valid, children, law_row, num_entries, count), to_merged, exists_s

            # node 0 -> merged root 0; the drafted node exists (and so do its ancestors)
            start = (merged, jnp.zeros((n,), jnp.int32), jnp.ones((n,), bool))
            merged = jax.lax.fori_loop(1, n, add_node, start)[0]
        tokens, parent, valid, children, law_row, _, _ = merged
        return tokens, parent, valid, children, law_row

    tokens, parent, valid, children, law_row = jax.vmap(merge_one)(
        [p.tokens for p in proposals], [p.parent for p in proposals], [p.ok for p in proposals],
        [p.law_row for p in proposals])
    return TokenTree(tokens=tokens, parent=parent, depth=depths(parent), valid=valid,
                     ancestor=ancestor_bits(parent, valid), children=children, law_row=law_row)


def concat_laws(proposals: list[Proposal]) -> jax.Array | None:
    """The stored laws of all proposals in drafter order (the rows ``merge_proposals`` offsets into)."""
    laws = [p.laws for p in proposals if p.laws is not None]
    return jnp.concatenate(laws, axis=1) if laws else None


def depths(parent: jax.Array) -> jax.Array:
    """[B, N] depth of every node from parents stored before children (-1 = root or padding)."""
    def one(par):
        def body(i, d):
            return d.at[i].set(jnp.where(par[i] >= 0, d[jnp.maximum(par[i], 0)] + 1, 0))

        return jax.lax.fori_loop(0, par.shape[0], body, jnp.zeros_like(par))

    return jax.vmap(one)(parent)
