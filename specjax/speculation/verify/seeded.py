"""Seeded verification: the incremental sampler's own token at every node, keyed by absolute position."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.decoding.sampling import SamplingArrays, sample_tokens
from specjax.speculation.tree import TokenTree
from specjax.speculation.verify.base import Verdict, follow


def verify_seeded(logits: jax.Array, tree: TokenTree, sampling: SamplingArrays, length: jax.Array,
                  max_depth: int, fault: str | None = None) -> Verdict:
    """Seeded verification: the incremental sampler's token at every node, keyed by the absolute
    position length + depth + 1 of the token it decides."""
    batch, n, vocab = logits.shape
    position = length[:, None] + tree.depth + 1
    if fault == "seeded_by_depth":
        position = tree.depth + 1
    per_node = jax.tree.map(lambda a: jnp.repeat(a, n, axis=0), sampling)  # request b's settings at its nodes
    target = sample_tokens(logits.reshape(batch * n, vocab), per_node, position.reshape(-1)).reshape(batch, n)
    return follow(target, tree, max_depth)
