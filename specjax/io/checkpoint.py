"""Orbax checkpoints of converted params: config + params (+ tokenizer), restorable into any sharding."""

from __future__ import annotations

import json
import os

import jax
import numpy as np

from specjax.config import ModelConfig
from specjax.errors import CheckpointError
from specjax.models.params import check_params, is_param_spec, param_specs, stack_layers

CONFIG_FILE = "specjax_config.json"


def is_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, CONFIG_FILE))


def check_destination(path: str) -> str:
    """The absolute path if a checkpoint can be written there: a new or empty directory whose
    nearest existing ancestor is a writable directory. Checked before any expensive work."""
    path = os.path.abspath(path)
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


def save_checkpoint(path: str, cfg: ModelConfig, params, tokenizer=None) -> None:
    import orbax.checkpoint as ocp

    path = check_destination(path)
    check_params(cfg, params, source="params to save")
    params = stack_layers(params)  # checkpoints hold the stacked layout, whatever layout was loaded
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot create the destination ({e.strerror or e})") from None
    dtype = str(jax.tree.leaves(params)[0].dtype)
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump({"config": cfg.to_dict(), "dtype": dtype}, f, indent=1)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(path, "params"), params)
    if tokenizer is not None:
        tokenizer.save_pretrained(os.path.join(path, "tokenizer"))


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
            params = ckptr.restore(os.path.join(path, "params"), abstract)
    except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types
        raise CheckpointError(f"{path}: cannot restore params ({type(e).__name__}: {e})") from None
    check_params(cfg, params, source=path)
    tok_dir = os.path.join(path, "tokenizer")
    return cfg, params, (tok_dir if os.path.isdir(tok_dir) else None)
