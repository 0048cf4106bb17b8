"""The engine: a request inserted into a batch that is already mid-generation yields exactly the tokens
it yields alone (greedy and seeded sampling, with and without speculation: SSM, lookup and corpus
drafters), whatever its slot, its batch mates, their settings and when it joined; released slots take
new requests."""

from __future__ import annotations

import numpy as np
import pytest

import specjax
from specjax.engine import Engine
from specjax.errors import InputError
from specjax.speculation.budget import Budget, default_levels
from specjax.speculation.drafters.corpus import CorpusDrafter
from specjax.speculation.drafters.corpus_index import build_index
from specjax.speculation.drafters.lookup import LookupDrafter
from specjax.speculation.drafters.ssm import derive_ssm, ssm_drafters
from specjax.speculation.loop import init_state_jit
from tests.conftest import random_ids


def _engine(llama, drafting: str, slots: int = 3) -> Engine:
    drafters, budget = (), None
    if drafting == "lookup":
        d = LookupDrafter(depth=3)
        drafters, budget = [(d, ())], Budget(default_levels((d,)), costs=(1.0, 1.1, 1.4, 2.0))
    if drafting == "corpus":  # random documents over the requests' vocabulary: short matches
        rng = np.random.RandomState(2)
        d = CorpusDrafter(depth=3, corpus_min_ngram=1)
        index = build_index([random_ids(rng, 128, 60) for _ in range(3)], d.corpus_max_ngram, d.depth,
                            llama.config.vocab_size)
        drafters, budget = [(d, index)], Budget(default_levels((d,)), costs=(1.0, 1.1, 1.4, 2.0))
    if drafting == "ssm":
        ssm = derive_ssm(llama, 1)
        drafters = [(d, ssm.params) for d in ssm_drafters([ssm.config], [(2, 1)], "coupled")]
    return Engine(llama, slots=slots, max_prompt_tokens=24, max_new_tokens=14, drafters=drafters, impl="xla",
                  budget=budget)


def _alone(llama, prompt, sampling, budget, stop_ids=()):
    """The reference: the incremental decoder, this request alone."""
    out = specjax.generate(llama, [prompt], max_new_tokens=budget, sampling=sampling, mode="incremental",
                           ignore_eos=True)
    tokens = out.token_ids[0]
    for i, t in enumerate(tokens):  # the engine stops after the first stop token
        if t in stop_ids:
            return tokens[:i + 1]
    return tokens


@pytest.mark.parametrize("drafting", ["none", "ssm", "lookup", "corpus"])
def test_inserted_mid_generation_equals_alone(llama, drafting):
    rng = np.random.RandomState(11)
    greedy, hot = specjax.SamplingParams(), specjax.SamplingParams(temperature=0.8, top_p=0.9, seed=5)
    requests = [  # (prompt, sampling, budget, stop tokens)
        (random_ids(rng, 128, 9), greedy, 14, ()),
        (random_ids(rng, 128, 17), hot, 10, ()),
        (random_ids(rng, 128, 5), specjax.SamplingParams(temperature=1.0, top_k=20, seed=9), 12, ()),
        (random_ids(rng, 128, 13), greedy, 14, ()),
    ]
    # a stop token the greedy request really produces, so the per-request stop rule is exercised
    want_last = _alone(llama, *requests[3][:3])
    requests[3] = requests[3][:3] + ((want_last[6],),)
    engine = _engine(llama, drafting)
    state = engine.init()
    state = engine.insert(state, engine.prefill(*requests[0]), 2)
    compiled = init_state_jit._cache_size()
    state = engine.insert(state, engine.prefill(*requests[1]), 0)
    for _ in range(3):
        state = engine.step(state)
    state = engine.insert(state, engine.prefill(*requests[2]), 1)  # joins a batch mid-generation
    where = {0: 2, 1: 0, 2: 1}
    got = {}
    for _ in range(40):
        view = engine.read(state)
        for r, slot in list(where.items()):
            if view.done[slot]:
                got[r] = view.tokens[slot, :view.num_generated[slot]].tolist()
                assert not view.failed[slot]
                state = engine.release(state, slot)
                del where[r]
                if r == 1:  # the freed slot takes the last request
                    state = engine.insert(state, engine.prefill(*requests[3]), slot)
                    where[3] = slot
        if not where:
            break
        state = engine.step(state)
    assert sorted(got) == [0, 1, 2, 3]
    for r, (prompt, sampling, budget, stops) in enumerate(requests):
        assert got[r] == _alone(llama, prompt, sampling, budget, stops), f"request {r}"
    assert init_state_jit._cache_size() == compiled  # prompts of 5-17 tokens: the one prefill program
    assert got[3][-1] == requests[3][3][0] and len(got[3]) < 14  # stopped at its own stop token


def test_engine_refuses_bad_requests(llama):
    engine = _engine(llama, "none", slots=2)
    with pytest.raises(InputError, match="the prompt has 25 tokens; this engine takes at most 24"):
        engine.prefill(list(range(25)))
    with pytest.raises(InputError, match=r"max_new_tokens must be an int in \[1, 14\]"):
        engine.prefill([1, 2], max_new_tokens=15)
    with pytest.raises(InputError, match=r"prompt token ids must be ints in \[0, 128\)"):
        engine.prefill([1, 200])
    with pytest.raises(InputError, match="stop_ids: at most 4"):
        engine.prefill([1, 2], stop_ids=(1, 2, 3, 4, 5))
    with pytest.raises(InputError, match=r"slot must be an int in \[0, 2\)"):
        engine.release(engine.init(), 2)
    with pytest.raises(InputError, match="exceeds the context window"):
        Engine(llama, slots=1, max_prompt_tokens=1000, max_new_tokens=100)


@pytest.mark.parametrize("stop_ids", [[2.7], np.array([9.9]), ["12"], [True], "12", 5, None])
def test_stop_ids_that_are_not_int_token_ids_are_refused(llama, stop_ids):
    """They were rounded, parsed or split into stop tokens ([2.7] -> 2, "12" -> 1 and 2), or a raw TypeError."""
    engine = _engine(llama, "none", slots=2)
    with pytest.raises(InputError, match="stop_ids must be a list of int token ids"):
        engine.prefill([1, 2], stop_ids=stop_ids)
    assert engine.prefill([1, 2], stop_ids=np.array([3, 4])) is not None  # NumPy ints are ints


def test_insert_refuses_rows_and_states_that_are_not_this_engines(llama):
    """A whole batch state passed as the row kept its row 0 and dropped the rest; another engine's state
    lost the request silently (an out-of-range scatter), or raised a broadcasting ValueError."""
    engine, other = _engine(llama, "none", slots=3), _engine(llama, "none", slots=2)
    state, row = engine.init(), engine.prefill([1, 2, 3])
    with pytest.raises(InputError, match=r"row is not a state of this engine's 1 request\(s\) .*prefill"):
        engine.insert(state, state, 0)
    with pytest.raises(InputError, match=r"state is not a state of this engine's 3 request\(s\)"):
        engine.insert(other.init(), row, 0)
    with pytest.raises(InputError, match="row is not a state"):
        engine.insert(state, {"tokens": np.zeros(3)}, 0)
    assert int(engine.read(engine.insert(state, row, 2)).num_generated[2]) == 1


def test_a_state_donated_to_an_earlier_call_is_refused_naming_the_fix(llama):
    """step() and insert() donate the state they are given; passing it again failed inside XLA ("Invalid buffer
    passed to Execute() as argument 24 to replica 0: ... Buffer has been deleted or donated")."""
    engine = _engine(llama, "none", slots=2)
    state, row = engine.init(), engine.prefill([1, 2, 3])
    stepped = engine.insert(state, row, 0)
    with pytest.raises(InputError, match=r"state was donated to an earlier step\(\) or insert\(\) .*: pass on the "
                                         r"state that call returned"):
        engine.insert(state, engine.prefill([4, 5]), 1)
    after = engine.step(stepped)
    with pytest.raises(InputError, match="state was donated"):
        engine.step(stepped)
    assert int(engine.read(engine.step(after)).num_generated[0]) >= 2  # the engine goes on


def test_release_and_step_refuse_states_that_are_not_this_engines(llama):
    """release() took a prefilled row or another engine's state and changed nothing (JAX drops out-of-range
    writes), so the slot it was asked to free stayed busy."""
    engine, other = _engine(llama, "none", slots=3), _engine(llama, "none", slots=2)
    row = engine.prefill([1, 2, 3])
    for bad in (row, other.init()):
        with pytest.raises(InputError, match=r"state is not a state of this engine's 3 request\(s\)"):
            engine.release(bad, 2)
        with pytest.raises(InputError, match=r"state is not a state of this engine's 3 request\(s\)"):
            engine.step(bad)
    state = engine.insert(engine.init(), row, 2)
    assert bool(engine.read(engine.release(state, 2)).done[2])


def test_a_budget_without_costs_gets_this_machines(llama, tmp_path, monkeypatch):
    """Only "auto" was measured: a Budget of levels alone passed init and prefill and failed at the first
    step ("the tree budget has no pass costs"), where specjax.generate measures the same Budget."""
    from specjax.speculation import cost

    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cost, "measure_pass_costs", lambda *a, **k: {n: 0.01 * n for n in a[3]})
    d = LookupDrafter(depth=3)
    levels = default_levels((d,))
    engine = Engine(llama, slots=1, max_prompt_tokens=8, max_new_tokens=4, drafters=[(d, ())], impl="xla",
                    budget=Budget(levels))
    nodes = [engine.spec.budget.node_count(i) for i in range(len(levels))]
    assert engine.spec.budget.costs == tuple(0.01 * n for n in nodes)
    state = engine.step(engine.insert(engine.init(), engine.prefill([1, 2, 3, 1, 2]), 0))
    assert int(engine.read(state).num_generated[0]) >= 2


def test_free_slots_hold_valid_sampling_settings(llama):
    """Free slots run through every step like busy ones (static shapes), so they must hold settings a
    request could have: all-zero rows (top_p = 0) sent the step's sampling code through non-finite
    values and made a step at 1 busy slot of 8 cost 2.6x one at 8 busy slots on this CPU."""
    engine = _engine(llama, "lookup", slots=4)
    s = engine.init().sampling
    want = specjax.SamplingParams()
    np.testing.assert_array_equal(np.asarray(s.top_p), np.full(4, want.top_p, np.float32))
    np.testing.assert_array_equal(np.asarray(s.temperature), np.full(4, want.temperature, np.float32))
    np.testing.assert_array_equal(np.asarray(s.top_k), np.full(4, want.top_k))
