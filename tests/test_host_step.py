"""Streaming: the host calls the decoding loop in chunks of a few passes (pipelined: chunk k + 1
dispatched before chunk k's tokens are read). It must stream exactly the tokens the one-jit loop
returns, one ``on_tokens`` call per LLM pass, share one compilation between chunk sizes and
generations, and be an ordinary program the persistent compilation cache keeps (no host callback).
A chunk is the same passes as single steps, does nothing once every request is done, and its
reports outlive the donated state."""

from __future__ import annotations

import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.decoding.host_step import MAX_CHUNK_STEPS, chunk_sizes
from specjax.decoding.incremental import PAD_TOKEN, decode_host_step, decode_host_step_jit, decode_init_jit
from specjax.decoding.programs import step_program
from specjax.speculation.loop import host_step, host_step_jit, init_state_jit
from specjax.speculation.spec import SpecConfig
from specjax.speculation.state import greedy_sampling, stop_rows
from tests.conftest import random_ids


def _prompts(model, seed=0):
    rng = np.random.RandomState(seed)
    # repeated spans so the lookup drafter proposes (and several tokens land per pass)
    base = random_ids(rng, model.config.vocab_size, 9)
    return [base * 3, random_ids(rng, model.config.vocab_size, 5), base + base[:4]]


@pytest.mark.parametrize("kind", ["incremental", "lookup"])
def test_streamed_tokens_and_passes_equal_the_one_jit_loop(llama, kind):
    kw = {"mode": "incremental"} if kind == "incremental" else {"drafters": [specjax.Bound(specjax.LookupDrafter())]}
    prompts = _prompts(llama)
    budgets = [23, 5, 40]  # requests finish at different passes: the batch keeps stepping after some are done
    one_jit = [specjax.generate(llama, [p], max_new_tokens=m, ignore_eos=True, **kw) for p, m in zip(prompts, budgets)]
    for p, m, ref in zip(prompts, budgets, one_jit):
        streamed = []
        res = specjax.generate(llama, [p], max_new_tokens=m, ignore_eos=True,
                               on_tokens=lambda i, ids: streamed.extend(ids), **kw)
        assert streamed == res.token_ids[0] == ref.token_ids[0]
        assert len(streamed) == m
        assert res.stats["llm_passes"] == ref.stats["llm_passes"]
    # one batch: each request's stream is its own tokens, the passes those of the one-jit batch
    streams = [[] for _ in prompts]
    batch = specjax.generate(llama, prompts, max_new_tokens=40, ignore_eos=True,
                             on_tokens=lambda i, ids: streams[i].extend(ids), **kw)
    ref = specjax.generate(llama, prompts, max_new_tokens=40, ignore_eos=True, **kw)
    assert streams == batch.token_ids == ref.token_ids
    assert batch.stats["llm_passes"] == ref.stats["llm_passes"]


def test_one_call_per_pass_and_one_compilation(llama):
    """Every pass's tokens reach ``on_tokens`` as their own call (the prefill's first token too), though
    the host reads them a chunk of passes at a time; a second streamed generation reuses the first's
    compiled chunk program (the chunk size is an operand); an ``on_tokens`` that raises stops the
    generation with its error."""
    drafters = [specjax.Bound(specjax.LookupDrafter())]
    prompt = _prompts(llama)[0]
    chunk = step_program(host_step, 1, ("cfg", "spec", "parallel"), ("state",)).jitted
    calls = []
    res = specjax.generate(llama, [prompt], max_new_tokens=30, ignore_eos=True, drafters=drafters,
                           on_tokens=lambda i, ids: calls.append(ids))
    assert sum(calls, []) == res.token_ids[0] and all(calls)
    assert len(calls) == res.stats["llm_passes"]  # every pass emits (the prefill's, counted, its first token)
    assert len(calls) > sum(itertools.takewhile(lambda k: k < MAX_CHUNK_STEPS, chunk_sizes()))  # chunks of 8 ran
    assert max(map(len, calls)) > 1  # the lookup drafter's passes land several tokens at once
    compiled = chunk._cache_size()
    again = specjax.generate(llama, [prompt], max_new_tokens=30, ignore_eos=True, drafters=drafters,
                             on_tokens=lambda i, ids: None)
    assert chunk._cache_size() == compiled and again.token_ids == res.token_ids

    def fail(i, ids):
        if len(ids) > 1:
            raise RuntimeError("the consumer went away")

    with pytest.raises(RuntimeError, match="the consumer went away"):
        specjax.generate(llama, [prompt], max_new_tokens=30, ignore_eos=True, drafters=drafters, on_tokens=fail)


@pytest.mark.parametrize("kind", ["incremental", "speculative"])
def test_the_chunk_program_has_no_host_callback(llama, kind):
    """JAX never writes a program with host callbacks to the persistent compilation cache (stop 62's
    streaming loop, an io_callback per step, compiled afresh in every ``specjax generate`` run)."""
    prompt, lens = _prompt(llama)
    sampling = greedy_sampling(1)
    max_new = jnp.asarray([4], jnp.int32)
    cfg = llama.config
    if kind == "incremental":
        state = decode_init_jit(llama.params, prompt, lens, max_new, sampling, cfg=cfg, cache_len=64, max_out=8)
        lowered = decode_host_step_jit.lower(llama.params, state, sampling, max_new, cfg=cfg, eos_ids=(),
                                             steps=np.int32(2))
    else:
        spec = SpecConfig((specjax.LookupDrafter(),), impl="xla")
        state = init_state_jit(llama.params, ((),), prompt, lens, max_new, sampling, stop_rows((), 1), cfg=cfg,
                               spec=spec, cache_len=64, max_out=8)
        lowered = host_step_jit.lower(llama.params, ((),), state, cfg=cfg, spec=spec, steps=np.int32(2))
    assert "callback" not in lowered.as_text()
    assert not lowered._lowering.compile_args["host_callbacks"]


def _prompt(model):
    """One right-padded prompt [1, 8] of 7 tokens, and its length."""
    prompt = jnp.asarray([random_ids(np.random.RandomState(3), model.config.vocab_size, 7) + [0]], jnp.int32)
    return prompt, jnp.asarray([7], jnp.int32)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "no-jit"])
def test_a_chunk_after_every_request_is_done_changes_nothing(llama, jit):
    prompt, lens = _prompt(llama)
    sampling = greedy_sampling(1)
    cfg = llama.config
    max_new = jnp.asarray([1], jnp.int32)
    state = decode_init_jit(llama.params, prompt, lens, max_new, sampling, cfg=cfg, cache_len=64, max_out=4)
    assert bool(state.done.all())
    run = decode_host_step_jit if jit else decode_host_step
    keep = jax.tree.map(jnp.copy, state)  # the jitted step takes the state donated
    after, rep = run(llama.params, state, sampling, max_new, cfg=cfg, eos_ids=(), steps=np.int32(MAX_CHUNK_STEPS))
    state = keep
    chex.assert_trees_all_equal(after, state)
    assert int(rep.ran) == 0
    chex.assert_shape(rep.counts, (MAX_CHUNK_STEPS, 1))
    chex.assert_trees_all_equal((rep.counts, rep.tokens, rep.done),
                                (jnp.broadcast_to(state.num_generated, (MAX_CHUNK_STEPS, 1)), state.tokens, state.done))


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "no-jit"])
def test_a_chunk_is_its_passes_one_by_one(llama, jit):
    """A chunk of k passes leaves the state k single steps leave, reports the count after each, and stops
    early (``ran`` < k) where every request is done; a chunk size above the maximum runs the maximum."""
    prompt, lens = _prompt(llama)
    sampling = greedy_sampling(1)
    cfg = llama.config
    max_new = jnp.asarray([MAX_CHUNK_STEPS + 6], jnp.int32)  # the prefill's token, 3, a full chunk, then 2
    kw = dict(cfg=cfg, cache_len=64, max_out=MAX_CHUNK_STEPS + 6)
    run = decode_host_step_jit if jit else decode_host_step
    one = decode_init_jit(llama.params, prompt, lens, max_new, sampling, **kw)
    singles = []
    for _ in range(3):
        one, rep = run(llama.params, one, sampling, max_new, cfg=cfg, eos_ids=(), steps=np.int32(1))
        assert int(rep.ran) == 1
        singles.append(int(rep.counts[0, 0]))
    three = decode_init_jit(llama.params, prompt, lens, max_new, sampling, **kw)
    three, rep = run(llama.params, three, sampling, max_new, cfg=cfg, eos_ids=(), steps=np.int32(3))
    chex.assert_trees_all_equal(three, one)
    assert int(rep.ran) == 3 and np.asarray(rep.counts)[:3, 0].tolist() == singles == [2, 3, 4]
    assert (np.asarray(rep.counts)[3:, 0] == 4).all()  # rows past the passes run repeat the last count
    # more than the maximum: the maximum; then the last passes, fewer than asked
    three, rep = run(llama.params, three, sampling, max_new, cfg=cfg, eos_ids=(), steps=np.int32(100))
    assert int(rep.ran) == MAX_CHUNK_STEPS and int(rep.counts[-1, 0]) == 4 + MAX_CHUNK_STEPS
    assert not bool(rep.done[0])
    three, rep = run(llama.params, three, sampling, max_new, cfg=cfg, eos_ids=(), steps=np.int32(MAX_CHUNK_STEPS))
    assert int(rep.ran) == 2 and bool(rep.done[0])
    last = 6 + MAX_CHUNK_STEPS
    assert np.asarray(rep.counts)[:, 0].tolist() == [last - 1] + [last] * (MAX_CHUNK_STEPS - 1)


def test_a_report_outlives_the_state_donated_to_the_next_chunk(llama):
    prompt, lens = _prompt(llama)
    sampling = greedy_sampling(1)
    cfg = llama.config
    max_new = jnp.asarray([6], jnp.int32)
    kw = dict(cfg=cfg, cache_len=64, max_out=8)
    one = np.int32(1)
    ref = decode_init_jit(llama.params, prompt, lens, max_new, sampling, **kw)
    for _ in range(2):
        ref, _ = decode_host_step_jit(llama.params, ref, sampling, max_new, cfg=cfg, eos_ids=(), steps=one)
    expect = np.asarray(ref.tokens)
    state = decode_init_jit(llama.params, prompt, lens, max_new, sampling, **kw)
    state, first = decode_host_step_jit(llama.params, state, sampling, max_new, cfg=cfg, eos_ids=(), steps=one)
    state, second = decode_host_step_jit(llama.params, state, sampling, max_new, cfg=cfg, eos_ids=(), steps=one)
    state, _ = decode_host_step_jit(llama.params, state, sampling, max_new, cfg=cfg, eos_ids=(), steps=one)  # donates
    assert int(first.counts[0, 0]) == 2 and int(second.counts[0, 0]) == 3
    np.testing.assert_array_equal(np.asarray(second.tokens), expect)
    np.testing.assert_array_equal(np.asarray(first.tokens)[0, :2], expect[0, :2])
    assert (np.asarray(first.tokens)[0, 2:] == PAD_TOKEN).all()
