"""Expansion configurations <k1, ..., km> and their static token-tree topology.

At depth i every frontier node gets k_i children, so the topology (parents, depths, ancestor bits,
child entries) is fixed per configuration: it is built once on the host and broadcast over the
batch. Sequence speculation is <1, ..., 1>; incremental decoding is the root-only tree. The SSM
drafter (``specjax.speculation.drafters.ssm``) fills such a topology with drafted tokens.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax.errors import InputError
from specjax.speculation.tree import TokenTree, from_parents_host


@dataclasses.dataclass(frozen=True)
class Expansion:
    """Static expansion configuration <k1, ..., km> and its tree topology (BFS order)."""

    widths: tuple[int, ...]

    def __post_init__(self):
        if not self.widths:
            raise InputError("expansion config is empty; use mode 'incremental' for no speculation")
        if not isinstance(self.widths, tuple):
            raise InputError(f"expansion widths must be a tuple of positive ints, got {self.widths!r}")
        bad = [k for k in self.widths if isinstance(k, (bool, np.bool_)) or not isinstance(k, (int, np.integer))
               or k < 1]
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
    def parse(cls, text: str) -> Expansion:
        """``"1,1,3,1"``; every item a positive int (``"1,,2"`` is an error, not (1, 2))."""
        items = [x.strip() for x in text.split(",")]
        if not all(x.isascii() and x.isdigit() for x in items):
            raise InputError(f"expansion must be comma-separated positive ints like 1,1,3,1, got {text!r}")
        return cls(tuple(int(x) for x in items))


def static_tree(topology: Expansion | tuple[int, ...], batch: int, tokens: jax.Array,
                entry_ok: jax.Array | None = None, law_row: jax.Array | None = None) -> TokenTree:
    """A static topology (an expansion, or a parents tuple stored parents-before-children) as a
    TokenTree carrying ``tokens`` [B, N].

    entry_ok [B, N]: False drops node i as an entry of its parent (a draw that does not exist, e.g.
    without replacement from a law with fewer than k tokens). law_row [B, N]: the stored law row
    node i was drawn from as its parent's child (-1 or None: one-hot entries)."""
    parents = tuple(topology.topology()[0]) if isinstance(topology, Expansion) else tuple(topology)
    t = _topology_tree(parents)
    rep = lambda x: jnp.broadcast_to(jnp.asarray(x), (batch,) + x.shape[1:])
    children = rep(t.children)
    flat = jnp.maximum(children, 0).reshape(batch, -1)
    if entry_ok is not None:
        ok = jnp.take_along_axis(entry_ok, flat, axis=1)
        children = jnp.where(ok.reshape(children.shape), children, -1)
    entry_law = jnp.full(children.shape, -1, jnp.int32)
    if law_row is not None:
        entry_law = jnp.where(children >= 0, jnp.take_along_axis(law_row, flat, axis=1).reshape(children.shape), -1)
    return TokenTree(tokens=tokens, parent=rep(t.parent), depth=rep(t.depth), valid=rep(t.valid),
                     ancestor=rep(t.ancestor), children=children, law_row=entry_law)


@functools.lru_cache(maxsize=64)
def _topology_tree(parents: tuple[int, ...]) -> TokenTree:
    """The static topology as host (numpy) arrays, built and validated once per parents tuple; read-only,
    since every caller shares them."""
    tree = from_parents_host([[0] * len(parents)], [list(parents)], n_max=len(parents))
    for field in jax.tree.leaves(tree):
        field.setflags(write=False)
    return tree
