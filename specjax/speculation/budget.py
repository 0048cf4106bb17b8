"""The tree budget: how many drafted nodes each step verifies, from measured pass costs and acceptance.

A bigger token tree costs a slower LLM pass (on a CPU the pass is compute-bound: 16 nodes cost ~2.7x
one token); it pays only when enough of it is accepted. A ``Budget`` holds a few *levels*, each a
static cut of every drafter's proposal (a prefix of its nodes, parents before children), and the
measured seconds of one LLM pass at each level for the batch size being compiled
(``specjax.speculation.cost``). Every step, inside the jitted loop, the drafters estimate the tokens
each level would get accepted for each request (``Drafter.expected_accepted``, e_r(l)), and the level
that serves the budget's *goal* best runs (``lax.switch`` over one compiled pass per level):

- ``"finish"`` (``specjax.generate``: the batch runs until its last request ends): the level that
  minimises the projected time until the last unfinished request is done,

      seconds per pass at l  *  max over unfinished r of  remaining_r / (1 + e_r(l)),

  remaining_r being the tokens request r may still emit. A tree that speeds up some requests but not
  the one that ends last only makes every pass dearer, so it is not chosen.
- ``"rate"`` (the serving engine: a slot is refilled as soon as its request ends): the level that
  maximises emitted tokens per second,

      sum over unfinished r of (1 + e_r(l))  /  seconds per pass at l.

With one request both goals choose alike. Level 0 is no drafted node at all: the cost of incremental
decoding plus the drafters' own bookkeeping. Because the costs are per batch size, large batches,
where a tree's extra nodes cost most, fall back to smaller trees or none by the same rule
("batch-aware"). A request whose drafts will not pay contributes nothing to a bigger level; the pass
shape is the batch's, so its nodes then cost nothing extra either.

The choice reads only committed tokens and past statistics, never the current pass's logits, so
every verifier stays exact whatever level runs.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from specjax.errors import InputError
from specjax.speculation.drafters.base import Drafter

GOALS = ("finish", "rate")


@dataclasses.dataclass(frozen=True)
class Budget:
    """levels[l][s]: nodes below the root kept of drafter s's proposal at level l (level 0 should be
    all zeros: no speculation). costs[l]: seconds per LLM pass at level l (None: measure before use,
    ``specjax.speculation.cost.with_costs``). source: where the costs come from (shown in stats).
    goal: "finish" (a batch that runs until its last request ends) or "rate" (slots refilled as
    requests end); see the module docstring."""

    levels: tuple[tuple[int, ...], ...]
    costs: tuple[float, ...] | None = None
    # Shown in stats only: not part of the equality and hash that key the compiled loop (a table
    # "measured now" and the same table read back next call had made the second call recompile).
    source: str = dataclasses.field(default="", compare=False)
    goal: str = "finish"

    def __post_init__(self):
        if not isinstance(self.levels, tuple) or not self.levels or not all(
                isinstance(lv, tuple) and lv and all(isinstance(m, int) and m >= 0 for m in lv) for lv in self.levels):
            raise InputError(f"Budget.levels must be a non-empty tuple of tuples of node counts >= 0 (one per "
                             f"drafter), got {self.levels!r}")
        if len({len(lv) for lv in self.levels}) != 1:
            raise InputError(f"Budget.levels: every level needs one node count per drafter, got {self.levels!r}")
        if self.costs is not None:
            if len(self.costs) != len(self.levels):
                raise InputError(f"Budget: {len(self.costs)} costs for {len(self.levels)} levels")
            bad = [c for c in self.costs if not (isinstance(c, float) and math.isfinite(c) and c > 0)]
            if bad:
                raise InputError(f"Budget.costs must be positive finite seconds (floats), got {bad[0]!r}")
        if self.goal not in GOALS:
            raise InputError(f"Budget.goal must be one of {GOALS}, got {self.goal!r}")

    def node_count(self, level: int) -> int:
        """Tree nodes at this level, the root included (before merging removes duplicates)."""
        return 1 + sum(self.levels[level])

    def check(self, drafters) -> None:
        """Refuse levels that do not fit the drafters, or drafters that cannot estimate acceptance."""
        if len(self.levels[0]) != len(drafters):
            raise InputError(f"Budget levels give node counts for {len(self.levels[0])} drafters, the spec has "
                             f"{len(drafters)}")
        for lv in self.levels:
            for d, m in zip(drafters, lv):
                if m > d.num_nodes:
                    raise InputError(f"Budget level {lv}: {m} nodes of {d.describe()}, which proposes {d.num_nodes}")
        for d in drafters:
            if type(d).expected_accepted is Drafter.expected_accepted:
                raise InputError(f"the tree budget needs drafters that estimate their acceptance; "
                                 f"{d.describe()} does not (use budget=None for a fixed tree)")


def default_levels(drafters) -> tuple[tuple[int, ...], ...]:
    """Level i keeps rung i of every drafter's own ladder (``Drafter.budget_ladder``; a shorter ladder
    stays on its top rung): one drafter climbs its ladder, several grow their merged tree together."""
    ladders = [d.budget_ladder() for d in drafters]
    return tuple(tuple(lad[min(i, len(lad) - 1)] for lad in ladders) for i in range(max(map(len, ladders))))


def expected_by_level(drafters, drafter_params, drafter_states, budget: Budget) -> jax.Array:
    """[B, L] expected accepted tokens per request at each level: the best single drafter's estimate
    (merged proposals share their first tokens, so their gains do not add up)."""
    per = []
    for s, (d, p, st) in enumerate(zip(drafters, drafter_params, drafter_states)):
        per.append(d.expected_accepted(p, st, tuple(lv[s] for lv in budget.levels)))
    return jnp.max(jnp.stack(per, 0), axis=0)


def choose_level(budget: Budget, expected: jax.Array, active: jax.Array, remaining: jax.Array) -> jax.Array:
    """The level serving the budget's goal best (int32). expected [B, L]: expected accepted tokens per
    request and level; active [B]: unfinished requests; remaining [B]: tokens each may still emit."""
    costs = jnp.asarray(budget.costs, jnp.float32)
    if budget.goal == "rate":
        tokens = jnp.sum(jnp.where(active[:, None], 1.0 + expected, 0.0), axis=0)  # [L]
        return jnp.argmax(tokens / costs).astype(jnp.int32)
    steps = jnp.where(active[:, None], remaining.astype(jnp.float32)[:, None] / (1.0 + expected), 0.0)  # [B, L]
    return jnp.argmin(costs * jnp.max(steps, axis=0)).astype(jnp.int32)
