"""Explicit key-map tables from checkpoint tensor names to specjax parameters.

Each entry maps one parameter path to one source key (``{i}`` = layer index for stacked layer
params) and a layout transform. Loading asserts every source shape, and fails on missing,
unexpected or duplicate keys, naming the key.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Mapping

import numpy as np
from tqdm.auto import tqdm

from specjax.config import ModelConfig
from specjax.errors import CheckpointError
from specjax.models.params import ParamSpec, param_specs


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a source tensor becomes a specjax parameter (per layer for stacked params)."""

    name: str
    source_shape: Callable[[tuple[int, ...]], tuple[int, ...]]  # target shape -> expected source shape
    convert: Callable[[np.ndarray, tuple[int, ...]], np.ndarray]
    invert: Callable[[np.ndarray], np.ndarray]  # specjax parameter -> source tensor (export)


IDENTITY = Layout("identity", lambda t: t, lambda a, t: a, lambda a: a)
# torch Linear weight [out, in] -> [in, out]
LINEAR = Layout("linear", lambda t: (t[1], t[0]), lambda a, t: a.T, lambda a: a.T)
# q/k/v projection [heads * head_dim, D] -> [D, heads, head_dim]
HEADS_IN = Layout("heads_in", lambda t: (t[1] * t[2], t[0]), lambda a, t: a.T.reshape(t),
                  lambda a: a.reshape(a.shape[0], -1).T)
# output projection [D, heads * head_dim] -> [heads, head_dim, D]
HEADS_OUT = Layout("heads_out", lambda t: (t[2], t[0] * t[1]), lambda a, t: a.T.reshape(t),
                   lambda a: a.reshape(-1, a.shape[-1]).T)
# q/k/v bias [heads * head_dim] -> [heads, head_dim]
HEADS_BIAS = Layout("heads_bias", lambda t: (t[0] * t[1],), lambda a, t: a.reshape(t), lambda a: a.reshape(-1))


@dataclasses.dataclass(frozen=True)
class KeyMapEntry:
    param: str  # "layers.wq" style path into the params tree
    source: str  # source key, "{i}" for the layer index
    layout: Layout = IDENTITY
    # Optional fix-up applied to the raw source tensor (e.g. undo GGUF's Q/K row permutation); it keeps
    # the shape, which is checked from the file's header before any tensor is read.
    prepare: Callable[[np.ndarray], np.ndarray] | None = None


def _spec_at(specs: dict, path: str) -> ParamSpec | None:
    node = specs
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _set_at(tree: dict, path: str, value) -> None:
    parts = path.split(".")
    for part in parts[:-1]:
        tree = tree.setdefault(part, {})
    tree[parts[-1]] = value


def _spec_paths(specs: dict, prefix: str = "") -> Iterable[str]:
    for k, v in specs.items():
        if isinstance(v, dict):
            yield from _spec_paths(v, f"{prefix}{k}.")
        else:
            yield prefix + k


def load_params(cfg: ModelConfig, table: list[KeyMapEntry], keys: Iterable[str],
                get: Callable[[str], np.ndarray], shape_of: Callable[[str], tuple[int, ...]], source: str,
                dtype=np.float32, optional_ignored: Mapping[str, str] | None = None, progress: bool = True) -> dict:
    """Assemble the params tree for ``cfg`` from a checkpoint exposing ``keys``, ``get(key)`` and
    ``shape_of(key)`` (the stored shape, read from the file's header without its data).

    optional_ignored: source keys allowed to be present and skipped, with the reason (e.g. a tied
    ``lm_head.weight`` duplicate). Any other key outside the table is an error.
    """
    specs = param_specs(cfg)
    entries = {e.param: e for e in table if _spec_at(specs, e.param) is not None}
    uncovered = [p for p in _spec_paths(specs) if p not in entries]
    if uncovered:
        raise CheckpointError(f"{source}: the {cfg.family} key map has no entry for parameters {uncovered}")

    expected: dict[str, tuple[str, int | None]] = {}
    for entry in entries.values():
        if "{i}" in entry.source:
            for i in range(cfg.num_layers):
                expected[entry.source.format(i=i)] = (entry.param, i)
        else:
            expected[entry.source] = (entry.param, None)
    available = list(keys)
    seen: set[str] = set()
    for key in available:
        if key in seen:
            raise CheckpointError(f"{source}: duplicate key {key!r}")
        seen.add(key)
    ignored = dict(optional_ignored or {})
    for key in sorted(seen - expected.keys() - ignored.keys()):
        raise CheckpointError(f"{source}: unexpected key {key!r} is not in the {cfg.family} key map "
                              f"for this configuration")
    for key in sorted(expected.keys() - seen):
        raise CheckpointError(f"{source}: missing key {key!r} (for parameter {expected[key][0]})")
    wants = _check_shapes(cfg, entries, specs, expected, shape_of, source)

    params: dict = {}
    stacked: dict[str, np.ndarray] = {}
    for key in tqdm(sorted(expected), desc=f"loading {source.rsplit('/', 1)[-1]}", disable=not progress,
                    leave=False):
        path, layer = expected[key]
        entry, spec = entries[path], _spec_at(specs, path)
        target = spec.shape[1:] if layer is not None else spec.shape
        raw = np.asarray(get(key))
        if raw.dtype.kind not in "fV":  # V: bfloat16 as ml_dtypes stores it; ints and bools are no weights
            raise CheckpointError(f"{source}: key {key!r} holds {raw.dtype} values; weights are floating point "
                                  f"(parameter {path})")
        if entry.prepare is not None:
            raw = entry.prepare(raw)
        want = wants[key]
        if tuple(raw.shape) != want:  # the data read against its header's shape
            raise CheckpointError(f"{source}: key {key!r} has shape {tuple(raw.shape)}, expected {want} "
                                  f"(parameter {path}, layout {entry.layout.name})")
        # One copy per tensor, converting the dtype on the way: into its own array (never a view of the
        # checkpoint's file), or into its layer's slot of the stacked buffer.
        value = entry.layout.convert(raw, target)
        if layer is None:
            _set_at(params, path, np.array(value, dtype=dtype))
        else:
            if path not in stacked:
                stacked[path] = np.empty(spec.shape, dtype)
            stacked[path][layer] = value
    for path, value in stacked.items():
        _set_at(params, path, value)
    return params


def _check_shapes(cfg: ModelConfig, entries: dict, specs: dict, expected: dict, shape_of,
                  source: str) -> dict[str, tuple[int, ...]]:
    """Every tensor's stored shape against the config, from the headers alone: a checkpoint that does not
    fit its config is refused before gigabytes are read and dequantized, with every misfit named at once.
    Returns each source key's expected shape."""
    wants, wrong = {}, []
    for key in sorted(expected):
        path, layer = expected[key]
        spec = _spec_at(specs, path)
        wants[key] = want = tuple(entries[path].layout.source_shape(spec.shape[1:] if layer is not None
                                                                    else spec.shape))
        have = tuple(int(d) for d in shape_of(key))
        if have != want:
            wrong.append(f"{key!r} has shape {have}, expected {want} (parameter {path})")
    if wrong:
        more = f" and {len(wrong) - 8} more" if len(wrong) > 8 else ""
        raise CheckpointError(f"{source}: {len(wrong)} tensor(s) do not fit the {cfg.family} config "
                              f"(hidden {cfg.hidden_size}, {cfg.num_layers} layers, vocab {cfg.vocab_size}): "
                              + "; ".join(wrong[:8]) + more)
    return wants


def export_params(cfg: ModelConfig, table: list[KeyMapEntry], params: dict) -> dict[str, np.ndarray]:
    """The inverse of ``load_params``: source key -> tensor for every parameter of ``cfg`` (the same
    table, each layout inverted), so a loader and an exporter can never disagree."""
    specs = param_specs(cfg)
    out = {}
    for entry in table:
        if _spec_at(specs, entry.param) is None:
            continue
        if entry.prepare is not None:
            raise CheckpointError(f"export through a table with source fix-ups ({entry.source}) is not supported")
        value = params
        for part in entry.param.split("."):
            value = value[part]
        value = np.asarray(value)
        if "{i}" in entry.source:
            for i in range(cfg.num_layers):
                out[entry.source.format(i=i)] = np.ascontiguousarray(entry.layout.invert(value[i]))
        else:
            out[entry.source] = np.ascontiguousarray(entry.layout.invert(value))
    return out
