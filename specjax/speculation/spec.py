"""SpecConfig: the static speculation setup (drafters, verifier, tree attention implementation)."""

from __future__ import annotations

import dataclasses

import numpy as np

from specjax.errors import InputError
from specjax.speculation.budget import Budget
from specjax.speculation.drafters.base import VERIFIER_LAWS, Drafter, check_pairing
from specjax.speculation.faults import check_fault

VERIFIERS = tuple(VERIFIER_LAWS)  # greedy, seeded, naive, mss, rrs
DEFAULT_DRAFT = {"greedy": "topk", "seeded": "coupled", "naive": "topk", "mss": "iid", "rrs": "wor"}


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Static speculation setup: the drafters (none = incremental decoding) and the verifier."""

    drafters: tuple[Drafter, ...] = ()
    impl: str = "auto"  # tree attention implementation
    verifier: str = "greedy"  # one of VERIFIERS; greedy ignores the sampling settings
    fault: str | None = None  # tests only: one of faults.FAULTS re-creates that pitfall (static, compiled apart)
    budget: Budget | None = None  # None: verify every proposal whole; else a measured per-step tree budget

    def __post_init__(self):
        if not isinstance(self.drafters, tuple) or not all(isinstance(d, Drafter) for d in self.drafters):
            raise InputError(f"SpecConfig.drafters must be a tuple of Drafter objects, got {self.drafters!r}")
        if self.verifier not in VERIFIERS:
            raise InputError(f"unknown verifier {self.verifier!r}; choose from {VERIFIERS}")
        check_fault(self.fault)
        check_pairing(self.drafters, self.verifier)
        if self.budget is not None:
            if not isinstance(self.budget, Budget):
                raise InputError(f"SpecConfig.budget must be a Budget or None, got {type(self.budget).__name__}")
            if not self.drafters:
                raise InputError("a tree budget needs at least one drafter")
            self.budget.check(self.drafters)

    def costs_apart(self) -> tuple["SpecConfig", np.ndarray | None]:
        """(this spec with its budget's pass costs taken out, the costs as a float32 [L] array; None without a
        budget or costs). The loop takes the array as its ``pass_costs`` argument: the spec is static (part
        of the compiled program's key), so costs left in it are compiled in and every remeasured table
        compiled the loop again."""
        if self.budget is None or self.budget.costs is None:
            return self, None
        costs = np.asarray(self.budget.costs, np.float32)
        return dataclasses.replace(self, budget=dataclasses.replace(self.budget, costs=None)), costs

    @property
    def levels(self) -> tuple[tuple[int, ...], ...]:
        """Per level, the nodes kept of each drafter's proposal (one level, everything, without a budget)."""
        if self.budget is None:
            return (tuple(d.num_nodes for d in self.drafters),)
        return self.budget.levels

    @property
    def max_depth(self) -> int:
        return max((d.max_depth for d in self.drafters), default=0)

    @property
    def num_nodes(self) -> int:
        return 1 + sum(d.num_nodes for d in self.drafters)

    @property
    def hidden_layers(self) -> tuple[int, ...] | None:
        """The LLM hidden states the drafters read (union, sorted), asked of the tree pass."""
        layers = sorted({i for d in self.drafters for i in (d.hidden_layers or ())})
        return tuple(layers) or None
