"""Pallas tree-attention kernel: flash-style online softmax over the prefix, then the tree slots.

Grid (batch, query head). Each program reads its KV head's cache rows in place (no transposed
copy of the cache): the committed prefix in blocks of ``block_k`` rows, then the tree's own
``N`` scratch rows starting at ``length``, where the ancestor bitmask decides visibility.
Runs compiled through the Triton backend on GPU and with ``interpret=True`` on CPU. Triton takes
power-of-two block shapes only: a head_dim that is not one (7, 12, 80, 96) is read as the next
power of two under a column mask, so the cache is never copied to pad it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

MIN_ROWS = 16  # tl.dot needs at least 16 rows; the tree is padded to a power of two >= this


def padded_tree_size(num_nodes: int) -> int:
    return max(MIN_ROWS, pl.next_power_of_2(num_nodes))


def _kernel(lengths_ref, q_ref, k_ref, v_ref, anc_ref, o_ref, *, region: int, region_padded: int,
            num_words: int, groups: int, block_k: int, scale: float, head_dim: int):
    # lengths_ref: [B] int32          q_ref: [B, TP, H, Dh]        k_ref, v_ref: [B, S, KVH, Dh]
    # anc_ref: [B, TP, W] uint32      o_ref: [B, TP, H, Dh]
    # TP = padded query count; the tree occupies `region` slots from `length`, loaded as RP rows.
    b, h = pl.program_id(0), pl.program_id(1)
    kvh = h // groups
    rows_padded = q_ref.shape[1]
    length = lengths_ref[b]
    dims_padded = pl.next_power_of_2(head_dim)
    padded = dims_padded != head_dim  # static: a power-of-two head_dim reads whole rows, no column mask
    cols = pl.ds(0, dims_padded)
    col_ok = jnp.arange(dims_padded) < head_dim

    def load(ref, rows_ok):  # [rows, DP]: masked rows (and padding columns) read as 0
        mask = rows_ok[:, None] & col_ok[None, :] if padded else rows_ok[:, None]
        return pl_triton.load(ref, mask=mask, other=0.0)

    if padded:
        q = load(q_ref.at[b, :, h, cols], jnp.ones((rows_padded,), bool))
    else:
        q = q_ref[b, :, h, :]
    q = q.astype(jnp.float32) * scale  # [NP, DP]

    def update(carry, k, v, mask):
        m, l, acc, bad = carry
        # Non-finite K/V rows (NaN-poisoned unused slots, overflowed activations) are zeroed, so they
        # cannot leak through 0 * NaN, and re-imposed as NaN on exactly the queries that see them.
        k, v = k.astype(jnp.float32), v.astype(jnp.float32)
        row_ok = (jnp.min(jnp.isfinite(k).astype(jnp.int32), axis=1) > 0) & \
            (jnp.min(jnp.isfinite(v).astype(jnp.int32), axis=1) > 0)  # [BK]
        k = jnp.where(row_ok[:, None], k, 0.0)
        v = jnp.where(row_ok[:, None], v, 0.0)
        bad = bad | (jnp.max((mask & ~row_ok[None, :]).astype(jnp.int32), axis=1) > 0)
        s = jnp.where(mask, jnp.dot(q, k.T), -jnp.inf)  # [NP, BK]
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows that saw nothing yet stay at 0
        p = jnp.exp(s - m_safe[:, None])
        alpha = jnp.exp(m - m_safe)
        return m_new, l * alpha + jnp.sum(p, axis=1), acc * alpha[:, None] + jnp.dot(p, v), bad

    def prefix_block(i, carry):
        start = i * block_k
        in_prefix = start + jnp.arange(block_k) < length
        k = load(k_ref.at[b, pl.ds(start, block_k), kvh, cols], in_prefix)
        v = load(v_ref.at[b, pl.ds(start, block_k), kvh, cols], in_prefix)
        mask = jnp.broadcast_to(in_prefix[None, :], (rows_padded, block_k))
        return update(carry, k, v, mask)

    carry = (jnp.full((rows_padded,), -jnp.inf, jnp.float32), jnp.zeros((rows_padded,), jnp.float32),
             jnp.zeros((rows_padded, dims_padded), jnp.float32), jnp.zeros((rows_padded,), bool))
    # int32 block count: under jax_enable_x64 a Python block_k would be int64, and lax.div refuses the mix
    carry = jax.lax.fori_loop(0, pl.cdiv(length, jnp.int32(block_k)), prefix_block, carry)

    # Tree phase: slot j of the tree lives at cache row length + j.
    j = jnp.arange(region_padded)
    real = j < region
    k = load(k_ref.at[b, pl.ds(length, region_padded), kvh, cols], real)
    v = load(v_ref.at[b, pl.ds(length, region_padded), kvh, cols], real)
    shift = (j % 32).astype(jnp.uint32)
    bits = jnp.zeros((rows_padded, region_padded), jnp.uint32)
    for w in range(num_words):  # static: W = ceil(N / 32) words per row
        word = anc_ref[b, :, w]  # [NP]
        bits = jnp.where((j // 32 == w)[None, :], (word[:, None] >> shift[None, :]) & jnp.uint32(1), bits)
    mask = (bits > 0) & real[None, :]
    m, l, acc, bad = update(carry, k, v, mask)
    out = acc / jnp.where(l == 0.0, 1.0, l)[:, None]  # a row that saw nothing outputs 0
    out = jnp.where(bad[:, None], jnp.nan, out)
    if padded:
        pl_triton.store(o_ref.at[b, :, h, cols], out.astype(o_ref.dtype), mask=col_ok[None, :])
    else:
        o_ref[b, :, h, :] = out.astype(o_ref.dtype)


def tree_attention_pallas(q, k, v, lengths, ancestor, *, scale: float, interpret: bool, region: int | None = None,
                          block_k: int = 32, num_warps: int = 4, num_stages: int = 2):
    """q: [B, T, H, Dh]; k, v: [B, S, KVH, Dh]; lengths: [B]; ancestor: [B, T, W] uint32; the tree
    occupies ``region`` (default T) slots from each request's length."""
    batch, num_nodes, heads, head_dim = q.shape
    region = num_nodes if region is None else region
    groups = heads // k.shape[2]
    rows_padded = padded_tree_size(num_nodes)
    pad = rows_padded - num_nodes
    q_p = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
    anc_p = jnp.pad(ancestor, ((0, 0), (0, pad), (0, 0)))  # padding rows see nothing of the tree
    kernel = functools.partial(_kernel, region=region, region_padded=padded_tree_size(region),
                               num_words=ancestor.shape[2], groups=groups, block_k=block_k, scale=scale,
                               head_dim=head_dim)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(q_p.shape, q.dtype),
        grid=(batch, heads),
        interpret=interpret,
        compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="tree_attention",
    )(lengths.astype(jnp.int32), q_p, k, v, anc_p)
    return out[:, :num_nodes]
