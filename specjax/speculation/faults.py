"""Test-only fault injection: each name re-introduces one pitfall of docs' verification checklist.

A fault is an explicit, static setting, never a global: ``SpecConfig(fault=...)`` for the loop, the
drafters and the merge, the ``fault`` argument of the verifiers. Because it is part of the static
configuration, a faulty program is its own compiled program: it can never leak into, or be served
from the compilation cache of, a correct one. The mutation tests pass one, run, and assert that the
statistical tests fail; production code never sets it (``None``).
"""

from __future__ import annotations

from specjax.errors import InputError

FAULTS = (
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


def check_fault(fault: str | None) -> str | None:
    """None (production) or one of FAULTS."""
    if fault is not None and fault not in FAULTS:
        raise InputError(f"unknown fault {fault!r}; known: {FAULTS}")
    return fault
