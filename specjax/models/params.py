"""Parameter layout: one table of (shape, logical axes) per family.

The same table drives random init (tests), checkpoint loading (every shape is asserted against it)
and sharding (logical axes -> mesh axes). Per-layer weights are stacked on a leading "layers" axis
so the forward pass can scan over it and pipeline stages can split it; ``split_layers`` gives the
split layout (a tuple of per-layer dicts) whose buffers the forward reads in place (see the note
at the end).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig
from specjax.errors import CheckpointError


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    axes: tuple[str, ...]  # logical axis names, one per dim
    init: str = "normal"  # "normal" | "ones" | "zeros"

    def __post_init__(self):
        assert len(self.shape) == len(self.axes), (self.shape, self.axes)


def _llama_specs(c: ModelConfig) -> dict:
    L, D, H, K, Dh, F, V = (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                            c.intermediate_size, c.embed_rows)
    layers = {
        "attn_norm": ParamSpec((L, D), ("layers", "embed"), "ones"),
        "wq": ParamSpec((L, D, H, Dh), ("layers", "embed", "heads", "head_dim")),
        "wk": ParamSpec((L, D, K, Dh), ("layers", "embed", "kv_heads", "head_dim")),
        "wv": ParamSpec((L, D, K, Dh), ("layers", "embed", "kv_heads", "head_dim")),
        "wo": ParamSpec((L, H, Dh, D), ("layers", "heads", "head_dim", "embed")),
        "mlp_norm": ParamSpec((L, D), ("layers", "embed"), "ones"),
        "w_gate": ParamSpec((L, D, F), ("layers", "embed", "mlp")),
        "w_up": ParamSpec((L, D, F), ("layers", "embed", "mlp")),
        "w_down": ParamSpec((L, F, D), ("layers", "mlp", "embed")),
    }
    if c.attention_bias:
        layers.update({
            "bq": ParamSpec((L, H, Dh), ("layers", "heads", "head_dim"), "normal"),
            "bk": ParamSpec((L, K, Dh), ("layers", "kv_heads", "head_dim"), "normal"),
            "bv": ParamSpec((L, K, Dh), ("layers", "kv_heads", "head_dim"), "normal"),
            "bo": ParamSpec((L, D), ("layers", "embed"), "normal"),
        })
    if c.mlp_bias:
        layers.update({
            "b_gate": ParamSpec((L, F), ("layers", "mlp")),
            "b_up": ParamSpec((L, F), ("layers", "mlp")),
            "b_down": ParamSpec((L, D), ("layers", "embed")),
        })
    specs = {
        "embed": ParamSpec((V, D), ("vocab", "embed")),
        "layers": layers,
        "final_norm": ParamSpec((D,), ("embed",), "ones"),
    }
    if not c.tie_word_embeddings:
        specs["lm_head"] = ParamSpec((D, V), ("embed", "vocab"))
    return specs


def _opt_specs(c: ModelConfig) -> dict:
    L, D, H, Dh, F, V, E = (c.num_layers, c.hidden_size, c.num_heads, c.head_dim, c.intermediate_size,
                            c.vocab_size, c.embed_dim)
    layers = {
        "attn_norm_scale": ParamSpec((L, D), ("layers", "embed"), "ones"),
        "attn_norm_bias": ParamSpec((L, D), ("layers", "embed"), "zeros"),
        "wq": ParamSpec((L, D, H, Dh), ("layers", "embed", "heads", "head_dim")),
        "wk": ParamSpec((L, D, H, Dh), ("layers", "embed", "kv_heads", "head_dim")),
        "wv": ParamSpec((L, D, H, Dh), ("layers", "embed", "kv_heads", "head_dim")),
        "wo": ParamSpec((L, H, Dh, D), ("layers", "heads", "head_dim", "embed")),
        "mlp_norm_scale": ParamSpec((L, D), ("layers", "embed"), "ones"),
        "mlp_norm_bias": ParamSpec((L, D), ("layers", "embed"), "zeros"),
        "fc1": ParamSpec((L, D, F), ("layers", "embed", "mlp")),
        "fc2": ParamSpec((L, F, D), ("layers", "mlp", "embed")),
    }
    if c.enable_bias:
        layers.update({
            "bq": ParamSpec((L, H, Dh), ("layers", "heads", "head_dim")),
            "bk": ParamSpec((L, H, Dh), ("layers", "kv_heads", "head_dim")),
            "bv": ParamSpec((L, H, Dh), ("layers", "kv_heads", "head_dim")),
            "bo": ParamSpec((L, D), ("layers", "embed")),
            "fc1_bias": ParamSpec((L, F), ("layers", "mlp")),
            "fc2_bias": ParamSpec((L, D), ("layers", "embed")),
        })
    specs = {
        "embed": ParamSpec((V, E), ("vocab", "embed")),
        "pos_embed": ParamSpec((c.max_position_embeddings + c.position_offset, D), ("positions", "embed")),
        "layers": layers,
    }
    if c.has_projections:
        specs["project_in"] = ParamSpec((E, D), ("embed", "embed_out"))
        specs["project_out"] = ParamSpec((D, E), ("embed_out", "embed"))
    if c.final_layer_norm:
        specs["final_norm_scale"] = ParamSpec((D,), ("embed",), "ones")
        specs["final_norm_bias"] = ParamSpec((D,), ("embed",), "zeros")
    if not c.tie_word_embeddings:
        specs["lm_head"] = ParamSpec((E, V), ("embed", "vocab"))
    return specs


def param_specs(cfg: ModelConfig) -> dict:
    """Nested dict of ParamSpec mirroring the params pytree."""
    return _llama_specs(cfg) if cfg.family == "llama" else _opt_specs(cfg)


def is_param_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def param_logical_axes(cfg: ModelConfig) -> dict:
    """The params pytree with every leaf replaced by its tuple of logical axis names."""
    return jax.tree.map(lambda s: s.axes, param_specs(cfg), is_leaf=is_param_spec)


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, scale: float = 0.02) -> dict:
    """Random parameters (for tests and freshly initialised SSMs)."""
    specs = param_specs(cfg)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_param_spec)
    keys = jax.random.split(key, len(leaves))
    out = []
    for spec, k in zip(leaves, keys):
        if spec.init == "ones":
            # Perturbed around 1 so that tests notice a norm weight applied to the wrong axis.
            out.append((1.0 + 0.1 * jax.random.normal(k, spec.shape)).astype(dtype))
        elif spec.init == "zeros":
            out.append((0.1 * jax.random.normal(k, spec.shape)).astype(dtype))
        else:
            out.append((scale * jax.random.normal(k, spec.shape)).astype(dtype))
    return jax.tree.unflatten(treedef, out)


def check_params(cfg: ModelConfig, params: dict, source: str = "params") -> None:
    """Assert that ``params`` has exactly the leaves and shapes of the spec table."""

    specs = param_specs(cfg)
    if layers_split(params):
        if len(params["layers"]) != cfg.num_layers:
            raise CheckpointError(f"{source}: {len(params['layers'])} layers, expected {cfg.num_layers}")
        per_layer = jax.tree.map(lambda s: ParamSpec(s.shape[1:], s.axes[1:], s.init), specs["layers"],
                                 is_leaf=is_param_spec)
        specs = {**specs, "layers": (_fused_specs(per_layer),) * cfg.num_layers}
        if cfg.tie_word_embeddings:
            specs[TIED_HEAD] = ParamSpec(specs["embed"].shape[::-1], specs["embed"].axes[::-1])
    flat_specs = {jax.tree_util.keystr(p): s for p, s in
                  jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_param_spec)[0]}
    flat_params = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    for name in flat_specs.keys() - flat_params.keys():
        raise CheckpointError(f"{source}: parameter {name} is missing")
    for name in flat_params.keys() - flat_specs.keys():
        raise CheckpointError(f"{source}: unexpected parameter {name}")
    for name, spec in flat_specs.items():
        shape = tuple(np.shape(flat_params[name]))
        if shape != spec.shape:
            raise CheckpointError(f"{source}: parameter {name} has shape {shape}, expected {spec.shape}")


# Two layouts of the same per-layer weights. *Stacked*: one array per weight with a leading layer
# axis (the spec table above; training, checkpoints, sharding and the pipeline use it): the forward
# scans over it. *Split*: a tuple of per-layer dicts, one buffer per layer and weight: the forward
# still scans, and each matmul switches to its layer's buffer (specjax.models.weights). On XLA:CPU
# a scanned layer first copies its weights out of the stacked buffers (a dynamic slice becomes a
# copy, ~424 MB per pass for SmolLM2), which makes a one-token pass ~1.5x as long as the same pass
# over split weights (scripts/bench_layer_layout.py); the switched matmuls cost compile time
# instead (unrolling the layers, the earlier way, took 12-15 s per pass program).
#
# The split layout also fuses the matmuls that read the same input (FUSED): q, k and v into one
# weight, the gate and up projections into another, concatenated on their output axis (axis 1 of a
# layer's weight). A decode step is a chain of GEMVs whose small ones pay a fixed cost each; on a
# 2-core Xeon, 30 SmolLM2 layers of switched GEMVs took 21.1 ms as 7 matmuls per layer and 18.3 ms
# as 4 (and compiled in 1.1 s instead of 1.9). Stacked params keep them apart: a mesh shards q and
# k/v heads separately.
FUSED = (("wqkv", ("wq", "wk", "wv")), ("w_gate_up", ("w_gate", "w_up")))


def _fused_specs(per_layer: dict) -> dict:
    """One split layer's specs: each FUSED group's parts replaced by their concatenation on axis 1."""
    out = dict(per_layer)
    for fused, parts in FUSED:
        if all(p in out for p in parts):
            specs = [out.pop(p) for p in parts]
            shape = specs[0].shape[:1] + (sum(s.shape[1] for s in specs),) + specs[0].shape[2:]
            out[fused] = ParamSpec(shape, specs[0].axes)
    return out


# The split layout (one CPU device) also keeps a tied model's head as a transposed copy of the
# embedding, [D, V] like an untied ``lm_head``: the logits then contract the weight's leading axis as
# every other matmul does. Read as [V, D] (contracting its minor axis) the head of SmolLM2 took
# 4.4 ms at 2-3 rows with YNNPACK and 106 ms with Eigen (XLA:CPU's two matmul libraries, see
# ``specjax.decoding.programs``), against 2.9 ms from the copy; it costs the embedding's memory once
# more (113 MB for SmolLM2 in float32). Derived, never saved: ``stack_layers`` drops it.
TIED_HEAD = "embed_t"

# The step programs' (``specjax.decoding.programs.step_params``) copy of the head for greedy decisions,
# a ``specjax.kernels.cpu.greedy_head.GreedyHead``: float16 panels, never in a model's params.
GREEDY_HEAD = "greedy_head"


def layers_split(params: dict) -> bool:
    """Whether ``params["layers"]`` is the split layout (a tuple of per-layer dicts)."""
    return isinstance(params.get("layers"), (tuple, list))


def fuse_layer(lp: dict) -> dict:
    """One layer's weights with the FUSED groups concatenated (numpy in, numpy out)."""
    out = dict(lp)
    for fused, parts in FUSED:
        if all(p in out for p in parts):
            arrays = [out.pop(p) for p in parts]
            xp = np if all(isinstance(a, np.ndarray) for a in arrays) else jnp
            out[fused] = xp.concatenate(arrays, axis=1)
    return out


def unfuse_layer(lp: dict) -> dict:
    """``fuse_layer`` undone: q takes as many heads as the output projection reads, k and v half the rest
    each; gate and up half each. Works on one layer ([D, ...]) or stacked layers ([L, D, ...]): the
    output axis is the one after "embed", axis -2 of wqkv and -1 of w_gate_up."""
    out = dict(lp)
    if "wqkv" in out:
        wqkv = out.pop("wqkv")
        heads = out["wo"].shape[-3]
        kv = (wqkv.shape[-2] - heads) // 2
        out["wq"], out["wk"], out["wv"] = (wqkv[..., :heads, :], wqkv[..., heads:heads + kv, :],
                                           wqkv[..., heads + kv:, :])
    if "w_gate_up" in out:
        gate_up = out.pop("w_gate_up")
        half = gate_up.shape[-1] // 2
        out["w_gate"], out["w_up"] = gate_up[..., :half], gate_up[..., half:]
    return out


def split_layers(params: dict) -> dict:
    """The same params with "layers" as a tuple of per-layer dicts, FUSED groups concatenated (a no-op
    when already split). Numpy leaves are sliced as views (fused ones copied); device arrays are copied
    once per layer."""
    if layers_split(params):
        return params
    stacked = params["layers"]
    count = jax.tree.leaves(stacked)[0].shape[0]
    out = {**params, "layers": tuple(fuse_layer(jax.tree.map(lambda a, i=i: a[i], stacked)) for i in range(count))}
    if "lm_head" not in params:  # tied: the head's own [D, V] copy (TIED_HEAD)
        embed = params["embed"]
        out[TIED_HEAD] = np.ascontiguousarray(embed.T) if isinstance(embed, np.ndarray) else jnp.asarray(embed.T)
    return out


def stack_layers(params: dict) -> dict:
    """The same params with "layers" stacked on a leading axis (a no-op when already stacked)."""
    if not layers_split(params):
        return params
    if not params["layers"]:
        raise CheckpointError("params['layers'] is an empty tuple: a model needs at least one layer")
    out = {k: v for k, v in params.items() if k != TIED_HEAD}
    return {**out, "layers": take_layers(params, range(len(params["layers"])))}


def llm_weights_digest(params: dict, values_per_tensor: int = 4096) -> str:
    """A sha256 of evenly strided values (at most ``values_per_tensor``) of every weight, with its name,
    shape and dtype, the same in either layout: names the weights a corpus or its features came from
    (a fine-tune keeps the config and tokenizer but moves every weight it trains). Only the samples leave
    the device."""
    import hashlib

    def on_host(a):
        if isinstance(a, jax.Array) and a.is_fully_addressable and all(d.platform == "cpu" for d in a.devices()):
            return np.asarray(a)  # host memory already: a view, no copy (numpy slices it without dispatches)
        return a

    def sample(a) -> np.ndarray:
        step = max(1, a.size // values_per_tensor)
        if isinstance(a, np.ndarray):
            return np.ravel(a)[::step]  # ravel copies only a non-contiguous slice (one layer's part)
        return np.asarray(jax.device_get(jnp.ravel(a)[::step]))

    params = jax.tree.map(on_host, params)
    digest = hashlib.sha256()

    def add(name: str, a) -> None:
        digest.update(f"{name}{tuple(a.shape)}{np.dtype(a.dtype).name};".encode())
        digest.update(np.ascontiguousarray(sample(a)).tobytes())

    for name in sorted(k for k in params if k not in ("layers", TIED_HEAD)):
        add(name, params[name])
    split = layers_split(params)
    count = len(params["layers"]) if split else jax.tree.leaves(params["layers"])[0].shape[0]
    for i in range(count):
        layer = unfuse_layer(params["layers"][i]) if split else {k: v[i] for k, v in params["layers"].items()}
        for name in sorted(layer):
            add(f"layers.{i}.{name}", layer[name])
    return digest.hexdigest()


def take_layers(params: dict, idx) -> dict:
    """The weights of layers ``idx`` stacked on a leading axis, from either layout (SSMs cut from an
    LLM's layers; ``stack_layers``)."""
    idx = [int(i) for i in idx]
    if layers_split(params):
        picked = [params["layers"][i] for i in idx]
        xp = np if all(isinstance(a, np.ndarray) for a in jax.tree.leaves(picked)) else jnp
        return unfuse_layer(jax.tree.map(lambda *a: xp.stack(a), *picked))
    return jax.tree.map(lambda a: a[np.asarray(idx)], params["layers"])
