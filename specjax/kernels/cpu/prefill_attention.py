"""Attention of a prefill chunk over the stacked KV cache, for XLA:CPU (``prefill_attention.cc``): the
chunks ``specjax.decoding.incremental.prefill`` reads a prompt in.

Query t of request b (query head h, KV head h // G) attends to the committed prefix, slots
``[0, lengths[b])`` of ``layer`` in the cache, and causally to the chunk's own K/V (slots j <= t of
``k_block``, ``v_block``). This is ``specjax.attention.xla.attend`` for a causal chunk, with the same
rules for non-finite K/V (a query that sees one is NaN; no other query is touched) and results that
never depend on the buffer's length, the batch or threads.

Why: XLA's blocked prefill attention (scores, masks, maxima, exponentials, sums, each a pass through
memory) was over half of a 4096-token SmolLM2 prefill on 2 Xeon cores; the kernel keeps blocks of K
and V in L1 while a unit's query rows pass over them, with the softmax online
(``prefill_attention.cc`` says how). Built and loaded by ``specjax.kernels.cpu.build`` (AVX-512F only).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.kernels.cpu.attention import check_query_and_cache

TARGET = "specjax_cpu_prefill_attention"


def attend(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer, lengths: jax.Array,
           k_block: jax.Array, v_block: jax.Array, scale: float) -> jax.Array:
    """q [B, T, H, Dh] float32; k_cache, v_cache [L, B, S, KVH, Dh] float32, the prefix read from
    ``layer``; lengths [B] int; k_block, v_block [B, T, KVH, Dh] the chunk's own K/V. Returns
    [B, T, H, Dh] float32."""
    batch, num_q = q.shape[:2]
    check_query_and_cache("CPU prefill attention kernel", q, k_cache, v_cache, k_block, v_block)
    if k_block.shape != v_block.shape or k_block.shape != (batch, num_q) + k_cache.shape[3:]:
        raise ValueError(f"the chunk's K/V {k_block.shape} / {v_block.shape} is not [B, T={num_q}, KVH, Dh]")
    if lengths.shape != (batch,):
        raise ValueError(f"lengths {lengths.shape} is not [B={batch}]")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(q, k_cache, v_cache, k_block, v_block, jnp.asarray(layer, jnp.int32), lengths.astype(jnp.int32),
                scale=np.float32(scale))
