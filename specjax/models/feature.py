"""The feature drafter's network (EAGLE-style), for LLaMA-family LLMs.

It predicts the LLM's next *feature* (the final hidden state after the final norm, what the LM head
reads) from the previous feature and the embedding of the current token:

    pair at position p:   x_p  = fc([embed(token_p) ; g_{p-1}])           g_{-1} = 0
                          f_p  = one LLaMA decoder layer(x_p), causal over the pairs before p
                          logits_p = f_p @ head^T  over the draft vocabulary (predicts token_{p+1})

g_p is the LLM's post-norm feature at p while drafting from committed text, and the drafter's own f_p
deeper in a draft (where the LLM has not run yet). The embedding, final norm and head rows are the
LLM's own, frozen and taken from its params at bind time (``bind``), so a shipped drafter holds only
``fc`` and its layer. The layer is the LLM's block shape (one layer of its config), attention
through the same cached path as the LLM (``decoder_layer``: prefill, tree drafting, commit).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig
from specjax.errors import InputError
from specjax.models.cache import KVCache, init_cache
from specjax.models.common import compute_dtype, rms_norm, rope_inv_freq
from specjax.models.layers import run_layers
from specjax.models.llama import decoder_layer

TRAINED = ("fc", "layers")  # the drafter's own params; the rest is the LLM's (``bind``)
FROZEN = ("embed", "final_norm", "head")


@dataclasses.dataclass(frozen=True)
class FeatureConfig:
    """llm: the LLM's config (LLaMA family). draft_vocab: the token ids the head can name (row r of the
    head is token draft_vocab[r]); drafts never contain other tokens, which costs acceptance only."""

    llm: ModelConfig
    draft_vocab: tuple[int, ...]

    def __post_init__(self):
        if not isinstance(self.llm, ModelConfig) or self.llm.family != "llama":
            family = getattr(self.llm, "family", type(self.llm).__name__)
            raise InputError(f"the feature drafter reads a LLaMA-family LLM's hidden states; got {family!r}")
        if self.llm.draft_vocab is not None:
            raise InputError("the feature drafter's LLM must have the full vocabulary (its config has a draft_vocab)")
        ids = np.asarray(self.draft_vocab)
        if not isinstance(self.draft_vocab, tuple) or ids.ndim != 1 or not len(ids) or ids.dtype.kind not in "iu":
            raise InputError(f"draft_vocab must be a non-empty tuple of token ids, got {type(self.draft_vocab)}")
        if ids.min() < 0 or ids.max() >= self.llm.vocab_size or len(np.unique(ids)) != len(ids):
            raise InputError(f"draft_vocab must hold distinct token ids in [0, {self.llm.vocab_size}), got min "
                             f"{ids.min()}, max {ids.max()}, {len(ids) - len(np.unique(ids))} repeats")

    @property
    def layer_config(self) -> ModelConfig:
        """The config of the drafter's one layer (and of its KV cache)."""
        return dataclasses.replace(self.llm, num_layers=1)

    @property
    def hidden_layer(self) -> int:
        """The LLM hidden state it reads: the final one (``specjax.models`` index L)."""
        return self.llm.num_layers

    @property
    def vocab_rows(self) -> int:
        return len(self.draft_vocab)

    def to_dict(self) -> dict:
        return {"llm": self.llm.to_dict(), "draft_vocab": list(self.draft_vocab)}

    @classmethod
    def from_dict(cls, d: dict, source: str = "feature drafter config") -> "FeatureConfig":
        if not isinstance(d, dict) or set(d) != {"llm", "draft_vocab"}:
            raise InputError(f"{source}: expected keys llm and draft_vocab, got {sorted(d) if isinstance(d, dict) else d}")
        return cls(ModelConfig.from_dict(d["llm"], source=f"{source}: llm"), tuple(int(t) for t in d["draft_vocab"]))


def head_rows(llm_params: dict, cfg: FeatureConfig) -> jax.Array:
    """[Vd, D] the LLM's output-head rows of the draft vocabulary."""
    ids = np.asarray(cfg.draft_vocab)
    if cfg.llm.tie_word_embeddings:
        return llm_params["embed"][ids]
    return llm_params["lm_head"][:, ids].T


def bind(trained: dict, llm_params: dict, cfg: FeatureConfig) -> dict:
    """The drafter's full params: its trained ``fc`` and layer, plus the LLM's embedding, final norm and
    head rows (shared arrays, frozen)."""
    missing = [k for k in TRAINED if k not in trained]
    if missing:
        raise InputError(f"feature drafter params lack {missing}")
    return {"fc": trained["fc"], "layers": trained["layers"], "embed": llm_params["embed"],
            "final_norm": llm_params["final_norm"], "head": head_rows(llm_params, cfg)}


def init_trained(llm_params: dict, cfg: FeatureConfig, key: jax.Array) -> dict:
    """Starting point for training: the LLM's last layer, and ``fc`` passing the feature through
    (identity on g) plus a small random map of the token embedding."""
    d = cfg.llm.hidden_size
    dtype = llm_params["embed"].dtype
    embed_part = jax.random.normal(key, (d, d), dtype) * (1.0 / np.sqrt(d))
    fc = jnp.concatenate([embed_part, jnp.eye(d, dtype=dtype)], axis=0)  # rows: [embedding ; feature]
    layers = jax.tree.map(lambda a: a[-1:], llm_params["layers"])
    return {"fc": fc, "layers": layers}


def llm_features(params: dict, hidden: jax.Array, cfg: FeatureConfig) -> jax.Array:
    """The LLM's final hidden states (the input of its final norm, [..., D]) -> post-norm features g."""
    return rms_norm(hidden, params["final_norm"], cfg.llm.norm_eps)


def pair_inputs(params: dict, tokens: jax.Array, prev_features: jax.Array) -> jax.Array:
    """x = fc([embed(tokens) ; g_prev]): tokens [B, T], prev_features [B, T, D] -> [B, T, D]."""
    e = params["embed"][tokens]
    return jnp.concatenate([e, prev_features.astype(e.dtype)], axis=-1) @ params["fc"]


def logits_of(params: dict, features: jax.Array) -> jax.Array:
    """Draft-vocabulary logits [..., Vd] float32 of drafter features [..., D]."""
    return jnp.einsum("...d,vd->...v", features, params["head"], preferred_element_type=compute_dtype(features.dtype))


def init_feature_cache(cfg: FeatureConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    return init_cache(cfg.layer_config, batch, max_len, dtype)


def feature_forward(params: dict, tokens: jax.Array, prev_features: jax.Array, positions: jax.Array, cache: KVCache,
                    meta, cfg: FeatureConfig) -> tuple[jax.Array, KVCache]:
    """Pairs (tokens [B, T], the features before them [B, T, D]) at ``positions`` [B, T] through the
    drafter's layer over its cache (``meta`` as for the LLM: causal, or a tree bitmask over scratch
    slots). Returns (features f [B, T, D], cache with the block's K/V written; length unchanged)."""
    lcfg = cfg.layer_config
    x = pair_inputs(params, tokens, prev_features)
    f, cache, _ = run_layers(decoder_layer(lcfg, rope_inv_freq(lcfg)), x, params["layers"], cache, (positions, meta))
    return f, cache
