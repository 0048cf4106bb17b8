"""The serving scheduler's bookkeeping against a scripted engine (no model): a cancel that races its request's
last step, and a log that fails (stderr a closed pipe) while requests wait. `tests/test_serve.py` runs the
scheduler behind the real HTTP server and engine."""

from __future__ import annotations

import asyncio
import types

import numpy as np
import pytest

from specjax.decoding.sampling import SamplingParams
from specjax.serving.scheduler import Failed, Finished, Scheduler, Submission, Ticket, Tokens


class ScriptedEngine:
    """One slot; every pass emits token 7, and ``end_at`` passes end the request. ``during_step`` runs inside
    ``step`` (what the HTTP side might do meanwhile); ``fail`` names a method that raises."""

    slots = 1

    def __init__(self, end_at: int = 100, during_step=None, fail: str | None = None):
        self.end_at, self.during_step, self.fail = end_at, during_step, fail
        self.generated, self.released = 0, []

    def _maybe_fail(self, name):
        if self.fail == name:
            raise RuntimeError(f"injected {name} failure")

    def init(self):
        return "state"

    def prefill(self, prompt, sampling, max_new_tokens, stop_ids):
        self._maybe_fail("prefill")
        self.generated = 1
        return "row"

    def insert(self, state, row, slot):
        return state

    def step(self, state):
        self._maybe_fail("step")
        if self.during_step is not None:
            self.during_step()
        self.generated += 1
        return state

    def release(self, state, slot):
        self.released.append(slot)
        return state

    def read(self, state):
        n = self.generated
        hist = np.zeros((1, 3), np.int64)
        hist[0, 1] = max(n - 1, 0)  # one token a pass after the prefill
        return types.SimpleNamespace(tokens=np.full((1, 128), 7, np.int64), num_generated=np.asarray([n]),
                                     done=np.asarray([n >= self.end_at]), failed=np.asarray([False]),
                                     tokens_per_pass=hist)


class Counted:
    def __init__(self):
        self.observed = []
        self.queue_length = self.busy_slots = types.SimpleNamespace(set=lambda v: None)
        self.llm_passes = types.SimpleNamespace(inc=lambda: None)
        self.tokens_per_pass = types.SimpleNamespace(observe=self.observed.append)


def _events(loop, ticket) -> list:
    loop.run_until_complete(asyncio.sleep(0))  # the scheduler pushes through call_soon_threadsafe
    out = []
    while not ticket.events.empty():
        out.append(ticket.events.get_nowait())
    return out


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _scheduler(engine, **kw) -> Scheduler:
    s = Scheduler(engine, max_queue=4, metrics=Counted(), **kw)
    s.state = engine.init()
    return s


def _ticket(loop) -> Ticket:
    return Ticket(Submission([1, 2, 3], SamplingParams(), 8, (2,)), loop)


def test_a_cancel_that_races_the_last_step_releases_and_counts_the_request_once(loop):
    """A stop string's cancel lands while the step that ends the request (EOS, max_tokens) runs: that step
    releases the slot and records the request; the cancel, read at the next iteration, must do neither again."""
    engine = ScriptedEngine(end_at=2)
    s = _scheduler(engine)
    t = _ticket(loop)
    engine.during_step = lambda: s.cancel(t)
    s.submit(t)
    assert s._iteration()  # admitted (prefill: 1 token), then the step that ends it, the cancel arriving meanwhile
    assert engine.released == [0] and len(s.metrics.observed) == 1
    assert s._iteration()  # the cancel is read now
    assert engine.released == [0] and len(s.metrics.observed) == 1, "the ended request was released twice"
    events = _events(loop, t)
    assert isinstance(events[-1], Finished) and all(isinstance(e, Tokens) for e in events[:-1])
    assert s.counts() == (0, 0)


def test_a_cancel_frees_its_running_slot_once(loop):
    engine = ScriptedEngine()
    s = _scheduler(engine)
    t = _ticket(loop)
    s.submit(t)
    assert s._iteration() and s.counts() == (0, 1)
    s.cancel(t)
    assert s._iteration()
    assert engine.released == [0] and len(s.metrics.observed) == 1 and s.counts() == (0, 0)


def _broken_log(*args):
    raise BrokenPipeError(32, "Broken pipe")


def test_an_engine_failure_fails_every_request_even_when_the_log_cannot_be_written(loop):
    s = _scheduler(ScriptedEngine(fail="step"), log=_broken_log)
    running, queued = _ticket(loop), _ticket(loop)
    s.submit(running)
    s.submit(queued)
    s._run()  # the step raises; the log raises too
    for t in (running, queued):
        end = _events(loop, t)[-1]
        assert isinstance(end, Failed) and end.code == "engine_error" and "injected step failure" in end.message
    assert not s.healthy() and s.counts() == (0, 0)


def test_an_admission_failure_fails_that_request_even_when_the_log_cannot_be_written(loop):
    s = _scheduler(ScriptedEngine(fail="prefill"), log=_broken_log)
    t = _ticket(loop)
    s.submit(t)
    assert s._iteration()  # lives on
    end = _events(loop, t)[-1]
    assert isinstance(end, Failed) and "injected prefill failure" in end.message
    assert s.counts() == (0, 0)
