"""What a model forward returns, and the request for hidden states."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from specjax.decoding.sampling import SamplingArrays
from specjax.errors import InputError
from specjax.models.cache import KVCache


class ForwardOutput(NamedTuple):
    logits: jax.Array  # [B, T or K, V] float32
    cache: KVCache  # the block's K/V written to the scratch slots; length unchanged (block_only: the block's
    # K/V alone, [L, B, T, KVH, Dh], with the input's length)
    hidden: jax.Array | None = None  # [B, T or K, len(hidden), D]: hidden states entering the asked layers


class TokenOutput(NamedTuple):
    """What a forward asked for ``greedy`` or ``seeded`` returns in place of the logits: the LLM's own token
    at each position, what greedy and seeded verification read."""

    token: jax.Array  # [B, T or K] int32: greedy, each position's first argmax of its logits (``first_argmax``);
    # seeded, the token seeded sampling draws there (``specjax.decoding.sampling.seeded_tokens``)
    finite: jax.Array  # [B, T or K] bool: whether all its logits are finite (``finite_rows``)
    cache: KVCache  # as ForwardOutput's
    hidden: jax.Array | None = None  # as ForwardOutput's


class SeededHead(NamedTuple):
    """Asks a forward for the seeded sampler's token at each position instead of its logits (seeded
    verification): request b's token at position i is ``seeded_tokens`` of its logits with settings
    ``sampling[b]`` and noise ``noise[b, row[b, i]]``."""

    sampling: SamplingArrays  # [B] each request's settings
    noise: jax.Array  # [B, R, V] float32: rows of G(seed, t), zeros for greedy requests
    row: jax.Array  # [B, T or K] int32 in [0, R): each position's row of noise


def check_hidden(hidden, cfg) -> tuple[int, ...] | None:
    """A static, sorted-as-given tuple of layer indices in [0, L] (L = the final hidden state), or None."""
    if hidden is None:
        return None
    if not isinstance(hidden, tuple) or not hidden or any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i <= cfg.num_layers for i in hidden):
        raise InputError(f"hidden must be a non-empty tuple of layer indices in [0, {cfg.num_layers}] "
                         f"({cfg.num_layers} = the final hidden state), got {hidden!r}")
    return hidden


def capture(buffers: jax.Array | None, index, h: jax.Array, layers: tuple[int, ...] | None, select):
    """Record h (the input of layer ``index``) into buffers [n, B, K, D] where ``layers`` asks for it."""
    if not layers:
        return buffers
    picked = select(h)
    return jnp.stack([jnp.where(index == layer, picked, buffers[j]) for j, layer in enumerate(layers)])


def select_positions(h: jax.Array, logits_indices: jax.Array | None) -> jax.Array:
    """h: [B, T, D] -> [B, K, D] at logits_indices [B, K] (all T positions when None)."""
    if logits_indices is None:
        return h
    return jnp.take_along_axis(h, logits_indices[:, :, None], axis=1)
