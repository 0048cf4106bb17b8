"""The per-node bookkeeping of a speculative step compiles to loops: its program does not grow with the
tree. Every budget level of a step program merges, walks and estimates its own tree, so an unrolled
node loop was compiled once per node per level (the default SmolLM2 loop's XLA compilation took 28 s
with them unrolled, 13 s as loops; see specjax/speculation/drafters/merge.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.speculation.budget import same_nodes
from specjax.speculation.drafters.base import Proposal
from specjax.speculation.drafters.feature import node_depths
from specjax.speculation.drafters.merge import merge_proposals
from specjax.speculation.tree import from_parents
from specjax.speculation.verify.greedy import verify_greedy


def _equations(jaxpr) -> int:
    """Equations of a jaxpr and of every jaxpr its equations hold (loop bodies, branches), recursively."""
    count = 0
    for eqn in jaxpr.eqns:
        count += 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    count += _equations(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    count += _equations(sub)
    return count


def _size(fn, *args) -> int:
    return _equations(jax.make_jaxpr(fn)(*args).jaxpr)


def _chain_and_fan(nodes: int, seed: int) -> list[Proposal]:
    """Two proposals of ``nodes`` nodes each (a chain and a fan below the root), random tokens, batch 2."""
    rng = np.random.RandomState(seed)
    shapes = [[-1] + list(range(nodes - 1)), [-1] + [0] * (nodes - 1)]
    out = []
    for parents in shapes:
        tokens = jnp.asarray(rng.randint(0, 3, (2, nodes)), jnp.int32).at[:, 0].set(7)
        out.append(Proposal(tokens=tokens, parent=jnp.asarray([parents] * 2, jnp.int32),
                            ok=jnp.ones((2, nodes), bool), law_row=jnp.full((2, nodes), -1, jnp.int32)))
    return out


@pytest.mark.parametrize("static", [True, False], ids=["static parents", "dynamic parents"])
def test_merge_program_does_not_grow_with_the_nodes(static):
    def merged(nodes):
        props = _chain_and_fan(nodes, nodes)
        parents = [tuple(int(p) for p in np.asarray(prop.parent[0])) for prop in props] if static else None
        return _size(lambda ps: merge_proposals(ps, parents), props)

    assert merged(4) == merged(17) == merged(33)


def test_greedy_walk_program_does_not_grow_with_the_depth():
    def walk(depth):
        tree = from_parents([[7] + [1] * depth], [[-1] + list(range(depth))], n_max=depth + 1)
        return _size(lambda t, tree: verify_greedy(t, tree, depth), jnp.ones((1, depth + 1), jnp.int32), tree)

    assert walk(2) == walk(8) == walk(32)


def test_node_matching_and_depths_do_not_grow_with_the_nodes():
    def matching(nodes):
        a, b = _chain_and_fan(nodes, 1)
        return _size(same_nodes, a, b), _size(node_depths, a.parent)

    assert matching(4) == matching(17) == matching(33)


def test_the_loops_compute_what_the_unrolled_walks_did():
    """Same results as a plain Python walk over the nodes (the loops' semantics, checked on values)."""
    a, b = _chain_and_fan(9, 3)
    b = b.replace(tokens=b.tokens.at[:, 1:3].set(a.tokens[:, 1:3]))  # some shared paths
    got = np.asarray(same_nodes(a, b))
    depths = np.asarray(node_depths(a.parent))
    for r in range(2):
        ta, tb = np.asarray(a.tokens[r]), np.asarray(b.tokens[r])
        pa, pb = np.asarray(a.parent[r]), np.asarray(b.parent[r])
        want = [0]
        for j in range(1, 9):
            up = want[pb[j]]
            hits = [i for i in range(1, 9) if up >= 0 and pa[i] == up and ta[i] == tb[j]]
            want.append(hits[0] if hits else -1)
        assert got[r].tolist() == want
        assert depths[r].tolist() == list(range(9))
