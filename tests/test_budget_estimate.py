"""The tree budget's estimate of a merged level: the sum of the acceptance estimates of the level's
distinct nodes (a token path two drafters propose counts once, at the larger estimate), against a
plain-Python reference over random proposals that share paths, reuse tokens under different parents
and leave nodes undrawn; and the levels the budget offers several drafters."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np

from specjax.speculation.budget import Budget, default_levels, expected_by_level, same_nodes
from specjax.speculation.drafters.base import Drafter, Proposal
from specjax.speculation.drafters.lookup import LookupDrafter


@dataclasses.dataclass(frozen=True)
class GivenEstimates(Drafter):
    """A drafter whose node acceptance estimates are its state (``node_acceptance`` reads them back)."""

    nodes: int = 4

    @property
    def num_nodes(self) -> int:
        return self.nodes

    @property
    def law(self) -> str:
        return "onehot"

    @property
    def max_depth(self) -> int:
        return self.nodes

    def node_acceptance(self, params, state):
        return state


def random_proposal(rng, batch: int, nodes: int, vocab: int, shared: list | None = None):
    """A proposal of ``nodes`` nodes below the root (parents first) over a small vocabulary, so that
    paths repeat across proposals and tokens repeat under different parents. ``shared``: proposals
    whose paths this one copies for about half its nodes."""
    tokens = np.zeros((batch, nodes + 1), np.int32)
    parent = np.full((batch, nodes + 1), -1, np.int32)
    for b in range(batch):
        paths = {(): 0}
        for i in range(1, nodes + 1):
            while True:
                if shared and rng.rand() < 0.5:  # copy a node (and so a path) of another proposal
                    other = shared[rng.randint(len(shared))]
                    j = rng.randint(1, other.tokens.shape[1])
                    path = _path(other, b, j)
                    if path[:-1] in paths and path not in paths:
                        break
                par = rng.randint(i)
                path = [p for p, n in paths.items() if n == par][0] + (int(rng.randint(vocab)),)
                if path not in paths:
                    break
            paths[path] = i
            tokens[b, i], parent[b, i] = path[-1], paths[path[:-1]]
    ok = rng.rand(batch, nodes + 1) > 0.15
    ok[:, 0] = True
    return Proposal(tokens=jnp.asarray(tokens), parent=jnp.asarray(parent), ok=jnp.asarray(ok),
                    law_row=jnp.full((batch, nodes + 1), -1, jnp.int32))


def _path(prop: Proposal, b: int, i: int) -> tuple:
    tokens, parent = np.asarray(prop.tokens[b]), np.asarray(prop.parent[b])
    path = []
    while i > 0:
        path.append(int(tokens[i]))
        i = int(parent[i])
    return tuple(reversed(path))


def _drawn(prop: Proposal, b: int, i: int) -> bool:
    ok, parent = np.asarray(prop.ok[b]), np.asarray(prop.parent[b])
    while i > 0:
        if not ok[i]:
            return False
        i = int(parent[i])
    return True


def reference_estimate(proposals, probs, level, b: int) -> float:
    """Sum over the distinct token paths of the kept, drawn nodes of the largest estimate among them."""
    best: dict[tuple, float] = {}
    for prop, p, m in zip(proposals, probs, level):
        for i in range(1, m + 1):
            if _drawn(prop, b, i):
                path = _path(prop, b, i)
                best[path] = max(best.get(path, 0.0), float(p[b, i - 1]))
    return sum(best.values())


_jitted_estimate = jax.jit(expected_by_level, static_argnums=(0, 1, 4))


class TestMergedEstimate(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_equals_the_reference(self):
        rng = np.random.RandomState(0)
        batch = 3
        for trial in range(4):
            sizes = (6, 5, 4) if trial % 2 else (8, 6)
            proposals = []
            for n in sizes:
                proposals.append(random_proposal(rng, batch, n, vocab=3, shared=list(proposals)))
            drafters = tuple(GivenEstimates(n) for n in sizes)
            probs = [jnp.asarray(rng.uniform(0.0, 1.0, (batch, n)), jnp.float32) for n in sizes]
            levels = tuple({tuple(int(rng.randint(n + 1)) for n in sizes) for _ in range(8)}
                           | {tuple(sizes), (0,) * len(sizes)})
            budget = Budget(levels)
            got = np.asarray(self.variant(
                lambda pr, ps: expected_by_level(drafters, ((),) * len(sizes), tuple(pr), ps, budget))(probs,
                                                                                                   proposals))
            assert got.shape == (batch, len(levels))
            for b in range(batch):
                for i, lv in enumerate(levels):
                    want = reference_estimate(proposals, [np.asarray(p) for p in probs], lv, b)
                    np.testing.assert_allclose(got[b, i], want, rtol=1e-6, atol=1e-6, err_msg=f"{lv} row {b}")
            # merging never estimates less than its best member, nor more than the members' sum. Each
            # member's estimates at every level come from one jitted call (a budget of the levels cut to
            # that member): op by op, one call per level and member had cost 34 of this test's 45 s.
            alone = np.stack([np.asarray(_jitted_estimate(
                drafters, ((),) * len(sizes), tuple(probs), proposals,
                Budget(tuple(tuple(m if t == s else 0 for t, m in enumerate(lv)) for lv in levels))))
                for s in range(len(sizes))])  # [member, batch, level]
            assert (got >= alone.max(axis=0) - 1e-6).all()
            assert (got <= alone.sum(axis=0) + 1e-6).all()


def test_paths_match_by_path_not_by_token():
    """The same token under different parents is a different node; undrawn nodes (and their children)
    match nothing."""
    def prop(tokens, parent, ok=None):
        ok = [True] * len(tokens) if ok is None else ok
        return Proposal(tokens=jnp.asarray([tokens], jnp.int32), parent=jnp.asarray([parent], jnp.int32),
                        ok=jnp.asarray([ok]), law_row=jnp.full((1, len(tokens)), -1, jnp.int32))

    a = prop([9, 5, 6, 7, 5], [-1, 0, 0, 1, 2])  # paths: (5), (6), (5, 7), (6, 5)
    b = prop([9, 5, 7, 6, 5, 4], [-1, 0, 1, 0, 3, 1])  # (5), (5, 7), (6), (6, 5), (5, 4)
    np.testing.assert_array_equal(np.asarray(same_nodes(a, b))[0], [0, 1, 3, 2, 4, -1])
    # a's node (6) undrawn: its child (6, 5) is not in a's tree either
    undrawn = prop([9, 5, 6, 7, 5], [-1, 0, 0, 1, 2], ok=[True, True, False, True, True])
    np.testing.assert_array_equal(np.asarray(same_nodes(undrawn, b))[0], [0, 1, 3, -1, -1, -1])
    d = (GivenEstimates(4), GivenEstimates(5))
    pa, pb = jnp.asarray([[0.5, 0.2, 0.4, 0.1]]), jnp.asarray([[0.3, 0.6, 0.25, 0.05, 0.1]])
    got = np.asarray(expected_by_level(d, ((), ()), (pa, pb), (a, b), Budget(((4, 0), (0, 5), (4, 5), (1, 2)))))[0]
    # (4, 5): (5) max(.5, .3) + (6) max(.2, .25) + (5, 7) max(.4, .6) + (6, 5) max(.1, .05) + (5, 4) .1
    # (1, 2): a keeps (5); b keeps (5) and (5, 7): .5 + .6
    np.testing.assert_allclose(got, [1.2, 1.3, 0.5 + 0.25 + 0.6 + 0.1 + 0.1, 1.1], rtol=1e-6)


def test_a_single_drafter_level_is_its_own_estimate():
    rng = np.random.RandomState(1)
    d = GivenEstimates(6)
    prop = random_proposal(rng, 2, 6, vocab=4)
    prop = prop.replace(ok=jnp.ones_like(prop.ok))
    p = jnp.asarray(rng.uniform(0, 1, (2, 6)), jnp.float32)
    budget = Budget(((0,), (2,), (6,)))
    np.testing.assert_allclose(expected_by_level((d,), ((),), (p,), (prop,), budget),
                               d.expected_accepted((), p, (0, 2, 6)), rtol=1e-6)


def test_several_drafters_get_their_merged_and_their_solo_rungs():
    a, b = GivenEstimates(8), LookupDrafter(depth=4, branches=2)  # ladders (0, 8) and (0, 2, 4, 8)
    assert default_levels((a,)) == ((0,), (8,))
    # rung i of both, and each ladder's inner rungs alone (not its smallest or largest): b's 4
    assert default_levels((a, b)) == ((0, 0), (0, 4), (8, 2), (8, 4), (8, 8))
    assert default_levels((a, b), solo=False) == ((0, 0), (8, 2), (8, 4), (8, 8))  # the serving engine's
