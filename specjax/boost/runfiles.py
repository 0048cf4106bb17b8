"""The small JSON files of corpora and training runs (manifests, recipes, histories, provenance), read so
that a damaged one is named with what to do about it rather than surfacing as a ``JSONDecodeError``."""

from __future__ import annotations

import json

from specjax.errors import InputError


def read_run_json(path: str, remedy: str):
    """``path``'s JSON; an unreadable or damaged file is an ``InputError`` naming it and ``remedy``."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise InputError(f"{path}: cannot be read ({type(e).__name__}: {str(e)[:200]}); {remedy}") from None


def differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    """``key old -> new`` for each setting that differs (nested dicts by dotted key)."""
    out = []
    for key in sorted(set(old) | set(new), key=str):
        a, b = old.get(key, "(unset)"), new.get(key, "(unset)")
        if isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key} {a!r} -> {b!r}")
    return out
