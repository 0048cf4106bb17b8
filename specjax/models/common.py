"""Pieces shared by the model families: norms, RoPE, the cached attention block.

The layers run through ``specjax.models.layers.run_layers`` (one scan, or the pipeline of a mesh)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from specjax.attention import resolve_impl, tree_attention
from specjax.attention.meta import AttentionMeta
from specjax.attention.xla import attend, attend_written_token
from specjax.config import ModelConfig
from specjax.decoding.sampling import finite_rows, first_argmax, needs_filter, seeded_tokens
from specjax.kernels import cpu as cpu_kernels
from specjax.kernels.cpu import attention as cpu_attention
from specjax.kernels.cpu import greedy_head as cpu_greedy_head
from specjax.kernels.cpu import prefill_attention as cpu_prefill_attention
from specjax.models.params import GREEDY_HEAD, TIED_HEAD
from specjax.models.weights import PackedWeight, dense, packed_layer, weight_einsum

# Up to this many queries per request, a step program with the CPU kernels on (packed weights) runs
# its attention in ``specjax.kernels.cpu.attention``; prefill chunks run in
# ``specjax.kernels.cpu.prefill_attention`` where ``prefill`` marks them (``AttentionMeta.cpu_prefill``).
CPU_ATTENTION_MAX_QUERIES = 128


def compute_dtype(dtype) -> jnp.dtype:
    """Where accuracy matters (norms, RoPE angles, softmax, logits): float32 for float32 and bfloat16
    activations, float64 for a float64 run (the tests' reference: the same math, exact enough)."""
    return jnp.promote_types(dtype, jnp.float32)


def head_logits(h: jax.Array, params: dict, cfg: ModelConfig) -> jax.Array:
    """[B, T, D] final hidden states -> [B, T, V] logits in the compute dtype: ``lm_head`` [D, V], or for
    a tied model the embedding, read from its transposed copy where the split layout keeps one
    (``specjax.models.params.TIED_HEAD``)."""
    out = compute_dtype(h.dtype)
    head = params["lm_head"] if not cfg.tie_word_embeddings else params.get(TIED_HEAD)
    if isinstance(head, PackedWeight):  # a step program's copy for the CPU matmul kernel
        return dense(h, head).astype(out)
    if head is not None:
        return jnp.einsum("btd,dv->btv", h, head, preferred_element_type=out)
    return jnp.einsum("btd,vd->btv", h, params["embed"], preferred_element_type=out)


def head_outputs(h: jax.Array, params: dict, cfg: ModelConfig, greedy: bool, logits_of, seeded=None) -> tuple:
    """The head over final hidden states h [B, K, D] as (logits, token, finite): ``logits_of(h)``
    [B, K, V] and None, None; or with ``greedy`` None and each position's first argmax [B, K] int32 and
    whether its logits are all finite [B, K] (what greedy verification reads); or with ``seeded`` (a
    ``SeededHead``) None and the token seeded sampling draws at each position, with the finiteness (what
    seeded verification reads). Where a step program's params carry the greedy head (``GREEDY_HEAD``:
    the CPU kernels on, float32), those decisions come from ``specjax.kernels.cpu.greedy_head`` without
    the float32 logits; the same decisions as from them."""
    if seeded is not None:
        return (None, *_seeded_decision(h, params, cfg, seeded, logits_of))
    if not greedy:
        return logits_of(h), None, None
    head = params.get(GREEDY_HEAD)
    if head is not None and cfg.draft_vocab is None and h.dtype == jnp.float32:
        ids, finite = cpu_greedy_head.greedy_decision(h.reshape(-1, h.shape[-1]), head)
        return None, ids.reshape(h.shape[:-1]), finite.reshape(h.shape[:-1])
    logits = logits_of(h)
    return None, first_argmax(logits), finite_rows(logits)


def _seeded_decision(h: jax.Array, params: dict, cfg: ModelConfig, seeded, logits_of) -> tuple:
    """(token [B, K], finite [B, K]) of a ``SeededHead`` over h [B, K, D]."""
    batch, k = h.shape[:2]
    sampling, noise, row = seeded.sampling, seeded.noise, seeded.row

    def from_logits(h):
        logits = logits_of(h)  # [B, K, V]
        per_position = jax.tree.map(lambda a: jnp.repeat(a, k, axis=0), sampling)
        at = jnp.take_along_axis(noise, row[:, :, None], axis=1)  # [B, K, V]
        tokens = seeded_tokens(logits.reshape(batch * k, -1), per_position, at.reshape(batch * k, -1))
        return tokens.reshape(batch, k), finite_rows(logits)

    head = params.get(GREEDY_HEAD)
    if head is None or cfg.draft_vocab is not None or h.dtype != jnp.float32:
        return from_logits(h)

    def from_kernel(h):
        # Only at temperature 1 (or 0): the scores are then the logits plus the noise, one rounding on
        # every backend; at other temperatures XLA may or may not fuse the product into the sum (one
        # FMA), so those batches are decided from the full logits, as incremental sampling decides.
        inv = jnp.repeat(jnp.where(sampling.temperature > 0, 1.0, 0.0).astype(jnp.float32), k)
        rows = (jnp.arange(batch, dtype=jnp.int32)[:, None] * noise.shape[1] + row).reshape(-1)
        ids, finite = cpu_greedy_head.sampled_decision(h.reshape(batch * k, -1), head, inv,
                                                       noise.reshape(batch * noise.shape[1], -1), rows)
        return ids.reshape(batch, k), finite.reshape(batch, k)

    exact = ~needs_filter(sampling) & jnp.all((sampling.temperature == 0) | (sampling.temperature == 1))
    return jax.lax.cond(exact, from_kernel, from_logits, h)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(compute_dtype(x.dtype))
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(compute_dtype(x.dtype))
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    return ((xf - mean) * jax.lax.rsqrt(var + eps)).astype(x.dtype) * scale + bias


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse RoPE frequencies [head_dim // 2], with linear or llama3 scaling applied."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    rs = cfg.rope_scaling
    if rs is None:
        pass
    elif rs.kind == "linear":
        inv = inv / rs.factor
    elif rs.kind == "llama3":
        old = rs.original_max_position_embeddings
        low_wavelen = old / rs.low_freq_factor
        high_wavelen = old / rs.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
        smooth = (old / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    else:
        raise ValueError(f"unknown rope scaling kind {rs.kind!r}")
    return inv  # float64: cast to the activations' compute dtype where used


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """x: [B, T, H, Dh]; positions: [B, T] absolute positions. Half-split (HF) convention."""
    cd = compute_dtype(x.dtype)
    angles = positions.astype(cd)[:, :, None] * jnp.asarray(inv_freq, cd)[None, None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, T, 1, Dh]
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def write_block(cache: jax.Array, layer: jax.Array, new: jax.Array, lengths: jax.Array,
                slots: jax.Array | None = None) -> jax.Array:
    """Write new [B, T, KVH, Dh] into cache [L, B, S, KVH, Dh] at (layer, b, length[b] + slots[b, t]),
    slots defaulting to 0..T-1.

    Callers validate on the host that the slots fit; mode="drop" guarantees that an out-of-range
    slot can never clamp onto (and overwrite) a committed position.
    """
    batch, num_tokens = new.shape[:2]
    offsets = jnp.arange(num_tokens)[None, :] if slots is None else slots
    rows = jnp.arange(batch)[:, None]
    return cache.at[layer, rows, lengths[:, None] + offsets].set(new.astype(cache.dtype), mode="drop")


def project_qkv(x, lp, positions, inv_freq, bias: bool, num_heads: int):
    """x [B, T, D] -> q [B, T, H, Dh], k and v [B, T, KVH, Dh], RoPE applied at ``positions`` (None: no RoPE).
    Split layers hold q, k and v as one fused weight (``specjax.models.params.FUSED``): one matmul."""
    if "wqkv" in lp:
        qkv = weight_einsum("btd,dhk->bthk", x, lp["wqkv"])
        kv_heads = (qkv.shape[2] - num_heads) // 2
        q, k, v = qkv[:, :, :num_heads], qkv[:, :, num_heads:num_heads + kv_heads], qkv[:, :, num_heads + kv_heads:]
    else:
        q = weight_einsum("btd,dhk->bthk", x, lp["wq"])
        k = weight_einsum("btd,dhk->bthk", x, lp["wk"])
        v = weight_einsum("btd,dhk->bthk", x, lp["wv"])
    if bias:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    if inv_freq is not None:
        q = apply_rope(q, positions, inv_freq)
        k = apply_rope(k, positions, inv_freq)
    return q, k, v


def _cpu_attention(q, k_cache, lp) -> bool:
    """Whether this layer's attention runs in the CPU kernel: a step program's packed weights (the CPU
    kernels are on) where the attention kernel is built (AVX-512F or AVX2), float32, few queries, a
    head_dim the kernel takes."""
    return (packed_layer(lp) and cpu_kernels.attention_status() is None and q.dtype == jnp.float32
            and k_cache.dtype == jnp.float32
            and q.shape[1] <= CPU_ATTENTION_MAX_QUERIES and q.shape[-1] <= cpu_attention.max_head_dim())


def attention_block(x, lp, k_cache, v_cache, layer, positions, meta: AttentionMeta,
                    cfg: ModelConfig, inv_freq, bias: bool, prefix=None):
    """Self-attention of the block tokens over the cache of layer ``layer``.

    x: [B, T, D]; k_cache, v_cache: [L, B, S, KVH, Dh]. Returns (out [B, T, D], k_cache, v_cache).
    ``prefix``: (k, v) caches [L, B, S, KVH, Dh] read only (block-only passes, ``run_layers``); then
    ``k_cache, v_cache`` are the pass's block buffers [L, B, T, KVH, Dh] and receive the block's K/V.
    """
    q, k, v = project_qkv(x, lp, positions, inv_freq, bias, cfg.num_heads)
    scale = cfg.head_dim ** -0.5
    k, v = k.astype(k_cache.dtype), v.astype(v_cache.dtype)
    pallas_tree = meta.ancestor is not None and resolve_impl(meta.impl) == "pallas"  # the GPU tree kernel
    written = prefix is None
    if written:
        k_cache = write_block(k_cache, layer, k, meta.lengths, meta.slots)
        v_cache = write_block(v_cache, layer, v, meta.lengths, meta.slots)
        prefix = (k_cache, v_cache)
    elif pallas_tree:
        raise ValueError("the Pallas tree kernel reads the tree from the cache: it cannot run block-only")
    else:  # block-only: the cache is read, never written (no copy of it where it is shared)
        k_cache, v_cache = k_cache.at[layer].set(k), v_cache.at[layer].set(v)
    own_block = meta.slots is None and meta.region in (None, q.shape[1])  # the block is this pass's K/V
    if meta.cpu_prefill and meta.ancestor is None and own_block:  # prefill decided it can run there
        attn = cpu_prefill_attention.attend(q, prefix[0], prefix[1], layer, meta.lengths, k, v, scale)
    elif not pallas_tree and (written or own_block) and _cpu_attention(q, prefix[0], lp):
        ancestor = meta.ancestor if meta.ancestor is not None else cpu_attention.causal_ancestor(*q.shape[:2])
        block = (k, v) if own_block else (None, None)  # else: a frontier of the tree written in the cache
        attn = cpu_attention.attend(q, prefix[0], prefix[1], layer, meta.lengths, ancestor, meta.region or q.shape[1],
                                    scale, *block).astype(q.dtype)
    elif pallas_tree:
        attn = tree_attention(q, k_cache[layer], v_cache[layer], meta.lengths, meta.ancestor, scale=scale,
                              impl="pallas", region=meta.region)
    elif written and q.shape[1] == 1 and meta.ancestor is None and meta.slots is None:  # a decoding pass
        attn = attend_written_token(q, k, v, prefix[0], prefix[1], meta.lengths, scale, layer)
    else:  # prefix through a bucketed view + the block: prefill, tree passes, drafting
        attn = attend(q, k, v, prefix[0], prefix[1], meta, scale, layer=layer)
    out = weight_einsum("bthk,hkd->btd", attn, lp["wo"])
    if bias:
        out = out + lp["bo"]
    return out, k_cache, v_cache
