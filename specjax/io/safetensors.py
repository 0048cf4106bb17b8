"""A small torch-free safetensors reader (memory-mapped, bf16 via ml_dtypes) with precise errors."""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

from specjax.errors import CheckpointError

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


def _is_index(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


class _DuplicateKey(ValueError):
    pass


def _no_duplicate_keys(pairs: list) -> dict:
    """A JSON object that names a key twice (a tensor, say): json keeps the last silently."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(f"key {key!r} appears twice")
        out[key] = value
    return out


def parse_header(header, path: str, data_len: int) -> dict:
    """Validate a decoded safetensors header against the file's data length; returns {key: entry}.

    Every entry must be an object with a known "dtype", a "shape" list of non-negative ints and
    "data_offsets" [start, end] covering exactly the tensor's bytes inside the data section."""
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (a JSON {type(header).__name__}, expected an "
                              f"object of tensors)")
    header = dict(header)
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not isinstance(metadata, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header ('__metadata__' is not an object)")
    for key, info in header.items():
        if not isinstance(info, dict):
            raise CheckpointError(f"{path}: key {key!r} has a corrupt header entry {info!r} (expected an object)")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in _DTYPES:
            raise CheckpointError(f"{path}: key {key!r} has unsupported dtype {dtype!r} (supported: {sorted(_DTYPES)})")
        if not isinstance(shape, list) or not all(_is_index(d) for d in shape):
            raise CheckpointError(f"{path}: key {key!r} has no valid 'shape' (a list of non-negative ints), got "
                                  f"{shape!r}")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_index(o) for o in offsets):
            raise CheckpointError(f"{path}: key {key!r} has no valid 'data_offsets' ([start, end]), got {offsets!r}")
        start, end = offsets
        nbytes = int(np.prod(shape, dtype=object)) * np.dtype(_DTYPES[dtype]).itemsize
        if not (start <= end <= data_len) or end - start != nbytes:
            raise CheckpointError(f"{path}: key {key!r} has corrupt data offsets {start}..{end} for shape {shape} "
                                  f"{dtype} (file data is {data_len} bytes; truncated or corrupt file)")
    spans = sorted((info["data_offsets"][0], info["data_offsets"][1], key) for key, info in header.items()
                   if info["data_offsets"][1] > info["data_offsets"][0])
    for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
        if start < end:  # two tensors in the same bytes: one of them is not what was saved
            raise CheckpointError(f"{path}: the data of keys {first!r} and {second!r} overlap (corrupt header)")
    return header


class SafetensorsFile:
    """Index of one .safetensors file; ``get(key)`` returns a numpy view of the tensor."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        try:
            size = os.path.getsize(self.path)
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise CheckpointError(f"{self.path}: truncated safetensors file (no header)")
                (header_len,) = struct.unpack("<Q", head)
                if header_len > size - 8:
                    raise CheckpointError(f"{self.path}: corrupt safetensors header length {header_len} "
                                          f"(the file has {size} bytes; truncated or not a safetensors file)")
                header = json.loads(f.read(header_len).decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: weight file not found") from None
        except IsADirectoryError:
            raise CheckpointError(f"{self.path}: is a directory, expected a .safetensors file") from None
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, _DuplicateKey) as e:
            raise CheckpointError(f"{self.path}: corrupt safetensors header ({type(e).__name__}: {e})") from None
        self._data_start = 8 + header_len
        self._entries = parse_header(header, self.path, size - self._data_start)
        self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r") if size > self._data_start else None

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, key: str) -> tuple[int, ...]:
        """The stored shape, from the header (no data read)."""
        return tuple(self._entries[key]["shape"])

    def get(self, key: str) -> np.ndarray:
        info = self._entries[key]
        start, end = info["data_offsets"]
        dtype = np.dtype(_DTYPES[info["dtype"]])
        if end == start:
            return np.zeros(info["shape"], dtype)
        raw = self._mmap[self._data_start + start:self._data_start + end]
        return raw.view(dtype).reshape(info["shape"])


def open_hf_weights(model_dir: str) -> tuple[list[str], callable, callable]:
    """All tensors of an HF directory (single file or sharded with an index). Returns (keys, get, shape):
    ``get(key)`` reads a tensor, ``shape(key)`` its stored shape from the header."""
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(index_path) and os.path.exists(single):  # transformers takes the single file, we took the shards
        raise CheckpointError(f"{model_dir}: holds both model.safetensors and model.safetensors.index.json, so it is "
                              f"unclear which weights belong to its config.json (an export into a directory of an "
                              f"earlier model leaves that); remove the stale one")
    if os.path.exists(index_path):
        try:
            with open(index_path, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, RecursionError) as e:
            raise CheckpointError(f"{index_path}: corrupt index ({type(e).__name__}: {e})") from None
        if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) and os.path.basename(v) == v and v
                for k, v in weight_map.items()):
            raise CheckpointError(f"{index_path}: 'weight_map' must map tensor names to file names in {model_dir}")
        files = {name: SafetensorsFile(os.path.join(model_dir, name)) for name in sorted(set(weight_map.values()))}
        owner: dict[str, str] = {}
        for name, sf in files.items():
            for key in sf.keys():
                if key in owner:
                    raise CheckpointError(f"{model_dir}: duplicate key {key!r} in {owner[key]} and {name}")
                owner[key] = name
        for key, name in weight_map.items():
            if owner.get(key) != name:
                raise CheckpointError(f"{index_path}: key {key!r} is mapped to {name} but found in {owner.get(key)}")
        for key in owner.keys() - weight_map.keys():
            raise CheckpointError(f"{index_path}: key {key!r} in {owner[key]} is missing from the index")
        return list(owner), lambda key: files[owner[key]].get(key), lambda key: files[owner[key]].shape(key)
    if os.path.exists(single):
        sf = SafetensorsFile(single)
        return sf.keys(), sf.get, sf.shape
    if any(n.endswith(".bin") for n in os.listdir(model_dir)):
        raise CheckpointError(f"{model_dir}: only PyTorch .bin weights found; specjax reads safetensors "
                              f"(re-save with save_pretrained(safe_serialization=True))")
    raise CheckpointError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")
