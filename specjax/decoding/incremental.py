"""Incremental decoding, the reference decoder: jitted prefill + one ``lax.while_loop`` decode.

``generate_incremental`` is a pure, jittable function of arrays (call it inside your own
``jax.jit``); ``decode_init`` + ``decode_step`` are its host-loop twin (one call per LLM pass, the
state donated), used for streaming; ``specjax.api.generate`` is the host wrapper that tokenises,
buckets and detokenises. Non-finite logits (NaN weights, overflow) fail the request: it stops and
emits nothing more, never a token read off a NaN row.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from specjax.attention.meta import causal_meta
from specjax.config import ModelConfig
from specjax.decoding.contract import check_batch
from specjax.decoding.host_step import steps_while_active
from specjax.decoding.programs import prefill_kernel_enabled
from specjax.decoding.sampling import SamplingArrays, finite_rows, sample_tokens
from specjax.kernels.cpu.attention import max_head_dim
from specjax.models import forward
from specjax.models.cache import KVCache, init_cache
from specjax.x32 import in_32_bit

PAD_TOKEN = -1  # fills the unused tail of the output buffer


@struct.dataclass
class DecodeState:
    """Loop state of incremental decoding (B requests, M = output buffer length)."""

    cache: KVCache  # committed K/V; cache.length[b] = tokens of request b whose K/V is cached
    last_token: jax.Array  # [B] int32, newest token of each request; its K/V is not cached yet
    tokens: jax.Array  # [B, M] int32, generated tokens, PAD_TOKEN beyond num_generated
    num_generated: jax.Array  # [B] int32
    done: jax.Array  # [B] bool, request finished (EOS, max_new_tokens or failure)
    failed: jax.Array  # [B] bool, the LLM gave non-finite logits: the request stopped, nothing invented
    llm_passes: jax.Array  # [] int32, LLM forward passes so far (prefill included)


@struct.dataclass
class GenerateOutput:
    tokens: jax.Array  # [B, M] int32, generated tokens (prompt excluded), PAD_TOKEN padded
    num_generated: jax.Array  # [B] int32
    llm_passes: jax.Array  # [] int32
    failed: jax.Array  # [B] bool


def is_eos(tokens: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
    if not eos_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(eos_ids, jnp.int32))


# Prompts are read in chunks (chunked prefill), each chunk attending to what the earlier ones wrote plus
# itself causally: chunks of each size of PREFILL_CHUNKS in turn, each size while the rest of the
# longest prompt exceeds that size less the smallest one, so at most one 256-token chunk and at most
# three 64-token ones follow the 512-token chunks (4 x 64 tokens cost more than one 256-token chunk:
# 98 vs ~266 ms each, SmolLM2 on 2 Xeon cores). A prompt costs its own length (rounded up to the
# smallest size) whatever the width of the array it arrives in, so one compiled program serves every
# prompt length (``specjax.api`` pads prompts to the width of their cache bucket). Measured on 2 Xeon
# cores (float32, SmolLM2-135M, alternating in one process): 1024/2048/4096-token prompts at
# 779/639/509 tok/s with 256-token chunks, 835/687/545 with 512 (the attention's score blocks have
# 1.5k rows: fewer, fuller products per key block). Larger chunks lost: 593 tok/s at 2048 with
# 1024-token chunks.
PREFILL_CHUNKS = (512, 256, 64)


def chunk_sizes(width: int) -> list[int]:
    """The chunk sizes of a prompt array ``width`` tokens wide, largest first: no chunk wider than the
    array, so narrow prompts (a wide batch of short ones) run in one pass."""
    return sorted({min(size, width) for size in PREFILL_CHUNKS}, reverse=True)


def pad_for_chunks(x: jax.Array, axis: int = 1) -> jax.Array:
    """``x`` padded along ``axis`` (its width) so that every chunk ``run_chunks`` slices is in range."""
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, -x.shape[axis] % chunk_sizes(x.shape[axis])[0])
    return jnp.pad(x, pad)


def run_chunks(run_chunk, longest: jax.Array, width: int, carry):
    """``carry = run_chunk(start, size, carry)`` over the chunks (PREFILL_CHUNKS) covering the first
    ``longest`` positions of an array ``width`` wide (padded by ``pad_for_chunks``): only the chunks the
    longest row needs run (dynamic trip counts), whatever the width."""
    sizes = chunk_sizes(width)
    small = sizes[-1]
    done = jnp.int32(0)  # positions the chunks so far cover
    for size in sizes:
        # chunks of this size while the rest exceeds size - small: what is left after them fits the
        # smaller sizes (at most three chunks of the smallest); a negative rest (> -small) runs none
        count = (longest - done + small - 1) // size
        carry = jax.lax.fori_loop(0, count, lambda c, carry, start=done, size=size: run_chunk(start + c * size,
                                                                                             size, carry), carry)
        done = done + count * size
    return carry


def cpu_prefill_route(params, cfg: ModelConfig, parallel=None) -> bool:
    """Whether causal chunks (prefill, teacher-forced passes) run their attention in the CPU prefill
    kernel (``specjax.kernels.cpu.prefill_attention``): one float32 model on one device with the CPU
    prefill kernel on (AVX-512F); at 4096 tokens XLA's attention took over half the prefill."""
    return (parallel is None and jax.tree.leaves(params)[0].dtype == jnp.float32 and prefill_kernel_enabled()
            and cfg.head_dim <= max_head_dim())


def prefill(params, prompt_tokens: jax.Array, prompt_lens: jax.Array, cache: KVCache, cfg: ModelConfig,
            parallel=None, hidden: tuple[int, ...] | None = None):
    """Run the right-padded prompts [B, T] through the model; returns (logits at each last prompt
    token [B, V], cache with length = prompt_lens). Padding slots are written but never committed.
    ``hidden`` (layer indices, as ``specjax.models.forward`` takes them): also return the hidden states
    at every prompt position, [B, T, len(hidden), D] (a third result).

    Chunked (see PREFILL_CHUNKS): chunk c attends to the positions already written plus itself
    causally, so attention costs the causal triangle, never [T, cache length], and the memory of one
    chunk's scores. Only the chunks the longest prompt of the batch needs run (dynamic trip counts):
    positions past it are never computed, whatever T is. A chunk's slots past the cache are dropped.
    """
    batch, num_tokens = prompt_tokens.shape
    lens = prompt_lens.astype(jnp.int32)
    padded = pad_for_chunks(prompt_tokens)
    dtype = jnp.promote_types(jax.tree.leaves(params)[0].dtype, jnp.float32)
    cpu_prefill = cpu_prefill_route(params, cfg, parallel)
    states = None
    if hidden:
        states = jnp.zeros((batch, padded.shape[1], len(hidden), cfg.hidden_size), dtype)

    def run_chunk(start, size, carry):
        cache, logits, states = carry
        tokens = jax.lax.dynamic_slice_in_dim(padded, start, size, axis=1)
        positions = jnp.broadcast_to(start + jnp.arange(size, dtype=jnp.int32), (batch, size))
        last = jnp.clip(lens - 1 - start, 0, size - 1)
        meta = causal_meta(jnp.full((batch,), start, jnp.int32), cpu_prefill)
        out = forward(params, tokens, positions, cache, meta, cfg, logits_indices=last[:, None], parallel=parallel,
                      hidden=hidden, all_hidden=bool(hidden))
        if hidden:
            states = jax.lax.dynamic_update_slice_in_dim(states, out.hidden.astype(dtype), start, axis=1)
        here = (lens - 1 >= start) & (lens - 1 < start + size)  # this chunk holds the last prompt token
        return out.cache, jnp.where(here[:, None], out.logits[:, 0].astype(dtype), logits), states

    carry = (cache, jnp.zeros((batch, cfg.vocab_size), dtype), states)
    cache, logits, states = run_chunks(run_chunk, jnp.max(lens), num_tokens, carry)
    result = (logits, cache.replace(length=lens))
    return result + (states[:, :num_tokens],) if hidden else result


def decode_step(params, state: DecodeState, sampling: SamplingArrays, max_new_tokens: jax.Array,
                cfg: ModelConfig, eos_ids: tuple[int, ...], parallel=None) -> DecodeState:
    """Feed each request's last token, commit it, sample the next one (for active requests)."""
    cache = state.cache
    logits, cache, _ = forward(params, state.last_token[:, None], cache.length[:, None], cache,
                            causal_meta(cache.length), cfg, parallel=parallel)
    ok = finite_rows(logits[:, 0])
    failed = state.failed | (~state.done & ~ok)
    active = ~state.done & ok
    new_length = cache.length + (~state.done).astype(jnp.int32)  # the fed token's K/V is committed
    next_token = sample_tokens(logits[:, 0], sampling, positions=new_length)
    rows = jnp.arange(state.tokens.shape[0])
    slot = jnp.where(active, state.num_generated, state.tokens.shape[1])  # out of range -> dropped
    tokens = state.tokens.at[rows, slot].set(next_token, mode="drop")
    num_generated = state.num_generated + active.astype(jnp.int32)
    done = state.done | failed | is_eos(next_token, eos_ids) | (num_generated >= max_new_tokens)
    return DecodeState(cache=cache.replace(length=new_length),
                       last_token=jnp.where(active, next_token, state.last_token),
                       tokens=tokens, num_generated=num_generated, done=done, failed=failed,
                       llm_passes=state.llm_passes + 1)


@in_32_bit
def decode_init(params, prompt_tokens: jax.Array, prompt_lens: jax.Array, max_new_tokens: jax.Array,
                sampling: SamplingArrays, *, cfg: ModelConfig, cache_len: int, max_out: int,
                eos_ids: tuple[int, ...] = (), parallel=None) -> DecodeState:
    """Prefill and sample each request's first token: the loop state before the first decode step."""
    check_batch(prompt_tokens, prompt_lens, max_new_tokens, sampling, cache_len=cache_len, max_out=max_out,
                where="generate_incremental")
    batch = prompt_tokens.shape[0]
    dtype = jax.tree.leaves(params)[0].dtype
    cache = init_cache(cfg, batch, cache_len, dtype)
    if parallel is not None:
        cache = parallel.constrain_cache(cache, cfg)
    logits, cache = prefill(params, prompt_tokens, prompt_lens, cache, cfg, parallel)
    ok = finite_rows(logits)
    first = sample_tokens(logits, sampling, positions=prompt_lens)
    tokens = jnp.full((batch, max_out), PAD_TOKEN, jnp.int32).at[:, 0].set(jnp.where(ok, first, PAD_TOKEN))
    return DecodeState(cache=cache, last_token=first, tokens=tokens, num_generated=ok.astype(jnp.int32),
                       done=~ok | is_eos(first, eos_ids) | (max_new_tokens <= 1), failed=~ok,
                       llm_passes=jnp.ones((), jnp.int32))


@in_32_bit
def generate_incremental(params, prompt_tokens: jax.Array, prompt_lens: jax.Array,
                         max_new_tokens: jax.Array, sampling: SamplingArrays, *, cfg: ModelConfig,
                         cache_len: int, max_out: int, eos_ids: tuple[int, ...] = (),
                         parallel=None) -> GenerateOutput:
    """Incremental decoding of a batch of right-padded prompts. Pure and jittable.

    prompt_tokens: [B, T] int32 (right-padded); prompt_lens: [B] >= 1; max_new_tokens: [B] in
    [1, max_out]. Static: cfg, cache_len (>= T and >= max(prompt_len + max_new_tokens)), max_out,
    parallel (a ``specjax.sharding.Parallel``: the cache is pinned to its sharding and pp > 1 runs
    the layers as a pipeline; None = whatever device the inputs are on; a pipelined mesh of several
    CPU devices in one process is warned against: ``Parallel.one_pass_per_call``).
    Shapes are checked at trace time and values where they are concrete (``specjax.decoding.contract``);
    inside jit the value bounds are the caller's contract (the host wrapper meets them).
    """
    state = decode_init(params, prompt_tokens, prompt_lens, max_new_tokens, sampling, cfg=cfg, cache_len=cache_len,
                        max_out=max_out, eos_ids=eos_ids, parallel=parallel)
    return finish_incremental(params, state, sampling, max_new_tokens, cfg=cfg, eos_ids=eos_ids, parallel=parallel)


@in_32_bit
def finish_incremental(params, state: DecodeState, sampling: SamplingArrays, max_new_tokens: jax.Array,
                       cfg: ModelConfig, eos_ids: tuple[int, ...] = (), parallel=None) -> GenerateOutput:
    """The loop of ``generate_incremental`` after ``decode_init``: one step per token until every
    request is done (its own program in ``specjax.generate``, see ``specjax.decoding.programs``)."""
    if parallel is not None:
        parallel.warn_multi_pass("a whole incremental decoding loop")

    def cond(state: DecodeState):
        return jnp.any(~state.done)  # some request still needs tokens

    step = functools.partial(decode_step, params, sampling=sampling, max_new_tokens=max_new_tokens,
                             cfg=cfg, eos_ids=eos_ids, parallel=parallel)
    state = jax.lax.while_loop(cond, step, state)
    return GenerateOutput(tokens=state.tokens, num_generated=state.num_generated, llm_passes=state.llm_passes,
                          failed=state.failed)


generate_incremental_jit = jax.jit(generate_incremental,
                                   static_argnames=("cfg", "cache_len", "max_out", "eos_ids", "parallel"))
decode_init_jit = jax.jit(decode_init, static_argnames=("cfg", "cache_len", "max_out", "eos_ids", "parallel"))
# The state is donated: its cache is updated in place, never copied per step.
decode_step_jit = jax.jit(decode_step, static_argnames=("cfg", "eos_ids", "parallel"), donate_argnames=("state",))


def decode_host_step(params, state: DecodeState, sampling: SamplingArrays, max_new_tokens: jax.Array,
                     cfg: ModelConfig, eos_ids: tuple[int, ...], parallel=None, steps=1):
    """``decode_step`` as the streaming host loop calls it: up to ``steps`` (int32 operand) steps while
    some request is not done, returning (state, ``ChunkReport``) (``specjax.decoding.host_step``)."""
    step = functools.partial(decode_step, params, sampling=sampling, max_new_tokens=max_new_tokens, cfg=cfg,
                             eos_ids=eos_ids, parallel=parallel)
    return steps_while_active(step, state, steps)


decode_host_step_jit = jax.jit(decode_host_step, static_argnames=("cfg", "eos_ids", "parallel"),
                               donate_argnames=("state",))


@in_32_bit
@functools.partial(jax.jit, static_argnames=("cfg", "parallel"))
def full_logits(params, tokens: jax.Array, cfg: ModelConfig, parallel=None) -> jax.Array:
    """Logits [B, T, V] of a full (right-padded) sequence, recomputed from scratch (no reuse)."""
    batch, num_tokens = tokens.shape
    dtype = jax.tree.leaves(params)[0].dtype
    cache = init_cache(cfg, batch, num_tokens, dtype)
    if parallel is not None:
        cache = parallel.constrain_cache(cache, cfg)
    positions = jnp.broadcast_to(jnp.arange(num_tokens, dtype=jnp.int32), (batch, num_tokens))
    return forward(params, tokens, positions, cache, causal_meta(jnp.zeros((batch,), jnp.int32)), cfg,
                   parallel=parallel).logits
