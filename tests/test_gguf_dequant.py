"""specjax's whole-tensor Q4_1 / Q8_0 dequantization is bit-identical to the ``gguf`` package's."""

from __future__ import annotations

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from specjax.io import gguf_dequant
from tests.conftest import requires_smollm2


def _random_blocks(rng, rows: int, blocks_per_row: int, width: int) -> np.ndarray:
    """Random bytes with finite float16 scale (and minimum) fields of every magnitude and sign."""
    raw = rng.integers(0, 256, (rows, blocks_per_row, width), dtype=np.uint8)
    fields = 2 if width == 20 else 1
    for k in range(fields):
        f16 = raw[..., 2 * k:2 * k + 2].copy().view("<f2")
        bad = ~np.isfinite(f16)
        f16[bad] = np.float16(0.5)
        raw[..., 2 * k:2 * k + 2] = f16.view(np.uint8)
    return raw.reshape(rows, blocks_per_row * width)


@pytest.mark.parametrize("ggml_type,width", [(gguf_dequant.Q4_1, 20), (gguf_dequant.Q8_0, 34)])
def test_random_blocks_equal_gguf_bit_for_bit(ggml_type, width):
    rng = np.random.default_rng(ggml_type)
    raw = _random_blocks(rng, 7, 5, width)
    ours = gguf_dequant.dequantize(raw, ggml_type)
    theirs = np.asarray(gguf_dequantize(raw, GGMLQuantizationType(ggml_type)), np.float32)
    assert ours.shape == theirs.shape == (7, 5 * 32) and ours.dtype == np.float32
    np.testing.assert_array_equal(ours.view(np.uint32), theirs.view(np.uint32))


def test_a_row_of_partial_blocks_is_refused():
    with pytest.raises(ValueError, match="not a whole number of 20-byte blocks"):
        gguf_dequant.dequantize(np.zeros((2, 30), np.uint8), gguf_dequant.Q4_1)


@requires_smollm2
def test_the_shipped_file_dequantizes_as_gguf_does():
    from specjax.io.gguf_file import GGUFFile
    from specjax.io.registry import resolve

    f = GGUFFile(resolve("smollm2-135m-instruct"))
    kinds = set()
    for name, t in f.tensors.items():
        if not gguf_dequant.supported(t.ggml_type):
            continue
        kinds.add(t.ggml_type)
        theirs = np.asarray(gguf_dequantize(f.raw(name), GGMLQuantizationType(t.ggml_type)), np.float32)
        ours = f.dequantized(name)
        assert ours.shape == theirs.shape == t.shape, name
        np.testing.assert_array_equal(ours.view(np.uint32), theirs.view(np.uint32), err_msg=name)
    assert kinds == {gguf_dequant.Q4_1, gguf_dequant.Q8_0}
