"""Functional model families. ``forward`` dispatches on ``cfg.family``; all share one signature:

    forward(params, tokens [B, T], positions [B, T], cache, meta, cfg, logits_indices=None,
            parallel=None, hidden=None) -> ForwardOutput(logits [B, T or K, V] float32, cache, hidden)

(``greedy=True``: a ``TokenOutput(token [B, T or K], finite [B, T or K], cache, hidden)`` instead,
each position's first argmax and whether its logits are all finite: what greedy verification reads,
computed for less where the step programs' params carry the greedy head; ``seeded=SeededHead(...)``:
the same with the token seeded sampling draws at each position, what seeded verification reads.)

The block's K/V is written to the cache scratch slots; ``cache.length`` is not advanced here.
``hidden`` (static, a tuple of layer indices in [0, L]; None = nothing, at no cost) asks for the
hidden state entering each listed layer, L meaning the final hidden state (the input of the final
norm), at the same positions as the logits: ``ForwardOutput.hidden`` [B, T or K, len(hidden), D].
EAGLE-style drafters read (L,); EAGLE-3 fuses the inputs of layers 2, L/2 and L-3.
"""

from __future__ import annotations

from specjax.models import llama, opt
from specjax.models.output import ForwardOutput, SeededHead, TokenOutput, check_hidden
from specjax.models.params import (
    ParamSpec,
    check_params,
    init_params,
    is_param_spec,
    param_logical_axes,
    param_specs,
)

_FAMILIES = {"llama": llama.forward, "opt": opt.forward}


def forward(params, tokens, positions, cache, meta, cfg, logits_indices=None, parallel=None,
            hidden: tuple[int, ...] | None = None, block_only: bool = False,
            all_hidden: bool = False, greedy: bool = False, seeded: SeededHead | None = None
            ) -> ForwardOutput | TokenOutput:
    """``block_only``: leave ``cache`` untouched and return only the pass's K/V (``run_layers``).
    ``all_hidden``: hidden states at every position [B, T, ...] even where ``logits_indices`` picks a few
    (a prefill that feeds a feature drafter pays the head for the last prompt token only)."""
    return _FAMILIES[cfg.family](params, tokens, positions, cache, meta, cfg, logits_indices, parallel,
                                 hidden=check_hidden(hidden, cfg), block_only=block_only, all_hidden=all_hidden,
                                 greedy=greedy, seeded=seeded)


__all__ = ["forward", "ForwardOutput", "SeededHead", "TokenOutput", "init_params", "param_specs", "param_logical_axes",
           "check_params", "ParamSpec", "is_param_spec"]
