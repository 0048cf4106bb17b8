"""The streaming host loop, and the loop step as it calls it: at most one step, plus a report of the tokens.

The host loop (``run_host_loop``, behind ``specjax.generate(on_tokens=...)``) dispatches step k + 1
before it reads step k's tokens, so the device does not wait for the host's fetch, its callbacks and
the next dispatch (about 1.4 ms of host time per step on a 2-core CPU). Measured on 2 Xeon cores
(SmolLM2, grounded prompts, alternating): the streaming loop 3.7% slower than the one-jit loop
before, 2.9% after; what remains is the host's CPU time competing with XLA's threads for the two
cores. That needs two things of the step:

- a report: copies of what the host reads (``num_generated``, ``tokens``, ``done``) as outputs of
  their own, because the state itself is donated to the next step before the host reads it;
- nothing to do once every request is done: the step dispatched after the last tokens runs the
  body zero times. It is a one-trip ``lax.while_loop``, the construct the one-jit loop runs its
  steps in, whose carried caches XLA updates in place.
"""

from __future__ import annotations

import functools
import time
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specjax.sharding.distributed import wait_for_peers


class StepReport(NamedTuple):
    """What the host reads after a step (copies, not the donated state's buffers)."""

    num_generated: jax.Array  # [B] int32
    tokens: jax.Array  # [B, M] int32
    done: jax.Array  # [B] bool


def report(state) -> StepReport:
    """The report of a loop state (any state with ``num_generated``, ``tokens`` and ``done``)."""
    return StepReport(num_generated=state.num_generated, tokens=state.tokens, done=state.done)


def step_if_active(step: Callable, state):
    """``step(state)`` if some request is not done, else ``state`` unchanged; and its report."""

    def cond(carry):
        state, ran = carry
        return ~ran & jnp.any(~state.done)

    def body(carry):
        return step(carry[0]), jnp.bool_(True)

    state, _ = jax.lax.while_loop(cond, body, (state, jnp.bool_(False)))
    return state, report(state)


def run_host_loop(init, step, host, n, on_tokens, timing):
    """The streaming loop of ``specjax.generate(on_tokens=...)``: the jitted step called once per LLM
    pass from the host (its state donated), reporting newly accepted tokens after every pass through
    ``on_tokens(request, ids)``. ``init()`` and ``step(state) -> (state, StepReport)`` are partially
    applied jitted functions (the step built on ``step_if_active``); ``host`` fetches an array to
    numpy; ``timing`` receives compile_seconds, prefill_seconds and seconds. Returns (final state, each
    request's finish time). Compilation is timed apart (AOT lower + compile; the calls then hit the
    same cache).

    Pipelined: step k + 1 is dispatched before step k's report is fetched, so the device goes from
    one step to the next while the host fetches, calls ``on_tokens`` and dispatches (the step after
    the last tokens finds every request done and does nothing).

    The prefill is waited for before the step is compiled (``prefill_then_compile``)."""
    state, compile_s, prefill_s = prefill_then_compile(init, step)
    loop_start = time.perf_counter()

    def elapsed():  # generation time: the prefill, then the loop so far (compilation excluded)
        return prefill_s + time.perf_counter() - loop_start

    def fetch(rep):
        return host(rep.num_generated)[:n], host(rep.tokens), host(rep.done)

    shown = np.zeros(n, np.int64)
    finish = [None] * n
    fetched = fetch(report(state))  # the prefill's tokens, read before the state is donated
    state, pending = step(state)
    while True:
        counts, tokens, done = fetched
        now = elapsed()
        for b in range(n):
            if counts[b] > shown[b]:
                on_tokens(b, tokens[b, shown[b]:counts[b]].tolist())
            if done[b] and finish[b] is None:
                finish[b] = now
        shown = counts
        if bool(np.all(done)):
            break
        state, following = step(state)  # queued behind the step whose report is fetched next
        fetched = fetch(pending)
        pending = following
    state = jax.block_until_ready(state)  # the step in flight: a no-op, every request being done
    timing["compile_seconds"] = compile_s
    timing["prefill_seconds"] = prefill_s
    timing["seconds"] = elapsed()
    return state, finish


def run_two_programs(init, finish, host, timing):
    """``specjax.generate`` without ``on_tokens``: the prefill program ``init()``, then the whole loop
    as one program ``finish(state)``, each compiled with its own options
    (``specjax.decoding.programs``). Compilation is timed apart as in ``run_host_loop``: the prefill
    is waited for before the loop is compiled (``prefill_then_compile``). Returns the loop's output."""
    state, compile_s, prefill_s = prefill_then_compile(init, finish)
    t0 = time.perf_counter()
    out = finish(state)
    host(out.tokens)  # blocks until done
    timing["compile_seconds"] = compile_s
    timing["prefill_seconds"] = prefill_s
    timing["seconds"] = prefill_s + time.perf_counter() - t0
    return out


def prefill_then_compile(init, then):
    """Compile ``init``, run it, then compile ``then`` for the state it returned: (state, seconds of
    compilation, seconds of prefill). AOT lower + compile, so the calls that follow hit the same cache.
    The prefill is waited for before ``then`` is compiled: it runs asynchronously, and a compilation
    overlapping it had hidden the prefill's time inside ``compile_seconds`` (a cold batch of 16
    prompts reported 7.9 s of generation for 16.4 s of prefill + decoding)."""
    t0 = time.perf_counter()
    lower_partial(init).compile()
    wait_for_peers("the prefill compiled")
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    state = jax.block_until_ready(init())
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    lower_partial(then, state).compile()
    wait_for_peers("the decoding loop compiled")
    return state, compile_s + time.perf_counter() - t0, prefill_s


def lower_partial(fn: functools.partial, *args):
    """AOT-lower a partially applied jitted function with these extra positional arguments."""
    return fn.func.lower(*fn.args, *args, **fn.keywords)
