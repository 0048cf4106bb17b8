"""A direct reader of GGUF files (metadata and tensor views), independent of ``gguf.GGUFReader``.

``gguf.GGUFReader`` builds a numpy view per metadata element, which takes ~6 s for a tokenizer of
50k tokens and 50k merges; reading the same layout with ``struct`` over one memory map takes well
under a second, so the config and tokenizer can be read (and checked) before the weights load.
The ``gguf`` package is still used for its constants and its dequantization kernels.

Layout (GGUF v2/v3, little-endian): magic "GGUF", version u32, tensor count u64, metadata count
u64; metadata = (key: string, type: u32, value); tensor infos = (name: string, n_dims: u32,
dims: u64[n_dims] (fastest first), ggml type: u32, offset: u64); tensor data from the next
multiple of ``general.alignment`` (default 32). A string is u64 length + UTF-8 bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import mmap
import os
import struct

import numpy as np

from specjax.errors import CheckpointError
from specjax.io import gguf_dequant

MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
STRING, ARRAY = 8, 9


class _Truncated(Exception):
    pass


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: int
    shape: tuple[int, ...]  # numpy order (slowest first), in elements
    offset: int  # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    """``fields``: metadata key -> Python value (int, float, bool, str, or a list of them);
    ``tensors``: name -> TensorInfo; ``raw(name)``: the tensor's bytes as numpy, shaped like
    ``gguf.GGUFReader``'s tensor data (element arrays for float/int types, bytes rows otherwise)."""

    def __init__(self, path: str):
        self.path = path
        if os.path.isdir(path):
            raise CheckpointError(f"{path}: is a directory, expected a .gguf file")
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        except FileNotFoundError:
            raise CheckpointError(f"{path}: GGUF file not found") from None
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
        try:
            self._parse()
        except _Truncated as e:
            raise CheckpointError(f"{path}: truncated GGUF file ({e}); download or copy it again") from None
        except (UnicodeDecodeError, ValueError, OverflowError, MemoryError, RecursionError) as e:
            raise CheckpointError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None

    # -- primitive reads -------------------------------------------------------------------------
    def _take(self, fmt: str):
        n = struct.calcsize(fmt)
        if self._pos + n > len(self._map):
            raise _Truncated(f"metadata ends at byte {len(self._map)}, inside a value at byte {self._pos}")
        value = struct.unpack_from(fmt, self._map, self._pos)[0]
        self._pos += n
        return value

    def _string(self) -> str:
        n = self._take("<Q")
        if self._pos + n > len(self._map):
            raise _Truncated(f"a string of {n} bytes at byte {self._pos} runs past the end ({len(self._map)} bytes)")
        raw = self._map[self._pos:self._pos + n]
        self._pos += n
        return raw.decode("utf-8")

    def _value(self, kind: int):
        if kind in _SCALARS:
            return self._take(_SCALARS[kind])
        if kind == STRING:
            return self._string()
        if kind == ARRAY:
            item, count = self._take("<I"), self._take("<Q")
            if item == STRING:
                return [self._string() for _ in range(count)]
            if item in _NUMPY:
                nbytes = np.dtype(_NUMPY[item]).itemsize * count
                if self._pos + nbytes > len(self._map):
                    raise _Truncated(f"an array of {count} values at byte {self._pos} runs past the end")
                values = np.frombuffer(self._map, _NUMPY[item], count, self._pos).tolist()
                self._pos += nbytes
                return values
            if item == ARRAY:
                return [self._value(ARRAY) for _ in range(count)]
            raise ValueError(f"unknown array item type {item} at byte {self._pos}")
        raise ValueError(f"unknown metadata value type {kind} at byte {self._pos}")

    # -- structure -------------------------------------------------------------------------------
    def _parse(self) -> None:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        self._pos = 0
        if len(self._map) < 4 or self._map[:4] != MAGIC:
            raise ValueError("GGUF magic invalid (not a GGUF file)")
        self._pos = 4
        version = self._take("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2, 3; big-endian files are not supported)")
        n_tensors, n_fields = self._take("<Q"), self._take("<Q")
        self.fields: dict = {}
        for _ in range(n_fields):
            key = self._string()
            if key in self.fields:
                raise ValueError(f"metadata key {key!r} appears twice")
            self.fields[key] = self._value(self._take("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._take("<I")
            if n_dims > 8:
                raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
            dims = [self._take("<Q") for _ in range(n_dims)]
            kind, offset = self._take("<I"), self._take("<Q")
            infos.append((name, dims, kind, offset))
        align = self.fields.get("general.alignment", 32)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise ValueError(f"general.alignment must be a positive power of two, got {align!r}")
        start = -(-self._pos // align) * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, kind, offset in infos:
            if name in self.tensors:
                raise ValueError(f"tensor {name!r} appears twice")
            try:
                qtype = GGMLQuantizationType(kind)
            except ValueError:
                raise ValueError(f"tensor {name!r} has unknown ggml type {kind}") from None
            block, type_size = GGML_QUANT_SIZES[qtype]
            elements = int(np.prod(dims, dtype=object)) if dims else 1
            if dims and dims[0] % block:
                raise ValueError(f"tensor {name!r}: row length {dims[0]} is not a multiple of the {qtype.name} "
                                 f"block size {block}")
            nbytes = elements // block * type_size
            begin = start + offset
            if begin + nbytes > len(self._map):
                raise _Truncated(f"tensor {name!r} needs bytes up to {begin + nbytes}, but the file has "
                                 f"{len(self._map)} bytes")
            self.tensors[name] = TensorInfo(name, kind, tuple(reversed(dims)), begin, nbytes)

    def raw(self, name: str) -> np.ndarray:
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        t = self.tensors[name]
        element = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64,
                   28: np.float64}.get(t.ggml_type)
        if element is not None:
            return np.frombuffer(self._map, element, t.nbytes // np.dtype(element).itemsize, t.offset).reshape(t.shape)
        data = np.frombuffer(self._map, np.uint8, t.nbytes, t.offset)
        return data.reshape(quant_shape_to_byte_shape(t.shape, GGMLQuantizationType(t.ggml_type)))

    def dequantized(self, name: str) -> np.ndarray:
        """The tensor as float32 (numpy order)."""
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize

        t = self.tensors[name]
        try:
            if gguf_dequant.supported(t.ggml_type):
                return gguf_dequant.dequantize(self.raw(name), t.ggml_type)
            return np.asarray(dequantize(self.raw(name), GGMLQuantizationType(t.ggml_type)), dtype=np.float32)
        except Exception as e:  # noqa: BLE001 - gguf raises assorted errors for unsupported types
            raise CheckpointError(f"{self.path}: cannot dequantize tensor {name!r} "
                                  f"({GGMLQuantizationType(t.ggml_type).name}): {e}") from None


def file_identity(path: str) -> list:
    """What tells a file's versions apart (real path, inode, size, modification and change times): a file
    rewritten in place with its old size and mtime restored (``cp -p``, ``rsync -a``) is another file. Keys
    the caches of a file's contents (``open_gguf``, the converted tokenizer, the weights cache)."""
    st = os.stat(path)
    return [os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def open_gguf(path: str) -> GGUFFile:
    """``GGUFFile(path)``, parsed once per process for the same file (its real path, inode, size and
    modification / change times): a command reads the config, the tokenizer and the weights of one file
    in turn, and parsing its 50k-token vocabulary and merges costs ~0.3 s each time. The last 4 files
    stay open (memory-mapped) for the life of the process."""
    try:
        identity = tuple(file_identity(path))
    except OSError:
        return GGUFFile(path)  # its own error names the problem
    return _open_gguf(path, identity)


@functools.lru_cache(maxsize=4)
def _open_gguf(path: str, identity: tuple) -> GGUFFile:
    """``identity``: only the cache key (what tells a file, or a rewrite of it, apart)."""
    return GGUFFile(path)
