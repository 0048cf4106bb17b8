"""Functional model families. ``forward`` dispatches on ``cfg.family``; all share one signature:

    forward(params, tokens [B, T], positions [B, T], cache, meta, cfg, logits_indices=None, parallel=None)
        -> (logits [B, T or K, V] float32, cache)

The block's K/V is written to the cache scratch slots; ``cache.length`` is not advanced here.
"""

from __future__ import annotations

from specjax.models import llama, opt
from specjax.models.params import (ParamSpec, check_params, init_params, param_logical_axes,
                                   param_specs)

_FAMILIES = {"llama": llama.forward, "opt": opt.forward}


def forward(params, tokens, positions, cache, meta, cfg, logits_indices=None, parallel=None):
    return _FAMILIES[cfg.family](params, tokens, positions, cache, meta, cfg, logits_indices, parallel)


__all__ = ["forward", "init_params", "param_specs", "param_logical_axes", "check_params", "ParamSpec"]
