"""T0: exact float64 oracle. For every supported (drafting, verifier) pair the emitted law,
completed by exact target sampling, equals the target law to 1e-12 on >= 500 random instances
plus edge cases; every pitfall variant of the checklist visibly fails."""

from __future__ import annotations

import numpy as np
import pytest

from tests.oracle import (
    RandomLaws,
    complete,
    max_abs_diff,
    target_law,
    total_variation,
    tree_law,
)

N_RANDOM = 500
EDGE_CASES = ("p_equals_q", "one_hot_p", "one_hot_q", "disjoint", "top_k_zeros", "top_p_zeros")


def _instance(i: int, vocab: int, n_ssms: int):
    """Instance i: (p, [q per SSM]); the first few are the edge cases, the rest random."""
    rng = np.random.default_rng(i)
    if i < len(EDGE_CASES):
        case = EDGE_CASES[i]
        if case == "p_equals_q":
            p = RandomLaws(vocab, 1000 + i)
            return p, [p] * n_ssms
        if case == "one_hot_p":
            return RandomLaws(vocab, 1000 + i, "one_hot"), [RandomLaws(vocab, 2000 + s) for s in range(n_ssms)]
        if case == "one_hot_q":
            return RandomLaws(vocab, 1000 + i), [RandomLaws(vocab, 2000 + s, "one_hot") for s in range(n_ssms)]
        if case == "disjoint":
            return RandomLaws(vocab, 2, "support"), [RandomLaws(vocab, 3 + 2 * s, "support") for s in range(n_ssms)]
        if case == "top_k_zeros":
            return RandomLaws(vocab, 1000 + i, top_k=2), [RandomLaws(vocab, 2000 + s, top_k=2) for s in range(n_ssms)]
        return RandomLaws(vocab, 1000 + i, top_p=0.6), [RandomLaws(vocab, 2000 + s, top_p=0.7) for s in range(n_ssms)]

    def one(seed):
        return RandomLaws(vocab, seed, top_k=int(rng.choice([0, 0, 2, vocab - 1])),
                          top_p=float(rng.choice([1.0, 1.0, 0.8])), scale=float(rng.choice([0.5, 2.0, 5.0])))

    p = one(10_000 + i)
    qs = [p if rng.random() < 0.05 else one(20_000 + 7 * i + s) for s in range(n_ssms)]
    return p, qs


# (draft, rule, vocab, widths per SSM, merged): every supported pair, depth 1 and 2, single and merged.
SUPPORTED = [
    ("iid", "mss", 5, [(3,)], False),
    ("iid", "mss", 4, [(2, 2)], False),
    ("wor", "rrs", 5, [(3,)], False),
    ("wor", "rrs", 4, [(2, 2)], False),
    ("topk", "naive", 6, [(3,)], False),
    ("topk", "naive", 4, [(2, 1)], False),
    ("iid", "naive", 4, [(2, 2)], False),
    ("wor", "naive", 4, [(2, 2)], False),
    ("iid", "mss", 3, [(2, 1), (1, 1)], True),
    ("wor", "rrs", 4, [(2,), (2,)], True),
    ("iid", "mss", 3, [(1, 2)], True),  # one SSM whose duplicate siblings merge and pool their children
]


@pytest.mark.parametrize("draft,rule,vocab,widths,merged", SUPPORTED,
                         ids=[f"{d}-{r}-V{v}-{'x'.join(map(str, w))}{'-merged' if m else ''}"
                              for d, r, v, w, m in SUPPORTED])
def test_supported_pairs_are_exact(draft, rule, vocab, widths, merged):
    depth = max(len(w) for w in widths)
    worst = 0.0
    for i in range(N_RANDOM + len(EDGE_CASES)):
        p, qs = _instance(i, vocab, len(widths))
        law = tree_law(p, qs, qs, widths, draft, rule, merged=merged)
        assert abs(sum(law.values()) - 1.0) < 1e-12
        worst = max(worst, max_abs_diff(complete(law, p, depth + 1), target_law(p, depth + 1)))
    assert worst <= 1e-12, f"max |emitted - target| = {worst:.3e}"


def _worst_tv(draft, rule, vocab, widths, merged, variant="correct", declared=None, n=60):
    depth = max(len(w) for w in widths)
    worst = 0.0
    for i in range(len(EDGE_CASES), len(EDGE_CASES) + n):
        p, qs = _instance(i, vocab, len(widths))
        dec = qs if declared is None else [declared(q) for q in qs]
        law = tree_law(p, qs, dec, widths, draft, rule, variant=variant, merged=merged)
        worst = max(worst, total_variation(complete(law, p, depth + 1), target_law(p, depth + 1)))
    return worst


def _hotter(q: RandomLaws) -> RandomLaws:
    return RandomLaws(q.vocab, q.seed, q.kind, q.top_k, q.top_p, q.scale, temperature=2.0)


PITFALLS = {  # checklist number: (draft, rule, vocab, widths, merged, variant, declared)
    "1 MSS ratio on top-k drafts": ("topk", "mss", 4, [(2,)], False, "correct", None),
    "2 plain MSS on without-replacement drafts": ("wor", "mss", 4, [(3,)], False, "correct", None),
    "2 RRS on with-replacement drafts": ("iid", "rrs", 4, [(3,)], False, "correct", None),
    "3 merged duplicates deduplicated": ("iid", "mss", 3, [(1, 1), (1, 1)], True, "dedupe", None),
    "4 entries re-ordered by token id": ("iid", "mss", 4, [(3,)], False, "reorder", None),
    "4 RRS entries re-ordered by token id": ("wor", "rrs", 4, [(3,)], False, "reorder", None),
    "5 declared law at another temperature": ("iid", "mss", 4, [(2,)], False, "correct", _hotter),
    "8 residual not cumulative": ("iid", "mss", 4, [(3,)], False, "not_cumulative", None),
    "8 target sampled after total rejection": ("iid", "mss", 4, [(2,)], False, "target_after_rejection", None),
    "8 residual carried into the child": ("iid", "mss", 4, [(1, 1)], False, "residual_carried", None),
}


@pytest.mark.parametrize("name", list(PITFALLS))
def test_pitfalls_visibly_fail_the_oracle(name):
    draft, rule, vocab, widths, merged, variant, declared = PITFALLS[name]
    tv = _worst_tv(draft, rule, vocab, widths, merged, variant, declared)
    assert tv > 1e-3, f"pitfall '{name}' went unnoticed: worst total variation {tv:.2e}"
    # and the same configuration done right is exact
    if variant != "correct" or declared is not None:
        assert _worst_tv(draft, rule, vocab, widths, merged, n=10) < 1e-12
