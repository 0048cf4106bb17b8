"""``Parallel``: a mesh plus the rules for the LLM and for the SSMs, passed (static) to generation.

It produces NamedShardings for params, caches and per-request arrays, places host data on the mesh
(also across processes), and tells the model how to run its layers: ``pp > 1`` -> the shard_map
pipeline (``specjax.sharding.pipeline``), otherwise one scan under GSPMD.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from specjax.config import ModelConfig
from specjax.errors import ShardingError
from specjax.models.cache import CACHE_AXES, LENGTH_AXES, KVCache
from specjax.models.params import is_param_spec, layers_split, param_specs
from specjax.sharding.mesh import MeshShape, make_mesh, mesh_shape
from specjax.sharding.pipeline import pipeline_layers
from specjax.sharding.rules import ShardingRules

SCHEDULES = ("pipeline", "sequential")


@dataclasses.dataclass(frozen=True)
class Parallel:
    """mesh: axes ("pp", "dp", "tp"); rules: the LLM's; ssm_rules: the SSMs' (replicated weights,
    requests over dp). microbatches: request groups in flight in the pipeline (None = pp).
    schedule: "pipeline" (shard_map + ppermute when pp > 1) or "sequential" (the same sharded
    weights run as one scan; XLA moves whatever it needs: the reference the pipeline is tested against)."""

    mesh: Mesh
    rules: ShardingRules = ShardingRules()
    ssm_rules: ShardingRules = ShardingRules.replicated_model()
    microbatches: int | None = None
    schedule: str = "pipeline"  # or "sequential": one GSPMD scan over the pp-split layers (the reference)

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ShardingError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.pp > 1 and self.rules.layers != "pp":
            raise ShardingError(f"a mesh with pp={self.pp} pipelines the layers: rules.layers must be 'pp', "
                                f"got {self.rules.layers!r}")
        if self.rules.batch not in (None, "dp"):  # the pipeline splits requests over dp only
            raise ShardingError(f"rules.batch must be 'dp' or None, got {self.rules.batch!r}")
        if self.microbatches is not None and (isinstance(self.microbatches, bool) or self.microbatches < 1):
            raise ShardingError(f"microbatches must be a positive int, got {self.microbatches!r}")
        if self.microbatches is not None and self.pp == 1:
            raise ShardingError(f"microbatches={self.microbatches} splits a pipeline's batch, but this mesh has "
                                f"pp=1 (nothing is pipelined)")

    @classmethod
    def create(cls, shape: MeshShape | str, devices=None, **kwargs) -> "Parallel":
        return cls(make_mesh(shape, devices), **kwargs)

    @property
    def shape(self) -> MeshShape:
        return mesh_shape(self.mesh)

    @property
    def pipelined(self) -> bool:
        return self.pp > 1 and self.schedule == "pipeline"

    @property
    def one_pass_per_call(self) -> bool:
        """Whether a decoding loop on this mesh must run one LLM pass per program call: a pipelined
        mesh (``pipelined``) with more than one CPU device in this process.

        Why: XLA:CPU ran a loop of several pipelined passes in one program wrongly there. SmolLM2 on
        an in-process pp=2 mesh gave another token at the 5th pass whenever that pass was the 3rd or a
        later iteration of one program's loop, from a state bit for bit equal to the one a single-pass
        call decoded correctly; multi-pass chunks also hung in a collective. The same programs were
        right with the sequential schedule, with one device per process (two processes, pp=2), on
        tp- and dp-only meshes, and pinned to one core (``taskset -c 0``), which points at XLA:CPU's
        in-process multi-device execution (most likely a race), not the program's semantics (stop 65; see
        ``tests/test_smollm2.py``). ``specjax.generate`` drives such meshes one pass per call; a caller
        jitting a whole loop itself (``generate_speculative``, ``generate_incremental``) is warned."""
        if not self.pipelined:
            return False
        here = [d for d in self.mesh.devices.flat if d.process_index == jax.process_index()]
        return len(here) > 1 and all(d.platform == "cpu" for d in here)

    def warn_multi_pass(self, what: str) -> None:
        """Warn (at trace time) that ``what`` puts several LLM passes in one program where
        ``one_pass_per_call`` holds."""
        if self.one_pass_per_call:
            warnings.warn(f"specjax: {what} runs several pipelined LLM passes in one program on a mesh of several "
                          f"CPU devices in this process, which XLA:CPU computed wrongly (another token at a later "
                          f"pass; see Parallel.one_pass_per_call): step one pass per call, as specjax.generate "
                          f"does, or run one process per device", RuntimeWarning, stacklevel=3)

    @property
    def pp(self) -> int:
        return self.shape.pp

    @property
    def dp(self) -> int:
        return self.shape.dp

    @property
    def request_axis(self) -> str | None:
        """The mesh axis the requests are split over ("dp"), or None when they are not split."""
        return self.rules.batch if self.dp > 1 else None

    @property
    def replicas(self) -> int:
        """How many dp replicas share the requests (each pipelines its own)."""
        return self.dp if self.request_axis else 1

    def per_replica(self, requests: int) -> int:
        """The requests each dp replica gets of a batch of ``requests`` (rounded up)."""
        return -(-requests // self.replicas)

    def groups_for(self, requests: int) -> int:
        """Pipeline request groups per replica for a batch of ``requests``: ``microbatches``, or pp but never
        more than the replica's requests (a single request on pp=4 ran as 4 groups, 3 of them padding, over 7
        ticks instead of 4); 1 when nothing is pipelined."""
        return (self.microbatches or min(self.pp, self.per_replica(requests))) if self.pipelined else 1

    def padding_for(self, requests: int) -> int:
        """Inert requests to add to a batch of ``requests`` so it splits over dp and the microbatches.

        An explicit ``microbatches`` larger than the requests each dp replica gets is refused: the
        extra groups would hold nothing but padding (1000 microbatches would turn one prompt into
        1000 requests)."""
        per_replica = self.per_replica(requests)
        if self.pipelined and self.microbatches is not None and self.microbatches > per_replica:
            raise ShardingError(f"microbatches={self.microbatches} exceeds the {per_replica} request(s) per dp replica "
                                f"of this batch of {requests}; use at most {per_replica} microbatches (CLI: "
                                f"--microbatches, at most --batch-size / dp)")
        return (-requests) % (self.replicas * self.groups_for(requests))

    def num_microbatches(self, local_batch: int) -> int:
        """Request groups for one dp replica's ``local_batch`` requests: ``microbatches`` or pp."""
        groups = self.microbatches or min(self.pp, local_batch)
        if local_batch % groups:
            replicas = self.replicas
            raise ShardingError(f"a batch of {local_batch * replicas} requests ({local_batch} per dp replica) does "
                                f"not split into {groups} pipeline microbatches per replica; pad the batch to a "
                                f"multiple of {replicas * groups} or set microbatches")
        return groups

    def validate(self, cfg: ModelConfig, batch: int, ssm_configs=()) -> None:
        """Raise ShardingError now (naming the leaf) for anything the mesh cannot split."""
        self.param_shardings(cfg)
        self.cache_shardings(cfg, batch, 1)
        for scfg in ssm_configs:
            self.param_shardings(scfg, self.ssm_rules)
        self.batch_sharding((batch,), "batch")
        if self.pipelined:  # each dp replica cuts its own requests into microbatches
            self.num_microbatches(batch // self.replicas)

    def _named(self, axes, shape, leaf, rules) -> NamedSharding:
        return NamedSharding(self.mesh, rules.partition_spec(tuple(axes), tuple(shape), self.mesh, leaf))

    def param_shardings(self, cfg: ModelConfig, rules: ShardingRules | None = None):
        """Pytree of NamedSharding matching the params of ``cfg``."""
        rules = rules or self.rules
        flat, treedef = jax.tree_util.tree_flatten_with_path(param_specs(cfg), is_leaf=is_param_spec)
        out = [self._named(s.axes, s.shape, f"param {jax.tree_util.keystr(p)}", rules) for p, s in flat]
        return jax.tree.unflatten(treedef, out)

    def cache_shardings(self, cfg: ModelConfig, batch: int, max_len: int, rules: ShardingRules | None = None):
        rules = rules or self.rules
        shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
        kv = self._named(CACHE_AXES, shape, "cache k/v", rules)
        return KVCache(k=kv, v=kv, length=self._named(LENGTH_AXES, (batch,), "cache length", rules))

    def batch_sharding(self, shape: tuple, leaf: str = "batch array") -> NamedSharding:
        """Requests (leading axis) over dp, everything else replicated."""
        axes = ("batch",) + (None,) * (len(shape) - 1)
        return self._named(axes, shape, leaf, self.rules)

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def constrain_batch(self, tree):
        """Inside jit: pin per-request arrays (leading axis = batch) over dp, as ``put_batch`` places them.
        The decoding step's outputs come out so; a state created otherwise (zeros, replicated by XLA) made
        a chunk program compiled for the prefill's output compile again for its own. A scalar (no batch
        axis, e.g. one ``max_new_tokens`` for every request) is replicated."""
        return jax.lax.with_sharding_constraint(tree, jax.tree.map(
            lambda x: self.batch_sharding(x.shape) if np.ndim(x) else self.replicated(), tree))

    def constrain_cache(self, cache: KVCache, cfg: ModelConfig, rules: ShardingRules | None = None) -> KVCache:
        """Inside jit: pin a freshly created cache to its sharding (stage-local layers, split KV heads)."""
        shardings = self.cache_shardings(cfg, cache.batch, cache.max_len, rules)
        return jax.lax.with_sharding_constraint(cache, shardings)

    def run_pipeline(self, layer_fn, h, layer_params, cache, per_request, capture_layers=(), logits_indices=None):
        """The model's layers as pipeline stages over "pp" (``specjax.models.layers.run_layers`` calls this)."""
        return pipeline_layers(layer_fn, h, layer_params, cache, per_request, self, capture_layers, logits_indices)

    def put(self, tree, shardings):
        """Place host or device arrays on the mesh; with several processes each one passes the same
        full values and keeps only its own shards."""
        if jax.process_count() == 1:
            return jax.device_put(tree, shardings)

        def place(x, sharding):
            if isinstance(x, jax.Array) and x.sharding == sharding:
                return x
            if isinstance(x, jax.Array) and not x.is_fully_addressable:  # already global: reshard on device
                return jax.jit(lambda a: a, out_shardings=sharding)(x)
            host = np.asarray(x)
            return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

        return jax.tree.map(place, tree, shardings)

    def put_params(self, params, cfg: ModelConfig, rules: ShardingRules | None = None):
        """Params on the mesh under the rules, which (like the pipeline stages) are written for stacked layer
        weights: split ones (``specjax.models.params.split_layers``) are refused, not restacked behind the
        caller's back (a full copy of the layers on one device)."""
        if layers_split(params):
            raise ShardingError("split layer weights (load_model's default on one CPU device) run on one device; load "
                                "the model stacked to place it on a mesh: load_model(..., parallel=) or "
                                "load_model(..., split_layers=False)")
        return self.put(params, self.param_shardings(cfg, rules))

    def put_batch(self, tree):
        """Per-request arrays (leading axis = batch) over dp."""
        return self.put(tree, jax.tree.map(lambda x: self.batch_sharding(np.shape(x)), tree))

    def fetch(self, x) -> np.ndarray:
        """The full value of a (possibly multi-process) array, as numpy on every process."""
        if x.is_fully_addressable:
            return np.asarray(jax.device_get(x))
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
