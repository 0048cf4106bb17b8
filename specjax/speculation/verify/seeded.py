"""Seeded verification: the incremental sampler's own token at every node, keyed by absolute position."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.decoding.sampling import SamplingArrays, gumbel_noise
from specjax.models.output import SeededHead
from specjax.speculation.tree import TokenTree
from specjax.speculation.verify.base import Verdict, follow


def seeded_noise(sampling: SamplingArrays, length: jax.Array, rows: int, vocab: int,
                 fault: str | None = None) -> jax.Array:
    """[B, rows, V] float32: G(seed, t) at t = length + 1 .. length + rows, the noise a node of depth d
    adds to its scores (it decides the token at position length + d + 1); zeros where no request
    samples. One row per depth, not per node: siblings share their position's noise, and a row of
    threefry noise costs about a tenth of a millisecond here (49152 tokens, 2 AMD EPYC cores)."""
    offsets = 1 + jnp.arange(rows, dtype=jnp.int32)[None, :]
    base = jnp.zeros_like(length) if fault == "seeded_by_depth" else length  # the mutant keys by depth
    positions = base[:, None] + offsets

    def noisy(_):
        return jax.vmap(lambda t: gumbel_noise(sampling.seed, t, vocab), in_axes=1, out_axes=1)(positions)

    zeros = jnp.zeros((length.shape[0], rows, vocab), jnp.float32)
    return jax.lax.cond(jnp.any(sampling.sampled), noisy, lambda _: zeros, None)


def seeded_head(sampling: SamplingArrays, noise: jax.Array, tree: TokenTree) -> SeededHead:
    """What the tree pass is asked for: each node's seeded token, from its depth's row of ``noise``."""
    # Padding nodes' depths are whatever the merge left there (their tokens are never read); a real
    # node's depth is at most the tree's static depth, below the noise's rows.
    return SeededHead(sampling=sampling, noise=noise, row=jnp.where(tree.valid, tree.depth, 0))


def verify_seeded(token: jax.Array, tree: TokenTree, max_depth: int) -> Verdict:
    """Seeded verification: follow the incremental sampler's token at every node, token [B, N] (the
    tree pass's ``TokenOutput`` for ``seeded_head``)."""
    return follow(token, tree, max_depth)
