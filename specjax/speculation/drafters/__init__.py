"""Drafters: what proposes each step's token tree (the interface is in ``base.py``).

``FACTORIES`` maps a drafter name to the function that builds it for ``specjax generate --drafter
NAME:ARG``: ``factory(arg, llm, *, load, expansion, draft) -> Bound``, where ``load=False`` asks for
the static part only (configs, for checks before any weights load). Adding a drafter to the command
line is its module plus one line here; the Python API takes any ``Bound`` directly.
"""

from specjax.errors import InputError
from specjax.speculation.drafters import corpus, feature, lookup, ssm

FACTORIES = {"ssm": ssm.from_arg, "lookup": lookup.from_arg, "feature": feature.from_arg, "corpus": corpus.from_arg}


def parse_spec(text: str) -> tuple[str, str]:
    """A --drafter entry ``NAME:ARG`` -> (NAME, ARG), refused unless NAME is in ``FACTORIES`` and ARG given."""
    name, _, arg = text.partition(":")
    if name not in FACTORIES or not arg:
        raise InputError(f"--drafter {text!r}: expected NAME:ARG with NAME one of {sorted(FACTORIES)} (e.g. "
                         f"ssm:derived:4)")
    return name, arg


def build(text: str, llm, *, load: bool, expansion, draft: str):
    """The ``Bound`` drafter a --drafter entry ``NAME:ARG`` names (``FACTORIES[NAME](ARG, llm, ...)``)."""
    name, arg = parse_spec(text)
    return FACTORIES[name](arg, llm, load=load, expansion=expansion, draft=draft)
