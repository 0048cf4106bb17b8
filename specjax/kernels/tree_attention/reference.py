"""Deliberately naive tree attention, written independently of the kernel and of the XLA path.

It never looks at the bitmask: it walks parent pointers to find each node's ancestors and loops
over requests, nodes and heads in float64 numpy.
"""

from __future__ import annotations

import numpy as np

from specjax.kernels.tree_attention.validate import validate_tree_attention


def tree_attention_reference(q, k, v, lengths, parent, valid, scale: float) -> np.ndarray:
    """q: [B, N, H, Dh]; k, v: [B, S, KVH, Dh] with the tree's K/V at slots [length, length + N);
    parent, valid: [B, N]. Returns float32 [B, N, H, Dh]; an invalid node sees only the prefix."""
    validate_tree_attention(q, k, v, lengths, np.shape(parent)[1], "parent")
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    lengths, parent, valid = np.asarray(lengths), np.asarray(parent), np.asarray(valid)
    batch, num_nodes, heads, head_dim = q.shape
    groups = heads // k.shape[2]
    out = np.zeros(q.shape, np.float64)
    for b in range(batch):
        length = int(lengths[b])
        for i in range(num_nodes):
            slots = list(range(length))
            if valid[b, i]:
                node = i
                while node >= 0:  # the node itself, then each ancestor up to the root
                    slots.append(length + node)
                    node = int(parent[b, node])
            if not slots:
                continue
            for h in range(heads):
                keys = k[b, slots, h // groups]  # [len(slots), Dh]
                scores = keys @ q[b, i, h] * scale
                weights = np.exp(scores - scores.max())
                weights /= weights.sum()
                out[b, i, h] = weights @ v[b, slots, h // groups]
    return out.astype(np.float32)
