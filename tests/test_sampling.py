"""The warp pipeline and the position-keyed Gumbel sampler."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.decoding.sampling import (
    SamplingArrays,
    SamplingParams,
    first_argmax,
    gumbel_noise,
    sample_tokens,
    warp_logits,
)


def _arrays(**kw):
    return SamplingArrays.from_params([SamplingParams(**kw)])


def _ulps(logits) -> float:
    """Relative error a float32 softmax may carry: a few ulps per operation, and the float32 rounding of
    the logits themselves (|x| eps each) carried into exp."""
    return 8 * float(np.finfo(np.float32).eps) * (1 + float(np.abs(logits).max()))


def _probs(logits, **kw):
    return np.exp(np.asarray(warp_logits(jnp.asarray([logits], jnp.float32), _arrays(**kw)))[0])


def test_temperature_only():
    logits = np.array([2.0, 1.0, 0.0, -1.0], np.float32)
    p = _probs(logits, temperature=0.5)
    want = np.exp(logits / 0.5) / np.exp(logits / 0.5).sum()
    np.testing.assert_allclose(p, want, rtol=_ulps(logits / 0.5))


def test_top_k_keeps_exactly_k_renormalised():
    logits = np.array([0.1, 3.0, 2.0, -1.0, 1.0], np.float32)
    p = _probs(logits, temperature=1.0, top_k=2)
    assert set(np.nonzero(p)[0]) == {1, 2}
    np.testing.assert_allclose(p[[1, 2]], np.exp([3.0, 2.0]) / np.exp([3.0, 2.0]).sum(), rtol=_ulps(logits))


def test_top_p_keeps_smallest_prefix_reaching_p():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = np.log(probs).astype(np.float32)
    assert set(np.nonzero(_probs(logits, temperature=1.0, top_p=0.5))[0]) == {0}
    assert set(np.nonzero(_probs(logits, temperature=1.0, top_p=0.6))[0]) == {0, 1}
    assert set(np.nonzero(_probs(logits, temperature=1.0, top_p=0.85))[0]) == {0, 1, 2}
    p = _probs(logits, temperature=1.0, top_p=0.81)
    np.testing.assert_allclose(p[:3], probs[:3] / probs[:3].sum(), rtol=_ulps(logits))


def test_top_k_then_top_p_order():
    probs = np.array([0.4, 0.3, 0.2, 0.1])
    # top-k 3 renormalises to 4/9, 3/9, 2/9; top-p 0.7 then needs the first two (4/9 < 0.7 <= 7/9)
    logits = np.log(probs).astype(np.float32)
    p = _probs(logits, temperature=1.0, top_k=3, top_p=0.7)
    np.testing.assert_allclose(p, [4 / 7, 3 / 7, 0, 0], rtol=_ulps(logits))


def test_greedy_is_raw_argmax_first_index_on_ties():
    logits = jnp.asarray([[1.0, 5.0, 5.0, 0.0]])
    tok = sample_tokens(logits, _arrays(temperature=0.0, seed=3), positions=jnp.asarray([10]))
    assert int(tok[0]) == 1


def test_noise_depends_only_on_seed_and_position():
    a = gumbel_noise(jnp.asarray([5, 5, 6]), jnp.asarray([9, 10, 9]), 16)
    b = gumbel_noise(jnp.asarray([6, 5]), jnp.asarray([9, 9]), 16)
    np.testing.assert_array_equal(a[0], b[1])
    np.testing.assert_array_equal(a[2], b[0])
    assert not np.array_equal(a[0], a[1])


def test_sampled_law_matches_warped_distribution():
    """Chi-square of 2e5 draws (one per absolute position) against the exact warped law."""
    scipy_stats = pytest.importorskip("scipy.stats")
    logits = np.array([1.5, 1.0, 0.2, -0.3, -2.0, 0.7], np.float32)
    kw = dict(temperature=0.8, top_k=5, top_p=0.95, seed=11)
    law = _probs(logits, **kw)
    n = 200_000
    sp = SamplingArrays.from_params([SamplingParams(**kw)] * n)
    tokens = jax.jit(sample_tokens)(jnp.broadcast_to(jnp.asarray(logits), (n, 6)), sp, jnp.arange(n))
    counts = np.bincount(np.asarray(tokens), minlength=6)
    support = law > 0
    assert counts[~support].sum() == 0, "a zero-probability token was sampled"
    chi2 = (((counts - n * law) ** 2)[support] / (n * law[support])).sum()
    assert scipy_stats.chi2.sf(chi2, support.sum() - 1) > 1e-6


def test_a_requests_warp_does_not_depend_on_its_batch_mates():
    """top_p = 1 and top_k = 0 mean off, exactly, even when another request switches the filter on
    (the float32 cumulative sum may reach 1.0 before the tail of the vocabulary)."""
    import jax
    import jax.numpy as jnp

    from specjax.decoding.sampling import SamplingArrays, warp_logits

    logits = jax.random.normal(jax.random.key(3), (2, 4096)) * 6.0
    both = SamplingArrays(temperature=jnp.asarray([1.0, 1.0]), top_k=jnp.asarray([0, 5]),
                          top_p=jnp.asarray([1.0, 0.5]), seed=jnp.asarray([0, 1]))
    alone = jax.tree.map(lambda a: a[:1], both)
    np.testing.assert_array_equal(np.asarray(warp_logits(logits, both))[0],
                                  np.asarray(warp_logits(logits[:1], alone))[0])
    assert np.isfinite(np.asarray(warp_logits(logits, both))[0]).all()


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "no-jit"])
def test_first_argmax_is_jnp_argmax_on_ties_nan_and_infinities(jit):
    """Greedy decisions everywhere (incremental, verification, the first token) go through
    ``first_argmax``: it must pick jnp.argmax's index in every case, or greedy outputs would differ."""
    rng = np.random.default_rng(0)
    x = rng.integers(-3, 3, size=(6, 5, 257)).astype(np.float32)  # few values: many ties per row
    x[0, 0, 7] = np.nan
    x[0, 0, 3] = np.nan  # two NaNs: the first wins
    x[0, 1, 200] = np.inf
    x[0, 1, 100] = np.inf
    x[0, 2] = -np.inf  # a row of -inf: index 0
    x[0, 3, 0] = np.nan  # NaN at index 0 beside a large value
    x[0, 3, 9] = 1e30
    x[0, 4, :] = 2.0  # all equal
    x[1, 0, 256] = 9.0  # the maximum at the last index
    fn = jax.jit(first_argmax) if jit else first_argmax
    got = np.asarray(fn(jnp.asarray(x)))
    want = np.asarray(jnp.argmax(jnp.asarray(x), axis=-1))
    assert got.dtype == np.int32
    chex.assert_shape(got, x.shape[:-1])
    np.testing.assert_array_equal(got, want)


def _reference_filter(x: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """The filter's definition in float64 over the sorted row: [V] bool, the tokens kept."""
    order = np.argsort(-x, kind="stable")
    s = x[order].astype(np.float64)
    kth = s[min(top_k, x.size) - 1] if top_k > 0 else -np.inf
    kept = x >= kth
    s = np.where(s >= kth, s, -np.inf)
    p = np.exp(s - s.max())
    p /= p.sum()
    before = np.cumsum(p) - p
    if top_p < 1.0:
        last = np.sum(before < top_p) - 1
        kept &= x >= s[last]
    return kept


@pytest.mark.parametrize("case", ["peaked top-p", "flat top-p (sorts)", "top-k then top-p", "top-k past the candidates",
                                  "mixed batch"])
def test_filter_from_candidates_keeps_what_the_sorted_row_keeps(case):
    """The top-k/top-p filter reads the largest FILTER_CANDIDATES values and sorts a row in full only where
    its kept tokens may lie past them; it keeps exactly the tokens the float64 definition over the sorted
    row keeps (rows whose cumulative mass at the boundary is within float32 rounding of top_p excepted),
    and exactly what the full sort's path (``_filter_sorted``) keeps."""
    from specjax.decoding.sampling import FILTER_CANDIDATES, _filter_sorted, _filter_top_k_top_p

    vocab = 4 * FILTER_CANDIDATES + 77
    rng = np.random.RandomState(["peaked top-p", "flat top-p (sorts)", "top-k then top-p", "top-k past the candidates",
                                 "mixed batch"].index(case))
    settings = {"peaked top-p": [(3.0, 0, 0.9)] * 4, "flat top-p (sorts)": [(0.05, 0, 0.95)] * 3,
                "top-k then top-p": [(2.0, 50, 0.8), (2.0, 7, 0.99), (2.0, FILTER_CANDIDATES, 0.999)],
                "top-k past the candidates": [(2.0, FILTER_CANDIDATES + 5, 0.9)],
                "mixed batch": [(3.0, 0, 1.0), (3.0, 0, 0.5), (2.0, 40, 1.0), (3.0, 0, 0.97)]}[case]
    scale = np.asarray([s for s, _, _ in settings], np.float32)[:, None]
    x = (rng.standard_normal((len(settings), vocab)) * scale).astype(np.float32)
    top_k = jnp.asarray([k for _, k, _ in settings], jnp.int32)
    top_p = jnp.asarray([p for _, _, p in settings], jnp.float32)
    got = np.asarray(jax.jit(_filter_top_k_top_p)(jnp.asarray(x), top_k, top_p))
    sorted_path = np.asarray(jax.jit(_filter_sorted)(jnp.asarray(x), top_k, top_p))
    for b, (_, k, p) in enumerate(settings):
        want = _reference_filter(x[b], k, p)
        np.testing.assert_array_equal(np.isfinite(got[b]), want, err_msg=f"row {b}: {case}")
        np.testing.assert_array_equal(got[b][want], x[b][want])  # kept values unchanged
        np.testing.assert_array_equal(np.isfinite(sorted_path[b]), want)
    if case == "peaked top-p":  # the candidates settle these rows: fewer tokens kept than candidates
        assert all(np.isfinite(got[b]).sum() < FILTER_CANDIDATES for b in range(len(settings)))
    if case == "flat top-p (sorts)":  # these rows keep more tokens than there are candidates
        assert all(np.isfinite(got[b]).sum() > FILTER_CANDIDATES for b in range(len(settings)))
