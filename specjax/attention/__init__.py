"""Attention over the KV cache with explicit metadata: ``AttentionMeta`` (committed lengths, an
optional ancestor bitmask), the XLA path, and the tree-attention entry point (XLA or the Pallas
kernel of ``specjax.kernels.tree_attention``). One forward serves prefill, decoding, tree
verification and drafting."""

from specjax.attention.meta import AttentionMeta, causal_meta
from specjax.attention.tree import IMPLS, resolve_impl, tree_attention
from specjax.attention.xla import attend, attend_xla, prefix_views

__all__ = ["AttentionMeta", "causal_meta", "attend", "attend_xla", "prefix_views", "tree_attention", "resolve_impl",
           "IMPLS"]
