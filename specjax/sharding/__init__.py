"""Sharding: meshes ("pp", "dp", "tp"), logical-axis rules, the layer pipeline, multi-host init.

    parallel = Parallel.create("pp=2,tp=4")          # 8 devices
    params = parallel.put_params(params, cfg)        # NamedShardings from the logical axes
    specjax.generate(model, prompts, parallel=parallel)
"""

from specjax.sharding.mesh import AXES, MeshShape, make_mesh, mesh_shape
from specjax.sharding.parallel import Parallel
from specjax.sharding.rules import LOGICAL_AXES, ShardingRules

__all__ = ["AXES", "LOGICAL_AXES", "MeshShape", "Parallel", "ShardingRules", "make_mesh", "mesh_shape"]
