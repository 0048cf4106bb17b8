"""Orbax checkpoints of converted params: config + params (+ tokenizer), restorable into any sharding."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid

import jax
import numpy as np

from specjax.config import ModelConfig
from specjax.errors import CheckpointError, InputError
from specjax.models.params import check_params, is_param_spec, param_specs, stack_layers

CONFIG_FILE = "specjax_config.json"


def is_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, CONFIG_FILE))


def check_destination(path: str) -> str:
    """The absolute path if a checkpoint can be written there: a new or empty directory whose
    nearest existing ancestor is a writable directory. Checked before any expensive work."""
    path = os.path.abspath(path)
    if os.path.islink(path) and not os.path.exists(path):
        raise CheckpointError(f"{path}: destination is a symbolic link to {os.readlink(path)!r}, which does not "
                              f"exist")
    if os.path.isfile(path):
        raise CheckpointError(f"{path}: destination exists and is a file")
    if os.path.isdir(path):
        if os.listdir(path):
            raise CheckpointError(f"{path}: destination exists and is not empty")
        if not os.access(path, os.W_OK):
            raise CheckpointError(f"{path}: destination directory is not writable")
        return path
    parent = os.path.dirname(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise CheckpointError(f"{path}: cannot create it under {parent}, which is a file")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CheckpointError(f"{path}: cannot create it, {parent} is not writable")
    return path


@contextlib.contextmanager
def written_aside(path: str, replace: bool = False):
    """A new hidden sibling directory of ``path`` to write into, renamed to ``path`` (absent or an empty
    directory, as ``check_destination`` allows; with ``replace``, whatever directory is there is swapped
    out and removed) when the block ends. On any failure or interrupt it is removed, so ``path`` never
    holds half a checkpoint that later loads, or refuses, confusingly. A failure other than an interrupt
    becomes a CheckpointError naming ``path``."""
    parent, name = os.path.split(path)
    tmp = os.path.join(parent, f".{name}.partial-{uuid.uuid4().hex[:8]}")
    try:
        os.makedirs(tmp)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot create the destination ({e.strerror or e})") from None
    try:
        yield tmp
        if replace and os.path.isdir(path):
            old = os.path.join(parent, f".{name}.replaced-{uuid.uuid4().hex[:8]}")
            os.rename(path, old)
            os.rename(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, path)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, (CheckpointError, InputError)) or not isinstance(e, Exception):
            raise
        raise CheckpointError(f"{path}: could not write it, nothing was left there ({type(e).__name__}: "
                              f"{str(e)[:300]})") from e


def save_checkpoint(path: str, cfg: ModelConfig, params, tokenizer=None) -> None:
    import orbax.checkpoint as ocp

    path = check_destination(path)
    check_params(cfg, params, source="params to save")
    params = stack_layers(params)  # checkpoints hold the stacked layout, whatever layout was loaded
    dtype = str(jax.tree.leaves(params)[0].dtype)
    with written_aside(path) as tmp:
        with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
            json.dump({"config": cfg.to_dict(), "dtype": dtype}, f, indent=1)
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(os.path.join(tmp, "params"), params)
        if tokenizer is not None:
            tokenizer.save_pretrained(os.path.join(tmp, "tokenizer"))


def _read_meta(path: str) -> dict:
    try:
        with open(os.path.join(path, CONFIG_FILE), encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path}: unreadable {CONFIG_FILE} ({type(e).__name__}: {e})") from None
    if not isinstance(meta, dict) or "config" not in meta:
        raise CheckpointError(f"{path}: {CONFIG_FILE} has no 'config' object")
    return meta


def read_checkpoint_config(path: str) -> tuple[ModelConfig, str | None]:
    """(config, tokenizer directory or None) of a checkpoint, without reading the params."""
    path = os.path.abspath(path)
    cfg = ModelConfig.from_dict(_read_meta(path)["config"], source=os.path.join(path, CONFIG_FILE))
    tok_dir = os.path.join(path, "tokenizer")
    return cfg, (tok_dir if os.path.isdir(tok_dir) else None)


def restore_checkpoint(path: str, shardings=None, dtype=None):
    """Returns (cfg, params, tokenizer_dir or None). ``shardings``: a pytree of jax.sharding objects
    matching the params, a function cfg -> such a pytree (e.g. ``Parallel.param_shardings``: the
    mesh may differ from the one the checkpoint was saved from), or None for the default device."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(path)
    meta = _read_meta(path)
    cfg = ModelConfig.from_dict(meta["config"], source=os.path.join(path, CONFIG_FILE))
    try:
        dtype = np.dtype(dtype or meta.get("dtype", "float32"))
    except TypeError:
        raise CheckpointError(f"{path}: {CONFIG_FILE} names an unknown dtype {meta.get('dtype')!r}") from None
    specs = param_specs(cfg)
    if callable(shardings):
        shardings = shardings(cfg)
    if shardings is None:
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        shardings = jax.tree.map(lambda s: device, specs, is_leaf=is_param_spec)
    abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, dtype, sharding=sh),
                            specs, shardings, is_leaf=is_param_spec)
    try:
        with ocp.StandardCheckpointer() as ckptr:
            stored = ckptr.metadata(os.path.join(path, "params"))
            _check_stored_shapes(path, specs, getattr(stored, "item_metadata", stored))
            params = ckptr.restore(os.path.join(path, "params"), abstract)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types
        raise CheckpointError(f"{path}: cannot restore params ({type(e).__name__}: {e})") from None
    check_params(cfg, params, source=path)
    tok_dir = os.path.join(path, "tokenizer")
    return cfg, params, (tok_dir if os.path.isdir(tok_dir) else None)


def _leaf_names(tree, is_leaf=None) -> dict:
    return {".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]}


def _check_stored_shapes(path: str, specs, stored) -> None:
    """The stored params against the config's, from orbax's metadata before any tensor is read: every misfit
    named in one error (orbax's own says only that some requested shape differs from a stored one)."""
    want, have = _leaf_names(specs, is_param_spec), _leaf_names(stored)
    misfits = [f"{k}: missing" for k in sorted(want.keys() - have.keys())]
    misfits += [f"{k}: stored but not in the config" for k in sorted(have.keys() - want.keys())]
    misfits += [f"{k}: stored {tuple(have[k].shape)}, the config needs {tuple(want[k].shape)}"
                for k in sorted(want.keys() & have.keys())
                if getattr(have[k], "shape", None) is not None and tuple(have[k].shape) != tuple(want[k].shape)]
    if misfits:
        raise CheckpointError(f"{path}: the stored params do not fit {CONFIG_FILE}'s config "
                              f"({len(misfits)} misfit(s)): " + "; ".join(misfits))
