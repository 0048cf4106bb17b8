"""Greedy verification: follow the child whose token is the LLM's argmax; that argmax is the bonus token."""

from __future__ import annotations

import jax

from specjax.speculation.tree import TokenTree
from specjax.speculation.verify.base import Verdict, follow


def verify_greedy(argmax: jax.Array, tree: TokenTree, max_depth: int) -> Verdict:
    """argmax: [B, N] the LLM's first argmax at every node (``first_argmax`` of its logits, or the
    forward's ``greedy`` output); max_depth: static bound on the tree depth."""
    return follow(argmax, tree, max_depth)
