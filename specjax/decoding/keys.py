"""Explicit PRNG keys: every random number derives from (seed, purpose, absolute position, slot).

Two disjoint key families hang off ``key(seed)``:

* ``sampling_key(seed, t) = fold_in(key(seed), t)`` with t < 2**31: the Gumbel noise G(seed, t) of
  incremental sampling (``specjax.sampling``) and of seeded verification and coupled drafting.
* ``purpose_key(seed, purpose, t, slot)``: verifier coins (one per entry slot), residual sampling
  and drafting noise, rooted at ``fold_in(key(seed), 2**31 + purpose)`` so they can never coincide
  with a sampling key. A key is either a parent (only folded) or a leaf (only drawn from), never
  both: JAX's random bits and ``fold_in`` run the same hash, so drawing from a parent could
  correlate with its children.

A request is identified by its seed: two requests with the same seed (and prompt) draw the same
random numbers, exactly as incremental sampling does; give requests distinct seeds for independent
samples. Keys are never reused: coins and residual noise are keyed by the absolute position they decide,
and each position is decided once; drafting noise is keyed by the root position of the step that
drafts (strictly increasing from step to step) plus the node and draw slot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

COIN = 1  # verifier acceptance coins, slot = entry index at the node
RESIDUAL = 2  # sampling from the residual / bonus distribution, slot 0
DRAFT = 3  # speculator drafting noise, slot = (SSM, node, draw)
_PURPOSE_BASE = 2**31  # positions stay below 2**31, so purpose roots never collide with sampling keys


def sampling_key(seed: jax.Array, position: jax.Array) -> jax.Array:
    return jax.random.fold_in(jax.random.key(seed), position)


def purpose_key(seed: jax.Array, purpose: int, position: jax.Array, slot: jax.Array | int = 0) -> jax.Array:
    root = jax.random.fold_in(jax.random.key(seed), jnp.uint32(_PURPOSE_BASE + purpose))
    return jax.random.fold_in(jax.random.fold_in(root, position), slot)


def uniform_coin(key: jax.Array) -> jax.Array:
    """xi ~ U[0, 1) in float32. It can be exactly 0.0, so acceptance tests must use a strict ``<``
    (xi * lambda(x) < r(x)): a token with r(x) = 0 is then never accepted."""
    return jax.random.uniform(key, (), jnp.float32)


def categorical_from_probs(key: jax.Array, probs: jax.Array, gumbel: jax.Array | None = None):
    """Sample from an unnormalised probability vector [V] by Gumbel-max over log(probs).

    Returns (token, ok). ok is False when probs has no positive finite mass: then the token is -2,
    never a silent 0 (jax.random.categorical over all -inf returns index 0). ``gumbel`` overrides the
    keyed noise (white-box tests)."""
    ok = jnp.all(jnp.isfinite(probs)) & jnp.all(probs >= 0) & (jnp.sum(probs) > 0)
    scores = jnp.where(probs > 0, jnp.log(jnp.where(probs > 0, probs, 1.0)), -jnp.inf)
    noise = jax.random.gumbel(key, probs.shape, jnp.float32) if gumbel is None else gumbel
    token = jnp.argmax(scores + noise).astype(jnp.int32)
    return jnp.where(ok, token, -2), ok
