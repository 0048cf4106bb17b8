"""The names a user may choose (API arguments and CLI flags), derived from where each thing is defined."""

from __future__ import annotations

from specjax.speculation.drafters.ssm import DRAFTS
from specjax.speculation.spec import VERIFIERS

MODES = ("tree", "sequence", "incremental")
VERIFIER_CHOICES = ("auto",) + VERIFIERS
DRAFT_CHOICES = ("auto",) + DRAFTS
