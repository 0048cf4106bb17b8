"""What a command reads at start-up is read once per process, and again when the file changes."""

from __future__ import annotations

import struct

from specjax.io.gguf_file import open_gguf
from tests.conftest import requires_smollm2


def _gguf_with_name(name: bytes) -> bytes:
    """A GGUF file without tensors whose only metadata is general.name = name."""
    def string(s: bytes) -> bytes:
        return struct.pack("<Q", len(s)) + s

    return b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + string(b"general.name") + struct.pack("<I", 8) + string(name)


def test_a_gguf_file_is_parsed_once_and_again_after_it_changes(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(_gguf_with_name(b"first"))
    first = open_gguf(str(path))
    assert open_gguf(str(path)) is first, "the same unchanged file was parsed twice"
    path.write_bytes(_gguf_with_name(b"second one"))
    assert open_gguf(str(path)).fields["general.name"] == "second one", "a changed file must be read again"


@requires_smollm2
def test_the_gguf_tokenizer_is_built_once_per_process():
    import specjax
    from specjax.io.registry import resolve
    from specjax.io.tokenizer import load_gguf_tokenizer

    tok = load_gguf_tokenizer(resolve("smollm2-135m-instruct"))
    assert specjax.describe_model("smollm2-135m-instruct").tokenizer is tok
    assert tok("Name a colour.")["input_ids"], "the tokenizer encodes"


def test_weights_reach_the_device_in_the_asked_dtype_with_their_values(tiny_llama_dir):
    """load_model puts host weights on the device with device_put (no program per shape), then casts:
    bfloat16 weights are exactly jax's own cast of the float32 ones (whose values the HF equivalence
    tests check)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import specjax

    f32 = specjax.load_model(tiny_llama_dir, progress=False)
    bf16 = specjax.load_model(tiny_llama_dir, dtype="bfloat16", progress=False)
    reference = jax.tree.map(lambda a: np.asarray(jnp.asarray(np.asarray(a)).astype(jnp.bfloat16)), f32.params)
    for a, b, ref in zip(jax.tree.leaves(f32.params), jax.tree.leaves(bf16.params), jax.tree.leaves(reference)):
        assert a.dtype == jnp.float32 and b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(b).view(np.uint16), ref.view(np.uint16))


def test_explicit_shardings_place_each_weight_there_in_the_asked_dtype(tiny_llama_dir):
    """load_model(shardings=...) puts each host weight straight into its sharding, then casts."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import specjax

    mesh = jax.make_mesh((len(jax.devices()),), ("x",))
    plain = specjax.load_model(tiny_llama_dir, progress=False, split_layers=False)
    shardings = jax.tree.map(lambda a: NamedSharding(mesh, P(*([None] * a.ndim))), plain.params)
    placed = specjax.load_model(tiny_llama_dir, progress=False, shardings=shardings, dtype="bfloat16")
    for a, b, s in zip(jax.tree.leaves(plain.params), jax.tree.leaves(placed.params), jax.tree.leaves(shardings)):
        assert b.sharding == s and b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(b).view(np.uint16), np.asarray(a.astype(jnp.bfloat16)).view(np.uint16))


@requires_smollm2
def test_a_damaged_cached_tokenizer_is_reported_and_converted_again(tmp_path, monkeypatch):
    """A truncated ``tokenizer.json`` in the cache (an older version's interrupted write) was a JSONDecodeError
    naming no file, on every later load."""
    import pytest

    from specjax.io import tokenizer as tok_lib
    from specjax.io.registry import resolve

    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path))
    path, text = resolve("smollm2-135m-instruct"), "Name a colour."
    monkeypatch.setattr(tok_lib, "_LOADED", {})  # this process's copies: the cache on disk is read again
    want = tok_lib.load_gguf_tokenizer(path)(text)["input_ids"]
    [entry] = (tmp_path / "tokenizers").iterdir()
    saved = entry / "tokenizer.json"
    saved.write_text(saved.read_text()[:len(saved.read_text()) // 2])
    monkeypatch.setattr(tok_lib, "_LOADED", {})
    with pytest.warns(UserWarning, match="cached tokenizer .* is damaged"):
        assert tok_lib.load_gguf_tokenizer(path)(text)["input_ids"] == want
    monkeypatch.setattr(tok_lib, "_LOADED", {})
    assert tok_lib.load_gguf_tokenizer(path)(text)["input_ids"] == want  # the rebuilt entry reads back
    assert [p.name for p in (tmp_path / "tokenizers").iterdir()] == [entry.name], "a temporary entry was left"
