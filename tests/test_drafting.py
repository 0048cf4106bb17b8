"""T3: drafted tokens follow the declared laws, and the stored law is bitwise the array the sampler
consumed (iid, without replacement, coupled, top-k; greedy requests always draft top-k)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.decoding.sampling import gumbel_noise, warp_logits
from specjax.speculation.drafters.ssm import draw_children
from tests import oracle
from tests.stats import assert_fits
from tests.toy import sampling_arrays

N = 200_000
VOCAB = 6


def _logits(batch):
    base = np.asarray([[2.0, 1.5, 0.3, -0.5, 1.0, -2.0], [0.1, -1.0, 2.5, 0.4, 0.4, 1.2]], np.float32)
    return jnp.broadcast_to(jnp.asarray(base), (batch, 2, VOCAB))  # two frontier nodes


def _draw(draft, k, temperature=0.7, top_k=0, top_p=0.9, n=N, fault=None):
    s = sampling_arrays(n, temperature, top_k, top_p)
    fn = jax.jit(lambda lg, s, length: draw_children(lg, k, draft, s, length, 2, np.asarray([3, 5]), 1, fault))
    length = jnp.full((n,), 11, jnp.int32)
    tokens, ok, law = fn(_logits(n), s, length)
    return np.asarray(tokens), np.asarray(ok), law, s


def _q(s, node):
    one = jax.tree.map(lambda a: a[:1], s)
    q = np.exp(np.asarray(warp_logits(_logits(1), one)[0, node], np.float64))
    return q / q.sum()


@pytest.mark.parametrize("draft", ["iid", "wor"])
def test_sampled_drafts_follow_their_declared_law(draft):
    tokens, ok, law, s = _draw(draft, 3)
    # the stored law is bitwise what the sampler consumed: the shared warp of the SSM logits
    np.testing.assert_array_equal(np.asarray(law), np.asarray(warp_logits(_logits(N), s)))
    for node in (0, 1):
        q = _q(s, node)
        exact = {}
        for combo, pr in oracle.draws(q, 3, draft):
            exact[combo] = exact.get(combo, 0.0) + pr
        samples = [tuple(int(x) for x, o in zip(row, oks) if o) for row, oks in zip(tokens[:, node], ok[:, node])]
        assert_fits(samples, exact, f"{draft} drafts at node {node}")
    # the two frontier nodes draw independently
    joint = {(a, b): pa * pb for a, pa in enumerate(_q(s, 0)) for b, pb in enumerate(_q(s, 1))}
    assert_fits(list(zip(tokens[:, 0, 0].tolist(), tokens[:, 1, 0].tolist())), joint, f"{draft} node independence")


def test_without_replacement_from_a_short_support_marks_missing_draws():
    tokens, ok, _, s = _draw("wor", 4, temperature=1.0, top_k=2, top_p=1.0, n=1000)
    assert ok[:, :, :2].all() and not ok[:, :, 2:].any()
    assert (tokens[:, :, 0] != tokens[:, :, 1]).all()


def test_coupled_drafts_are_the_top_k_of_the_seeded_noise():
    tokens, ok, law, s = _draw("coupled", 2)
    length = jnp.full((N,), 11, jnp.int32)
    noise = np.asarray(gumbel_noise(s.seed, length + 2 + 1, VOCAB))  # children sit at length + depth + 1
    scores = np.asarray(law) + noise[:, None, :]
    np.testing.assert_array_equal(tokens, np.argsort(-scores, axis=-1, kind="stable")[..., :2])
    # the first coupled child is an exact sample from q (Gumbel-max)
    assert_fits(tokens[:, 0, 0].tolist(), dict(enumerate(_q(s, 0))), "coupled first child")


def test_greedy_requests_and_top_k_drafts_are_deterministic():
    n = 8
    s = sampling_arrays(n, 0.0)
    for draft in ("topk", "iid", "wor", "coupled"):
        tokens, ok, law = draw_children(_logits(n), 3, draft, s, jnp.zeros((n,), jnp.int32), 0, np.asarray([1, 2]), 0)
        np.testing.assert_array_equal(np.asarray(tokens), np.asarray(jax.lax.top_k(_logits(n), 3)[1]))
        assert np.asarray(ok).all()
    assert draw_children(_logits(n), 3, "topk", sampling_arrays(n, 1.0), jnp.zeros((n,), jnp.int32), 0,
                         np.asarray([1, 2]), 0)[2] is None, "top-k entries must declare one-hot laws"


def test_mutant_wrong_temperature_law_is_caught():
    _, _, law, s = _draw("iid", 1, n=16, fault="law_wrong_temperature")
    assert not np.array_equal(np.asarray(law), np.asarray(warp_logits(_logits(16), s)))
