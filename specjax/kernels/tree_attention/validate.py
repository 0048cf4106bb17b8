"""Input validation shared by every tree-attention implementation, so all reject the same inputs."""

from __future__ import annotations

import jax
import numpy as np

from specjax.errors import InputError


def _concrete(x) -> np.ndarray | None:
    """The value of x if it is known on the host (not a tracer), else None."""
    if isinstance(x, jax.core.Tracer):
        return None
    return np.asarray(x)


def validate_tree_attention(q, k, v, lengths, num_mask_rows: int, mask_name: str, region: int | None = None) -> None:
    """q: [B, T, H, Dh]; k, v: [B, S, KVH, Dh]; lengths: [B]; the mask has num_mask_rows rows; the
    tree occupies ``region`` scratch slots (default T).

    Shapes are always checked; ``lengths + region <= S`` (prefix + tree fits the cache) is checked
    whenever the lengths are concrete, i.e. at validation time on the host.
    """
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise InputError(f"tree attention expects q [B, N, H, Dh] and k, v [B, S, KVH, Dh]; got ranks "
                         f"{q.ndim}, {k.ndim}, {v.ndim}")
    batch, num_nodes, heads, head_dim = q.shape
    if k.shape != v.shape:
        raise InputError(f"k shape {k.shape} != v shape {v.shape}")
    if k.shape[0] != batch or k.shape[3] != head_dim:
        raise InputError(f"k/v shape {k.shape} does not match q shape {q.shape} (batch, head_dim)")
    if k.shape[2] < 1:
        raise InputError(f"k/v shape {k.shape} has no KV heads")
    if heads % k.shape[2]:
        raise InputError(f"{heads} query heads are not a multiple of {k.shape[2]} KV heads")
    if lengths.shape != (batch,):
        raise InputError(f"lengths must have shape ({batch},), got {lengths.shape}")
    if not np.issubdtype(lengths.dtype, np.integer):  # a float length was truncated (Pallas) or failed unclearly
        raise InputError(f"lengths must be integers, got dtype {lengths.dtype}")
    if num_mask_rows != num_nodes:
        raise InputError(f"{mask_name} describes {num_mask_rows} nodes but q has {num_nodes} tree tokens")
    max_len = k.shape[1]
    region = num_nodes if region is None else region
    if region < num_nodes:
        raise InputError(f"{num_nodes} query tokens but a tree region of only {region} slots")
    num_nodes = region
    if num_nodes > max_len:
        raise InputError(f"tree of {num_nodes} nodes does not fit a cache of {max_len} slots")
    concrete = _concrete(lengths)
    if concrete is not None:
        if (concrete < 0).any():
            raise InputError(f"negative committed length in {concrete.tolist()}")
        over = np.nonzero(concrete + num_nodes > max_len)[0]
        if over.size:
            b = int(over[0])
            raise InputError(f"request {b}: prefix {int(concrete[b])} + tree {num_nodes} = "
                             f"{int(concrete[b]) + num_nodes} exceeds the cache size {max_len}")
