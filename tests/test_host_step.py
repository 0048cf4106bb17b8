"""Streaming. On one device the loop program reports every step to the host (an io_callback): it must
stream exactly the tokens the one-jit loop returns, one report per LLM pass, share one compilation
between generations and leave no sink behind, whatever the callback does. The host loop of meshes is
pipelined (step k + 1 dispatched before step k's tokens are read): its step does nothing once every
request is done, and its reports outlive the donated state."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.decoding import host_step
from specjax.decoding.incremental import PAD_TOKEN, decode_host_step, decode_host_step_jit, decode_init_jit
from specjax.decoding.programs import step_program
from specjax.speculation.loop import finish_speculative
from specjax.speculation.state import greedy_sampling
from tests.conftest import random_ids


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return specjax.load_model(tiny_llama_dir, progress=False)


def _prompts(model, seed=0):
    rng = np.random.RandomState(seed)
    # repeated spans so the lookup drafter proposes (and several tokens land per pass)
    base = random_ids(rng, model.config.vocab_size, 9)
    return [base * 3, random_ids(rng, model.config.vocab_size, 5), base + base[:4]]


@pytest.mark.parametrize("kind", ["incremental", "lookup"])
def test_streamed_tokens_and_passes_equal_the_one_jit_loop(llama, kind):
    kw = {} if kind == "incremental" else {"drafters": [specjax.Bound(specjax.LookupDrafter())]}
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


def test_one_report_per_pass_one_compilation_and_no_sink_left(llama):
    """Every pass's tokens reach ``on_tokens`` as their own call (the prefill's first token too), a second
    streamed generation reuses the first's compiled loop (the sink id is an operand), and the sinks
    are unregistered afterwards, also when ``on_tokens`` raises mid-generation."""
    drafters = [specjax.Bound(specjax.LookupDrafter())]
    prompt = _prompts(llama)[0]
    loop = step_program(finish_speculative, 1, ("cfg", "spec", "parallel")).jitted
    calls = []
    res = specjax.generate(llama, [prompt], max_new_tokens=30, ignore_eos=True, drafters=drafters,
                           on_tokens=lambda i, ids: calls.append(ids))
    assert sum(calls, []) == res.token_ids[0] and all(calls)
    assert len(calls) == res.stats["llm_passes"]  # every pass emits (the prefill's, counted, its first token)
    assert max(map(len, calls)) > 1  # the lookup drafter's passes land several tokens at once
    compiled = loop._cache_size()
    again = specjax.generate(llama, [prompt], max_new_tokens=30, ignore_eos=True, drafters=drafters,
                             on_tokens=lambda i, ids: None)
    assert loop._cache_size() == compiled and again.token_ids == res.token_ids
    assert not host_step._SINKS

    def fail(i, ids):
        if len(ids) > 1:
            raise RuntimeError("the consumer went away")

    with pytest.raises(RuntimeError, match="the consumer went away"):
        specjax.generate(llama, [prompt], max_new_tokens=30, ignore_eos=True, drafters=drafters, on_tokens=fail)
    assert not host_step._SINKS


def _prompt(model):
    """One right-padded prompt [1, 8] of 7 tokens, and its length."""
    prompt = jnp.asarray([random_ids(np.random.RandomState(3), model.config.vocab_size, 7) + [0]], jnp.int32)
    return prompt, jnp.asarray([7], jnp.int32)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "no-jit"])
def test_a_step_after_every_request_is_done_changes_nothing(llama, jit):
    prompt, lens = _prompt(llama)
    sampling = greedy_sampling(1)
    cfg = llama.config
    max_new = jnp.asarray([1], jnp.int32)
    state = decode_init_jit(llama.params, prompt, lens, max_new, sampling, cfg=cfg, cache_len=64, max_out=4)
    assert bool(state.done.all())
    run = decode_host_step_jit if jit else decode_host_step
    keep = jax.tree.map(jnp.copy, state)  # the jitted step takes the state donated
    after, rep = run(llama.params, state, sampling, max_new, cfg=cfg, eos_ids=())
    state = keep
    chex.assert_trees_all_equal(after, state)
    chex.assert_trees_all_equal((rep.num_generated, rep.tokens, rep.done),
                                (state.num_generated, state.tokens, state.done))


def test_a_report_outlives_the_state_donated_to_the_next_step(llama):
    prompt, lens = _prompt(llama)
    sampling = greedy_sampling(1)
    cfg = llama.config
    max_new = jnp.asarray([6], jnp.int32)
    kw = dict(cfg=cfg, cache_len=64, max_out=8)
    ref = decode_init_jit(llama.params, prompt, lens, max_new, sampling, **kw)
    for _ in range(2):
        ref, _ = decode_host_step_jit(llama.params, ref, sampling, max_new, cfg=cfg, eos_ids=())
    expect = np.asarray(ref.tokens)
    state = decode_init_jit(llama.params, prompt, lens, max_new, sampling, **kw)
    state, first = decode_host_step_jit(llama.params, state, sampling, max_new, cfg=cfg, eos_ids=())
    state, second = decode_host_step_jit(llama.params, state, sampling, max_new, cfg=cfg, eos_ids=())
    state, _ = decode_host_step_jit(llama.params, state, sampling, max_new, cfg=cfg, eos_ids=())  # donates again
    assert int(first.num_generated[0]) == 2 and int(second.num_generated[0]) == 3
    np.testing.assert_array_equal(np.asarray(second.tokens), expect)
    np.testing.assert_array_equal(np.asarray(first.tokens)[0, :2], expect[0, :2])
    assert (np.asarray(first.tokens)[0, 2:] == PAD_TOKEN).all()
