"""The loop step as the host calls it when it streams: at most one step, plus a report of the tokens.

The host loop (``specjax.api``) dispatches step k + 1 before it reads step k's tokens, so the device
never waits for the host's fetch, its callbacks and the next dispatch (about 1.4 ms per step on a
2-core CPU, ~5% of a SmolLM2 step). That needs two things of the step:

- a report: copies of what the host reads (``num_generated``, ``tokens``, ``done``) as outputs of
  their own, because the state itself is donated to the next step before the host reads it;
- nothing to do once every request is done: the step dispatched after the last tokens runs the
  body zero times. It is a one-trip ``lax.while_loop`` rather than a ``lax.cond`` so that the
  caches are updated in place, exactly as in the one-jit loop.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp


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
