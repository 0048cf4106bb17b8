"""Tree attention: one entry point over the XLA path and the Pallas kernel (specjax.kernels.tree_attention).

Query i of request b sees the committed prefix ``[0, lengths[b])`` and the tree slot
``lengths[b] + j`` (j < region) iff bit j of ``ancestor[b, i]`` is set. The tree's K/V must already
sit in the scratch slots ``[lengths[b], lengths[b] + region)`` of ``k``/``v``. The queries may be
all N nodes of the tree (verification: region = N = T) or any subset of them (SSM drafting scores
one frontier per pass: T < region).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.attention.meta import AttentionMeta
from specjax.attention.xla import attend_xla
from specjax.errors import InputError
from specjax.kernels.tree_attention import (
    tree_attention_pallas,
    validate_tree_attention,
)

IMPLS = ("auto", "xla", "pallas")


def resolve_impl(impl: str) -> str:
    if impl not in IMPLS:
        raise InputError(f"tree attention impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    return impl


def tree_attention(q, k, v, lengths, ancestor, *, scale: float, impl: str = "auto", region: int | None = None):
    """q: [B, T, H, Dh]; k, v: [B, S, KVH, Dh]; lengths: [B] int32; ancestor: [B, T, W] uint32;
    region: tree slots N (default T)."""
    region = q.shape[1] if region is None else region
    # One ancestor table per request: a batch-1 table under a batch-2 q gave request 1 request 0's tree.
    if ancestor.ndim != 3 or ancestor.shape[0] != q.shape[0] or ancestor.dtype != jnp.uint32:
        raise InputError(f"ancestor must be [B={q.shape[0]}, T, W] uint32 bit rows, got {ancestor.dtype} "
                         f"{tuple(ancestor.shape)}")
    validate_tree_attention(q, k, v, lengths, ancestor.shape[1], "ancestor", region=region)
    if ancestor.shape[2] * 32 < region:
        raise InputError(f"ancestor has {ancestor.shape[2]} uint32 words per row, too few for a tree of "
                         f"{region} slots")
    impl = resolve_impl(impl)
    # Lengths known only inside a jit are not checked above. A request whose tree would run past the buffer
    # read clamped slots and got a finite, wrong row (the Pallas kernel on a GPU would read past the
    # buffer): it attends from length 0 instead, and its rows are NaN.
    over = lengths + region > k.shape[1]
    lengths = jnp.where(over, 0, lengths)
    if impl == "xla":
        meta = AttentionMeta(lengths=lengths, ancestor=ancestor, region=region)
        return _poison(attend_xla(q, k, v, meta, scale=scale), over)
    # The Triton kernel where the program is lowered for a GPU, the interpreter elsewhere: chosen per
    # lowering platform, not by this host's backend (a CUDA export from a CPU host embedded the interpreter).
    def run(interpret: bool):
        return lambda *args: tree_attention_pallas(*args, scale=scale, region=region, interpret=interpret)

    out = jax.lax.platform_dependent(q, k, v, lengths, ancestor, cuda=run(False), rocm=run(False),
                                     default=run(True))
    return _poison(out, over)


def _poison(out, rows):
    return jnp.where(rows[:, None, None, None], jnp.nan, out)
