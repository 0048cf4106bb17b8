"""Pearson chi-square goodness of fit against an exactly computed law (alpha = 1e-6 per test)."""

from __future__ import annotations

from collections import Counter

import numpy as np
from scipy import stats

ALPHA = 1e-6


def chi_square(samples, law: dict) -> tuple[float, list]:
    """samples: iterable of hashable outcomes; law: {outcome: probability}. Returns (p-value,
    outcomes observed that have probability 0). Cells expecting < 5 are pooled into one cell."""
    counts = Counter(samples)
    n = sum(counts.values())
    impossible = [k for k in counts if law.get(k, 0.0) <= 0.0]
    observed, expected, pool_o, pool_e = [], [], 0, 0.0
    for k, pr in law.items():
        if pr <= 0:
            continue
        if n * pr >= 5:
            observed.append(counts.get(k, 0))
            expected.append(n * pr)
        else:
            pool_o += counts.get(k, 0)
            pool_e += n * pr
    if pool_e > 0:
        observed.append(pool_o)
        expected.append(pool_e)
    observed, expected = np.asarray(observed, float), np.asarray(expected, float)
    expected *= observed.sum() / expected.sum()  # impossible outcomes are reported separately
    if len(observed) < 2:
        return 1.0, impossible
    stat = float(((observed - expected) ** 2 / expected).sum())
    return float(stats.chi2.sf(stat, len(observed) - 1)), impossible


def assert_fits(samples, law: dict, what: str) -> None:
    p, impossible = chi_square(samples, law)
    assert not impossible, f"{what}: zero-probability outcomes observed: {impossible[:5]}"
    assert p >= ALPHA, f"{what}: chi-square p-value {p:.3g} < alpha {ALPHA}"


def fits(samples, law: dict) -> bool:
    p, impossible = chi_square(samples, law)
    return not impossible and p >= ALPHA
