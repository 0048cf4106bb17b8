"""OPT family: learned positions (offset 2), pre-LN or post-LN, project_in/out, ReLU MLP, biases."""

from __future__ import annotations

import jax

from specjax.attention.meta import AttentionMeta
from specjax.config import ModelConfig
from specjax.models.cache import KVCache
from specjax.models.common import attention_block, head_logits, head_outputs, layer_norm
from specjax.models.layers import hidden_output, run_layers
from specjax.models.output import ForwardOutput, SeededHead, TokenOutput, select_positions
from specjax.models.weights import weight_einsum


def forward(params: dict, tokens: jax.Array, positions: jax.Array, cache: KVCache, meta: AttentionMeta,
            cfg: ModelConfig, logits_indices: jax.Array | None = None, parallel=None,
            hidden=None, block_only: bool = False, all_hidden: bool = False,
            greedy: bool = False, seeded: SeededHead | None = None) -> ForwardOutput | TokenOutput:
    """tokens, positions: [B, T] -> ForwardOutput(logits [B, T or K, V] float32, cache with the block
    written, hidden states entering the ``hidden`` layers or None; see ``specjax.models``).
    parallel: a ``specjax.sharding.Parallel`` whose pp > 1 pipelines the layers (None = one scan)."""
    eps, pre_ln, bias = cfg.norm_eps, cfg.do_layer_norm_before, cfg.enable_bias
    h = params["embed"][tokens]  # [B, T, E]
    if cfg.has_projections:
        h = h @ params["project_in"]  # [B, T, D]
    h = h + params["pos_embed"][positions + cfg.position_offset]

    def layer(h, lp, k_all, v_all, i, per_request):
        positions, meta, *prefix = per_request  # prefix: the read-only cache of a block-only pass
        with jax.named_scope("attention"):
            x = layer_norm(h, lp["attn_norm_scale"], lp["attn_norm_bias"], eps) if pre_ln else h
            attn, k_all, v_all = attention_block(x, lp, k_all, v_all, i, positions, meta, cfg, None, bias=bias,
                                                 prefix=prefix[0] if prefix else None)
            h = h + attn
            if not pre_ln:
                h = layer_norm(h, lp["attn_norm_scale"], lp["attn_norm_bias"], eps)
        with jax.named_scope("mlp"):
            x = layer_norm(h, lp["mlp_norm_scale"], lp["mlp_norm_bias"], eps) if pre_ln else h
            x = weight_einsum("btd,df->btf", x, lp["fc1"])
            x = jax.nn.relu(x + lp["fc1_bias"] if bias else x)
            x = weight_einsum("btf,fd->btd", x, lp["fc2"])
            h = h + (x + lp["fc2_bias"] if bias else x)
            if not pre_ln:
                h = layer_norm(h, lp["mlp_norm_scale"], lp["mlp_norm_bias"], eps)
        return h, k_all, v_all

    h, cache, captured = run_layers(layer, h, params["layers"], cache, (positions, meta), parallel, hidden,
                                   None if all_hidden else logits_indices, block_only=block_only)
    every_h = h
    h = final_h = select_positions(h, logits_indices)  # the input of the final norm
    if cfg.final_layer_norm:
        h = layer_norm(h, params["final_norm_scale"], params["final_norm_bias"], eps)
    if cfg.has_projections:
        h = h @ params["project_out"]  # [B, K, E]
    logits, argmax, finite = head_outputs(h, params, cfg, greedy, lambda h: head_logits(h, params, cfg), seeded)
    states = hidden_output(hidden, captured, every_h if all_hidden else final_h, cfg.num_layers)
    if greedy or seeded is not None:
        return TokenOutput(argmax, finite, cache, states)
    return ForwardOutput(logits, cache, states)
