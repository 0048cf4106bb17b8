"""The weights cache (specjax/io/params_cache.py): a GGUF's converted weights read back as memory maps
are the converted weights bit for bit, in both layouts; a damaged entry is rebuilt; a changed file
is a new entry; the cache can be turned off and then writes nothing."""

from __future__ import annotations

import os
import shutil

import chex
import jax
import numpy as np
import pytest

from specjax.errors import InputError
from specjax.io import loader, params_cache
from tests.conftest import requires_smollm2


@pytest.fixture(autouse=True)
def _drop_entries(tmp_path):
    """Each SmolLM2 entry is 622 MB: removed after the test rather than left in pytest's temporary
    directories for the rest of the run."""
    yield
    shutil.rmtree(tmp_path / "params", ignore_errors=True)


def _assert_same(got, want):
    chex.assert_trees_all_equal_structs(got, want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@requires_smollm2
@pytest.mark.parametrize("split", [True, False], ids=["split", "stacked"])
def test_cached_weights_are_the_converted_weights_bit_for_bit(tmp_path, monkeypatch, split):
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path))
    path = loader.resolve_model_path("smollm2-135m-instruct")
    monkeypatch.setenv(params_cache.ENV, "0")
    cfg, converted = loader.gguf_params(path, split, progress=False)
    assert not (tmp_path / "params").exists(), "the cache is off: nothing may be written"
    monkeypatch.setenv(params_cache.ENV, "1")
    cfg_first, first = loader.gguf_params(path, split, progress=False)  # converted, then written
    entry = params_cache.entry_dir(path, "split" if split else "stacked")
    assert os.path.exists(os.path.join(entry, "manifest.json"))
    cfg_again, again = loader.gguf_params(path, split, progress=False)  # read back
    assert cfg == cfg_first == cfg_again
    assert all(isinstance(a, np.memmap) for a in jax.tree.leaves(again)), "not read back as memory maps"
    assert not any(a.flags.writeable for a in jax.tree.leaves(again))
    assert isinstance(again["layers"], tuple) == split
    _assert_same(first, converted)
    _assert_same(again, converted)


@requires_smollm2
def test_a_damaged_entry_is_reported_and_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path))
    path = loader.resolve_model_path("smollm2-135m-instruct")
    _, want = loader.gguf_params(path, False, progress=False)
    entry = params_cache.entry_dir(path, "stacked")
    leaf = os.path.join(entry, "3.npy")
    with open(leaf, "r+b") as f:
        f.truncate(os.path.getsize(leaf) // 2)
    with pytest.warns(UserWarning, match=r"weights cache entry .* is damaged"):
        _, got = loader.gguf_params(path, False, progress=False)
    _assert_same(got, want)
    _, again = loader.gguf_params(path, False, progress=False)  # the rebuilt entry reads back
    assert all(isinstance(a, np.memmap) for a in jax.tree.leaves(again))
    _assert_same(again, want)


def test_the_entry_follows_the_file_and_the_layout(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"x" * 10)
    first = params_cache.entry_dir(str(f), "split")
    assert first.startswith(str(tmp_path / "params"))
    assert params_cache.entry_dir(str(f), "stacked") != first
    os.utime(f, ns=(1, 1))  # the same size, another modification time: another file as far as the cache knows
    assert params_cache.entry_dir(str(f), "split") != first


def test_a_second_writer_of_the_same_entry_keeps_the_first(tmp_path):
    tree = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "layers": ({"w": np.ones(4, np.float32)},)}
    entry = str(tmp_path / "e")
    assert params_cache.write(entry, tree) and params_cache.write(entry, {"a": np.zeros(1, np.float32)})
    _assert_same(params_cache.read(entry), tree)
    assert sorted(os.listdir(tmp_path)) == ["e"], "a temporary directory was left behind"


def test_a_bad_switch_value_is_refused(monkeypatch):
    monkeypatch.setenv(params_cache.ENV, "sometimes")
    with pytest.raises(InputError, match="SPECJAX_PARAMS_CACHE='sometimes'"):
        params_cache.enabled()
