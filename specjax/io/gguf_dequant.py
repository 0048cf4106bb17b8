"""Whole-tensor dequantization of the GGUF block types SmolLM2's file holds (Q4_1, Q8_0).

``gguf.quants.dequantize`` computes the same values, but over groups of rows with a Python loop and
extra array splits: 1.1 s for SmolLM2's 272 tensors against 0.34 s here (AMD EPYC), paid by every
command. The arithmetic is the same float32 operations in the same order, so the results are
bit-identical (``tests/test_gguf_dequant.py`` holds them to ``gguf``'s on random blocks and on the
shipped file). Other types go through ``gguf``.
"""

from __future__ import annotations

import numpy as np

Q4_1, Q8_0 = 3, 8  # their gguf.GGMLQuantizationType values (this module imports nothing from gguf)
BLOCK = 32  # elements per block for both types
_BLOCK_BYTES = {Q4_1: 20, Q8_0: 34}  # Q4_1: f16 scale, f16 minimum, 16 bytes of 4-bit codes; Q8_0: f16 scale, 32 int8


def supported(ggml_type: int) -> bool:
    return ggml_type in _BLOCK_BYTES


def dequantize(raw: np.ndarray, ggml_type: int) -> np.ndarray:
    """raw [..., row bytes] uint8 (``GGUFFile.raw``) -> float32 [..., row elements]."""
    width = _BLOCK_BYTES[ggml_type]
    if raw.shape[-1] % width:
        raise ValueError(f"a row of {raw.shape[-1]} bytes is not a whole number of {width}-byte blocks")
    blocks = raw.reshape(-1, width)
    scale = _f16(blocks[:, 0:2])
    if ggml_type == Q4_1:
        codes = blocks[:, 4:]  # element j in the low nibble of byte j, element 16 + j in its high nibble
        out = np.concatenate([codes & np.uint8(0x0F), codes >> np.uint8(4)], axis=1).astype(np.float32)
        out *= scale
        out += _f16(blocks[:, 2:4])
    else:
        out = blocks[:, 2:].copy().view(np.int8).astype(np.float32)
        out *= scale
    return out.reshape(*raw.shape[:-1], raw.shape[-1] // width * BLOCK)


def _f16(pairs: np.ndarray) -> np.ndarray:
    """[n, 2] bytes -> [n, 1] float32 of the little-endian float16 they hold."""
    return np.ascontiguousarray(pairs).view("<f2").astype(np.float32)
