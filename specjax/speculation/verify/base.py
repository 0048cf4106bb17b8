"""What every verifier returns, and the walk that follows the LLM's own token down the tree."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specjax.speculation.tree import TokenTree


@struct.dataclass
class Verdict:
    path: jax.Array  # [B, D + 1] node ids, path[:, 0] = 0 (root), accepted nodes in depth order, -1 pad
    num_accepted: jax.Array  # [B] int32, accepted tree nodes below the root (0..D)
    bonus: jax.Array  # [B] int32, the LLM's own token after the accepted path
    emitted: jax.Array  # [B, D + 1] int32, accepted tokens then the bonus token; garbage beyond
    ok: jax.Array  # [B] bool, False if a residual had no probability mass (NaN logits): never a silent 0
    residual: jax.Array | None = None  # [B, V] the law the final token was drawn from (sampled rules only)


def follow(target: jax.Array, tree: TokenTree, max_depth: int) -> Verdict:
    """Walk down children whose token equals the LLM's token target [B, N] at the current node."""
    batch = target.shape[0]
    rows = jnp.arange(batch)

    # A loop, not unrolled: every budget level of a step program verifies its own tree, and unrolled
    # walks of up to 9 steps were ~360 of the default SmolLM2 loop's ~2,000 fusions.
    def step(depth, carry):
        node, alive, path, emitted, accepted = carry
        want = target[rows, node]  # [B]
        match = tree.valid & (tree.parent == node[:, None]) & (tree.tokens == want[:, None])
        found = alive & jnp.any(match, axis=1)
        child = jnp.argmax(match, axis=1).astype(jnp.int32)  # equal-token siblings: identical contexts
        node = jnp.where(found, child, node)
        path = path.at[:, depth].set(jnp.where(found, child, -1))
        emitted = emitted.at[:, depth - 1].set(jnp.where(found, want, emitted[:, depth - 1]))
        return node, found, path, emitted, accepted + found.astype(jnp.int32)

    start = (jnp.zeros((batch,), jnp.int32), jnp.ones((batch,), bool),
             jnp.full((batch, max_depth + 1), -1, jnp.int32).at[:, 0].set(0),
             jnp.zeros((batch, max_depth + 1), jnp.int32), jnp.zeros((batch,), jnp.int32))
    node, _, path, emitted, accepted = jax.lax.fori_loop(1, max_depth + 1, step, start)
    bonus = target[rows, node]
    emitted = emitted.at[rows, accepted].set(bonus)
    return Verdict(path=path, num_accepted=accepted, bonus=bonus, emitted=emitted, ok=jnp.ones((batch,), bool))
