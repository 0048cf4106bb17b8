"""TokenTree: a static-shape token tree per request, its ancestor bitmask, builders and validation.

Nodes are stored parents-before-children, padded to N (= N_max) nodes per request; node 0 is the
root = the last committed token, whose K/V is not cached yet. Node i sits at position
``length + depth[i]`` and attends to the committed prefix plus the tree slots set in its row of the
ancestor bitmask (itself and its ancestors). Padding nodes have an all-zero row.

Example, committed length 10, parents [-1, 0, 0, 1, 1, 2, 5]:

             0
           /   \\
          1     2
         / \\     \\
        3   4     5
                  |
                  6

``mask_diagram(tree, length=10)`` (row i: x = node i attends to tree slot j; then its position):

        0123456
      0 x......  10
      1 xx.....  11
      2 x.x....  11
      3 xx.x...  12
      4 xx..x..  12
      5 x.x..x.  12
      6 x.x..xx  13

``tests/test_tree.py`` asserts that this literal is exactly what the code renders for that tree.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.errors import InputError


class TreeError(InputError):
    """A token tree is malformed or does not fit its static limits."""


@struct.dataclass
class TokenTree:
    tokens: jax.Array  # [B, N] int32, token at each node (0 for padding)
    parent: jax.Array  # [B, N] int32, parent node index; -1 for the root and for padding
    depth: jax.Array  # [B, N] int32, root = 0; the node's position is length + depth
    valid: jax.Array  # [B, N] bool
    ancestor: jax.Array  # [B, N, W] uint32, W = ceil(N / 32): bit j of row i iff j is i or an ancestor
    children: jax.Array  # [B, N, K] int32, child node ids in DRAW ORDER (entries; may repeat), -1 pad
    law_row: jax.Array  # [B, N, K] int32, stored draft law each entry was drawn from; -1 = one-hot

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]


def num_words(num_nodes: int) -> int:
    return (num_nodes + 31) // 32


def ancestor_bits(parent: jax.Array, valid: jax.Array) -> jax.Array:
    """Jittable: [B, N] parents (parents before children) -> [B, N, W] uint32 ancestor bitmask."""
    batch, n = parent.shape
    words = num_words(n)
    node = jnp.arange(n)
    own = jnp.zeros((n, words), jnp.uint32).at[node, node // 32].set(jnp.uint32(1) << (node % 32).astype(jnp.uint32))

    def one_request(parent_b, valid_b):
        def body(i, rows):
            p = parent_b[i]
            inherited = jnp.where(p >= 0, rows[jnp.maximum(p, 0)], jnp.zeros((words,), jnp.uint32))
            row = jnp.where(valid_b[i], inherited | own[i], jnp.zeros((words,), jnp.uint32))
            return rows.at[i].set(row)

        return jax.lax.fori_loop(0, n, body, jnp.zeros((n, words), jnp.uint32))

    return jax.vmap(one_request)(parent, valid)


def ancestor_bits_host(parent: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """``ancestor_bits`` in numpy, for trees built on the host. Built with jax ops outside a jit,
    every op of the node loop compiled a program of its own (0.8 s per static topology at a
    command's start-up)."""
    batch, n = parent.shape
    rows = np.zeros((batch, n, num_words(n)), np.uint32)
    for b in range(batch):
        for i in range(n):
            if not valid[b, i]:
                continue
            if parent[b, i] >= 0:
                rows[b, i] = rows[b, parent[b, i]]
            rows[b, i, i // 32] |= np.uint32(1 << (i % 32))
    return rows


def _validate_request(b: int, tokens: Sequence[int], parents: Sequence[int], n_max: int, max_depth: int | None):
    n = len(parents)
    if n == 0:
        raise TreeError(f"request {b}: a tree needs at least the root node")
    if len(tokens) != n:
        raise TreeError(f"request {b}: {len(tokens)} tokens for {n} parent entries")
    if n > n_max:
        raise TreeError(f"request {b}: {n} nodes exceed the static tree size N_max={n_max}")
    if parents[0] != -1:
        raise TreeError(f"request {b}: node 0 must be the root (parent -1), got parent {parents[0]}")
    depth = [0] * n
    for i in range(1, n):
        p = parents[i]
        if p == i:
            raise TreeError(f"request {b}: node {i} is its own parent (cycle)")
        if p < 0:
            raise TreeError(f"request {b}: node {i} has parent {p}; only node 0 may be a root")
        if p > i:
            raise TreeError(f"request {b}: node {i} has parent {p} stored after it (parents must come "
                            f"before children; a cycle or an unsorted tree)")
        depth[i] = depth[p] + 1
        if max_depth is not None and depth[i] > max_depth:
            raise TreeError(f"request {b}: node {i} has depth {depth[i]} > max_depth={max_depth}")
    return depth


def from_parents(tokens: Sequence[Sequence[int]], parents: Sequence[Sequence[int]], n_max: int,
                 max_depth: int | None = None, max_children: int | None = None) -> TokenTree:
    """Build a batch of trees from per-request token and parent lists (host side, validated).

    Children entries are recorded in node order, which is the draw order for trees built this way.
    """
    return jax.tree.map(jnp.asarray, from_parents_host(tokens, parents, n_max, max_depth, max_children))


def from_parents_host(tokens: Sequence[Sequence[int]], parents: Sequence[Sequence[int]], n_max: int,
                      max_depth: int | None = None, max_children: int | None = None) -> TokenTree:
    """``from_parents`` with numpy arrays: no jax op runs, so it can be called while tracing."""
    if len(tokens) != len(parents) or not tokens:
        raise TreeError(f"need one token list per parent list, got {len(tokens)} and {len(parents)}")
    batch = len(parents)
    depths = [_validate_request(b, tokens[b], parents[b], n_max, max_depth) for b in range(batch)]
    kids = [[[] for _ in range(n_max)] for _ in range(batch)]
    for b in range(batch):
        for i in range(1, len(parents[b])):
            kids[b][parents[b][i]].append(i)
    widest = max((len(k) for req in kids for k in req), default=0)
    if max_children is not None and (isinstance(max_children, bool) or not isinstance(max_children, int)
                                     or max_children < 1):
        raise TreeError(f"max_children must be an int >= 1 (the children array's last axis), got {max_children!r}")
    k_max = max_children if max_children is not None else max(widest, 1)
    if widest > k_max:
        raise TreeError(f"a node has {widest} children, more than max_children={k_max}")
    tok = np.zeros((batch, n_max), np.int32)
    par = np.full((batch, n_max), -1, np.int32)
    dep = np.zeros((batch, n_max), np.int32)
    val = np.zeros((batch, n_max), bool)
    children = np.full((batch, n_max, k_max), -1, np.int32)
    for b in range(batch):
        n = len(parents[b])
        tok[b, :n], par[b, :n], dep[b, :n], val[b, :n] = tokens[b], parents[b], depths[b], True
        for i, ks in enumerate(kids[b]):
            children[b, i, :len(ks)] = ks
    return TokenTree(tokens=tok, parent=par, depth=dep, valid=val, ancestor=ancestor_bits_host(par, val),
                     children=children, law_row=np.full(children.shape, -1, np.int32))


def from_paths(root_tokens: Sequence[int], paths: Sequence[Sequence[Sequence[int]]], n_max: int,
               max_depth: int | None = None) -> TokenTree:
    """Build trees from token paths below each request's root: every distinct prefix becomes exactly
    one node (shared prefixes merge), nodes in first-appearance order."""
    all_tokens, all_parents = [], []
    for root, req_paths in zip(root_tokens, paths, strict=True):
        index: dict[tuple[int, ...], int] = {(): 0}
        toks, pars = [int(root)], [-1]
        for path in req_paths:
            for d in range(1, len(path) + 1):
                key = tuple(int(t) for t in path[:d])
                if key not in index:
                    index[key] = len(toks)
                    toks.append(key[-1])
                    pars.append(index[key[:-1]])
        all_tokens.append(toks)
        all_parents.append(pars)
    return from_parents(all_tokens, all_parents, n_max, max_depth)


def root_path(tree: TokenTree, b: int, i: int) -> list[int]:
    """Node ids from the root to node i (host side)."""
    parent = np.asarray(tree.parent[b])
    path = [i]
    while parent[path[-1]] >= 0:
        path.append(int(parent[path[-1]]))
    return path[::-1]


def mask_diagram(tree: TokenTree, b: int = 0, length: int = 0) -> str:
    """The ancestor mask of request b as text ('x' = visible), with each node's position."""
    n = int(np.asarray(tree.valid[b]).sum())
    words = np.asarray(tree.ancestor[b])
    depth = np.asarray(tree.depth[b])
    lines = ["    " + "".join(str(j % 10) for j in range(n))]
    for i in range(n):
        row = "".join("x" if (words[i, j // 32] >> (j % 32)) & 1 else "." for j in range(n))
        lines.append(f"{i:>3} {row}  {length + depth[i]}")
    return "\n".join(lines)
