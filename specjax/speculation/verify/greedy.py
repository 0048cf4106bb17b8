"""Greedy verification: follow the child whose token is the LLM's argmax; that argmax is the bonus token."""

from __future__ import annotations

import jax

from specjax.decoding.sampling import first_argmax
from specjax.speculation.tree import TokenTree
from specjax.speculation.verify.base import Verdict, follow


def verify_greedy(logits: jax.Array, tree: TokenTree, max_depth: int) -> Verdict:
    """logits: [B, N, V] LLM logits at every node; max_depth: static bound on the tree depth."""
    return follow(first_argmax(logits), tree, max_depth)
