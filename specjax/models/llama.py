"""LLaMA family: RMSNorm, RoPE (default/linear/llama3), GQA/MQA, SwiGLU, tied or untied head."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax.attention.meta import AttentionMeta
from specjax.config import ModelConfig
from specjax.models.cache import KVCache
from specjax.models.common import attention_block, head_logits, head_outputs, rms_norm, rope_inv_freq
from specjax.models.layers import hidden_output, run_layers
from specjax.models.output import ForwardOutput, SeededHead, TokenOutput, select_positions
from specjax.models.weights import weight_einsum


@functools.lru_cache(maxsize=16)
def draft_rows(cfg: ModelConfig) -> np.ndarray:
    """[vocab_size] int32: the embedding row of every LLM token (the "other" row for tokens outside
    ``cfg.draft_vocab``)."""
    rows = np.full((cfg.vocab_size,), len(cfg.draft_vocab), np.int32)
    rows[np.asarray(cfg.draft_vocab)] = np.arange(len(cfg.draft_vocab), dtype=np.int32)
    return rows


def mlp(x: jax.Array, lp: dict, cfg: ModelConfig) -> jax.Array:
    """SwiGLU: x [B, T, D] -> [B, T, D]."""
    if "w_gate_up" in lp:  # split layers: one fused matmul (specjax.models.params.FUSED)
        gate_up = weight_einsum("btd,df->btf", x, lp["w_gate_up"])
        gate, up = gate_up[..., :cfg.intermediate_size], gate_up[..., cfg.intermediate_size:]
    else:
        gate = weight_einsum("btd,df->btf", x, lp["w_gate"])
        up = weight_einsum("btd,df->btf", x, lp["w_up"])
    if cfg.mlp_bias:
        gate, up = gate + lp["b_gate"], up + lp["b_up"]
    down = weight_einsum("btf,fd->btd", jax.nn.silu(gate) * up, lp["w_down"])
    return down + lp["b_down"] if cfg.mlp_bias else down


def decoder_layer(cfg: ModelConfig, inv_freq):
    """One pre-norm LLaMA block over the cache, as ``run_layers`` calls it: (h, lp, k_all, v_all, i,
    (positions, meta[, read-only prefix])) -> (h, k_all, v_all). Shared with the feature drafter."""

    def layer(h, lp, k_all, v_all, i, per_request):
        positions, meta, *prefix = per_request  # prefix: the read-only cache of a block-only pass
        with jax.named_scope("attention"):
            x = rms_norm(h, lp["attn_norm"], cfg.norm_eps)
            attn, k_all, v_all = attention_block(x, lp, k_all, v_all, i, positions, meta, cfg, inv_freq,
                                                 bias=cfg.attention_bias,
                                                 prefix=prefix[0] if prefix else None)
            h = h + attn
        with jax.named_scope("mlp"):
            h = h + mlp(rms_norm(h, lp["mlp_norm"], cfg.norm_eps), lp, cfg)
        return h, k_all, v_all

    return layer


def forward(params: dict, tokens: jax.Array, positions: jax.Array, cache: KVCache, meta: AttentionMeta,
            cfg: ModelConfig, logits_indices: jax.Array | None = None, parallel=None, hidden=None,
            row_logits: bool = False, block_only: bool = False, all_hidden: bool = False,
            greedy: bool = False, seeded: SeededHead | None = None) -> ForwardOutput | TokenOutput:
    """tokens, positions: [B, T] -> ForwardOutput(logits [B, T or K, V] float32, cache with the block
    written, hidden states entering the ``hidden`` layers or None; see ``specjax.models``).
    parallel: a ``specjax.sharding.Parallel`` whose pp > 1 pipelines the layers (None = one scan).
    With ``cfg.draft_vocab``, logits are scattered into the full vocabulary (-inf elsewhere) unless
    ``row_logits`` asks for the raw head rows [B, T, len(draft_vocab) + 1] (training)."""
    inv_freq = rope_inv_freq(cfg)
    rows = tokens if cfg.draft_vocab is None else jnp.asarray(draft_rows(cfg))[tokens]
    h = params["embed"][rows]  # [B, T, D]

    layer = decoder_layer(cfg, inv_freq)
    h, cache, captured = run_layers(layer, h, params["layers"], cache, (positions, meta), parallel, hidden,
                                   None if all_hidden else logits_indices, block_only=block_only)
    every_h = h
    final_h = select_positions(h, logits_indices)  # the input of the final norm
    h = rms_norm(final_h, params["final_norm"], cfg.norm_eps)

    def logits_of(h):
        logits = head_logits(h, params, cfg)
        if cfg.draft_vocab is not None and not row_logits:
            # The "other" row is dropped: it stands for many tokens, none of which the SSM can name.
            full = jnp.full(logits.shape[:-1] + (cfg.vocab_size,), -jnp.inf, logits.dtype)
            logits = full.at[..., np.asarray(cfg.draft_vocab)].set(logits[..., :-1])
        return logits

    logits, argmax, finite = head_outputs(h, params, cfg, greedy, logits_of, seeded)
    states = hidden_output(hidden, captured, every_h if all_hidden else final_h, cfg.num_layers)
    if greedy or seeded is not None:
        return TokenOutput(argmax, finite, cache, states)
    return ForwardOutput(logits, cache, states)
