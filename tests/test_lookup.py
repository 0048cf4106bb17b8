"""The lookup drafter and the tree budget: the on-device lookup rule equals a plain-Python reference;
speculation with it (whole tree or budgeted, any level sequence) is exactly incremental decoding
(greedy and seeded), samples the exact law under MSS, RRS and naive verification, and works in the
engine; the budget picks the level with the best expected tokens per second; the cost table is
measured and cached."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.errors import InputError
from specjax.io import registry
from specjax.speculation.budget import Budget, choose_level, default_levels
from specjax.speculation.drafters.lookup import LookupDrafter, find_chains, parse_arg
from specjax.speculation.drafters.ssm import SSMDrafter
from specjax.speculation.expansion import Expansion
from specjax.speculation.loop import SpecConfig, generate_speculative, generate_speculative_jit
from specjax.speculation.request import default_drafters
from tests.conftest import random_ids
from tests.toy import assert_drafter_samples_the_exact_law, toy_model


def reference_chains(history, length, depth, branches, max_ngram, min_ngram):
    """The lookup rule of specjax/speculation/drafters/lookup.py, one request, in plain Python."""
    def run_at(p):
        n = 0
        while n < max_ngram and p - n >= 0 and length - n >= 0 and history[p - n] == history[length - n]:
            n += 1
        return n

    cands = []
    for p in range(length):
        n = run_at(p)
        if n >= min_ngram:
            cands.append((n, min(length - p, depth), p))
    cands.sort(reverse=True)
    chains, used = [], set()
    for n, known, p in cands:
        if len(chains) == branches:
            break
        if history[p + 1] in used:
            continue
        used.add(history[p + 1])
        chains.append((history[p + 1:p + 1 + known], n))
    return chains


class TestLookupRule(chex.TestCase):
    """The on-device rule equals the reference, traced and eagerly (chex variants), on a tiny and a
    larger vocabulary (many long matches, few)."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_matches_the_reference(self):
        for vocab in (3, 12):
            rng = np.random.RandomState(vocab)
            batch, size, depth, branches, max_n, min_n = 6, 40, 5, 3, 3, 1
            history = rng.randint(0, vocab, (batch, size)).astype(np.int32)
            length = rng.randint(0, size - 1, batch).astype(np.int32)
            length[0] = 0  # nothing before the root: no candidate at all
            find = self.variant(lambda h, n: find_chains(h, n, depth, branches, max_n, min_n))
            chains, known, ngram = (np.asarray(x) for x in find(jnp.asarray(history), jnp.asarray(length)))
            chex.assert_shape(chains, (batch, branches, depth))
            for b in range(batch):
                want = reference_chains(history[b].tolist(), int(length[b]), depth, branches, max_n, min_n)
                got = [(chains[b, c, :known[b, c]].tolist(), int(ngram[b, c])) for c in range(branches)
                       if known[b, c] > 0]
                assert got == [(list(map(int, w)), n) for w, n in want], f"vocab {vocab}, request {b}"
                assert (known[b, len(want):] == 0).all() and (ngram[b, len(want):] == 0).all()


def test_lookup_parses_and_refuses_bad_settings():
    assert parse_arg("auto") == LookupDrafter()
    assert parse_arg("5") == LookupDrafter(depth=5)
    assert parse_arg("depth=4,branches=3,ngram=2") == LookupDrafter(depth=4, branches=3, max_ngram=2)
    with pytest.raises(InputError, match="expected lookup:auto, lookup:D"):
        parse_arg("deep=4")
    with pytest.raises(InputError, match="depth must be a positive int"):
        LookupDrafter(depth=0)
    with pytest.raises(InputError, match="beyond the tree limit of 64"):
        LookupDrafter(depth=40, branches=2)
    with pytest.raises(InputError, match="min_ngram 3 exceeds max_ngram 2"):
        LookupDrafter(max_ngram=2, min_ngram=3)
    with pytest.raises(InputError, match="max_ngram 33 exceeds 32"):  # its search unrolls once per length
        LookupDrafter(max_ngram=33)
    with pytest.raises(InputError, match=r"64 nodes, beyond the tree limit of 64 \(the root and 63"):
        LookupDrafter(depth=32, branches=2)
    assert LookupDrafter(depth=21, branches=3).num_nodes == 63


def test_budget_checks_and_chooses_the_best_rate():
    d = LookupDrafter(depth=4, branches=2)
    assert default_levels((d,)) == ((0,), (2,), (4,), (8,))
    with pytest.raises(InputError, match="2 costs for 3 levels"):
        Budget(((0,), (1,), (2,)), costs=(1.0, 2.0))
    with pytest.raises(InputError, match="positive finite seconds"):
        Budget(((0,), (1,)), costs=(1.0, float("nan")))
    with pytest.raises(InputError, match="proposes 8"):
        SpecConfig((d,), budget=Budget(((0,), (9,))))
    ssm = SSMDrafter(toy_model(8, 0)[0], Expansion((2,)))  # SSMs do not estimate their acceptance
    with pytest.raises(InputError, match=r"needs drafters that estimate their acceptance; ssm\(<2>, topk\) does not"):
        SpecConfig((ssm,), budget=Budget(((0,), (2,))))
    with pytest.raises(InputError, match=r"goal must be one of \('finish', 'rate'\), got 'fast'"):
        Budget(((0,), (1,)), goal="fast")
    # NumPy numbers and lists are taken as the plain ints and floats of a hashable static config
    budget = Budget([[np.int64(0)], [np.int64(2)]], costs=[1, np.float32(1.5)])
    assert budget == Budget(((0,), (2,)), costs=(1.0, 1.5)) and hash(budget) == hash(Budget(((0,), (2,)), (1.0, 1.5)))
    assert type(budget.levels[1][0]) is int and type(budget.costs[0]) is float


def test_budget_goals_choose_the_best_level():
    rate = Budget(((0,), (1,), (4,)), costs=(1.0, 1.5, 3.0), goal="rate")
    finish = dataclasses.replace(rate, goal="finish")
    expected = jnp.asarray([[0.0, 0.9, 2.5], [0.0, 0.2, 0.3]])
    both, left = jnp.asarray([True, True]), jnp.asarray([10, 10])
    # rate: level 0: 2 / 1 = 2; level 1: (1.9 + 1.2) / 1.5 = 2.07; level 2: (3.5 + 1.3) / 3 = 1.6
    assert int(choose_level(rate, expected, both, left)) == 1
    # finish: the second request ends last whatever runs: level 0: 1 * 10; level 1: 1.5 * 10 / 1.2 = 12.5;
    # level 2: 3 * 10 / 1.3 = 23.1. The first request's gain does not bring the batch's end closer.
    assert int(choose_level(finish, expected, both, left)) == 0
    # ... unless the second is nearly done: level 1: 1.5 * max(10 / 1.9, 2 / 1.2) = 7.9 < 10 (level 0)
    # and < 3 * max(10 / 3.5, 2 / 1.3) = 8.6 (level 2)
    assert int(choose_level(finish, expected, both, jnp.asarray([10, 2]))) == 1
    # only the second request still running: its drafts do not pay under either goal
    for budget in (rate, finish):
        assert int(choose_level(budget, expected, jnp.asarray([False, True]), left)) == 0
    assert int(choose_level(rate, expected * 10, both, left)) == 2
    # finish at 10x: level 1: 1.5 * 10 / 3 = 5; level 2: 3 * 10 / 4 = 7.5
    assert int(choose_level(finish, expected * 10, both, left)) == 1
    # nothing running (a free engine step): level 0, no speculation
    assert int(choose_level(finish, expected, jnp.asarray([False, False]), left)) == 0


def test_one_request_chooses_alike_under_both_goals():
    """With one request, min of seconds * remaining / (1 + e) is max of (1 + e) / seconds."""
    rng = np.random.RandomState(0)
    for _ in range(200):
        costs = tuple(float(c) for c in np.cumsum(rng.uniform(0.1, 1.0, 5)))
        expected = jnp.asarray(rng.uniform(0, 4, (1, 5)), jnp.float32)
        left = jnp.asarray([rng.randint(1, 200)])
        levels = tuple((m,) for m in range(5))  # choose_level reads only the costs and the goal
        picks = {int(choose_level(Budget(levels, costs=costs, goal=g), expected, jnp.asarray([True]), left))
                 for g in ("rate", "finish")}
        assert len(picks) == 1, (costs, expected)


def _prompts(vocab):
    rng = np.random.RandomState(3)
    base = random_ids(rng, vocab, 9)
    return [base + base + base[:3], random_ids(rng, vocab, 6), [7, 8, 7, 8, 7, 8, 7]]


# Costs under which each level wins somewhere: the budget switches between them within one run.
_COSTS = (1.0, 1.1, 1.4, 1.8, 2.5)


@pytest.mark.parametrize("budget", [None, "finish", "rate"])
def test_lookup_speculation_equals_incremental_greedy_and_seeded(llama, budget):
    prompts = _prompts(llama.config.vocab_size)
    b = Budget(default_levels((LookupDrafter(),)), costs=_COSTS, goal=budget) if budget else None
    lookup = [specjax.Bound(LookupDrafter())]
    want = specjax.generate(llama, prompts, max_new_tokens=24, ignore_eos=True, mode="incremental")
    got = specjax.generate(llama, prompts, max_new_tokens=24, ignore_eos=True, drafters=lookup, budget=b)
    assert got.token_ids == want.token_ids
    assert got.stats["mean_tokens_per_pass"] > 1.2  # the repeated text is really copied
    if budget:
        used = np.asarray(got.stats["budget"]["passes_at_level"])
        assert (used > 0).sum() >= 2, f"the budget never switched levels: {used}"
        assert got.stats["budget"]["tree_nodes"] == [1, 3, 5, 9, 17]
        assert got.stats["budget"]["goal"] == budget
        assert sum(r["passes_at_level"][0] for r in got.stats["requests"]) == used[0]
    seeded = specjax.SamplingParams(temperature=0.9, top_k=30, seed=4)
    inc = specjax.generate(llama, prompts, max_new_tokens=24, ignore_eos=True, sampling=seeded, mode="incremental")
    spec = specjax.generate(llama, prompts, max_new_tokens=24, ignore_eos=True, sampling=seeded, drafters=lookup,
                            budget=b, verifier="seeded")
    assert spec.token_ids == inc.token_ids


def test_generate_with_no_drafter_speculates_as_the_command_does(llama, tmp_path, monkeypatch):
    """No mode, SSM or drafter: ``specjax.generate`` drafts with ``registry.default_drafters`` (for this LLM
    the lookup drafter) under the tree budget, as ``specjax generate`` does, and its tokens are incremental
    decoding's, greedy and seeded."""
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path))  # this LLM's pass costs: measured in a fresh table
    assert registry.default_drafters(llama.config) == ("lookup:auto",)
    default = [b.drafter.describe() for b in default_drafters(llama, load=False)]
    assert len(default) == 1 and default[0].startswith("lookup(")
    prompts = _prompts(llama.config.vocab_size)
    got = specjax.generate(llama, prompts, max_new_tokens=24, ignore_eos=True)
    assert got.stats["mode"] == "tree" and got.stats["drafters"] == default
    assert got.stats["budget"]["costs_source"].startswith("measured now")
    want = specjax.generate(llama, prompts, max_new_tokens=24, ignore_eos=True, mode="incremental")
    assert got.token_ids == want.token_ids
    seeded = specjax.SamplingParams(temperature=0.9, top_k=30, seed=4)
    got = specjax.generate(llama, prompts, max_new_tokens=24, ignore_eos=True, sampling=seeded)
    assert got.stats["verifier"] == "seeded" and got.stats["drafters"] == default
    want = specjax.generate(llama, prompts, max_new_tokens=24, ignore_eos=True, sampling=seeded, mode="incremental")
    assert got.token_ids == want.token_ids


def test_the_default_drafting_checks_the_request_before_any_drafter_loads(llama, monkeypatch):
    built, real = [], specjax.api.default_drafters

    def recording(*args, **kwargs):
        built.append(kwargs.get("load", True))
        return real(*args, **kwargs)

    monkeypatch.setattr(specjax.api, "default_drafters", recording)
    with pytest.raises(InputError, match="exceeds the context window"):
        specjax.generate(llama, [[1] * (llama.config.max_positions - 4)], max_new_tokens=8)
    assert built == [False]  # described (configs only), never loaded
    with pytest.raises(InputError, match="expansion shapes SSM drafts, and the default drafters have none"):
        specjax.generate(llama, [[1, 2, 3]], max_new_tokens=4, expansion=(1, 2))


def test_pass_costs_are_an_argument_of_the_compiled_loop(llama):
    """The budget's pass costs reach the loop as an array (``SpecConfig.costs_apart``): two cost tables run
    one compiled program, and each steers the levels it should (never past level 0 where drafted nodes
    cost 100x, drafting where they cost nothing), the tokens incremental decoding's either way."""
    d = LookupDrafter()
    levels = default_levels((d,))
    spec, costs = SpecConfig((d,), budget=Budget(levels, costs=_COSTS)).costs_apart()
    assert spec.budget.costs is None and costs.dtype == np.float32 and costs.tolist() == pytest.approx(_COSTS)
    other = SpecConfig((d,), budget=Budget(levels, costs=tuple(2.0 * c for c in _COSTS))).costs_apart()[0]
    assert other == spec and hash(other) == hash(spec)  # one static spec, so one compiled loop
    prompts = _prompts(llama.config.vocab_size)
    want = specjax.generate(llama, prompts, max_new_tokens=24, ignore_eos=True, mode="incremental").token_ids
    padded = np.zeros((len(prompts), 32), np.int32)
    for i, p in enumerate(prompts):
        padded[i, :len(p)] = p
    traced = []

    def run(*args, **kw):
        traced.append(1)  # once per compilation
        return generate_speculative(*args, **kw)

    loop = jax.jit(run, static_argnames=("cfg", "spec", "cache_len", "max_out"))
    args = (llama.params, ((),), jnp.asarray(padded), jnp.asarray([len(p) for p in prompts]), jnp.full((3,), 24))
    sizes = dict(cfg=llama.config, spec=spec, cache_len=96, max_out=32)
    dear = np.asarray([1.0] + [100.0] * (len(levels) - 1), np.float32)
    free = np.ones(len(levels), np.float32)
    at_level = []
    for pass_costs in (dear, free):
        out = loop(*args, pass_costs=pass_costs, **sizes)
        assert [np.asarray(out.tokens[i, :24]).tolist() for i in range(3)] == want
        at_level.append(np.asarray(out.level_passes).sum(0))
    assert len(traced) == 1, "new pass costs compiled the loop again"
    assert at_level[0][1:].sum() == 0 and at_level[0][0] > 0, at_level[0]
    assert at_level[1][1:].sum() > 0, at_level[1]
    with pytest.raises(InputError, match="the tree budget has no pass costs"):
        loop(*args, **sizes)
    with pytest.raises(InputError, match=rf"pass_costs has shape \(2,\); the tree budget has {len(levels)} levels"):
        loop(*args, pass_costs=free[:2], **sizes)


def test_generate_with_remeasured_costs_compiles_nothing(llama):
    """``specjax.generate`` hands the budget's costs to its programs as an array: a second cost table (a
    remeasured one) runs the programs the first compiled, and each call's stats report its own costs."""
    from jax._src.dispatch import BACKEND_COMPILE_EVENT

    prompts = _prompts(llama.config.vocab_size)
    lookup = [specjax.Bound(LookupDrafter())]
    levels = default_levels((LookupDrafter(),))
    first = specjax.generate(llama, prompts, max_new_tokens=24, ignore_eos=True, drafters=lookup,
                             budget=Budget(levels, costs=_COSTS))
    compiled = []

    def listen(event, seconds, **kwargs):
        if event == BACKEND_COMPILE_EVENT:
            compiled.append(seconds)

    remeasured = tuple(1.5 * c for c in _COSTS)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        second = specjax.generate(llama, prompts, max_new_tokens=24, ignore_eos=True, drafters=lookup,
                                  budget=Budget(levels, costs=remeasured))
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert compiled == [], f"{len(compiled)} programs compiled again for new pass costs"
    assert second.token_ids == first.token_ids
    assert first.stats["budget"]["seconds_per_pass"] == list(_COSTS)
    assert second.stats["budget"]["seconds_per_pass"] == list(remeasured)


def test_lookup_merged_with_an_ssm_equals_incremental(llama):
    prompts = _prompts(llama.config.vocab_size)
    want = specjax.generate(llama, prompts, max_new_tokens=20, ignore_eos=True, mode="incremental")
    ssm = specjax.derive_ssm(llama, 1)
    got = specjax.generate(llama, prompts, max_new_tokens=20, ignore_eos=True, ssms=[ssm], expansion=(2,),
                           drafters=[specjax.Bound(LookupDrafter(depth=4))])
    assert got.token_ids == want.token_ids
    assert got.stats["tree_nodes"] == 1 + 2 + 8


def test_budget_refuses_drafters_without_estimates(llama):
    ssm = specjax.derive_ssm(llama, 1)
    with pytest.raises(InputError, match="estimate their acceptance"):
        specjax.generate(llama, [[1, 2, 3]], max_new_tokens=4, ssms=[ssm], budget="auto")
    with pytest.raises(InputError, match="takes no tree budget"):
        specjax.generate(llama, [[1, 2, 3]], max_new_tokens=4, mode="incremental", budget="auto")
    with pytest.raises(InputError, match="budget must be None, 'auto'"):
        specjax.generate(llama, [[1, 2, 3]], max_new_tokens=4, drafters=[specjax.Bound(LookupDrafter())],
                         budget="fast")


# -- exact laws under every verifier the lookup drafter allows ------------------------------------------

@pytest.mark.parametrize("verifier", ["mss", "rrs", "naive"])
def test_lookup_samples_the_exact_law(verifier):
    """Deterministic entries (declared one-hot) under the sampled verifiers follow the LLM's exact
    sequence law under a tree budget (``tests.toy.assert_drafter_samples_the_exact_law``)."""
    assert_drafter_samples_the_exact_law(LookupDrafter(depth=2, branches=2, max_ngram=2), (), verifier,
                                         f"lookup + {verifier}")


# -- the cost table -------------------------------------------------------------------------------------------


def test_cost_table_is_measured_once_and_cached(llama, tmp_path, monkeypatch):
    from specjax.speculation import cost

    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path))
    measured = []
    real = cost.measure_pass_costs

    def counting(*args, **kwargs):
        result = real(*args, **kwargs)
        measured.append(sorted(result))
        return result

    monkeypatch.setattr(cost, "measure_pass_costs", counting)
    costs, source = cost.cached_pass_costs(llama.params, llama.config, 2, [1, 3], "xla")
    assert measured == [[1, 3]] and "measured now" in source
    assert all(s > 0 for s in costs.values())
    again, source = cost.cached_pass_costs(llama.params, llama.config, 2, [3, 1], "xla")
    assert measured == [[1, 3]] and again == costs and "measured earlier" in source
    # a missing size: the whole row timed again together (a size timed alone, at another moment, read as
    # 6.0x the one-node pass under load where the sizes timed together said 2.4x)
    cost.cached_pass_costs(llama.params, llama.config, 2, [1, 5], "xla")
    assert measured[-1] == [1, 3, 5]
    _, source = cost.cached_pass_costs(llama.params, llama.config, 2, [5], "xla", remeasure=True)
    assert measured[-1] == [1, 3, 5] and "measured now" in source  # remeasured whole, not cut to [5]
    table = json.loads((tmp_path / "tree_costs.json").read_text())
    (key,) = table
    assert "batch=2" in key and set(table[key]) == {"1", "3", "5"}
    budget = cost.with_costs(Budget(((0,), (2,))), llama.params, llama.config, 2, "xla")
    latest = cost.monotone({n: table[key][str(n)] for n in (1, 3)})  # the remeasured row
    assert budget.costs == (latest[1], latest[3]) and "measured earlier" in budget.source
    jax.clear_caches()


def test_cost_tables_are_keyed_by_the_cpu_generation_and_usable_cores_and_measured_one_process_at_a_time(
        llama, tmp_path, monkeypatch, capfd):
    """"cpu:AMD EPYC:2 cores" named AVX2-only and AVX-512 generations alike (their kernels differ), and a
    process under taskset -c 0 wrote its one-core table as the two-core machine's. Two processes starting
    together both measured on shared cores and cached those costs."""
    import fcntl

    from specjax.speculation import cost

    info = {"model name": "AMD EPYC", "cpu family": "25", "model": "1", "stepping": "1", "flags": "fpu avx2 fma"}
    monkeypatch.setattr(cost, "_cpuinfo", lambda: dict(info))
    keys = {cost.machine_key()}
    for field, value in (("model", "17"), ("flags", "fpu avx2 fma avx512f")):
        monkeypatch.setattr(cost, "_cpuinfo", lambda field=field, value=value: {**info, field: value})
        keys.add(cost.machine_key())
    monkeypatch.setattr(cost, "_cpuinfo", lambda: dict(info))
    monkeypatch.setattr(cost.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    keys.add(cost.machine_key())
    assert len(keys) == 4 and cost.machine_key().endswith(":1 cores")

    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path))
    held = []

    def measure(*args, **kwargs):  # while one process measures, another cannot take the lock
        with open(tmp_path / "tree_costs.json.lock", "a") as other:
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held.append(False)
            except BlockingIOError:
                held.append(True)
        return {n: 0.01 * n for n in args[3]}

    monkeypatch.setattr(cost, "measure_pass_costs", measure)
    cost.cached_pass_costs(llama.params, llama.config, 1, [1, 3], "xla")
    assert held == [True]
    key = cost.table_key(llama.config, jnp.float32, 2, "xla", split=cost.layers_split(llama.params))
    real_lock = cost._measuring_lock

    @contextlib.contextmanager
    def meanwhile(path, shared):  # another process measured the row while this one waited for the lock
        with real_lock(path, shared):
            table = json.loads((tmp_path / "tree_costs.json").read_text())
            table[key] = {"1": 0.5, "3": 0.7}
            (tmp_path / "tree_costs.json").write_text(json.dumps(table))
            yield

    monkeypatch.setattr(cost, "_measuring_lock", meanwhile)
    costs, source = cost.cached_pass_costs(llama.params, llama.config, 2, [1, 3], "xla")
    assert costs == {1: 0.5, 3: 0.7} and "measured earlier" in source and held == [True]  # read, not measured
    # a holder that never lets go (a process stopped with Ctrl-Z): said, and waited for a bounded time
    monkeypatch.setattr(cost, "_measuring_lock", real_lock)
    monkeypatch.setattr(cost, "LOCK_WAIT_S", 0.5)
    with open(tmp_path / "tree_costs.json.lock", "a") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)
        with pytest.warns(UserWarning, match="still held after 0.5 s; measuring beside its holder"):
            cost.cached_pass_costs(llama.params, llama.config, 4, [1, 3], "xla")
    assert "waiting for another process measuring tree pass costs" in capfd.readouterr().err


def test_a_damaged_cost_table_file_is_reported_and_kept_aside(llama, tmp_path, monkeypatch):
    """A truncated file was replaced silently by one holding only the row measured next."""
    from specjax.speculation import cost

    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cost, "measure_pass_costs", lambda *a, **k: {n: 0.01 * n for n in a[3]})
    path = tmp_path / "tree_costs.json"
    path.write_text('{"some row": {"1": 0.0')
    with pytest.warns(UserWarning, match=f"tree cost table {re.escape(str(path))} cannot be read .* kept as "
                                         f"{re.escape(str(path))}.damaged"):
        costs, source = cost.cached_pass_costs(llama.params, llama.config, 1, [1, 3], "xla")
    assert "measured now" in source and (tmp_path / "tree_costs.json.damaged").read_text() == '{"some row": {"1": 0.0'


@pytest.mark.parametrize("row", [None, {"1": None, "3": None}, [1, 2], {"1": "fast"}, {"one": 0.1},
                                 {"1": -5.0, "3": 0.2}, {"1": float("nan"), "3": 0.2}, {"1": True, "3": 0.2}])
def test_a_damaged_cost_table_row_is_reported_and_measured_again(llama, tmp_path, monkeypatch, row):
    """A row of wrong types crashed every later run (TypeError, AttributeError); negative, NaN and boolean
    costs were used, steering every step's tree size."""
    from specjax.speculation import cost

    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path))
    good, _ = cost.cached_pass_costs(llama.params, llama.config, 2, [1, 3], "xla")
    path = tmp_path / "tree_costs.json"
    (key,) = json.loads(path.read_text())
    path.write_text(json.dumps({key: row}))
    with pytest.warns(UserWarning, match=f"tree cost table .* has a damaged row '{re.escape(key)}'"):
        costs, source = cost.cached_pass_costs(llama.params, llama.config, 2, [1, 3], "xla")
    assert "measured now" in source and set(costs) == {1, 3} and all(0 < s < math.inf for s in costs.values())
    assert set(json.loads(path.read_text())[key]) == {"1", "3"}  # the row is rewritten
    assert good  # (measured the first time)


@pytest.mark.parametrize("seconds_per_pass,rounds", [(1e-4, 15), (1.0, 5), (0.5, 7)])
def test_slow_passes_are_timed_in_fewer_rounds(llama, monkeypatch, seconds_per_pass, rounds):
    """15 round-robin rounds over the sizes, but slow passes stop after the round in which the timed
    passes passed MEASURE_SECONDS (10 s), and never before 5 rounds: 3 sizes at 1 s a pass pass it in
    round 4, so 5 rounds; at 0.5 s in round 7 (10.5 s)."""
    from specjax.speculation import cost

    clock = {"t": 0.0, "calls": 0}

    def fake_clock():  # every pass starts and ends with a reading: one pass = seconds_per_pass
        clock["calls"] += 1
        if clock["calls"] % 2 == 0:
            clock["t"] += seconds_per_pass
        return clock["t"]

    monkeypatch.setattr(cost, "_clock", fake_clock)
    costs = cost.measure_pass_costs(llama.params, llama.config, 1, [1, 2, 3], "xla", prefix=8)
    assert clock["calls"] == 2 * 3 * rounds
    assert costs == pytest.approx({1: seconds_per_pass, 2: seconds_per_pass, 3: seconds_per_pass})


@pytest.mark.parametrize("streaming", [True, False], ids=["host-loop", "one-jit"])
def test_a_cost_table_read_back_does_not_recompile_the_loop(llama, tmp_path, monkeypatch, streaming):
    """The first call measures the table ("measured now"), the next reads it back ("measured
    earlier"): the costs are the same, so the compiled loop must be too. (The source string had been
    part of the budget's hash: every second call recompiled, and the first call's prefill then ran
    hidden under that compilation.) Both paths compile apart from ``seconds``; the host loop's
    ``seconds`` counts the prefill, whatever compiles."""
    from specjax.speculation.loop import step_jit

    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path))
    assert Budget(((0,), (1,)), (1.0, 2.0), source="a") == Budget(((0,), (1,)), (1.0, 2.0), source="b")
    assert hash(Budget(((0,), (1,)), (1.0, 2.0), source="a")) == hash(Budget(((0,), (1,)), (1.0, 2.0), source="b"))
    lookup = [specjax.Bound(LookupDrafter(depth=3, branches=1))]
    jitted = step_jit if streaming else generate_speculative_jit
    extra = {"on_tokens": lambda i, ids: None} if streaming else {}
    runs, sizes = [], []
    for _ in range(2):
        runs.append(specjax.generate(llama, [[1, 2, 3, 1, 2]], max_new_tokens=6, drafters=lookup, budget="auto",
                                     **extra))
        sizes.append(jitted._cache_size())
    first, second = (r.stats for r in runs)
    assert "measured now" in first["budget"]["costs_source"]
    assert "measured earlier" in second["budget"]["costs_source"]
    assert sizes[1] == sizes[0], "the second call compiled its loop again"
    assert second["compile_seconds"] < first["compile_seconds"]
    if streaming:
        for st in (first, second):
            assert 0 < st["prefill_seconds"] < st["seconds"]
    assert runs[0].token_ids == runs[1].token_ids


def test_cost_tables_never_make_a_bigger_tree_cheaper(llama, tmp_path, monkeypatch):
    """A noisy table (a shared CPU) can time 2 nodes below 1: the budget would then speculate on a
    cost it will not get. The costs it reads are the running maximum over node counts."""
    from specjax.speculation import cost

    assert cost.monotone({1: 0.11, 2: 0.097, 5: 0.12, 3: 0.2}) == {1: 0.11, 2: 0.11, 3: 0.2, 5: 0.2}
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path))
    noisy = {1: 0.111, 2: 0.097, 3: 0.121, 5: 0.118}
    monkeypatch.setattr(cost, "measure_pass_costs", lambda *a, **k: {n: noisy[n] for n in a[3]})
    costs, _ = cost.cached_pass_costs(llama.params, llama.config, 4, [5, 1, 3, 2], "xla")
    assert costs == {5: 0.121, 1: 0.111, 3: 0.121, 2: 0.111}
    budget = cost.with_costs(Budget(((0,), (1,), (2,), (4,))), llama.params, llama.config, 4, "xla")
    assert budget.costs == (0.111, 0.111, 0.121, 0.121)
    (row,) = json.loads((tmp_path / "tree_costs.json").read_text()).values()
    assert row == {str(n): s for n, s in noisy.items()}  # the cache keeps what was measured


def test_auto_budgets_take_the_goal_of_their_batching(llama, tmp_path, monkeypatch):
    """specjax.generate runs a batch until its last request ends ("finish"); the engine refills slots
    ("rate")."""
    from specjax.engine import Engine
    from specjax.speculation import cost

    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path))

    def fake_measure(params, cfg, batch, nodes, impl, parallel=None, progress=None, head="logits", beside=None):
        settle = None if beside is None else beside()  # generate's programs compile beside the measurement
        for n in nodes:
            if progress is not None:  # generate below measures batch 1 without a progress callback
                progress(n)
        if settle is not None:
            settle()
        return {n: 0.1 + 0.01 * n for n in nodes}

    monkeypatch.setattr(cost, "measure_pass_costs", fake_measure)
    lookup = [specjax.Bound(LookupDrafter())]
    measuring = []
    engine = Engine(llama, slots=2, max_prompt_tokens=16, max_new_tokens=8, impl="xla", drafters=lookup,
                    budget="auto", progress=measuring.append)
    assert engine.spec.budget.goal == "rate" and engine.spec.budget.costs[0] == pytest.approx(0.11)
    assert sorted(measuring) == [1, 3, 5, 9, 17]  # the server logs these lines through ``progress``
    res = specjax.generate(llama, [[1, 2, 3, 1, 2]], max_new_tokens=4, drafters=lookup, budget="auto")
    assert res.stats["budget"]["goal"] == "finish"
    assert res.stats["budget"]["seconds_per_pass"][0] == pytest.approx(0.11)


def test_the_budget_switch_never_copies_the_cache(llama):
    """Every level's tree pass only reads the cache (block-only) and the accepted path is committed
    after the switch: the compiled step holds no copy of the cache buffers. (A pass that wrote the
    shared cache inside lax.switch made XLA copy both buffers on every step: at 8 requests on this
    CPU that was 2.5x the step's own time.)"""
    import re

    from specjax.engine import Engine
    from specjax.speculation.loop import step_jit

    engine = Engine(llama, slots=2, max_prompt_tokens=16, max_new_tokens=16, impl="xla",
                    drafters=[specjax.Bound(LookupDrafter())],
                    budget=Budget(default_levels((LookupDrafter(),)), costs=_COSTS))
    state = engine.init()
    hlo = step_jit.lower(llama.params, engine.drafter_params,
                         state, cfg=llama.config, spec=engine.spec).compile().as_text()
    cache_shape = ",".join(str(d) for d in state.llm_cache.k.shape)
    assert "conditional(" in hlo  # the budget's switch is there
    copies = [line.strip() for line in hlo.splitlines()
              if re.search(rf"= f32\[{cache_shape}\]\{{[^}}]*\}} copy\(", line)]
    assert not copies, copies[:4]
