"""T1 white-box and T2 black-box tests of the jitted verifier on fixed drafted trees, and the
mutation tests for the verifier-side pitfalls."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import oracle
from tests.stats import assert_fits, fits
from tests.verify_cases import make_case, outcomes, run

EPS32 = float(np.finfo(np.float32).eps)
N_SAMPLES = 300_000

# Adversarial fixed trees: (seed, vocab, widths per SSM, draft, rule, merged, extra). Seeds chosen
# so that no outcome has probability > 0.4 and acceptance is frequent (informative laws).
CASES = {
    "mss-iid-wide-duplicates": (129, 6, [(4, 1)], "iid", "mss", False, dict(q_kw=dict(scale=0.5))),
    "mss-iid-depth2-peaked": (60, 6, [(2, 2)], "iid", "mss", False, dict(p_kw=dict(scale=3.0), q_kw=dict(scale=3.0))),
    "rrs-wor-depth2": (159, 6, [(3, 2)], "wor", "rrs", False, dict(p_kw=dict(top_k=4), q_kw=dict(scale=1.0))),
    "rrs-wor-short-support": (167, 6, [(4,)], "wor", "rrs", False, dict(q_kw=dict(top_k=2))),
    "naive-topk-target-warped": (175, 8, [(3, 1)], "topk", "naive", False, dict(top_k=3)),
    "mss-merged-duplicates": (71, 4, [(2, 1), (2, 1)], "iid", "mss", True, dict(same_q=True, q_kw=dict(scale=0.3))),
    "rrs-merged": (100, 5, [(2, 1), (2,)], "wor", "rrs", True, {}),
}


def _case(name, fault=None):
    seed, vocab, widths, draft, rule, merged, extra = CASES[name]
    return make_case(seed, vocab, widths, draft, rule, merged, fault=fault, **extra)


@pytest.mark.parametrize("name", list(CASES))
def test_t2_jitted_verifier_law(name):
    case = _case(name)
    law = case.exact_law()
    # the oracle works in float64 on float32 target probabilities (each within an ulp of its value)
    assert abs(sum(law.values()) - 1) < 8 * EPS32
    verdict = run(case, N_SAMPLES)
    assert np.asarray(verdict.ok).all()
    assert_fits(outcomes(verdict), law, name)


def _white_box_trees():
    rng = np.random.default_rng(0)
    kinds = [("iid", "mss"), ("wor", "rrs"), ("topk", "naive"), ("iid", "naive")]
    for i in range(200):
        draft, rule = kinds[i % len(kinds)]
        widths = [(3,), (2, 2)][(i // len(kinds)) % 2]  # few static shapes: few compilations
        yield make_case(100 + i, 5, [widths], draft, rule, p_kw=dict(top_k=int(rng.choice([0, 2]))),
                        q_kw=dict(scale=float(rng.choice([0.5, 2.0]))))


def _check_white_box(case, rng, fault=None) -> None:
    """Inject coins (random, just below / just above every acceptance threshold, all 0.0) and Gumbel
    noise, one request per coin policy; compare the accepted path, the emitted tokens and the final
    law with the oracle's step-by-step simulation of the rule."""
    tokens, children, law_row, target, laws = case.arrays()
    k = children.shape[1]
    vocab = target.shape[1]
    policies = [lambda d, j, thr, rx: float(rng.random()),
                lambda d, j, thr, rx: min(thr * (1 - 1e-4), 0.99999),
                lambda d, j, thr, rx: min(thr * (1 + 1e-4), 0.99999) if thr > 0 else 0.5,
                lambda d, j, thr, rx: 0.0]
    coins = np.full((len(policies), case.max_depth + 1, k), 0.5, np.float32)
    gumbel = rng.gumbel(size=(len(policies), case.max_depth + 1, vocab)).astype(np.float32)
    expected = []
    for b, policy in enumerate(policies):
        path, used, final = oracle.simulate(tokens, children, law_row, target, laws, case.rule, policy)
        for (d, j), xi in used.items():
            coins[b, d, j] = xi
        with np.errstate(divide="ignore"):
            y = int(np.argmax(np.where(final > 0, np.log(final), -np.inf) + gumbel[b, len(path)]))
        expected.append((path, final, [int(tokens[c]) for c in path] + [y]))
    v = run(case, len(policies), injected=(jnp.asarray(coins), jnp.asarray(gumbel)), fault=fault)
    for b, (path, final, emitted) in enumerate(expected):
        got_path = [int(x) for x in np.asarray(v.path[b, 1:]) if x >= 0]
        assert got_path == path, (b, got_path, path)
        # float32 residual updates (at most one per entry): a few float32 ulps each
        np.testing.assert_allclose(np.asarray(v.residual[b], np.float64), final, atol=4 * EPS32 * (1 + k))
        assert list(np.asarray(v.emitted[b, :len(path) + 1])) == emitted


def test_t1_white_box_injected_randomness():
    rng = np.random.default_rng(1)
    for case in _white_box_trees():
        _check_white_box(case, rng)


# ---- mutation tests: each verifier-side pitfall, switched on, must fail the tests above ----

VERIFIER_MUTANTS = {  # mutation: the case of T2 that catches it
    "reorder_by_token": "mss-iid-wide-duplicates",
    "shared_coins": "naive-topk-target-warped",
    "residual_not_cumulative": "mss-iid-depth2-peaked",
    "target_after_rejection": "mss-iid-depth2-peaked",
    "residual_carried": "mss-iid-depth2-peaked",
    "mss_on_wor": "rrs-wor-short-support",
    "target_unwarped": "naive-topk-target-warped",
    "dedupe_merged": "mss-merged-duplicates",
}


@pytest.mark.parametrize("mutation", list(VERIFIER_MUTANTS))
def test_mutant_fails_t2(mutation):
    name = VERIFIER_MUTANTS[mutation]
    law = _case(name).exact_law()  # the correct law, computed from the correct tree
    # the fault reaches the merge (dedupe_merged) and the verifier: an explicit static argument
    verdict = run(_case(name, fault=mutation), N_SAMPLES // 3, fault=mutation)  # fewer samples: harder to catch
    assert not fits(outcomes(verdict), law), f"mutation {mutation} was not detected on {name}"


def test_mutant_coin_le_fails_t1():
    """`<=` only differs when xi = 0.0 meets r(x) = 0, which float32 uniforms do produce."""
    case = make_case(11, 4, [(3,)], "topk", "naive", p_kw=dict(top_k=1))  # r(x) = 0 for all but one token
    _check_white_box(case, np.random.default_rng(0))
    with pytest.raises(AssertionError):
        _check_white_box(case, np.random.default_rng(0), fault="coin_le")


def test_no_probability_mass_is_reported_never_token_0():
    """NaN logits (or a residual without mass) must not silently become token 0."""
    from specjax.decoding.keys import categorical_from_probs

    key = jax.random.key(0)
    assert int(categorical_from_probs(key, jnp.zeros(5))[0]) == -2
    assert int(categorical_from_probs(key, jnp.asarray([0.5, jnp.nan, 0.5]))[0]) == -2
    assert not bool(categorical_from_probs(key, jnp.zeros(5))[1])
    case = _case("mss-iid-depth2-peaked")
    case.logits = jnp.full_like(case.logits, jnp.nan)
    verdict = run(case, 4)
    assert not np.asarray(verdict.ok).any()
    assert (np.asarray(verdict.bonus) == -2).all()


def _seeded(batch: int):
    from specjax.decoding.sampling import SamplingArrays, SamplingParams

    return SamplingArrays.from_params([SamplingParams(temperature=1.0, seed=i) for i in range(batch)])


@pytest.mark.parametrize("rule", ["naive", "mss", "rrs"])
def test_without_stored_laws_every_entry_is_one_hot_whatever_its_law_row(rule):
    """``laws=None`` means one-hot entries (``Proposal``); an entry that still named a law row was checked
    against a law of zeros and accepted whenever the target gave its token any mass (P(token 1) = 1.0 where
    the LLM says 0.1)."""
    from specjax.speculation.tree import from_parents
    from specjax.speculation.verify.sampled import verify_sampled

    batch = 64
    tree = from_parents([[0, 1]] * batch, [[-1, 0]] * batch, n_max=2)
    logits = jnp.broadcast_to(jnp.log(jnp.asarray([[0.9, 0.1], [0.5, 0.5]], jnp.float32)), (batch, 2, 2))
    length = jnp.full((batch,), 10)
    one_hot = verify_sampled(logits, tree, None, _seeded(batch), length, rule, 1)
    named = verify_sampled(logits, tree.replace(law_row=tree.law_row.at[:, 0, 0].set(0)), None, _seeded(batch),
                           length, rule, 1)
    np.testing.assert_array_equal(np.asarray(named.emitted), np.asarray(one_hot.emitted))
    assert 0 < np.mean(np.asarray(one_hot.emitted)[:, 0] == 1) < 0.5  # the LLM's 0.1, not every draw


@pytest.mark.parametrize("rule", ["naive", "mss", "rrs"])
def test_a_tree_deeper_than_max_depth_is_cut_at_the_bound(rule):
    """A drafter deeper than it declares: the sampled walk went on past ``max_depth`` and reported more
    accepted tokens than ``emitted`` holds (the greedy walk stops there)."""
    from specjax.speculation.tree import from_parents
    from specjax.speculation.verify.sampled import verify_sampled

    tree = from_parents([[0, 1, 2, 3]], [[-1, 0, 1, 2]], n_max=4)  # a chain of depth 3
    logits = jnp.full((1, 4, 5), -10.0).at[0, 0, 1].set(10).at[0, 1, 2].set(10).at[0, 2, 3].set(10).at[0, 3, 4].set(10)
    for max_depth in (1, 2, 3):
        verdict = verify_sampled(logits, tree, None, _seeded(1), jnp.array([5]), rule, max_depth)
        assert int(verdict.num_accepted[0]) == max_depth
        assert np.asarray(verdict.emitted)[0].tolist() == list(range(1, max_depth + 2))  # accepted, then the bonus


def test_a_tree_without_room_for_children_is_refused():
    from specjax.speculation.tree import TreeError, from_parents

    for bad in (0, -1, 1.5, True):
        with pytest.raises(TreeError, match="max_children must be an int >= 1"):
            from_parents([[2]], [[-1]], n_max=1, max_children=bad)
