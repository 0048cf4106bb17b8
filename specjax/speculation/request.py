"""A generation request's drafting: the user's mode, SSMs, drafters, verifier, draft and budget checked and
turned into a ``SpecConfig`` (``spec_config``), and the default drafting of ``specjax.generate`` and
``specjax generate`` (``default_drafters``)."""

from __future__ import annotations

from specjax.attention import resolve_impl
from specjax.errors import InputError
from specjax.io import registry
from specjax.speculation.budget import Budget, default_levels
from specjax.speculation.choices import DRAFT_CHOICES, VERIFIER_CHOICES
from specjax.speculation.drafters import build
from specjax.speculation.drafters.base import Bound
from specjax.speculation.drafters.ssm import SSMDrafter, check_compatible
from specjax.speculation.expansion import Expansion
from specjax.speculation.loop import DEFAULT_DRAFT, SpecConfig
from specjax.types import Model

MAX_TREE_NODES = 64


def default_drafters(model: Model, sampled: bool = False, verifier: str = "auto", draft: str = "auto",
                     load: bool = True) -> list[Bound]:
    """The drafters ``specjax.generate`` speculates with when given no mode, SSM or drafter: the entries
    ``registry.default_drafters`` names for this LLM (the one place that decides, for ``specjax generate``
    too), built for ``model`` as that command builds them. sampled: some request samples (the drafters
    then draw as the verifier needs). load=False: their static parts only (params None)."""
    _, draft = resolve_verifier(verifier, draft, sampled)
    return [build(spec, model, load=load, expansion=Expansion(registry.DEFAULT_EXPANSION), draft=draft)
            for spec in registry.default_drafters(model.config)]


def expansions_of(mode: str, expansion, n_ssms: int) -> list[Expansion]:
    """One ``Expansion`` per SSM from ``expansion`` (None: the mode's default; widths, a string like
    "1,2,1", or one of those per SSM), refused when the tree would exceed ``MAX_TREE_NODES``."""
    if expansion is None:
        expansion = registry.DEFAULT_SEQUENCE if mode == "sequence" else registry.DEFAULT_EXPANSION
    if isinstance(expansion, str):
        expansion = Expansion.parse(expansion).widths
    if isinstance(expansion, Expansion):
        expansion = expansion.widths
    if not isinstance(expansion, (list, tuple)) or not expansion:
        raise InputError(f"expansion must be a non-empty tuple of widths like (1, 1, 3, 1) or one per SSM, "
                         f"got {expansion!r}")
    per_ssm = (list(expansion) if isinstance(expansion[0], (tuple, list, Expansion)) else [expansion] * n_ssms)
    if len(per_ssm) != n_ssms:
        raise InputError(f"{len(per_ssm)} expansion configs for {n_ssms} SSMs")
    exps = [e if isinstance(e, Expansion) else Expansion(tuple(e)) for e in per_ssm]
    nodes = 1 + sum(e.num_nodes - 1 for e in exps)
    if nodes > MAX_TREE_NODES:
        raise InputError(f"expansion {[list(e.widths) for e in exps]} makes a token tree of {nodes} nodes; the "
                         f"limit is {MAX_TREE_NODES} (N_max)")
    if mode == "sequence" and any(set(e.widths) != {1} for e in exps):
        raise InputError(f"mode 'sequence' drafts a chain: widths must all be 1, got {[e.widths for e in exps]}")
    return exps


def resolve_verifier(verifier: str, draft: str, sampled: bool) -> tuple[str, str]:
    """(verifier, draft) after resolving "auto"; lossy pairs are refused later by SpecConfig."""
    if verifier not in VERIFIER_CHOICES:
        raise InputError(f"verifier must be one of {VERIFIER_CHOICES}, got {verifier!r}")
    if draft not in DRAFT_CHOICES:
        raise InputError(f"draft must be one of {DRAFT_CHOICES}, got {draft!r}")
    if verifier == "greedy" and sampled:
        raise InputError("verifier 'greedy' decodes greedily but a request has temperature > 0; use "
                         "verifier 'auto', 'seeded', 'mss', 'rrs' or 'naive' to sample")
    if verifier == "auto":
        if not sampled:
            verifier = "greedy" if draft in ("auto", "topk") else "seeded"
        else:
            verifier = {"iid": "mss", "wor": "rrs"}.get(draft, "seeded")
    if draft == "auto":
        draft = DEFAULT_DRAFT[verifier]
    return verifier, draft


def as_bound(d) -> Bound:
    """A drafter given as ``Bound(drafter, params)`` or a (drafter, params) pair, as a ``Bound``."""
    if isinstance(d, Bound):
        return d
    if isinstance(d, tuple) and len(d) == 2:
        return Bound(*d)
    raise InputError(f"a drafter must be given as specjax.Bound(drafter, params) or a (drafter, params) pair, "
                     f"got {type(d).__name__}")


def spec_config(model: Model, ssms: list, drafters: list, mode: str, expansion, impl: str, verifier: str,
                 draft: str, sampled: bool, budget=None):
    """(SpecConfig, verifier, draft) for a speculative request, every choice checked against the LLM:
    SSMs compatible with it, drafters bound, the (draft, verifier) pair resolved, the budget built."""
    if not ssms and not drafters:
        raise InputError(f"mode {mode!r} needs at least one SSM (ssms=[...]) or drafter (drafters=[...])")
    if mode == "sequence" and (len(ssms) != 1 or drafters):
        raise InputError(f"mode 'sequence' takes exactly one SSM and no other drafter, got {len(ssms)} SSMs and "
                         f"{len(drafters)} drafters")
    for i, ssm in enumerate(ssms):
        if not isinstance(ssm, Model):
            raise InputError(f"SSM {i} must be a Model (specjax.load_model or specjax.derive_ssm), got "
                             f"{type(ssm).__name__}")
        check_compatible(model, ssm, name=f"SSM {i}")
    verifier, draft = resolve_verifier(verifier, draft, sampled)
    if expansion is not None and not ssms:  # a drafter's shape is its own (built with it)
        raise InputError("expansion shapes the drafts of ssms=[...], and none are given: drop it (a drafter in "
                         "drafters=[...] takes its shape when it is built)")
    exps = expansions_of(mode, expansion, len(ssms)) if ssms else []
    bound = [as_bound(d) for d in drafters]
    drafter_objs = tuple(SSMDrafter(s.config, e, draft) for s, e in zip(ssms, exps)) + tuple(b.drafter for b in bound)
    if isinstance(budget, str):
        if budget != "auto":
            raise InputError(f"budget must be None, 'auto' or a specjax.Budget, got {budget!r}")
        budget = Budget(default_levels(drafter_objs))
    elif budget is not None and not isinstance(budget, Budget):
        raise InputError(f"budget must be None, 'auto' or a specjax.Budget, got {type(budget).__name__}")
    spec = SpecConfig(drafters=drafter_objs, impl=resolve_impl(impl), verifier=verifier, budget=budget)
    check_spec(model.config, spec)
    return spec, verifier, draft


def check_positions(spec, tokens: int, what: str) -> None:
    """Refuse a request of ``tokens`` (prompt + new tokens; ``what`` names it) that some drafter cannot
    follow to its end (``Drafter.position_limit``), before any work. Up to the limit it is enough: a
    draft made by reading a position past it is of a token after the request's last, never committed."""
    for d in spec.drafters:
        limit = d.position_limit
        if limit is not None and tokens > limit:
            raise InputError(f"{what}: {tokens} tokens, more than the {limit} positions of {d.describe()}'s "
                             f"position table")


def check_spec(config, spec) -> None:
    """The drafters fit this LLM and one token tree (``specjax.generate`` and the ``Engine``)."""
    for d in spec.drafters:
        d.check_llm(config)
    if spec.num_nodes > MAX_TREE_NODES:
        raise InputError(f"the drafters {[d.describe() for d in spec.drafters]} make a token tree of {spec.num_nodes} "
                         f"nodes; the limit is {MAX_TREE_NODES} (N_max)")
