"""Device meshes with the named axes ("pp", "dp", "tp").

``pp``: pipeline stages (contiguous layer groups; across nodes), ``dp``: replicas of the batch (and
the data-parallel SSMs), ``tp``: tensor parallelism (heads, MLP hidden, vocabulary; inside a node).
Devices are laid out in ``jax.devices()`` order with ``pp`` outermost, so that with several
processes (hosts) the pipeline axis runs across them and ``tp`` stays inside one process.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh

from specjax.errors import ShardingError

AXES = ("pp", "dp", "tp")


@dataclasses.dataclass(frozen=True)
class MeshShape:
    pp: int = 1
    dp: int = 1
    tp: int = 1

    def __post_init__(self):
        for name in AXES:
            size = getattr(self, name)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ShardingError(f"mesh axis {name!r} must be a positive int, got {size!r}")

    @property
    def size(self) -> int:
        return self.pp * self.dp * self.tp

    @classmethod
    def parse(cls, text: str) -> "MeshShape":
        """``"pp=2,tp=4"`` (axes left out have size 1)."""
        sizes = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, sep, value = part.partition("=")
            name = name.strip()
            if not sep or name not in AXES or not value.strip().isdigit():
                raise ShardingError(f"mesh {text!r}: expected comma-separated AXIS=SIZE with AXIS in {AXES}, "
                                    f"got {part!r}")
            if name in sizes:
                raise ShardingError(f"mesh {text!r}: axis {name!r} given twice")
            sizes[name] = int(value)
        return cls(**sizes)

    def __str__(self) -> str:
        return ",".join(f"{a}={getattr(self, a)}" for a in AXES)


def make_mesh(shape: MeshShape | str = MeshShape(), devices=None) -> Mesh:
    """A Mesh of exactly ``shape.size`` devices (all of ``jax.devices()`` by default)."""
    shape = MeshShape.parse(shape) if isinstance(shape, str) else shape
    devices = list(jax.devices() if devices is None else devices)
    if shape.size > len(devices):
        hint = (" (on CPU, simulate more with JAX_NUM_CPU_DEVICES, set before jax is imported)"
                if devices and devices[0].platform == "cpu" else "")
        raise ShardingError(f"mesh {shape} needs {shape.pp} x {shape.dp} x {shape.tp} = {shape.size} devices, "
                            f"but only {len(devices)} are available{hint}")
    if shape.size < len(devices):
        raise ShardingError(f"mesh {shape} uses {shape.size} of the {len(devices)} devices; a mesh must use every "
                            f"device (e.g. add dp={len(devices) // shape.size} to replicate it"
                            f"{'' if len(devices) % shape.size == 0 else ', once the count divides'})")
    grid = np.empty(len(devices), dtype=object)
    grid[:] = devices
    return Mesh(grid.reshape(shape.pp, shape.dp, shape.tp), AXES)


def mesh_shape(mesh: Mesh) -> MeshShape:
    return MeshShape(**{a: int(mesh.shape.get(a, 1)) for a in AXES})
