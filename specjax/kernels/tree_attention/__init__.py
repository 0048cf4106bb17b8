"""The tree-attention kernel package: the Pallas kernel, an independently written naive reference,
and the input validation both share (so they reject the same inputs). The entry point that picks
the XLA path or this kernel is ``specjax.attention.tree_attention``."""

from specjax.kernels.tree_attention.kernel import (
    padded_tree_size,
    tree_attention_pallas,
)
from specjax.kernels.tree_attention.reference import tree_attention_reference
from specjax.kernels.tree_attention.validate import validate_tree_attention

__all__ = ["tree_attention_pallas", "tree_attention_reference", "validate_tree_attention", "padded_tree_size"]
