"""ModelConfig: one frozen, hashable description of a LLaMA- or OPT-family model.

Built from a HuggingFace ``config.json`` (transformers 4.x ``rope_theta``/``rope_scaling`` or 5.x
``rope_parameters``) or from GGUF metadata. Hashable so it can be a static argument of ``jax.jit``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

import numpy as np

from specjax.errors import ConfigError

SUPPORTED_FAMILIES = ("llama", "opt")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. kind: "linear" or "llama3" ("default" is represented by None)."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: str  # "llama" | "opt"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    # LLaMA family
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    # OPT family
    do_layer_norm_before: bool = True
    word_embed_proj_dim: int | None = None  # None -> hidden_size (no project_in/out)
    final_layer_norm: bool = True
    enable_bias: bool = True
    position_offset: int = 2  # OPT's learned positional embedding is indexed at position + 2
    # tokens
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # SSMs with a shrunk head: the LLM token ids the model can propose (row r of its embedding/head is
    # token draft_vocab[r]; one extra row stands for every other token). Logits stay vocab_size wide
    # (-inf outside the list), so drafting and verification see the LLM's vocabulary. LLaMA only.
    draft_vocab: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.family not in SUPPORTED_FAMILIES:
            raise ConfigError(f"unsupported model family {self.family!r}; supported: {SUPPORTED_FAMILIES}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.family == "llama" and self.head_dim % 2:
            raise ConfigError(f"RoPE needs an even head_dim, got {self.head_dim}")
        if self.draft_vocab is not None:
            ids = np.asarray(self.draft_vocab)
            if self.family != "llama" or not len(ids) or ids.ndim != 1:
                raise ConfigError(f"draft_vocab needs the llama family and a non-empty id list, got "
                                  f"{self.family!r} with {ids.size} ids")
            if ids.min() < 0 or ids.max() >= self.vocab_size or len(np.unique(ids)) != len(ids):
                raise ConfigError(f"draft_vocab must hold distinct token ids in [0, {self.vocab_size}), got "
                                  f"min {ids.min()}, max {ids.max()}, {len(ids) - len(np.unique(ids))} repeats")
        if self.family == "opt" and self.num_heads * self.head_dim != self.hidden_size:
            raise ConfigError(f"OPT needs num_heads*head_dim == hidden_size, got "
                              f"{self.num_heads}*{self.head_dim} != {self.hidden_size}")

    @property
    def embed_dim(self) -> int:
        """Width of the token embedding (OPT's word_embed_proj_dim, otherwise hidden_size)."""
        return self.word_embed_proj_dim or self.hidden_size

    @property
    def embed_rows(self) -> int:
        """Rows of the embedding / head: the vocabulary, or the draft vocabulary plus one "other" row."""
        return self.vocab_size if self.draft_vocab is None else len(self.draft_vocab) + 1

    @property
    def has_projections(self) -> bool:
        return self.family == "opt" and self.embed_dim != self.hidden_size

    @property
    def max_positions(self) -> int:
        """The context window: prompt + generated tokens must fit in it."""
        return self.max_position_embeddings

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        if d.get("draft_vocab") is not None:
            d["draft_vocab"] = tuple(int(i) for i in d["draft_vocab"])
        return cls(**d)


def _require(d: Mapping[str, Any], key: str, source: str):
    if key not in d:
        raise ConfigError(f"{source}: required key {key!r} is missing")
    return d[key]


def _eos_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope_from_hf(d: Mapping[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    params = d.get("rope_parameters")  # transformers >= 5
    if params is None:
        params = dict(d.get("rope_scaling") or {})
        params.setdefault("rope_theta", d.get("rope_theta", 10000.0))
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, RopeScaling("linear", float(_require(params, "factor", source)))
    if kind == "llama3":
        return theta, RopeScaling(
            "llama3",
            factor=float(_require(params, "factor", source)),
            low_freq_factor=float(_require(params, "low_freq_factor", source)),
            high_freq_factor=float(_require(params, "high_freq_factor", source)),
            original_max_position_embeddings=int(_require(params, "original_max_position_embeddings", source)),
        )
    raise ConfigError(f"{source}: unsupported RoPE scaling type {kind!r} (supported: default, linear, llama3)")


def config_from_hf(d: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
    """Build a ModelConfig from a HuggingFace config dictionary."""
    model_type = d.get("model_type")
    if model_type == "llama":
        heads = int(_require(d, "num_attention_heads", source))
        hidden = int(_require(d, "hidden_size", source))
        theta, scaling = _rope_from_hf(d, source)
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{source}: LLaMA hidden_act {act!r} is not supported (only 'silu')")
        return ModelConfig(
            family="llama",
            vocab_size=int(_require(d, "vocab_size", source)),
            hidden_size=hidden,
            intermediate_size=int(_require(d, "intermediate_size", source)),
            num_layers=int(_require(d, "num_hidden_layers", source)),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            rope_theta=theta,
            rope_scaling=scaling,
            attention_bias=bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=_eos_tuple(d.get("eos_token_id")),
            pad_token_id=d.get("pad_token_id"),
        )
    if model_type == "opt":
        heads = int(_require(d, "num_attention_heads", source))
        hidden = int(_require(d, "hidden_size", source))
        act = d.get("activation_function", "relu")
        if act != "relu":
            raise ConfigError(f"{source}: OPT activation_function {act!r} is not supported (only 'relu')")
        if not d.get("layer_norm_elementwise_affine", True):
            raise ConfigError(f"{source}: OPT layer_norm_elementwise_affine=False is not supported")
        proj = d.get("word_embed_proj_dim") or hidden
        before = bool(d.get("do_layer_norm_before", True))
        return ModelConfig(
            family="opt",
            vocab_size=int(_require(d, "vocab_size", source)),
            hidden_size=hidden,
            intermediate_size=int(_require(d, "ffn_dim", source)),
            num_layers=int(_require(d, "num_hidden_layers", source)),
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=hidden // heads,
            max_position_embeddings=int(_require(d, "max_position_embeddings", source)),
            norm_eps=1e-5,  # torch.nn.LayerNorm default, which OPT uses
            tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
            do_layer_norm_before=before,
            word_embed_proj_dim=int(proj),
            final_layer_norm=before and not d.get("_remove_final_layer_norm", False),
            enable_bias=bool(d.get("enable_bias", True)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=_eos_tuple(d.get("eos_token_id")),
            pad_token_id=d.get("pad_token_id"),
        )
    raise ConfigError(f"{source}: unsupported architecture model_type={model_type!r} "
                      f"(architectures={d.get('architectures')}); supported: 'llama', 'opt'")


def config_from_hf_file(path: str | os.PathLike) -> ModelConfig:
    try:
        with open(path) as f:
            d = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    return config_from_hf(d, source=str(path))


def config_from_gguf(fields: Mapping[str, Any], source: str, vocab_size: int | None = None) -> ModelConfig:
    """Build a ModelConfig from GGUF metadata (already decoded to Python values)."""
    arch = fields.get("general.architecture")
    if arch != "llama":
        raise ConfigError(f"{source}: unsupported GGUF architecture {arch!r} (supported: 'llama')")

    def get(key, default=None):
        value = fields.get(f"llama.{key}", default)
        if value is None:
            raise ConfigError(f"{source}: GGUF metadata key 'llama.{key}' is missing")
        return value

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    scaling = None
    kind = fields.get("llama.rope.scaling.type", "none")
    if kind == "linear":
        scaling = RopeScaling("linear", float(get("rope.scaling.factor")))
    elif kind not in ("none", None):
        raise ConfigError(f"{source}: GGUF rope scaling type {kind!r} is not supported (none, linear)")
    vocab = fields.get("llama.vocab_size") or vocab_size
    if vocab is None:
        raise ConfigError(f"{source}: neither 'llama.vocab_size' nor a token list gives the vocabulary size")
    eos = fields.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        family="llama",
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(fields.get("llama.attention.head_count_kv") or heads),
        head_dim=int(fields.get("llama.rope.dimension_count") or hidden // heads),
        max_position_embeddings=int(get("context_length")),
        norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings=True,  # corrected by the loader when an output.weight tensor exists
        rope_theta=float(fields.get("llama.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_eos_tuple(eos),
        pad_token_id=fields.get("tokenizer.ggml.padding_token_id"),
    )
