"""The speculative loop's state: per-slot arrays for everything a request owns, so a request can be
inserted into (or released from) a running batch between steps without touching the others."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specjax.decoding.sampling import SamplingArrays
from specjax.models.cache import KVCache

NO_STOP = -1  # pads each request's stop-token row (token ids are >= 0, so it never matches)


@struct.dataclass
class SpecState:
    """Loop state: B request slots, S cache slots, M output slots, D = max tree depth, E stop tokens.

    Every field but ``llm_passes`` has one row per slot (``KVCache`` leaves on their batch axis), so
    ``write_row`` can put a freshly prefilled request into any slot of a running batch. A free or
    finished slot has ``done`` set and is carried along unchanged.
    """

    llm_cache: KVCache  # committed LLM K/V; llm_cache.length[b] = position of request b's root
    drafter_states: tuple  # one pytree per drafter (an SSM's: its KV cache), batch-major rows
    history: jax.Array  # [B, S] int32, prompt + generated tokens; history[b, length[b]] = the root
    tokens: jax.Array  # [B, M] int32, generated tokens, PAD_TOKEN beyond num_generated
    num_generated: jax.Array  # [B] int32
    done: jax.Array  # [B] bool, finished (stop token, budget, failure) or free
    failed: jax.Array  # [B] bool, non-finite LLM logits or a residual without mass; the request stopped
    sampling: SamplingArrays  # [B] temperature / top-k / top-p / seed of each request
    max_new_tokens: jax.Array  # [B] int32, each request's budget (<= M)
    stop_ids: jax.Array  # [B, E] int32, each request's stop tokens, NO_STOP padded
    tokens_per_pass: jax.Array  # [B, D + 2] int32, per request: histogram over its passes of tokens emitted
    accepted_at_depth: jax.Array  # [B, max(D, 1)] int32, per request: accepted nodes at depth d + 1
    level_passes: jax.Array  # [B, L] int32, per request: its passes at each tree-budget level (L = 1 without)
    llm_passes: jax.Array  # [] int32, LLM forward passes of the batch (prefills included)


@struct.dataclass
class SpecOutput:
    tokens: jax.Array  # [B, M] int32
    num_generated: jax.Array  # [B] int32
    llm_passes: jax.Array  # [] int32
    tokens_per_pass: jax.Array  # [B, D + 2] int32 (sum over axis 0 for the batch's histogram)
    accepted_at_depth: jax.Array  # [B, max(D, 1)] int32
    level_passes: jax.Array  # [B, L] int32, passes at each tree-budget level
    failed: jax.Array  # [B] bool


def stop_hit(tokens: jax.Array, stop_ids: jax.Array) -> jax.Array:
    """tokens [B] or [B, K] -> bool of the same shape: the token is one of its request's stop tokens."""
    ids = stop_ids if tokens.ndim == 1 else stop_ids[:, None, :]
    return jnp.any(tokens[..., None] == ids, axis=-1)


def stop_rows(eos_ids: tuple[int, ...], batch: int) -> jax.Array:
    """The same stop tokens for every request: [B, max(1, len(eos_ids))]."""
    row = list(eos_ids) or [NO_STOP]
    return jnp.broadcast_to(jnp.asarray(row, jnp.int32), (batch, len(row)))


def greedy_sampling(batch: int) -> SamplingArrays:
    return SamplingArrays(temperature=jnp.zeros((batch,), jnp.float32), top_k=jnp.zeros((batch,), jnp.int32),
                          top_p=jnp.ones((batch,), jnp.float32), seed=jnp.zeros((batch,), jnp.int32))


def write_row(state: SpecState, row: SpecState, slot: jax.Array) -> SpecState:
    """``state`` with slot ``slot`` replaced by the single request of ``row`` (batch 1, same buffer
    sizes). The batch's pass counter is kept: the row's prefill pass is its own."""
    def put(big, small):
        if isinstance(big, KVCache):
            return KVCache(k=big.k.at[:, slot].set(small.k[:, 0]), v=big.v.at[:, slot].set(small.v[:, 0]),
                           length=big.length.at[slot].set(small.length[0]))
        return big.at[slot].set(small[0])

    rows = jax.tree.map(put, state.replace(llm_passes=None), row.replace(llm_passes=None),
                        is_leaf=lambda x: isinstance(x, KVCache))
    return rows.replace(llm_passes=state.llm_passes)


def release_row(state: SpecState, slot: jax.Array) -> SpecState:
    """Mark slot ``slot`` free: it stops and is skipped by every later step until a new insert."""
    return state.replace(done=state.done.at[slot].set(True))
