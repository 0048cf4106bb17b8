"""Kernels. ``tree_attention`` is the one entry point for attention over a token tree."""

from specjax.kernels.tree_attention import tree_attention

__all__ = ["tree_attention"]
