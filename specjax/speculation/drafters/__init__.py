"""Drafters: what proposes each step's token tree (the interface is in ``base.py``).

``FACTORIES`` maps a drafter name to the function that builds it for ``specjax generate --drafter
NAME:ARG``: ``factory(arg, llm, *, load, expansion, draft) -> Bound``, where ``load=False`` asks for
the static part only (configs, for checks before any weights load). Adding a drafter to the command
line is its module plus one line here; the Python API takes any ``Bound`` directly.
"""

from specjax.speculation.drafters import corpus, feature, lookup, ssm

FACTORIES = {"ssm": ssm.from_arg, "lookup": lookup.from_arg, "feature": feature.from_arg, "corpus": corpus.from_arg}
