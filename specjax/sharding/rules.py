"""One rules object mapping the logical axes declared on every leaf to mesh axes.

Every parameter (``specjax.models.param_specs``) and cache leaf (``specjax.cache.CACHE_AXES``)
names its dimensions with logical axes; ``ShardingRules`` says which mesh axis each logical axis
is split over. Switching TP-only <-> TP x PP changes this object, never the model code. There is no
catch-all: a logical axis without a rule, two logical axes on one mesh axis, or a size the mesh axis
does not divide raises ``ShardingError`` naming the leaf.
"""

from __future__ import annotations

import dataclasses

from jax.sharding import Mesh, PartitionSpec

from specjax.errors import ShardingError
from specjax.sharding.mesh import AXES

LOGICAL_AXES = ("layers", "batch", "heads", "kv_heads", "mlp", "vocab", "embed", "embed_out", "head_dim",
                "seq", "positions")
KV_FALLBACKS = ("replicate", "error")


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """logical axis -> mesh axis (None = replicated).

    Defaults: layers over the pipeline, requests over dp, heads / KV heads / MLP hidden / vocabulary
    over tp (Megatron-style: column-parallel q/k/v/gate/up, row-parallel o/down). ``kv_fallback``:
    what to do when tp does not divide the KV heads (GQA/MQA with fewer KV heads than tensor shards):
    "replicate" keeps every KV head on every tensor shard, "error" refuses.
    """

    layers: str | None = "pp"
    batch: str | None = "dp"
    heads: str | None = "tp"
    kv_heads: str | None = "tp"
    mlp: str | None = "tp"
    vocab: str | None = "tp"
    embed: str | None = None
    embed_out: str | None = None
    head_dim: str | None = None
    seq: str | None = None
    positions: str | None = None
    kv_fallback: str = "replicate"

    def __post_init__(self):
        for logical in LOGICAL_AXES:
            target = getattr(self, logical)
            if target is not None and target not in AXES:
                raise ShardingError(f"sharding rule {logical}={target!r}: mesh axes are {AXES} or None")
        if self.kv_fallback not in KV_FALLBACKS:
            raise ShardingError(f"kv_fallback must be one of {KV_FALLBACKS}, got {self.kv_fallback!r}")

    @classmethod
    def replicated_model(cls) -> "ShardingRules":
        """Every weight on every device, requests over dp: how SSMs are served (data-parallel)."""
        return cls(layers=None, heads=None, kv_heads=None, mlp=None, vocab=None)

    def mesh_axis(self, logical: str, leaf: str) -> str | None:
        if logical not in LOGICAL_AXES:
            raise ShardingError(f"{leaf}: no sharding rule for logical axis {logical!r} (known: {LOGICAL_AXES})")
        return getattr(self, logical)

    def partition_spec(self, axes: tuple, shape: tuple, mesh: Mesh, leaf: str) -> PartitionSpec:
        """The PartitionSpec of one leaf with logical ``axes`` and ``shape``; ``leaf`` names it in errors."""
        if len(axes) != len(shape):
            raise ShardingError(f"{leaf}: {len(axes)} logical axes {axes} for shape {shape}")
        spec, used = [], {}
        for dim, (logical, size) in enumerate(zip(axes, shape)):
            target = None if logical is None else self.mesh_axis(logical, leaf)
            if target is None:
                spec.append(None)
                continue
            if target in used:
                raise ShardingError(f"{leaf}: logical axes {used[target]!r} and {logical!r} both map to mesh axis "
                                    f"{target!r}")
            shards = int(mesh.shape.get(target, 1))
            if size % shards:
                if logical == "kv_heads" and self.kv_fallback == "replicate":
                    spec.append(None)  # every tensor shard keeps all KV heads; queries stay split
                    continue
                raise ShardingError(f"{leaf}: dimension {dim} ({logical}) has size {size}, which mesh axis "
                                    f"{target!r} of size {shards} does not divide{_hint(logical)}")
            used[target] = logical
            spec.append(target if shards > 1 else None)  # a size-1 axis splits nothing: keep specs readable
        return PartitionSpec(*spec)


def _hint(logical: str) -> str:
    if logical == "heads":
        return ("; keep attention heads whole on every tensor shard (CLI: --replicate-attention; Python: "
                "ShardingRules(heads=None, kv_heads=None)), which splits only the MLP and vocabulary, or choose a tp "
                "that divides the head count")
    if logical == "layers":
        return "; choose a pp that divides the layer count"
    if logical == "batch":
        return "; pad the batch to a multiple of dp"
    if logical in ("vocab", "mlp"):  # no CLI flag: a model whose sizes tp cannot split is rare enough
        return (f"; choose a tp that divides it, or keep that dimension whole on every tensor shard (Python: "
                f"ShardingRules({logical}=None))")
    return ""
