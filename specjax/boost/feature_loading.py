"""Loading the feature corpus into memory once: the whole set, or its train / held-out split.

The features dominate memory (float16 [N, D] per stored layer: 2.8 GiB a layer for SmolLM2's 2.6M-token
corpus, g and each raw layer of a fusion), so they are copied once, into arrays allocated at their
final size. Loading shard by shard into lists and concatenating them held every shard and the
concatenation at once, and splitting the loaded set and concatenating the request rounds' splits
copied it again: on the layer-15 fusion's whole corpus (5.60 GiB of features, stop 65) that route
peaked at 11.45 GiB of RSS against 5.90 GiB here, which is what lets three raw layers and g (11.2 GiB
of features) train on a 24 GiB machine. A first pass reads only what is small (the corpus tokens,
the feature files' offsets and array headers) and decides where every sequence goes; the second
loads one feature file at a time and copies its rows into place. The result equals the replaced
route's exactly (``tests/test_feature_loading.py``); three raw layers and g, 11.20 GiB, loaded at
a peak of 11.52 GiB.
"""

from __future__ import annotations

import dataclasses
import zipfile

import numpy as np

from specjax.boost.corpus import read_shard
from specjax.boost.feature_data import FeatureSet, held_out_indices
from specjax.errors import InputError


@dataclasses.dataclass(frozen=True)
class _Sequence:
    """One corpus sequence as the loader places it (rows ``cut:`` of its feature rows)."""

    file: int  # index into the feature files
    index: int  # its index in its shard and feature file
    cut: int  # rows dropped from the left of the prompt (``max_len``)
    tokens: np.ndarray
    greedy: np.ndarray
    prompt_len: int  # after the cut
    part: int  # index into the part names


@dataclasses.dataclass(frozen=True)
class _Index:
    files: list  # (feature file path, its offsets) per file
    groups: list  # per group: its sequences, in the order the old route concatenated them
    part_names: tuple
    row_shape: tuple  # [D] (final features only) or [n + 1, D] (fused-layer inputs, then g)
    dtype: np.dtype


def _header(path: str, member: str):
    """(shape, dtype) of an array in an ``.npz`` without reading its data."""
    try:
        with zipfile.ZipFile(path) as zf, zf.open(member + ".npy") as fh:
            version = np.lib.format.read_magic(fh)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, _, dtype = read(fh)
    except (OSError, KeyError, zipfile.BadZipFile, ValueError) as e:
        raise InputError(f"{path}: not a feature file with a {member!r} array ({e})") from None
    return shape, dtype


def _index(groups: list[dict[str, tuple[list[str], list[str]]]], max_len: int | None) -> _Index:
    files, grouped, names, shapes, dtypes = [], [], [], set(), []
    for parts in groups:
        sequences = []
        for name, (shards, features) in parts.items():
            if len(shards) != len(features):
                raise InputError(f"part {name}: {len(shards)} corpus shards but {len(features)} feature files")
            part = len(names)
            names.append(name)
            for shard, fpath in zip(shards, features):
                corpus = read_shard(shard)
                with np.load(shard) as z:
                    is_greedy = float(z["temperature"]) == 0.0
                with np.load(fpath) as z:
                    offsets = np.asarray(z["offsets"])
                shape, dtype = _header(fpath, "features")
                if len(offsets) != len(corpus) + 1 or shape[0] != offsets[-1]:
                    raise InputError(f"{fpath}: {len(offsets) - 1} sequences, its shard {shard} has {len(corpus)}")
                if not np.array_equal(np.diff(offsets), [len(ids) for ids, _ in corpus]):
                    raise InputError(f"{fpath}: its sequence lengths differ from those of its shard {shard} (the "
                                     f"features of another shard?)")
                shapes.add(tuple(shape[1:]))
                dtypes.append(dtype)
                file = len(files)
                files.append((fpath, offsets))
                for i, (ids, prompt_len) in enumerate(corpus):
                    cut = 0 if max_len is None else max(0, len(ids) - max_len)
                    if cut >= prompt_len:
                        raise InputError(f"{shard}: a continuation of {len(ids) - prompt_len} tokens exceeds max_len "
                                         f"{max_len}")
                    ids = np.asarray(ids, np.int32)
                    nxt = np.full(len(ids), -1, np.int32)
                    if is_greedy:  # position p's greedy next token is the continuation's token p + 1
                        nxt[prompt_len - 1:-1] = ids[prompt_len:]
                    sequences.append(_Sequence(file, i, cut, ids[cut:], nxt[cut:], prompt_len - cut, part))
        grouped.append(sequences)
    if not any(grouped):
        raise InputError("no feature data: the corpus parts are empty")
    if len({len(s) for s in shapes}) > 1:
        raise InputError("feature files disagree: some hold fused-layer inputs, some do not")
    if len(shapes) > 1:
        raise InputError(f"feature files disagree on their row shape: {sorted(shapes)}")
    return _Index(files, grouped, tuple(names), shapes.pop(), np.result_type(*dtypes))


def _gather(index: _Index, selections: list[list[_Sequence]]) -> list[FeatureSet]:
    """One FeatureSet per selection (sequences in the given order), each feature row copied once."""
    fused = len(index.row_shape) == 2
    placed = {}  # feature file -> [(sequence, selection, first destination row)]
    out = []
    for k, chosen in enumerate(selections):
        offsets = np.cumsum([0] + [len(s.tokens) for s in chosen]).astype(np.int64)
        for s, start in zip(chosen, offsets[:-1]):
            placed.setdefault(s.file, []).append((s, k, int(start)))
        rows = int(offsets[-1])
        features = np.empty((rows, index.row_shape[-1]), index.dtype)
        inputs = np.empty((rows, index.row_shape[0] - 1, index.row_shape[-1]), index.dtype) if fused else None
        tokens = np.concatenate([s.tokens for s in chosen]) if chosen else np.zeros((0,), np.int32)
        greedy = np.concatenate([s.greedy for s in chosen]) if chosen else np.zeros((0,), np.int32)
        out.append(FeatureSet(tokens, features, greedy, offsets, np.asarray([s.prompt_len for s in chosen], np.int32),
                              np.asarray([s.part for s in chosen], np.int32), index.part_names, inputs))
    for file, sequences in placed.items():  # one feature file in memory at a time
        path, offsets = index.files[file]
        with np.load(path) as z:
            stored = z["features"]
        for s, k, start in sequences:
            rows = stored[offsets[s.index] + s.cut:offsets[s.index + 1]]
            end = start + len(rows)
            if fused:  # [T, n + 1, D]: the inputs, then g
                out[k].features[start:end] = rows[:, -1]
                out[k].inputs[start:end] = rows[:, :-1]
            else:
                out[k].features[start:end] = rows
        del stored
    return out


def load_feature_set(parts: dict[str, tuple[list[str], list[str]]], max_len: int | None = None) -> FeatureSet:
    """parts: {name: (corpus shard paths, feature shard paths)}. Sequences longer than ``max_len`` are
    cut from the left of their prompt (the continuation is kept whole; positions restart at 0)."""
    index = _index([parts], max_len)
    return _gather(index, [index.groups[0]])[0]


def load_split(groups: list[dict[str, tuple[list[str], list[str]]]], fraction: float, seed: int = 0,
               max_len: int | None = None) -> tuple[FeatureSet, FeatureSet, list[tuple[int, int]]]:
    """(train, held out, [(train, held out) sequences per group]): each group's sequences split on
    their own (``held_out_indices`` with the same seed), then the groups' train and held-out parts
    concatenated in order; equal to ``split_held_out`` of each group's ``load_feature_set`` joined by
    ``concat_sets``, with the features copied once."""
    index = _index(groups, max_len)
    train, held, counts = [], [], []
    for group in index.groups:
        t, h = held_out_indices(len(group), fraction, seed)
        train += [group[i] for i in t]
        held += [group[i] for i in h]
        counts.append((len(t), len(h)))
    train_set, held_set = _gather(index, [train, held])
    return train_set, held_set, counts
