"""The feature drafter's network (EAGLE-style), for LLaMA-family LLMs.

It predicts the LLM's next *feature* (the final hidden state after the final norm, what the LM head
reads) from the previous feature and the embedding of the current token:

    pair at position p:   x_p  = fc([embed(token_p) ; g_{p-1}])           g_{-1} = 0
                          f_p  = RMSNorm(one LLaMA decoder layer(x_p))     causal over the pairs before p
                          logits_p = f_p @ head^T  over the draft vocabulary (predicts token_{p+1})

g_p is the LLM's post-norm feature at p while drafting from committed text (or, for a fused drafter,
the fusion of several LLM layers' hidden states at p: ``FeatureConfig.fused``), and the drafter's own
f_p deeper in a draft (where the LLM has not run yet). The embedding, final norm and head rows are the
LLM's own, frozen and taken from its params at bind time (``bind``), so a shipped drafter holds only
``fc``, its layer and its output norm. The output norm (initialised as the LLM's final norm) puts f in
g's space whatever the layer's residual scale: f is what the next draft step reads as its feature,
and what training regresses on g. The layer is the LLM's block shape (one layer of its config), attention
through the same cached path as the LLM (``decoder_layer``: prefill, tree drafting, commit); a deeper
drafter stacks several (``FeatureConfig.layers``).
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
from specjax.models.params import take_layers
from specjax.models.weights import PackedWeight, dense

TRAINED = ("fc", "layers", "out_norm")  # the drafter's own params; the rest is the LLM's (``bind``)
FUSED = ("fuse", "fuse_norm")  # and, reading several LLM layers, their fusion
FROZEN = ("embed", "final_norm", "head")


@dataclasses.dataclass(frozen=True)
class FeatureConfig:
    """llm: the LLM's config (LLaMA family). draft_vocab: the token ids the head can name (row r of the
    head is token draft_vocab[r]); drafts never contain other tokens, which costs acceptance only.
    fused: () reads the LLM's final feature g (EAGLE-1); or LLM layer indices whose input hidden states
    are normalised, concatenated and projected to one feature (EAGLE-3: low, middle and high layers
    carry more about the tokens after the next than the final, next-token-shaped feature). The index
    ``llm.num_layers`` names the final feature g itself (post-norm, as the head reads it), so a fusion
    that includes it can start as exactly a trained final-feature drafter (``with_fusion``).
    layers: the drafter's decoder layers (the LLM's block shape each; EAGLE uses one). A deeper drafter
    can start as exactly a trained shallower one (``deepen``)."""

    llm: ModelConfig
    draft_vocab: tuple[int, ...]
    fused: tuple[int, ...] = ()
    layers: int = 1

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
        if not isinstance(self.fused, tuple) or list(self.fused) != sorted(set(self.fused)) or any(
                isinstance(i, bool) or not isinstance(i, int) or not 0 <= i <= self.llm.num_layers for i in self.fused):
            raise InputError(f"fused must be increasing LLM layer indices in [0, {self.llm.num_layers}] "
                             f"({self.llm.num_layers}: the final feature), got {self.fused!r}")
        if self.fused == (self.llm.num_layers,):
            raise InputError(f"fused={self.fused!r} is the final feature alone: that is fused=()")
        if isinstance(self.layers, bool) or not isinstance(self.layers, int) or self.layers < 1:
            raise InputError(f"layers (the drafter's decoder layers) must be an integer >= 1, got {self.layers!r}")

    @property
    def layer_config(self) -> ModelConfig:
        """The config of the drafter's layers (and of its KV cache)."""
        return dataclasses.replace(self.llm, num_layers=self.layers)

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The LLM hidden states it reads (``specjax.models`` indices; L = the final one)."""
        return self.fused or (self.llm.num_layers,)

    @property
    def reads_final(self) -> bool:
        """Whether the fusion includes the final feature g (its last slot)."""
        return self.llm.num_layers in self.fused

    @property
    def raw_layers(self) -> tuple[int, ...]:
        """The fused layers read as raw hidden states (normalised by ``fuse_norm``): all but the final one.
        The training corpus stores these beside g."""
        return tuple(i for i in self.fused if i != self.llm.num_layers)

    @property
    def trained_keys(self) -> tuple[str, ...]:
        return TRAINED + (FUSED if self.fused else ())

    @property
    def vocab_rows(self) -> int:
        return len(self.draft_vocab)

    def to_dict(self) -> dict:
        out = {"llm": self.llm.to_dict(), "draft_vocab": list(self.draft_vocab), "fused": list(self.fused)}
        if self.layers != 1:  # absent for one layer, as in every drafter saved before deeper ones existed
            out["layers"] = self.layers
        return out

    @classmethod
    def from_dict(cls, d: dict, source: str = "feature drafter config") -> "FeatureConfig":
        if not isinstance(d, dict) or not {"llm", "draft_vocab"} <= set(d) <= {"llm", "draft_vocab", "fused", "layers"}:
            raise InputError(f"{source}: expected keys llm and draft_vocab (fused and layers optional), got "
                             f"{sorted(d) if isinstance(d, dict) else d}")
        layers = d.get("layers", 1)
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            raise InputError(f"{source}: layers must be an integer >= 1, got {layers!r}")
        return cls(ModelConfig.from_dict(d["llm"], source=f"{source}: llm"), tuple(int(t) for t in d["draft_vocab"]),
                   tuple(int(i) for i in d.get("fused", ())), layers)


def head_columns(llm_params: dict, cfg: FeatureConfig) -> jax.Array:
    """[D, Vd] the LLM's output-head columns of the draft vocabulary. Kept [D, Vd], not as the tied
    embedding's [Vd, D] rows: under the Eigen options of small-batch step programs, 4 rows by the
    transposed [8192, 576] head cost 7.3 ms against 1.05 ms for [576, 8192] (an AMD EPYC without
    AVX-512, measured before its AVX2 kernels; it holds wherever XLA multiplies), 6 times per
    drafting step."""
    ids = np.asarray(cfg.draft_vocab)
    if cfg.llm.tie_word_embeddings:
        return llm_params["embed"][ids].T
    return llm_params["lm_head"][:, ids]


def bind(trained: dict, llm_params: dict, cfg: FeatureConfig) -> dict:
    """The drafter's full params: its trained ``fc`` and layer, plus the LLM's embedding, final norm and
    head rows (shared arrays, frozen)."""
    missing = [k for k in cfg.trained_keys if k not in trained]
    if missing:
        raise InputError(f"feature drafter params lack {missing}")
    stacked = sorted({a.shape[0] for a in jax.tree.leaves(trained["layers"])})
    if stacked != [cfg.layers]:  # unrolled training and drafting would use only the config's first layers
        raise InputError(f"feature drafter params hold {stacked} decoder layers (their layers' leading axis), but the "
                         f"config says {cfg.layers}")
    return {**{k: trained[k] for k in cfg.trained_keys}, "embed": llm_params["embed"],
            "final_norm": llm_params["final_norm"],
            "head": head_columns(llm_params, cfg)}


def init_trained(llm_params: dict, cfg: FeatureConfig, key: jax.Array) -> dict:
    """Starting point for training: the LLM's last layer(s) with their output projections (attention ``wo``,
    MLP ``w_down``) zeroed, so each layer starts as the identity on its residual stream, and the LLM's
    final norm as the output norm; ``fc`` passes the feature through (identity on g) plus a small random
    map of the token embedding; a fusion starts random, or, where it reads the final feature, passing g
    through (the raw layers' rows zero: the start is the final-feature drafter's). (Measured on the
    passages corpus: held-out depth-1 agreement 0.19 after 50 steps, against 0.10 with the LLM's last
    layer as it is, whose updates, meant for layer 29's residual stream, swamp the post-norm input.)"""
    d = cfg.llm.hidden_size
    dtype = llm_params["embed"].dtype
    k_embed, k_fuse = jax.random.split(key)
    embed_part = jax.random.normal(k_embed, (d, d), dtype) * (1.0 / np.sqrt(d))
    fc = jnp.concatenate([embed_part, jnp.eye(d, dtype=dtype)], axis=0)  # rows: [embedding ; feature]
    if cfg.layers > cfg.llm.num_layers:
        raise InputError(f"a drafter of {cfg.layers} layers cannot start from the LLM's last layers: it has "
                         f"{cfg.llm.num_layers}")
    layers = take_layers(llm_params, range(cfg.llm.num_layers - cfg.layers, cfg.llm.num_layers))
    out = {"fc": fc, "layers": _identity_outputs(layers), "out_norm": llm_params["final_norm"]}
    if cfg.fused:
        n = len(cfg.fused)
        if cfg.reads_final:
            out.update(fusion_passing_final(cfg, dtype))
        else:
            out["fuse"] = jax.random.normal(k_fuse, (n * d, d), dtype) * (1.0 / np.sqrt(n * d))
            out["fuse_norm"] = jnp.ones((n, d), dtype)
    return out


_OUTPUTS = ("wo", "bo", "w_down", "b_down")  # what a layer adds to its residual stream: zero, it passes it on


def _identity_outputs(layers: dict) -> dict:
    """Stacked layer weights with every output projection (and its bias) zeroed."""
    return {n: jnp.zeros_like(w) if n in _OUTPUTS else w for n, w in layers.items()}


def deepen(trained: dict, from_cfg: FeatureConfig, to_cfg: FeatureConfig) -> dict:
    """A trained drafter's params -> those of ``to_cfg``, the same drafter with more decoder layers, that
    compute exactly the same features: the added layers come after the trained ones, copies of the last
    with their output projections zeroed (identity on the residual stream, inputs that training can
    move from there). The start of training a deeper drafter from a trained one."""
    if dataclasses.replace(from_cfg, layers=to_cfg.layers) != to_cfg or to_cfg.layers <= from_cfg.layers:
        raise InputError(f"deepen adds decoder layers to the same drafter: {from_cfg.layers} -> {to_cfg.layers} "
                         f"layers must add some and change nothing else")
    missing = [k for k in from_cfg.trained_keys if k not in trained]
    if missing:
        raise InputError(f"deepen: the drafter's params lack {missing}")
    layers = trained["layers"]
    have = {n: w.shape[0] for n, w in layers.items()}
    if set(have.values()) != {from_cfg.layers}:
        raise InputError(f"deepen: expected {from_cfg.layers} stacked layer(s), got {have}")
    added = to_cfg.layers - from_cfg.layers
    extra = _identity_outputs({n: jnp.repeat(w[-1:], added, axis=0) for n, w in layers.items()})
    return {**trained, "layers": {n: jnp.concatenate([w, extra[n]], axis=0) for n, w in layers.items()}}


def fusion_passing_final(cfg: FeatureConfig, dtype=jnp.float32) -> dict:
    """{fuse, fuse_norm} of a fusion that reads the final feature and passes it through unchanged: the
    raw layers' rows zero (they start to matter as training moves them), g's rows the identity."""
    if not cfg.reads_final:
        raise InputError(f"a fusion of layers {cfg.fused} does not read the final feature "
                         f"({cfg.llm.num_layers}): it cannot pass it through")
    d = cfg.llm.hidden_size
    raw = len(cfg.raw_layers)
    return {"fuse": jnp.concatenate([jnp.zeros((raw * d, d), dtype), jnp.eye(d, dtype=dtype)], axis=0),
            "fuse_norm": jnp.ones((raw, d), dtype)}


def with_fusion(trained: dict, fused_cfg: FeatureConfig) -> dict:
    """A final-feature drafter's trained params -> those of ``fused_cfg`` (same LLM and draft vocabulary)
    that compute exactly the same drafts: its fusion passes g through (``fusion_passing_final``). The
    start of EAGLE-3-style training from a trained EAGLE-1-style drafter."""
    missing = [k for k in TRAINED if k not in trained]
    if missing or any(k in trained for k in FUSED):
        raise InputError(f"with_fusion takes a final-feature drafter's params ({TRAINED}); got {sorted(trained)}")
    return {**{k: trained[k] for k in TRAINED}, **fusion_passing_final(fused_cfg, trained["out_norm"].dtype)}


def widen_fusion(trained: dict, from_cfg: FeatureConfig, to_cfg: FeatureConfig) -> dict:
    """A trained fusion's params -> those of a fusion of more LLM layers (``to_cfg.fused`` a superset
    of ``from_cfg.fused``, the same final-feature slot) that compute exactly the same features: the
    added layers' ``fuse`` rows are zero and their ``fuse_norm`` rows one, the others move to their
    layers' places. The start of training a fusion of more layers from a trained one."""
    if not from_cfg.fused or not set(from_cfg.fused) < set(to_cfg.fused) or from_cfg.reads_final != to_cfg.reads_final:
        raise InputError(f"widen_fusion adds layers to a fusion: layers {list(from_cfg.fused)} -> "
                         f"{list(to_cfg.fused)} must add some and keep the final feature's slot as it is")
    missing = [k for k in from_cfg.trained_keys if k not in trained]
    if missing:
        raise InputError(f"widen_fusion: the fusion's params lack {missing}")
    d = from_cfg.llm.hidden_size
    fuse, norm = trained["fuse"], trained["fuse_norm"]
    old = {layer: i for i, layer in enumerate(from_cfg.raw_layers)}
    blocks = [fuse[old[layer] * d:(old[layer] + 1) * d] if layer in old else jnp.zeros((d, d), fuse.dtype)
              for layer in to_cfg.raw_layers]
    rows = [norm[old[layer]] if layer in old else jnp.ones((d,), norm.dtype) for layer in to_cfg.raw_layers]
    if to_cfg.reads_final:
        blocks.append(fuse[len(old) * d:])
    return {**{k: trained[k] for k in TRAINED}, "fuse": jnp.concatenate(blocks, axis=0), "fuse_norm": jnp.stack(rows)}


def llm_features(params: dict, hidden: jax.Array, cfg: FeatureConfig) -> jax.Array:
    """The drafter's input feature from the LLM's hidden states at ``cfg.hidden_layers``, [..., n, D] -> [..., D]:
    the post-norm final feature g, or the fusion of the listed layers' normalised inputs."""
    if not cfg.fused:
        return final_features(params, hidden[..., 0, :], cfg)
    if cfg.reads_final:
        return fuse_features(params, hidden[..., :-1, :], final_features(params, hidden[..., -1, :], cfg), cfg)
    return fuse_features(params, hidden, None, cfg)


def fuse_features(params: dict, raw: jax.Array, g: jax.Array | None, cfg: FeatureConfig) -> jax.Array:
    """The fusion of ``cfg.raw_layers``' hidden states ``raw`` [..., n_raw, D] (each normalised by its
    ``fuse_norm`` row) and, where the fusion reads it, the final feature ``g`` [..., D] -> [..., D]."""
    if (g is not None) != cfg.reads_final or raw.shape[-2] != len(cfg.raw_layers):
        raise InputError(f"fusion of layers {cfg.fused}: got {raw.shape[-2]} raw layers and "
                         f"{'a' if g is not None else 'no'} final feature")
    normed = rms_norm(raw, params["fuse_norm"], cfg.llm.norm_eps)  # per layer
    parts = normed.reshape(raw.shape[:-2] + (-1,))
    if g is not None:
        parts = jnp.concatenate([parts, g.astype(parts.dtype)], axis=-1)
    return parts @ params["fuse"]


def final_features(params: dict, hidden: jax.Array, cfg: FeatureConfig) -> jax.Array:
    """The LLM's final hidden states (the input of its final norm, [..., D]) -> post-norm features g."""
    return rms_norm(hidden, params["final_norm"], cfg.llm.norm_eps)


def pair_inputs(params: dict, tokens: jax.Array, prev_features: jax.Array) -> jax.Array:
    """x = fc([embed(tokens) ; g_prev]): tokens [B, T], prev_features [B, T, D] -> [B, T, D]."""
    e = params["embed"][tokens]
    return dense(jnp.concatenate([e, prev_features.astype(e.dtype)], axis=-1), params["fc"])


def logits_of(params: dict, features: jax.Array) -> jax.Array:
    """Draft-vocabulary logits [..., Vd] float32 of drafter features [..., D]. The head is [D, Vd], in a
    step program's params packed for the CPU kernel (``FeatureDrafter.step_params``)."""
    if isinstance(params["head"], PackedWeight):
        return dense(features, params["head"]).astype(compute_dtype(features.dtype))
    return jnp.einsum("...d,dv->...v", features, params["head"], preferred_element_type=compute_dtype(features.dtype))


def init_feature_cache(cfg: FeatureConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    return init_cache(cfg.layer_config, batch, max_len, dtype)


def feature_forward(params: dict, tokens: jax.Array, prev_features: jax.Array, positions: jax.Array, cache: KVCache,
                    meta, cfg: FeatureConfig) -> tuple[jax.Array, KVCache]:
    """Pairs (tokens [B, T], the features before them [B, T, D]) at ``positions`` [B, T] through the
    drafter's layers over its cache (``meta`` as for the LLM: causal, or a tree bitmask over scratch
    slots). Returns (features f [B, T, D], cache with the block's K/V written; length unchanged)."""
    lcfg = cfg.layer_config
    x = pair_inputs(params, tokens, prev_features)
    h, cache, _ = run_layers(decoder_layer(lcfg, rope_inv_freq(lcfg)), x, params["layers"], cache, (positions, meta))
    return output_features(params, h, cfg), cache


def output_features(params: dict, h: jax.Array, cfg: FeatureConfig) -> jax.Array:
    """The layer's residual stream [..., D] -> the drafter's feature f (normalised like g)."""
    return rms_norm(h, params["out_norm"], cfg.llm.norm_eps)
