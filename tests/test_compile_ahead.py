"""The first budgeted run at a batch size: the decoding programs compile in a worker thread beside the tree
budget's measurement (``specjax.decoding.host_step.AheadCompile``), each exactly once, and no measured pass
is timed while that thread runs (it would take a core from the passes and skew the costs the budget
steers by). Also: the CPU kernels' parallel build names a source that does not compile."""

from __future__ import annotations

import os
import shutil
import threading

import jax
import numpy as np
import pytest

import specjax
from specjax.decoding import host_step
from specjax.sharding.parallel import Parallel
from specjax.speculation import cost
from specjax.speculation.drafters.lookup import LookupDrafter
from tests.conftest import random_ids
from tests.toy import mesh_model

AHEAD = "specjax-compile-ahead"


def _prompts(vocab):
    rng = np.random.RandomState(5)
    base = random_ids(rng, vocab, 8)
    return [base + base + base[:3], random_ids(rng, vocab, 6)]


def _ahead_alive() -> bool:
    return any(t.name == AHEAD and t.is_alive() for t in threading.enumerate())


@pytest.mark.parametrize("streamed,placed", [(False, None), (True, None), (True, "device")])
def test_the_first_budgeted_run_compiles_each_program_once_beside_the_measurement(llama, tmp_path, monkeypatch,
                                                                                   compile_log, streamed, placed):
    """A fresh cost table: the budget measures its sizes while the prefill and the loop compile ahead; every
    timed pass runs with that compilation over; the prefill and the loop (whole or in chunks) compile
    once each, the run after the measurement compiling nothing again; the tokens are incremental
    decoding's. ``placed``: "device", weights put on a device (``jax.device_put``, as a caller's own arrays
    may be), so the state is committed too, which the compilation ahead (from shapes) cannot know. A second
    run reads the table: nothing is measured or compiled ahead, and it lowers the very modules compiled ahead
    (so the persistent cache serves it what the first run compiled)."""
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path))
    parallel = None
    if placed == "device":
        llama = llama._replace(params=jax.device_put(llama.params, jax.devices()[0]))
    jax.clear_caches()
    timed_beside = []
    real_clock = cost._clock

    def clock():
        timed_beside.append(_ahead_alive())
        return real_clock()

    monkeypatch.setattr(cost, "_clock", clock)
    from specjax import api

    made, lowered, real_lower = [], [], host_step.lower_partial
    monkeypatch.setattr(api, "AheadCompile", lambda *a, **k: made.append(a) or host_step.AheadCompile(*a, **k))

    def lower_and_record(fn, *args, **kwargs):  # every program lowered: (its function, its module)
        out = real_lower(fn, *args, **kwargs)
        lowered.append((fn.func, out.as_text()))
        return out

    monkeypatch.setattr(host_step, "lower_partial", lower_and_record)
    prompts = _prompts(llama.config.vocab_size)
    reference = specjax.generate(llama, prompts, max_new_tokens=12, mode="incremental", chat_template=False,
                                 parallel=parallel)
    lowered.clear()  # the incremental reference's own programs
    streamed_ids = [[] for _ in prompts]
    result = specjax.generate(llama, prompts, max_new_tokens=12, chat_template=False,
                              drafters=[specjax.Bound(LookupDrafter(depth=3, branches=2, max_ngram=2), None)],
                              budget="auto", parallel=parallel,
                              on_tokens=(lambda i, ids: streamed_ids[i].extend(ids)) if streamed else None)
    assert timed_beside and not any(timed_beside), "a measured pass was timed while the programs compiled"
    assert "measured now" in result.stats["budget"]["costs_source"]
    assert compile_log("init_state") == 1
    assert compile_log("host_step" if streamed else "finish_speculative") == 1
    assert compile_log("finish_speculative" if streamed else "host_step") == 0
    assert result.stats["compile_seconds"] > 0
    assert result.token_ids == reference.token_ids
    if streamed:
        assert streamed_ids == result.token_ids
    assert not _ahead_alive()
    assert len(made) == 1 and len(lowered) == 2  # the prefill and the loop, lowered ahead
    ahead = list(lowered)
    again = specjax.generate(llama, prompts, max_new_tokens=12, chat_template=False,
                             drafters=[specjax.Bound(LookupDrafter(depth=3, branches=2, max_ngram=2), None)],
                             budget="auto", parallel=parallel, on_tokens=(lambda i, ids: None) if streamed else None)
    assert "measured earlier" in again.stats["budget"]["costs_source"] and len(made) == 1
    assert again.token_ids == reference.token_ids
    # The programs compiled ahead are those this run lowers from the real state: else the first run's
    # persistent-cache entries are never read and every later run compiles the loop again.
    assert lowered[2:] == ahead
    jax.clear_caches()


def test_a_mesh_measures_first_and_compiles_after(tmp_path, monkeypatch, compile_log):
    """On a mesh nothing compiles ahead: the budget measures, then the programs compile as before, and the
    tokens are incremental decoding's. The chunk program compiles once: the prefill leaves every
    per-request array over dp, as each chunk does (the lookup drafter's state and the zeroed counters had
    come out replicated, and the second chunk compiled the loop again)."""
    from specjax import api

    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path))
    made = []
    monkeypatch.setattr(api, "AheadCompile", lambda *a, **k: made.append(a) or host_step.AheadCompile(*a, **k))
    model, parallel = mesh_model("llama"), Parallel.create("dp=2", jax.devices()[:2])
    prompts = _prompts(model.config.vocab_size)
    reference = specjax.generate(model, prompts, max_new_tokens=8, chat_template=False, parallel=parallel,
                                 mode="incremental")
    result = specjax.generate(model, prompts, max_new_tokens=8, chat_template=False, parallel=parallel,
                              drafters=[specjax.Bound(LookupDrafter(depth=2, branches=1, max_ngram=2), None)],
                              budget="auto", on_tokens=lambda i, ids: None)
    assert "measured now" in result.stats["budget"]["costs_source"] and made == []
    assert result.token_ids == reference.token_ids
    assert result.stats["llm_passes"] > 3  # several chunks ran (1, 2, 4 passes, ...)
    assert (compile_log("init_state"), compile_log("host_step")) == (1, 1)


def test_work_beside_starts_before_the_compiles_and_ends_before_any_timed_pass(llama, monkeypatch):
    """``measure_pass_costs(beside=...)``: the work starts, the sizes compile (``progress`` before each),
    the work is waited for, then the timed rounds (the clock)."""
    events = []
    monkeypatch.setattr(cost, "_clock", lambda: events.append("clock") or 0.0)

    def beside():
        events.append("start")
        return lambda: events.append("wait")

    cost.measure_pass_costs(llama.params, llama.config, 1, [1, 2, 3], "xla", prefix=8, repeats=5,
                            progress=lambda n: events.append(n), beside=beside)
    assert events[:5] == ["start", 1, 2, 3, "wait"] and set(events[5:]) == {"clock"}


def test_a_failed_ahead_compilation_is_raised_by_generate(llama, tmp_path, monkeypatch):
    """What the worker thread raised reaches the caller, and no compilation is left running."""
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path))
    real = jax.stages.Lowered.compile

    def failing(self, *args, **kwargs):
        if threading.current_thread().name == AHEAD:
            raise RuntimeError("the ahead compilation failed on purpose")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", failing)
    with pytest.raises(RuntimeError, match="failed on purpose"):
        specjax.generate(llama, _prompts(llama.config.vocab_size), max_new_tokens=6, chat_template=False,
                         drafters=[specjax.Bound(LookupDrafter(depth=2, branches=1, max_ngram=2), None)],
                         budget="auto")
    assert not _ahead_alive()


def test_a_kernel_source_that_does_not_compile_is_named_and_nothing_is_left(tmp_path, monkeypatch):
    """The sources compile side by side (one compiler process each); one that fails is named with its
    compiler output, the others are stopped, and neither a library nor object files stay in the cache."""
    from specjax.kernels.cpu import build

    try:
        build._compiler()
    except build.KernelUnavailable:
        pytest.skip("no C++ compiler")
    sources = tmp_path / "src"
    shutil.copytree(build.HERE, sources, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    broken = build.AVX2_SOURCES[-1]
    with open(sources / broken, "a") as f:
        f.write("\n#error this source is broken on purpose\n")
    monkeypatch.setattr(build, "HERE", sources)
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(build.KernelUnavailable, match=rf"(?s){broken}.*broken on purpose"):
        build._build("avx2")
    assert os.listdir(tmp_path / "cache" / "kernels") == []
