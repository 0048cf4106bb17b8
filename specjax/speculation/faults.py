"""Test-only fault injection: each name re-introduces one pitfall of docs' verification checklist.

The mutation tests switch one on, re-trace the verifier or loop, and assert that the statistical
tests fail. Production code reads ``active()`` at trace time only; nothing sets it outside tests.
"""

from __future__ import annotations

import contextlib

MUTATIONS = (
    "allow_mss_on_topk",  # 1: MSS ratio with deterministic top-k drafts (entries declare the SSM's q)
    "mss_on_wor",  # 2: plain MSS on without-replacement drafts (no removal of drawn tokens)
    "dedupe_merged",  # 3: merged duplicate proposals kept as ONE entry (residual applied once)
    "reorder_by_token",  # 4: entries visited in token-id order instead of draw order
    "law_wrong_temperature",  # 5: declared law warped at temperature 1, not the one sampled from
    "target_unwarped",  # 6: verifier target without top-k / top-p
    "greedy_first_token",  # 6: argmax first token after prefill at T > 0
    "shared_coins",  # 7: one coin for all entries of a node
    "residual_draft_noise",  # 7: residual sampled with the drafting noise
    "residual_not_cumulative",  # 8: residual recomputed from the target at every entry
    "target_after_rejection",  # 8: sample the target instead of the residual after total rejection
    "residual_carried",  # 8: residual carried into the child instead of restarting from its target
    "coin_le",  # 10: `<=` instead of `<`
    "seeded_by_depth",  # 14: seeded noise keyed by tree depth instead of absolute position
)

_active: str | None = None


def active() -> str | None:
    return _active


@contextlib.contextmanager
def inject(name: str):
    """Enable one mutation (tests only). Compiled code is dropped on entry and exit, so jitted
    functions re-trace with the mutation inside and without it afterwards."""
    import jax

    global _active
    if name not in MUTATIONS:
        raise ValueError(f"unknown mutation {name!r}; known: {MUTATIONS}")
    previous, _active = _active, name
    jax.clear_caches()
    try:
        yield
    finally:
        _active = previous
        jax.clear_caches()
