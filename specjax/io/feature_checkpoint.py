"""Feature drafter checkpoints: the trained part of the network (``fc`` and its layer) as an orbax
checkpoint, beside ``feature_drafter.json`` (the FeatureConfig with the LLM's config it was trained
against, the drafting settings it ships with, and the storage dtype). The LLM's embedding, final norm
and head rows are not stored: they are bound from the LLM's own params at load time."""

from __future__ import annotations

import json
import os

import jax
import numpy as np

from specjax.errors import CheckpointError, InputError
from specjax.io.checkpoint import check_destination, written_aside
from specjax.io.registry import FEATURE_META_FILE
from specjax.models.feature import FeatureConfig
from specjax.models.params import is_param_spec, param_specs

META_FILE = FEATURE_META_FILE  # the registry finds shipped drafters by it
DRAFTING_KEYS = ("depth", "beam", "nodes", "ladder")
STORED_DTYPES = ("float16", "bfloat16", "float32")  # weights: an integer or bool dtype would restore as garbage


def is_feature_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, META_FILE))


def trained_shapes(cfg: FeatureConfig) -> dict:
    """{fc, layers: {name: shape}, out_norm} shapes of the trained params."""
    d = cfg.llm.hidden_size
    layers = param_specs(cfg.layer_config)["layers"]
    shapes = {"fc": (2 * d, d), "layers": jax.tree.map(lambda s: s.shape, layers, is_leaf=is_param_spec),
              "out_norm": (d,)}
    if cfg.fused:
        shapes.update(fuse=(len(cfg.fused) * d, d), fuse_norm=(len(cfg.raw_layers), d))
    return shapes


def unfinished_export_of(path: str, run_dir: str) -> bool:
    """Whether ``path`` holds a drafter that the training run in ``run_dir`` exported before it finished
    (``--stop-after``, ``--time-budget``): the run, resumed, may replace it with a later one."""
    try:
        with open(os.path.join(path, META_FILE), encoding="utf-8") as f:
            trained = json.load(f).get("trained") or {}
        steps = trained["steps"]
        return trained.get("run") == os.path.abspath(run_dir) and steps["done"] < steps["planned"]
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return False


def save_feature_drafter(path: str, cfg: FeatureConfig, trained: dict, drafting: dict, dtype: str = "float16",
                         extra: dict | None = None, replace_unfinished_of: str | None = None) -> None:
    """Write ``trained`` ({fc, layers, out_norm}) and the metadata to the new or empty directory ``path``
    (or over the unfinished export of the run in ``replace_unfinished_of``: ``unfinished_export_of``);
    written aside and renamed into place, so ``path`` never holds half a drafter."""
    import orbax.checkpoint as ocp

    if dtype not in STORED_DTYPES:
        raise InputError(f"a feature drafter is stored as one of {STORED_DTYPES}, got dtype={dtype!r}")
    replace = replace_unfinished_of is not None and unfinished_export_of(path, replace_unfinished_of)
    path = os.path.abspath(path) if replace else check_destination(path)
    _check_shapes(cfg, trained, f"{path}: params to save")
    if set(drafting) != set(DRAFTING_KEYS):
        raise InputError(f"drafting settings need exactly {DRAFTING_KEYS}, got {sorted(drafting)}")
    cast = jax.tree.map(lambda a: np.asarray(a, dtype), {k: trained[k] for k in cfg.trained_keys})
    with written_aside(path, replace=replace) as tmp:
        with open(os.path.join(tmp, META_FILE), "w") as f:
            json.dump({"config": cfg.to_dict(), "drafting": {k: (list(v) if isinstance(v, tuple) else v)
                                                              for k, v in drafting.items()},
                       "dtype": dtype, **(extra or {})}, f, indent=1)
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(os.path.join(tmp, "params"), cast)


def read_feature_meta(path: str) -> tuple[FeatureConfig, dict, dict]:
    """(FeatureConfig, drafting settings, the whole metadata) without reading the params."""
    file = os.path.join(os.path.abspath(path), META_FILE)
    try:
        with open(file, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(meta, dict) or not {"config", "drafting", "dtype"} <= set(meta):
        raise CheckpointError(f"{file}: expected keys config, drafting and dtype")
    if meta["dtype"] not in STORED_DTYPES:
        raise CheckpointError(f"{file}: 'dtype' must be one of {STORED_DTYPES} (how the params are stored), got "
                              f"{meta['dtype']!r}")
    cfg = FeatureConfig.from_dict(meta["config"], source=file)
    drafting = meta["drafting"]
    if not isinstance(drafting, dict) or set(drafting) != set(DRAFTING_KEYS):
        raise CheckpointError(f"{file}: 'drafting' needs exactly {DRAFTING_KEYS}")
    drafting = {k: (tuple(v) if isinstance(v, list) else v) for k, v in drafting.items()}
    return cfg, drafting, meta


def restore_feature_drafter(path: str, dtype="float32") -> tuple[FeatureConfig, dict, dict]:
    """(FeatureConfig, trained params {fc, layers, out_norm} in ``dtype``, drafting settings)."""
    import orbax.checkpoint as ocp

    cfg, drafting, meta = read_feature_meta(path)
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jax.numpy.dtype(meta["dtype"]), sharding=device),
                            trained_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    try:
        with ocp.StandardCheckpointer() as ckptr:
            trained = ckptr.restore(os.path.join(os.path.abspath(path), "params"), abstract)
    except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types
        raise CheckpointError(f"{path}: cannot restore the feature drafter's params ({type(e).__name__}: {e})") \
            from None
    trained = jax.tree.map(lambda a: jax.numpy.asarray(a, dtype), trained)
    _check_shapes(cfg, trained, path)
    return cfg, trained, drafting


def _check_shapes(cfg: FeatureConfig, trained: dict, source: str) -> None:
    want = trained_shapes(cfg)
    got = jax.tree.map(lambda a: tuple(a.shape), {k: trained.get(k) for k in cfg.trained_keys})
    if jax.tree.structure(got, is_leaf=lambda x: isinstance(x, tuple)) != \
            jax.tree.structure(want, is_leaf=lambda x: isinstance(x, tuple)) or got != want:
        raise CheckpointError(f"{source}: feature drafter params have shapes {got}, expected {want}")
