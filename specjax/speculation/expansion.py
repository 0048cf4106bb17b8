"""Speculators: token trees drafted by small speculative models (SSMs).

* Expansion-based: one SSM, a static expansion configuration <k1, ..., km>; at depth i every
  frontier node gets k_i children. The topology is static, so its parent/depth/ancestor arrays are
  built once on the host; the SSM scores a whole frontier per forward pass with tree attention.
  How children are drawn (``DRAFTS``), each entry recording the law it was drawn from:
  ``topk`` the SSM's top-k (deterministic: law one-hot, -1); ``iid`` k samples with replacement
  from the SSM's warped distribution q; ``wor`` k samples without replacement (Gumbel-top-k, in
  perturbed-score order = draw order); ``coupled`` the top-k of log q + G(seed, t), the same Gumbel
  noise seeded verification uses at position t. Greedy requests (temperature 0) always draft top-k.
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
import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax.errors import InputError
from specjax.speculation.tree import TokenTree, from_parents


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


def static_tree(expansion: Expansion, batch: int, tokens: jax.Array, entry_ok: jax.Array | None = None,
                law_rows: jax.Array | None = None) -> TokenTree:
    """The expansion's static topology as a TokenTree carrying ``tokens`` [B, N].

    entry_ok [B, N]: False drops node i as an entry of its parent (a draw that does not exist, e.g.
    without replacement from a law with fewer than k tokens). law_rows [B]: True makes every entry
    of node u declare law row u (sampled drafts); otherwise entries are one-hot (-1)."""
    t = _topology_tree(expansion)
    rep = lambda x: jnp.broadcast_to(jnp.asarray(x), (batch,) + x.shape[1:])
    children = rep(t.children)
    if entry_ok is not None:
        ok = jnp.take_along_axis(entry_ok, jnp.maximum(children, 0).reshape(batch, -1), axis=1)
        children = jnp.where(ok.reshape(children.shape), children, -1)
    node = jnp.arange(children.shape[1], dtype=jnp.int32)[None, :, None]
    law_row = jnp.full(children.shape, -1, jnp.int32)
    if law_rows is not None:
        law_row = jnp.where(law_rows[:, None, None] & (children >= 0), node, -1)
    return TokenTree(tokens=tokens, parent=rep(t.parent), depth=rep(t.depth), valid=rep(t.valid),
                     ancestor=rep(t.ancestor), children=children, law_row=law_row)


@functools.lru_cache(maxsize=64)
def _topology_tree(expansion: Expansion) -> TokenTree:
    """The static topology as host (numpy) arrays, built and validated once per expansion."""
    parents, _ = expansion.topology()
    with jax.ensure_compile_time_eval():  # may first be called while tracing a jitted step
        t = from_parents([[0] * len(parents)], [parents], n_max=len(parents))
        return jax.tree.map(np.asarray, t)


