"""Attention metadata: committed lengths, an optional ancestor bitmask, and the visibility mask it defines."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class AttentionMeta:
    lengths: jax.Array  # [B] int32, committed positions per request
    ancestor: jax.Array | None = None  # [B, T, W] uint32 bit words, or None for causal
    slots: jax.Array | None = None  # [B, T] int32 tree slot of each token; None = 0..T-1
    region: int | None = struct.field(pytree_node=False, default=None)  # tree slots (N); None = T
    impl: str = struct.field(pytree_node=False, default="auto")  # tree attention: auto | xla | pallas
    # A prefill chunk whose causal attention runs in the CPU prefill kernel
    # (``specjax.kernels.cpu.prefill_attention``); set by ``specjax.decoding.incremental.prefill``.
    cpu_prefill: bool = struct.field(pytree_node=False, default=False)
    # The cache holds nothing before this pass (training from position 0): the prefix is not read. Besides
    # the read, this keeps a pass of many queries differentiable: the blocked prefix loop's trip count
    # depends on the lengths, which reverse-mode differentiation cannot follow.
    empty_prefix: bool = struct.field(pytree_node=False, default=False)


def causal_meta(lengths: jax.Array, cpu_prefill: bool = False, empty_prefix: bool = False) -> AttentionMeta:
    return AttentionMeta(lengths=lengths.astype(jnp.int32), ancestor=None, cpu_prefill=cpu_prefill,
                         empty_prefix=empty_prefix)
