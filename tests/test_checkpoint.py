"""Orbax checkpoints: convert, restore, identical outputs; the params tree declares logical axes."""

from __future__ import annotations

import subprocess
import sys

import jax
import numpy as np
import pytest

import specjax
from specjax.models import param_logical_axes, param_specs
from specjax.models.cache import cache_logical_axes, init_cache


def test_convert_cli_and_restore_give_identical_logits(tiny_opt_dir, tmp_path):
    dst = tmp_path / "ckpt"
    r = subprocess.run([sys.executable, "-m", "specjax", "convert", tiny_opt_dir, str(dst)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    original = specjax.load_model(tiny_opt_dir, progress=False)
    restored = specjax.load_model(str(dst))
    assert restored.config == original.config
    seq = [[3, 1, 4, 1, 5, 9, 2, 6]]
    np.testing.assert_array_equal(specjax.logits(restored, seq)[0], specjax.logits(original, seq)[0])


def test_restore_into_explicit_sharding(tiny_llama_dir, tmp_path):
    from specjax.io.checkpoint import restore_checkpoint, save_checkpoint
    from specjax.models.params import is_param_spec

    m = specjax.load_model(tiny_llama_dir, progress=False, split_layers=False)  # the layout a checkpoint holds
    save_checkpoint(str(tmp_path / "c"), m.config, m.params)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[-1])
    shardings = jax.tree.map(lambda s: sharding, param_specs(m.config), is_leaf=is_param_spec)
    cfg, params, tok = restore_checkpoint(str(tmp_path / "c"), shardings=shardings)
    assert tok is None
    for leaf in jax.tree.leaves(params):
        assert leaf.sharding == sharding
    jax.tree.map(np.testing.assert_array_equal, params, m.params)


def test_save_refuses_non_empty_destination(tiny_llama_dir, tmp_path):
    from specjax.errors import CheckpointError
    from specjax.io.checkpoint import save_checkpoint

    m = specjax.load_model(tiny_llama_dir, progress=False)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "x").write_text("x")
    with pytest.raises(CheckpointError, match="not empty"):
        save_checkpoint(str(tmp_path / "c"), m.config, m.params)


class _Tokenizer:
    def save_pretrained(self, path):
        raise OSError(28, "No space left on device")


@pytest.mark.parametrize("failure", ["params", "tokenizer", "interrupt"])
def test_a_save_that_fails_leaves_nothing_at_the_destination(tiny_llama_dir, tmp_path, monkeypatch, failure):
    """The config was written first: a disk that filled up during the params, or Ctrl-C, left a directory that
    `is_checkpoint` took for a checkpoint (then 'params not found', or a model silently without its tokenizer)."""
    import orbax.checkpoint as ocp

    from specjax.errors import CheckpointError
    from specjax.io.checkpoint import is_checkpoint, save_checkpoint

    m = specjax.load_model(tiny_llama_dir, progress=False)
    (tmp_path / "empty").mkdir()  # an empty destination is allowed: it must stay empty
    raised = KeyboardInterrupt if failure == "interrupt" else OSError

    def fail(*a, **k):
        raise raised("injected")

    if failure != "tokenizer":
        monkeypatch.setattr(ocp.StandardCheckpointer, "save", fail)
    for dst in (tmp_path / "new", tmp_path / "empty"):
        if raised is KeyboardInterrupt:
            with pytest.raises(KeyboardInterrupt):
                save_checkpoint(str(dst), m.config, m.params)
        else:
            with pytest.raises(CheckpointError, match=f"{dst}: could not write it, nothing was left there"):
                save_checkpoint(str(dst), m.config, m.params, _Tokenizer() if failure == "tokenizer" else None)
        assert not is_checkpoint(str(dst))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"] and not any((tmp_path / "empty").iterdir())


def test_a_destination_that_is_a_broken_link_is_refused_before_loading(tiny_llama_dir, tmp_path):
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    r = subprocess.run([sys.executable, "-m", "specjax", "convert", tiny_llama_dir, str(tmp_path / "link")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "is a symbolic link to" in r.stderr and "loading" not in r.stderr, r.stderr


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_opt_dir"])
def test_every_leaf_declares_logical_axes(request, fixture):
    m = specjax.load_model(request.getfixturevalue(fixture), progress=False, split_layers=False)  # sharded layout
    axes = param_logical_axes(m.config)
    flat_p = jax.tree_util.tree_flatten_with_path(m.params)[0]
    flat_a = dict(jax.tree_util.tree_flatten_with_path(axes, is_leaf=lambda x: isinstance(x, tuple))[0])
    for path, leaf in flat_p:
        assert path in flat_a, f"{jax.tree_util.keystr(path)} declares no logical axes"
        assert len(flat_a[path]) == leaf.ndim
        if jax.tree_util.keystr(path).startswith("['layers']"):
            assert flat_a[path][0] == "layers", "layer weights must be stacked on a leading 'layers' axis"
    cache = init_cache(m.config, 2, 8)
    cache_axes = cache_logical_axes()
    assert len(cache_axes.k) == cache.k.ndim and len(cache_axes.length) == cache.length.ndim
