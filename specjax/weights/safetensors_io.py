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
                    raise CheckpointError(f"{self.path}: corrupt safetensors header length {header_len}")
                header = json.loads(f.read(header_len))
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: weight file not found") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{self.path}: corrupt safetensors header ({e})") from None
        header.pop("__metadata__", None)
        self._data_start = 8 + header_len
        self._entries = header
        self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r") if size > self._data_start else None
        data_len = size - self._data_start
        for key, info in header.items():
            start, end = info.get("data_offsets", (0, -1))
            if info.get("dtype") not in _DTYPES:
                raise CheckpointError(f"{self.path}: key {key!r} has unsupported dtype {info.get('dtype')!r}")
            nbytes = int(np.prod(info["shape"], dtype=np.int64)) * np.dtype(_DTYPES[info["dtype"]]).itemsize
            if not (0 <= start <= end <= data_len) or end - start != nbytes:
                raise CheckpointError(f"{self.path}: key {key!r} has corrupt data offsets {start}..{end} "
                                      f"for shape {info['shape']} {info['dtype']} (file data is {data_len} bytes)")

    def keys(self) -> list[str]:
        return list(self._entries)

    def get(self, key: str) -> np.ndarray:
        info = self._entries[key]
        start, end = info["data_offsets"]
        dtype = np.dtype(_DTYPES[info["dtype"]])
        if end == start:
            return np.zeros(info["shape"], dtype)
        raw = self._mmap[self._data_start + start:self._data_start + end]
        return raw.view(dtype).reshape(info["shape"])


def open_hf_weights(model_dir: str) -> tuple[list[str], callable]:
    """All tensors of an HF directory (single file or sharded with an index). Returns (keys, get)."""
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index_path}: corrupt index ({e!r})") from None
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
        return list(owner), lambda key: files[owner[key]].get(key)
    if os.path.exists(single):
        sf = SafetensorsFile(single)
        return sf.keys(), sf.get
    if any(n.endswith(".bin") for n in os.listdir(model_dir)):
        raise CheckpointError(f"{model_dir}: only PyTorch .bin weights found; specjax reads safetensors "
                              f"(re-save with save_pretrained(safe_serialization=True))")
    raise CheckpointError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")
