"""Attention of a few queries per request over the stacked KV cache, for XLA:CPU (``attention.cc``):
the decode steps, tree passes and drafting passes of the CPU step programs.

Query t of request b (query head h, KV head h // G) attends to the committed prefix, slots
``[0, lengths[b])`` of ``layer`` in the cache, and to the block slots j < region whose bit j is set
in ``ancestor[b, t]`` (the pass's own K/V, or the tree written in the cache at ``lengths[b] + j``);
a causal block is the tree whose row t has bits 0..t (``causal_ancestor``). This is
``specjax.attention.xla.attend`` over a cache whose block is written, with the same rules for what
cannot be seen and for non-finite K/V (a query that sees one is NaN; no other query is touched),
and results that never depend on the buffer's length or the batch.

Why: XLA runs that attention as a chain of small ops per layer, each a pass through memory, and a
view of the cache transposed per layer; at 17 nodes over a 300-token prefix it cost 12.9 ms of a
48.8 ms SmolLM2 tree pass on 2 Xeon cores, 3.6 ms in the kernel, which reads each K/V row once per
call and keeps scores and outputs in registers and L1 (``attention.cc`` says how). Built and
loaded by ``specjax.kernels.cpu.build`` (AVX-512F, or AVX2 with FMA and F16C: ``vec16.h``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.kernels.cpu.build import library

TARGET = "specjax_cpu_attention"


def max_head_dim() -> int:
    """The largest head_dim the kernel takes (128); builds the kernels if needed."""
    return int(library().specjax_cpu_attention_max_head_dim())


def causal_ancestor(batch: int, num_queries: int) -> jax.Array:
    """uint32 [batch, T, ceil(T / 32)]: query t sees block slots 0..t."""
    j = np.arange(-(-num_queries // 32) * 32)
    bits = (j[None, :] <= np.arange(num_queries)[:, None]).reshape(num_queries, -1, 32)
    words = (bits.astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(-1).astype(np.uint32)
    return jnp.broadcast_to(jnp.asarray(words), (batch,) + words.shape)


def check_query_and_cache(kernel: str, q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, *more: jax.Array):
    """What both attention kernels (this one and ``prefill_attention``) check before XLA lowers their
    call: every array float32, and a cache [L, B, S, KVH, Dh] that q [B, T, H, Dh] reads (head_dim at
    most ``max_head_dim()``). Also builds the kernels and registers their targets."""
    limit = max_head_dim()
    arrays = (q, k_cache, v_cache, *more)
    if any(x.dtype != jnp.float32 for x in arrays):
        raise TypeError(f"the {kernel} is float32 only, got {[str(x.dtype) for x in arrays]}")
    batch, _, heads, head_dim = q.shape
    if (k_cache.ndim != 5 or k_cache.shape != v_cache.shape or k_cache.shape[1] != batch
            or k_cache.shape[4] != head_dim or heads % k_cache.shape[3] or head_dim > limit):
        raise ValueError(f"q {q.shape} does not match the cache {k_cache.shape} / {v_cache.shape} "
                         f"(head_dim at most {limit})")


def attend(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer, lengths: jax.Array,
           ancestor: jax.Array, region: int, scale: float, k_block: jax.Array | None = None,
           v_block: jax.Array | None = None) -> jax.Array:
    """q [B, T, H, Dh] float32; k_cache, v_cache [L, B, S, KVH, Dh] float32, the prefix read from
    ``layer``; lengths [B] int; ancestor uint32 [B, T, W], W * 32 >= region. The block: k_block,
    v_block [B, region, KVH, Dh], or (None) the cache slots ``lengths[b] + j`` where it is written.
    Returns [B, T, H, Dh] float32."""
    batch, num_q = q.shape[:2]
    in_cache = k_block is None
    if in_cache:
        k_block = v_block = jnp.zeros((0,), jnp.float32)
    check_query_and_cache("CPU attention kernel", q, k_cache, v_cache, k_block, v_block)
    if not in_cache and (k_block.shape != v_block.shape
                         or k_block.shape != (batch, region) + k_cache.shape[3:]):
        raise ValueError(f"the block {k_block.shape} / {v_block.shape} is not [B, region={region}, KVH, Dh]")
    if ancestor.shape[:2] != (batch, num_q) or ancestor.shape[2] * 32 < region or region < 0:
        raise ValueError(f"ancestor {ancestor.shape} does not cover {num_q} queries x {region} tree slots")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(q, k_cache, v_cache, k_block, v_block, jnp.asarray(layer, jnp.int32), lengths.astype(jnp.int32),
                ancestor.astype(jnp.uint32), scale=np.float32(scale), region=np.int64(region),
                block_in_cache=in_cache)
