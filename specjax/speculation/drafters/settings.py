"""The ``key=N`` settings of a ``--drafter NAME:ARG`` entry, one parser for every drafter that takes them."""

from __future__ import annotations

from specjax.errors import InputError


def parse_int_settings(items, names: dict[str, str], where: str, expected: str) -> dict[str, int]:
    """``["depth=4", "beam=2"]`` -> ``{names["depth"]: 4, names["beam"]: 2}``. Each problem names the entry
    (``where``) and says what was expected: an unknown key, a value that is not a non-negative integer, and a
    key given twice (which would otherwise silently keep the last value)."""
    values = {}
    for item in items:
        key, _, value = item.partition("=")
        if key not in names or not (value.isascii() and value.isdigit()):
            raise InputError(f"{where}: expected {expected}, got {item!r}")
        if names[key] in values:
            raise InputError(f"{where}: {key} given twice")
        values[names[key]] = int(value)
    return values
