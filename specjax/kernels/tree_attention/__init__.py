"""Tree attention: one entry point, an XLA path and a Pallas kernel, plus an independent reference.

Query node i of request b sees the committed prefix ``[0, lengths[b])`` and the tree slot
``lengths[b] + j`` iff bit j of ``ancestor[b, i]`` is set. The tree's K/V must already sit in the
scratch slots ``[lengths[b], lengths[b] + N)`` of ``k``/``v``.
"""

from __future__ import annotations

import jax

from specjax.attention import AttentionMeta, attend_xla
from specjax.errors import InputError
from specjax.kernels.tree_attention.kernel import tree_attention_pallas
from specjax.kernels.tree_attention.reference import tree_attention_reference
from specjax.kernels.tree_attention.validate import validate_tree_attention

IMPLS = ("auto", "xla", "pallas")


def resolve_impl(impl: str) -> str:
    if impl not in IMPLS:
        raise InputError(f"tree attention impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    return impl


def tree_attention(q, k, v, lengths, ancestor, *, scale: float, impl: str = "auto"):
    """q: [B, N, H, Dh]; k, v: [B, S, KVH, Dh]; lengths: [B] int32; ancestor: [B, N, W] uint32."""
    validate_tree_attention(q, k, v, lengths, ancestor.shape[1], "ancestor")
    if ancestor.shape[2] * 32 < q.shape[1]:
        raise InputError(f"ancestor has {ancestor.shape[2]} uint32 words per row, too few for "
                         f"{q.shape[1]} nodes")
    impl = resolve_impl(impl)
    if impl == "xla":
        return attend_xla(q, k, v, AttentionMeta(lengths=lengths, ancestor=ancestor), scale=scale)
    return tree_attention_pallas(q, k, v, lengths, ancestor, scale=scale,
                                 interpret=jax.default_backend() != "gpu")


__all__ = ["tree_attention", "tree_attention_reference", "tree_attention_pallas", "validate_tree_attention",
           "resolve_impl", "IMPLS"]
