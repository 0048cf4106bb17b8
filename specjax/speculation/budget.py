"""The tree budget: how many drafted nodes each step verifies, from measured pass costs and acceptance.

A bigger token tree costs a slower LLM pass (on a CPU the pass is compute-bound: 16 nodes cost ~2.7x
one token); it pays only when enough of it is accepted. A ``Budget`` holds a few *levels*, each a
static cut of every drafter's proposal (a prefix of its nodes, parents before children), and the
measured seconds of one LLM pass at each level for the batch size being compiled
(``specjax.speculation.cost``). Every step, inside the jitted loop, the drafters estimate the tokens
each level would get accepted for each request (e_r(l), ``expected_by_level``: the sum of the
level's distinct nodes' ``Drafter.node_acceptance``), and the level
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

The seconds per pass reach the loop as an array argument (``pass_costs``; ``SpecConfig.costs_apart``
takes them out of the static spec), not as constants of the compiled program: a remeasured table
(``specjax tree-cost --remeasure``, a new machine reading the same persistent XLA cache) then reuses the
compiled loop instead of compiling it again. A ``Budget`` that carries its costs still works where the
loop is called without the array (they are then compiled in).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from specjax.errors import InputError
from specjax.speculation.drafters.base import estimates_acceptance

GOALS = ("finish", "rate")


@dataclasses.dataclass(frozen=True)
class Budget:
    """levels[l][s]: nodes below the root kept of drafter s's proposal at level l (level 0 should be
    all zeros: no speculation). costs[l]: seconds per LLM pass at level l (None: measure before use,
    ``specjax.speculation.cost.with_costs``, or give them to the loop as its ``pass_costs`` array).
    source: where the costs come from (shown in stats).
    goal: "finish" (a batch that runs until its last request ends) or "rate" (slots refilled as
    requests end); see the module docstring."""

    levels: tuple[tuple[int, ...], ...]
    costs: tuple[float, ...] | None = None
    # Shown in stats only: not part of the equality and hash that key the compiled loop (a table
    # "measured now" and the same table read back next call had made the second call recompile).
    source: str = dataclasses.field(default="", compare=False)
    goal: str = "finish"

    def __post_init__(self):
        def count(m) -> bool:
            return isinstance(m, (int, np.integer)) and not isinstance(m, bool) and m >= 0

        if not isinstance(self.levels, (tuple, list)) or not self.levels or not all(
                isinstance(lv, (tuple, list)) and lv and all(count(m) for m in lv) for lv in self.levels):
            raise InputError(f"Budget.levels must be a non-empty tuple of tuples of node counts >= 0 (one per "
                             f"drafter), got {self.levels!r}")
        # plain ints in tuples: the budget is part of the loop's static, hashed config
        object.__setattr__(self, "levels", tuple(tuple(int(m) for m in lv) for lv in self.levels))
        if len({len(lv) for lv in self.levels}) != 1:
            raise InputError(f"Budget.levels: every level needs one node count per drafter, got {self.levels!r}")
        if self.costs is not None:
            if not isinstance(self.costs, (tuple, list, np.ndarray)):
                raise InputError(f"Budget: costs must be one number of seconds per level, got {self.costs!r}")
            if len(self.costs) != len(self.levels):
                raise InputError(f"Budget: {len(self.costs)} costs for {len(self.levels)} levels")
            real = (int, float, np.integer, np.floating)
            bad = [c for c in self.costs
                   if isinstance(c, bool) or not isinstance(c, real) or not (math.isfinite(c) and c > 0)]
            if bad:
                raise InputError(f"Budget.costs must be positive finite seconds, got {bad[0]!r}")
            object.__setattr__(self, "costs", tuple(float(c) for c in self.costs))
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
            if not estimates_acceptance(d):
                raise InputError(f"the tree budget needs drafters that estimate their acceptance; "
                                 f"{d.describe()} does not (use budget=None for a fixed tree)")


def default_levels(drafters, solo: bool = True) -> tuple[tuple[int, ...], ...]:
    """Level i keeps rung i of every drafter's own ladder (``Drafter.budget_ladder``; a shorter ladder
    stays on its top rung): one drafter climbs its ladder, several grow their merged tree together.
    With several drafters and ``solo``, a drafter's rungs alone are levels too (sorted by node count),
    its smallest and largest excepted: where one drafter's nodes do not pay (lookup's chains in text
    that does not repeat, a feature drafter at temperature 1 on copied text) the step need not verify
    them to get the other's. The budget never picked the excepted ones on the 8 task kinds of
    ``scripts/data/task_kinds.jsonl`` at temperature 0 or 1 (a 2- or 3-node pass costs what the merged
    4-node level does; the largest alone was never worth its pass), and every level is a branch that
    each step program compiles. The serving engine passes ``solo=False``: it calls its step program
    once per pass, and XLA:CPU allocates a program's temporaries on every call (41 MB for SmolLM2's
    default with solo levels against 7.9 MB without, batch 1: above glibc's mmap threshold)."""
    ladders = [d.budget_ladder() for d in drafters]
    together = {tuple(lad[min(i, len(lad) - 1)] for lad in ladders) for i in range(max(map(len, ladders)))}
    if solo and len(drafters) > 1:
        for s, lad in enumerate(ladders):
            inner = [m for m in lad if m > 0][1:-1]
            together |= {tuple(m if t == s else 0 for t in range(len(drafters))) for m in inner}
    return tuple(sorted(together, key=lambda lv: (sum(lv), lv)))


def expected_by_level(drafters, drafter_params, drafter_states, proposals, budget: Budget) -> jax.Array:
    """[B, L] expected accepted tokens per request at each level: the sum of the acceptance estimates
    (``Drafter.node_acceptance``) of the level's distinct nodes. Accepted tokens are accepted nodes, so
    the sum is the expectation; a node several drafters propose is one node of the merged tree and
    counts once, at the largest of their estimates."""
    exists = [_exists(prop) for prop in proposals]
    probs = [jnp.where(e, jnp.pad(d.node_acceptance(p, st), ((0, 0), (1, 0))), 0.0)
             for d, p, st, e in zip(drafters, drafter_params, drafter_states, exists)]  # [B, 1 + N_s]
    # same[t][s] [B, 1 + N_t]: the node of drafter s < t with the path of t's node (-1: none; 0: the root)
    same = [[_match_paths(proposals[s], proposals[t], exists[s], exists[t]) for s in range(t)]
            for t in range(len(drafters))]
    out = []
    for lv in budget.levels:
        total = jnp.zeros(probs[0].shape[:1], jnp.float32)
        for t, m in enumerate(lv):
            if m == 0:
                continue
            # what the earlier drafters kept of the same node already counts (the largest estimate wins)
            before = jnp.zeros_like(probs[t][:, 1:m + 1])
            for s in range(t):
                idx = same[t][s][:, 1:m + 1]
                kept = (idx > 0) & (idx <= lv[s])
                before = jnp.maximum(before, jnp.where(kept, jnp.take_along_axis(probs[s], jnp.maximum(idx, 0),
                                                                                 axis=1), 0.0))
            total = total + jnp.sum(jnp.maximum(probs[t][:, 1:m + 1] - before, 0.0), axis=1)
        out.append(total)
    return jnp.stack(out, axis=1)


def _exists(prop) -> jax.Array:
    """[B, N] the node and its ancestors were drawn (``Proposal.ok`` along the path; parents first)."""
    exists = prop.ok.at[:, 0].set(True)

    def node(i, exists):  # a loop, not unrolled: one node's ops, compiled once (see merge_proposals)
        par = prop.parent[:, i]
        up = jnp.take_along_axis(exists, jnp.maximum(par, 0)[:, None], axis=1)[:, 0]
        return exists.at[:, i].set(exists[:, i] & up & (par >= 0))

    return jax.lax.fori_loop(1, prop.ok.shape[1], node, exists)


def same_nodes(a, b) -> jax.Array:
    """[B, N_b] for every node of proposal ``b`` the index of the node of ``a`` with the same token
    path from the root (0 for the root, -1 where ``a`` has none or b's node was not drawn)."""
    return _match_paths(a, b, _exists(a), _exists(b))


def _match_paths(a, b, ea: jax.Array, eb: jax.Array) -> jax.Array:
    """``same_nodes`` with both proposals' ``_exists`` given (computed once per step)."""
    match = jnp.full(b.tokens.shape, -1, jnp.int32).at[:, 0].set(0)
    cols = jnp.arange(a.tokens.shape[1])[None, :]

    def node(j, match):  # a loop, not unrolled (see _exists)
        up = jnp.take_along_axis(match, jnp.maximum(b.parent[:, j], 0)[:, None], axis=1)  # [B, 1]
        hit = ea & (cols > 0) & (a.parent == up) & (a.tokens == b.tokens[:, j][:, None]) & (up >= 0)
        found = jnp.any(hit, axis=1) & eb[:, j]
        return match.at[:, j].set(jnp.where(found, jnp.argmax(hit, axis=1), -1))

    return jax.lax.fori_loop(1, b.tokens.shape[1], node, match)


def choose_level(budget: Budget, expected: jax.Array, active: jax.Array, remaining: jax.Array,
                 costs: jax.Array | None = None) -> jax.Array:
    """The level serving the budget's goal best (int32). expected [B, L]: expected accepted tokens per
    request and level; active [B]: unfinished requests; remaining [B]: tokens each may still emit;
    costs [L]: seconds per pass at each level (default: the budget's own)."""
    costs = jnp.asarray(level_costs(budget, costs), jnp.float32)
    if budget.goal == "rate":
        tokens = jnp.sum(jnp.where(active[:, None], 1.0 + expected, 0.0), axis=0)  # [L]
        return jnp.argmax(tokens / costs).astype(jnp.int32)
    steps = jnp.where(active[:, None], remaining.astype(jnp.float32)[:, None] / (1.0 + expected), 0.0)  # [B, L]
    return jnp.argmin(costs * jnp.max(steps, axis=0)).astype(jnp.int32)


def level_costs(budget: Budget, costs=None):
    """The seconds per pass the budget decides with: ``costs`` (an array argument of the loop, [L]) or the
    budget's own; refused, naming the problem, when there are neither or the array has another length."""
    if costs is None:
        if budget.costs is None:
            raise InputError("the tree budget has no pass costs: give the loop pass_costs=[seconds per level] or a "
                             "Budget with costs (specjax.speculation.cost.with_costs measures them)")
        return budget.costs
    if jnp.shape(costs) != (len(budget.levels),):
        raise InputError(f"pass_costs has shape {jnp.shape(costs)}; the tree budget has {len(budget.levels)} levels, "
                         f"so it needs shape ({len(budget.levels)},): seconds per pass at each level")
    return costs
