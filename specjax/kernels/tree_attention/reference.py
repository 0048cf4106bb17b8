"""Deliberately naive tree attention, written independently of the kernel and of the XLA path.

It never looks at the bitmask: it walks parent pointers to find each node's ancestors and loops
over requests, nodes and heads in numpy: float64 by default (the tests' reference), or float32 (a
second float32 route, whose error against the float64 result is the tests' tolerance floor).
"""

from __future__ import annotations

import numpy as np

from specjax.kernels.tree_attention.validate import validate_tree_attention


def tree_attention_reference(q, k, v, lengths, parent, valid, scale: float, query_nodes=None,
                             dtype=np.float64) -> np.ndarray:
    """q: [B, T, H, Dh]; k, v: [B, S, KVH, Dh] with the tree's K/V at slots [length, length + N);
    parent, valid: [B, N] describe the whole tree; query_nodes: [B, T] node of each query (default
    0..T-1 with T = N). Returns [B, T, H, Dh] computed in ``dtype``; an invalid node sees only the
    prefix."""
    num_tree = np.shape(parent)[1]
    if query_nodes is None:
        validate_tree_attention(q, k, v, lengths, num_tree, "parent")
        query_nodes = np.broadcast_to(np.arange(num_tree), np.shape(parent))
    else:
        validate_tree_attention(q, k, v, lengths, np.shape(query_nodes)[1], "query_nodes", region=num_tree)
    q, k, v = (np.asarray(x, dtype) for x in (q, k, v))
    lengths, parent, valid = np.asarray(lengths), np.asarray(parent), np.asarray(valid)
    query_nodes = np.asarray(query_nodes)
    batch, num_queries, heads, head_dim = q.shape
    groups = heads // k.shape[2]
    out = np.zeros(q.shape, dtype)
    for b in range(batch):
        length = int(lengths[b])
        for i in range(num_queries):
            slots = list(range(length))
            if valid[b, query_nodes[b, i]]:
                node = int(query_nodes[b, i])
                while node >= 0:  # the node itself, then each ancestor up to the root
                    slots.append(length + node)
                    node = int(parent[b, node])
            if not slots:
                continue
            for h in range(heads):
                keys = k[b, slots, h // groups]  # [len(slots), Dh]
                scores = keys @ q[b, i, h] * dtype(scale)
                weights = np.exp(scores - scores.max())
                weights /= weights.sum()
                out[b, i, h] = weights @ v[b, slots, h // groups]
    return out
