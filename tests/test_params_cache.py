"""The weights cache (specjax/io/params_cache.py): a GGUF's converted weights read back as memory maps
are the converted weights bit for bit, in both layouts; a damaged entry is rebuilt; a changed file
is a new entry; the cache can be turned off and then writes nothing."""

from __future__ import annotations

import os
import shutil
import time

import chex
import jax
import numpy as np
import pytest

from specjax.errors import InputError
from specjax.io import loader, params_cache
from tests.conftest import requires_smollm2
from tests.toy import tiny_gguf


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


def _converted(path, monkeypatch):
    monkeypatch.setenv(params_cache.ENV, "0")
    try:
        return loader.gguf_params(path, False, progress=False)
    finally:
        monkeypatch.setenv(params_cache.ENV, "1")


def test_a_file_rewritten_with_its_old_size_and_mtime_is_a_new_entry(tmp_path, monkeypatch):
    """``cp -p``, ``rsync -a`` and ``touch -r`` restore the modification time: the weights served must still be
    the new file's (they were the old entry's, of another shape than the new config)."""
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path))
    path = tiny_gguf(tmp_path / "m.gguf", seed=0, vocab=32, ffn=24)
    loader.gguf_params(path, False, progress=False)  # cached
    old = os.stat(path)
    time.sleep(0.05)  # past the filesystem's timestamp granularity: the rewrite gets a new change time
    tiny_gguf(tmp_path / "m.gguf", seed=1, vocab=38, ffn=20)
    os.utime(path, ns=(old.st_atime_ns, old.st_mtime_ns))
    if os.path.getsize(path) != old.st_size:  # pad the tensor data's end: the same size as before
        with open(path, "ab") as f:
            f.write(b"\0" * (old.st_size - os.path.getsize(path)))
        os.utime(path, ns=(old.st_atime_ns, old.st_mtime_ns))
    assert (os.path.getsize(path), os.stat(path).st_mtime_ns) == (old.st_size, old.st_mtime_ns)
    cfg, want = _converted(path, monkeypatch)
    got_cfg, got = loader.gguf_params(path, False, progress=False)
    assert (got_cfg.vocab_size, got_cfg.intermediate_size) == (38, 20)
    _assert_same(got, want)


def test_an_entry_that_does_not_fit_the_files_config_is_rebuilt(tmp_path, monkeypatch):
    """Another model's weights under this file's key (a damaged or foreign entry): refused by the config
    check, reported, and converted again."""
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path))
    small = tiny_gguf(tmp_path / "a.gguf", seed=0, vocab=32, ffn=24)
    path = tiny_gguf(tmp_path / "b.gguf", seed=1, vocab=38, ffn=20)
    _, foreign = _converted(small, monkeypatch)
    assert params_cache.write(params_cache.entry_dir(path, "stacked"), foreign)
    with pytest.warns(UserWarning, match=r"weights cache entry .* is damaged .*has shape"):
        _, got = loader.gguf_params(path, False, progress=False)
    _assert_same(got, _converted(path, monkeypatch)[1])


def test_writing_an_entry_removes_those_no_load_can_hit_again(tmp_path, monkeypatch):
    """Each fresh virtual environment holds its own copy of the packaged GGUF, and each left a 622 MB entry
    per layout behind (5.1 GB in CI's cache after four runs). Writing an entry removes those of its file and
    layout before it changed, and those of files that are gone; another layout's and unrecorded ones stay."""
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path))
    a = tiny_gguf(tmp_path / "a.gguf", seed=0, vocab=32, ffn=24)
    b = tiny_gguf(tmp_path / "b.gguf", seed=1, vocab=32, ffn=24)
    loader.gguf_params(a, False, progress=False)
    loader.gguf_params(a, True, progress=False)
    loader.gguf_params(b, False, progress=False)
    old_a, split_a, entry_b = (params_cache.entry_dir(a, "stacked"), params_cache.entry_dir(a, "split"),
                               params_cache.entry_dir(b, "stacked"))
    legacy = tmp_path / "params" / "legacy-stacked-0"  # an entry written before identities were recorded
    assert params_cache.write(str(legacy), {"a": np.ones(2, np.float32)})
    time.sleep(0.05)  # a new change time for the rewritten file
    tiny_gguf(tmp_path / "a.gguf", seed=2, vocab=32, ffn=24)
    os.remove(b)
    loader.gguf_params(a, False, progress=False)  # a new entry for the changed file
    left = set(os.listdir(tmp_path / "params"))
    assert os.path.basename(params_cache.entry_dir(a, "stacked")) in left
    assert os.path.basename(old_a) not in left and os.path.basename(entry_b) not in left
    assert {os.path.basename(split_a), legacy.name} <= left and len(left) == 3


def test_a_manifest_naming_a_missing_leaf_is_damage_not_a_crash(tmp_path):
    entry = str(tmp_path / "e")
    assert params_cache.write(entry, {"a": np.ones(3, np.float32)})
    manifest = os.path.join(entry, "manifest.json")
    with open(manifest) as f:
        text = f.read()
    with open(manifest, "w") as f:
        f.write(text.replace('"leaf": 0', '"leaf": 7'))
    with pytest.warns(UserWarning, match="is damaged"):
        assert params_cache.read(entry) is None
    assert not os.path.exists(entry), "a damaged entry is removed, so the next load rebuilds it"


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
