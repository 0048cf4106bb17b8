"""The offline RRS acceptance of ``scripts/coupled_drafts.py`` (sampled drafts against coupled ones, stop 87):
its exact per-draw probability must be the recursive-rejection-sampling law, checked in closed form on a small
vocabulary and against a float64 simulation of the rule."""

import chex
import jax
import jax.numpy as jnp
import numpy as np

from tests.conftest import load_script


def _script():
    return load_script("coupled_drafts")


def _laws(seed, vocab=12, draft=8):
    rng = np.random.default_rng(seed)
    logp = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(3, vocab)) * 2.0, jnp.float32), -1)
    ids = jnp.asarray(rng.choice(vocab, size=draft, replace=False), jnp.int32)
    logq = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(3, draft)) * 1.5, jnp.float32), -1)
    return logp, logq, ids


def _rrs_by_hand(p, q, ids, children):
    """float64: the RRS walk over ``children`` (indices into the draft vocabulary), acceptance after each."""
    r, lam, reject, out = p.astype(np.float64), q.astype(np.float64), 1.0, []
    for x in children:
        a = min(1.0, r[ids[x]] / lam[x]) if lam[x] > 0 else 0.0
        reject *= 1.0 - a
        out.append(1.0 - reject)
        full = np.zeros_like(r)
        full[ids] = lam
        left = np.maximum(r - full, 0.0)
        r = left / left.sum() if left.sum() > 0 else r
        lam = lam.copy()
        lam[x] = 0.0
        lam = lam / lam.sum()
    return out


def test_one_child_accepts_with_the_overlap_of_p_and_q():
    mod = _script()
    logp, logq, ids = _laws(0)
    noise = jax.random.gumbel(jax.random.key(1), logq.shape)
    got = mod.rrs_accept(logp, logq, ids, noise, 1)[..., 0]
    overlap = np.sum(np.minimum(np.exp(np.asarray(logp, np.float64))[:, np.asarray(ids)],
                                np.exp(np.asarray(logq, np.float64))), -1)
    # acceptance of one child x is min(1, p(x)/q(x)); its expectation over x ~ q is the overlap. One draw
    # is not the expectation, so average over many draws (the noise picks x ~ q): each draw's value lies in
    # [0, 1], so the mean of 4000 has a standard error of at most 0.5 / sqrt(4000) = 0.008; 0.03 is ~4 of them.
    keys = jax.random.split(jax.random.key(2), 4000)
    one = jax.vmap(lambda k: mod.rrs_accept(logp, logq, ids, jax.random.gumbel(k, logq.shape), 1)[..., 0])
    mean = jnp.mean(one(keys), 0)
    chex.assert_shape(got, (3,))
    np.testing.assert_allclose(np.asarray(mean), overlap, atol=0.03)


def test_rrs_accept_is_the_rrs_walk_over_the_drawn_children():
    mod = _script()
    for seed in range(3):
        logp, logq, ids = _laws(seed)
        noise = jax.random.gumbel(jax.random.key(seed + 10), logq.shape)
        got = np.asarray(mod.rrs_accept(logp, logq, ids, noise, 4))
        chex.assert_shape(got, (3, 4))
        children = np.asarray(jax.lax.top_k(logq + noise, 4)[1])
        for row in range(3):
            want = _rrs_by_hand(np.exp(np.asarray(logp[row], np.float64)), np.exp(np.asarray(logq[row], np.float64)),
                                np.asarray(ids), children[row])
            np.testing.assert_allclose(got[row], want, rtol=1e-5, atol=1e-6)
        assert np.all(np.diff(got, axis=-1) >= -1e-7)  # more children never accept less


def test_a_drafter_equal_to_the_llm_is_always_accepted():
    mod = _script()
    logp, _, _ = _laws(5, vocab=8, draft=8)
    ids = jnp.arange(8, dtype=jnp.int32)
    noise = jax.random.gumbel(jax.random.key(3), logp.shape)
    np.testing.assert_allclose(np.asarray(mod.rrs_accept(logp, logp, ids, noise, 2)), 1.0, atol=1e-6)
