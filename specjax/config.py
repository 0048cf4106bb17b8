"""ModelConfig: one frozen, hashable description of a LLaMA- or OPT-family model.

Built from a HuggingFace ``config.json`` (transformers 4.x ``rope_theta``/``rope_scaling`` or 5.x
``rope_parameters``) or from GGUF metadata. Hashable so it can be a static argument of ``jax.jit``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings
from typing import Any, Mapping

import numpy as np

from specjax.errors import ConfigError


def cache_root() -> str:
    """specjax's cache directory (tokenizers, tree pass costs, compiled kernels, XLA programs):
    ``$SPECJAX_CACHE_DIR``, default ``~/.cache/specjax``."""
    return os.environ.get("SPECJAX_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "specjax")

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
                     "num_kv_heads", "head_dim", "max_position_embeddings", "position_offset"):
            value = getattr(self, name)
            minimum = 0 if name == "position_offset" else 1
            if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value < 2**31:
                raise ConfigError(f"ModelConfig.{name} must be an int in [{minimum}, 2**31), got {value!r}")
        for name in ("norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise ConfigError(f"ModelConfig.{name} must be a finite positive number, got {value!r}")
        for name in ("tie_word_embeddings", "attention_bias", "mlp_bias", "do_layer_norm_before",
                     "final_layer_norm", "enable_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"ModelConfig.{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("bos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ConfigError(f"ModelConfig.{name} must be None or an int >= 0, got {value!r}")
        if not isinstance(self.eos_token_ids, tuple) or any(
                isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in self.eos_token_ids):
            raise ConfigError(f"ModelConfig.eos_token_ids must be a tuple of ints >= 0, got {self.eos_token_ids!r}")
        special = [("bos_token_id", self.bos_token_id)] + [("eos_token_ids", v) for v in self.eos_token_ids]
        outside = [(n, v) for n, v in special if v is not None and v >= self.vocab_size]
        if outside:  # an end-of-sequence id no token can equal would never end a request
            raise ConfigError(f"ModelConfig.{outside[0][0]} holds {outside[0][1]}, outside the vocabulary "
                              f"[0, {self.vocab_size})")
        if self.word_embed_proj_dim is not None and (isinstance(self.word_embed_proj_dim, bool) or not isinstance(
                self.word_embed_proj_dim, int) or self.word_embed_proj_dim < 1):
            raise ConfigError(f"ModelConfig.word_embed_proj_dim must be None or a positive int, got "
                              f"{self.word_embed_proj_dim!r}")
        if self.rope_scaling is not None:
            rs = self.rope_scaling
            if not isinstance(rs, RopeScaling) or rs.kind not in ("linear", "llama3") or not all(
                    isinstance(x, (int, float)) and math.isfinite(x) and x > 0
                    for x in (rs.factor, rs.low_freq_factor, rs.high_freq_factor, rs.original_max_position_embeddings)):
                raise ConfigError(f"ModelConfig.rope_scaling must be a RopeScaling of kind 'linear' or 'llama3' "
                                  f"with finite positive factors, got {rs!r}")
            if rs.kind == "llama3" and rs.high_freq_factor <= rs.low_freq_factor:
                raise ConfigError(f"llama3 RoPE scaling needs high_freq_factor > low_freq_factor, got "
                                  f"{rs.high_freq_factor} <= {rs.low_freq_factor}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.family == "llama" and self.head_dim % 2:
            raise ConfigError(f"RoPE needs an even head_dim, got {self.head_dim}")
        if self.draft_vocab is not None:
            ids = np.asarray(self.draft_vocab)
            if self.family != "llama" or not len(ids) or ids.ndim != 1 or ids.dtype.kind not in "iu":
                raise ConfigError(f"draft_vocab needs the llama family and a non-empty list of token ids, got "
                                  f"{self.family!r} with {ids.size} entries of type {ids.dtype}")
            if ids.min() < 0 or ids.max() >= self.vocab_size or len(np.unique(ids)) != len(ids):
                raise ConfigError(f"draft_vocab must hold distinct token ids in [0, {self.vocab_size}), got "
                                  f"min {ids.min()}, max {ids.max()}, {len(ids) - len(np.unique(ids))} repeats")
        if self.family == "opt" and self.num_kv_heads != self.num_heads:  # OPT's k/v projections have every head
            raise ConfigError(f"OPT has no grouped-query attention: num_kv_heads must equal num_heads, got "
                              f"{self.num_kv_heads} and {self.num_heads}")
        if self.family == "llama":  # OPT's variants: a LLaMA would compute without them, silently
            opt_only = [f"{name}={value!r}" for name, value, default in (
                ("do_layer_norm_before", self.do_layer_norm_before, True),
                ("final_layer_norm", self.final_layer_norm, True),
                ("enable_bias", self.enable_bias, True)) if value != default]
            if self.word_embed_proj_dim not in (None, self.hidden_size):
                opt_only.append(f"word_embed_proj_dim={self.word_embed_proj_dim}")
            if opt_only:
                raise ConfigError(f"{', '.join(opt_only)}: OPT-only settings, which the llama family does not have")
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
    def from_dict(cls, d: Mapping[str, Any], source: str = "config") -> "ModelConfig":
        """Inverse of ``to_dict`` (a specjax checkpoint's config); malformed input is a ConfigError."""
        if not isinstance(d, Mapping):
            raise ConfigError(f"{source}: expected a JSON object, got {type(d).__name__}")
        d = dict(d)
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ConfigError(f"{source}: unknown ModelConfig fields {sorted(unknown)}")
        try:
            if d.get("rope_scaling") is not None:
                d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
            d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
            if d.get("draft_vocab") is not None:
                d["draft_vocab"] = tuple(d["draft_vocab"])
            return cls(**d)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None
        except TypeError as e:  # missing fields, a non-mapping rope_scaling, a non-list token list
            raise ConfigError(f"{source}: malformed ModelConfig ({e})") from None


def _require(d: Mapping[str, Any], key: str, source: str):
    if key not in d or d[key] is None:
        raise ConfigError(f"{source}: required key {key!r} is missing")
    return d[key]


def _as_int(value, key: str, source: str, minimum: int | None = 1) -> int:
    """A JSON integer (not a bool, not a float with a fraction, not a string) >= minimum."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ConfigError(f"{source}: {key!r} must be an integer, got {value!r}")
    if isinstance(value, (float, np.floating)) and not float(value).is_integer():
        raise ConfigError(f"{source}: {key!r} must be an integer, got {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ConfigError(f"{source}: {key!r} must be >= {minimum}, got {value}")
    if value >= 2**31:
        raise ConfigError(f"{source}: {key!r} = {value} is beyond the supported range (< 2**31)")
    return value


def _as_float(value, key: str, source: str, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ConfigError(f"{source}: {key!r} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or (positive and value <= 0):
        raise ConfigError(f"{source}: {key!r} must be a finite{' positive' if positive else ''} number, got {value}")
    return value


def _as_bool(value, key: str, source: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ConfigError(f"{source}: {key!r} must be true or false, got {value!r}")
    return bool(value)


class _Reader:
    """Typed access to one configuration mapping; every error names the source and the key."""

    def __init__(self, d, source: str, prefix: str = ""):
        if not isinstance(d, Mapping):
            raise ConfigError(f"{source}: expected a JSON object (key/value mapping), got {type(d).__name__}")
        self.d, self.source, self.prefix = d, source, prefix

    def _value(self, key: str, default, required: bool):
        full = self.prefix + key
        value = self.d.get(full)
        if value is None:
            if required:
                raise ConfigError(f"{self.source}: required key {full!r} is missing")
            return None if default is None else default
        return value

    def int(self, key: str, default=None, required: bool = False, minimum: int | None = 1):
        value = self._value(key, default, required)
        return None if value is None else _as_int(value, self.prefix + key, self.source, minimum)

    def float(self, key: str, default=None, required: bool = False, positive: bool = False):
        value = self._value(key, default, required)
        return None if value is None else _as_float(value, self.prefix + key, self.source, positive)

    def bool(self, key: str, default=None):
        value = self._value(key, default, False)
        return None if value is None else _as_bool(value, self.prefix + key, self.source)

    def str(self, key: str, default=None):
        value = self._value(key, default, False)
        if value is not None and not isinstance(value, str):
            raise ConfigError(f"{self.source}: {self.prefix + key!r} must be a string, got {value!r}")
        return value

    def token_id(self, key: str):
        return self.int(key, minimum=0)

    def unused_token_id(self, key: str, vocab_size: int):
        """A token id specjax never uses (BOS, which tokenizers add; padding): one naming no token (early
        LLaMA conversions: ``"pad_token_id": -1``) is read as none with a warning, as transformers runs it."""
        value = self.int(key, minimum=None)
        if value is None or 0 <= value < vocab_size:
            return value
        warnings.warn(f"{self.source}: {self.prefix + key!r} is {value}, not a token id of the vocabulary "
                      f"[0, {vocab_size}); read as none (specjax does not use it)", stacklevel=2)

    def token_ids(self, key: str) -> tuple[int, ...]:
        value = self.d.get(self.prefix + key)
        if value is None:
            return ()
        values = value if isinstance(value, (list, tuple)) else [value]
        return tuple(_as_int(v, self.prefix + key, self.source, minimum=0) for v in values)


def _rope_from_hf(r: _Reader) -> tuple[float, RopeScaling | None]:
    source = r.source
    params = r.d.get("rope_parameters")  # transformers >= 5
    if params is None:
        params = r.d.get("rope_scaling") or {}
        if not isinstance(params, Mapping):
            raise ConfigError(f"{source}: 'rope_scaling' must be an object, got {params!r}")
        params = dict(params)
        params.setdefault("rope_theta", r.d.get("rope_theta", 10000.0))
    p = _Reader(params, f"{source} (rope parameters)")
    theta = p.float("rope_theta", r.float("rope_theta", 10000.0, positive=True), positive=True)
    kind = p.str("rope_type", p.str("type", "default"))
    if kind == "default":
        factor = p.float("factor")
        if factor not in (None, 1.0):  # transformers would drop it; a factor says scaling was meant
            raise ConfigError(f"{source}: a RoPE scaling factor of {factor} without a scaling type ('rope_type': "
                              f"'linear', 'llama3', ...): say which scaling it is")
        return theta, None
    if kind == "linear":
        return theta, RopeScaling("linear", p.float("factor", required=True, positive=True))
    if kind == "llama3":
        return theta, RopeScaling(
            "llama3",
            factor=p.float("factor", required=True, positive=True),
            low_freq_factor=p.float("low_freq_factor", required=True, positive=True),
            high_freq_factor=p.float("high_freq_factor", required=True, positive=True),
            original_max_position_embeddings=p.int("original_max_position_embeddings", required=True),
        )
    raise ConfigError(f"{source}: unsupported RoPE scaling type {kind!r} (supported: default, linear, llama3)")


def _head_dim(r: _Reader, hidden: int, heads: int) -> int:
    head_dim = r.int("head_dim")
    if head_dim is not None:
        return head_dim
    if hidden % heads:
        raise ConfigError(f"{r.source}: hidden_size={hidden} is not a multiple of num_attention_heads={heads} "
                          f"(and no head_dim is given)")
    return hidden // heads


def _build(source: str, **fields) -> ModelConfig:
    """ModelConfig(**fields); its own validation errors are prefixed with the source file."""
    try:
        return ModelConfig(**fields)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def config_from_hf(d: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
    """Build a ModelConfig from a HuggingFace config dictionary. Any malformed value is a ConfigError
    naming the key."""
    r = _Reader(d, source)
    model_type = r.d.get("model_type")
    if model_type == "llama":
        heads = r.int("num_attention_heads", required=True)
        hidden = r.int("hidden_size", required=True)
        theta, scaling = _rope_from_hf(r)
        act = r.str("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{source}: LLaMA hidden_act {act!r} is not supported (only 'silu')")
        return _build(
            source,
            family="llama",
            vocab_size=r.int("vocab_size", required=True),
            hidden_size=hidden,
            intermediate_size=r.int("intermediate_size", required=True),
            num_layers=r.int("num_hidden_layers", required=True),
            num_heads=heads,
            num_kv_heads=r.int("num_key_value_heads", heads),
            head_dim=_head_dim(r, hidden, heads),
            max_position_embeddings=r.int("max_position_embeddings", 2048),
            norm_eps=r.float("rms_norm_eps", 1e-6, positive=True),
            tie_word_embeddings=r.bool("tie_word_embeddings", False),
            rope_theta=theta,
            rope_scaling=scaling,
            attention_bias=r.bool("attention_bias", False),
            mlp_bias=r.bool("mlp_bias", False),
            bos_token_id=r.unused_token_id("bos_token_id", r.int("vocab_size", required=True)),
            eos_token_ids=r.token_ids("eos_token_id"),
            pad_token_id=r.unused_token_id("pad_token_id", r.int("vocab_size", required=True)),
        )
    if model_type == "opt":
        heads = r.int("num_attention_heads", required=True)
        hidden = r.int("hidden_size", required=True)
        act = r.str("activation_function", "relu")
        if act != "relu":
            raise ConfigError(f"{source}: OPT activation_function {act!r} is not supported (only 'relu')")
        if not r.bool("layer_norm_elementwise_affine", True):
            raise ConfigError(f"{source}: OPT layer_norm_elementwise_affine=False is not supported")
        if hidden % heads:
            raise ConfigError(f"{source}: OPT hidden_size={hidden} is not a multiple of num_attention_heads={heads}")
        before = r.bool("do_layer_norm_before", True)
        return _build(
            source,
            family="opt",
            vocab_size=r.int("vocab_size", required=True),
            hidden_size=hidden,
            intermediate_size=r.int("ffn_dim", required=True),
            num_layers=r.int("num_hidden_layers", required=True),
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=hidden // heads,
            max_position_embeddings=r.int("max_position_embeddings", required=True),
            norm_eps=1e-5,  # torch.nn.LayerNorm default, which OPT uses
            tie_word_embeddings=r.bool("tie_word_embeddings", True),
            do_layer_norm_before=before,
            word_embed_proj_dim=r.int("word_embed_proj_dim", hidden),
            final_layer_norm=before and not r.bool("_remove_final_layer_norm", False),
            enable_bias=r.bool("enable_bias", True),
            bos_token_id=r.unused_token_id("bos_token_id", r.int("vocab_size", required=True)),
            eos_token_ids=r.token_ids("eos_token_id"),
            pad_token_id=r.unused_token_id("pad_token_id", r.int("vocab_size", required=True)),
        )
    raise ConfigError(f"{source}: unsupported architecture model_type={model_type!r} "
                      f"(architectures={r.d.get('architectures')}); supported: 'llama', 'opt'")


def _read_json(path, what: str = "config.json") -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, expected a {what} file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:
        raise ConfigError(f"{path}: JSON nested too deeply") from None


def config_from_hf_file(path: str | os.PathLike) -> ModelConfig:
    """An HF directory's config.json, with the end-of-sequence ids of the ``generation_config.json`` beside
    it added (transformers' ``generate`` stops at those: Llama-3-Instruct's end-of-turn 128009 is only there)."""
    cfg = config_from_hf(_read_json(path), source=str(path))
    gen_path = os.path.join(os.path.dirname(os.fspath(path)), "generation_config.json")
    if not os.path.exists(gen_path):
        return cfg
    gen = _read_json(gen_path, "generation_config.json")
    if not isinstance(gen, Mapping):
        raise ConfigError(f"{gen_path}: expected a JSON object (key/value mapping), got {type(gen).__name__}")
    extra = _Reader(gen, gen_path).token_ids("eos_token_id")
    merged = cfg.eos_token_ids + tuple(dict.fromkeys(t for t in extra if t not in cfg.eos_token_ids))
    if merged == cfg.eos_token_ids:
        return cfg
    try:
        return dataclasses.replace(cfg, eos_token_ids=merged)
    except ConfigError as e:
        raise ConfigError(f"{gen_path}: {e}") from None


def _rope_from_gguf(r: _Reader) -> RopeScaling | None:
    """llama.cpp's reading: the factor is ``rope.scaling.factor``, else the older ``rope.scale_linear``; a
    factor without a type is linear scaling. A factor other than 1 beside type "none" is refused, not
    dropped: one of the two keys is wrong, and guessing would change every position's rotation."""
    factor = r.float("rope.scaling.factor", positive=True)
    if factor is None:
        factor = r.float("rope.scale_linear", positive=True)
    kind = r.str("rope.scaling.type", "linear" if factor not in (None, 1.0) else "none")
    if kind == "linear":
        if factor is None:
            raise ConfigError(f"{r.source}: GGUF rope scaling type 'linear' needs 'llama.rope.scaling.factor' (or "
                              f"'llama.rope.scale_linear')")
        return RopeScaling("linear", factor)
    if kind != "none":
        raise ConfigError(f"{r.source}: GGUF rope scaling type {kind!r} is not supported (none, linear)")
    if factor not in (None, 1.0):
        raise ConfigError(f"{r.source}: GGUF rope scaling type 'none' beside a scaling factor of {factor}: one of "
                          f"them is wrong")
    return None


def config_from_gguf(fields: Mapping[str, Any], source: str, vocab_size: int | None = None) -> ModelConfig:
    """Build a ModelConfig from GGUF metadata (already decoded to Python values)."""
    arch = fields.get("general.architecture")
    if arch != "llama":
        raise ConfigError(f"{source}: unsupported GGUF architecture {arch!r} (supported: 'llama')")
    r = _Reader(fields, source, prefix="llama.")
    t = _Reader(fields, source, prefix="tokenizer.ggml.")
    heads = r.int("attention.head_count", required=True)
    hidden = r.int("embedding_length", required=True)
    scaling = _rope_from_gguf(r)
    vocab = r.int("vocab_size") or vocab_size
    if vocab is None:
        raise ConfigError(f"{source}: neither 'llama.vocab_size' nor a token list gives the vocabulary size")
    # llama.cpp's head width: attention.key_length, else hidden / heads; RoPE rotates rope.dimension_count
    # of it (default: all; llama.cpp refuses a llama that rotates less). specjax rotates whole heads, and
    # values as wide as keys.
    key_length, value_length = r.int("attention.key_length"), r.int("attention.value_length")
    rope_dims = r.int("rope.dimension_count")
    head_dim = key_length
    if head_dim is None:
        if hidden % heads:
            raise ConfigError(f"{source}: embedding_length={hidden} is not a multiple of head_count={heads}")
        head_dim = hidden // heads
    if rope_dims not in (None, head_dim):
        raise ConfigError(f"{source}: 'llama.rope.dimension_count'={rope_dims} rotates part of a head of "
                          f"{head_dim} ('llama.attention.key_length', else embedding_length / head_count); partial "
                          f"rotary embeddings are not supported")
    if value_length not in (None, head_dim):
        raise ConfigError(f"{source}: 'llama.attention.value_length'={value_length} differs from the key length "
                          f"{head_dim}; specjax needs values as wide as keys")
    return _build(
        source,
        family="llama",
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=r.int("feed_forward_length", required=True),
        num_layers=r.int("block_count", required=True),
        num_heads=heads,
        num_kv_heads=r.int("attention.head_count_kv", heads),
        head_dim=head_dim,
        max_position_embeddings=r.int("context_length", required=True),
        norm_eps=r.float("attention.layer_norm_rms_epsilon", required=True, positive=True),
        tie_word_embeddings=True,  # corrected by the loader when an output.weight tensor exists
        rope_theta=r.float("rope.freq_base", 10000.0, positive=True),
        rope_scaling=scaling,
        bos_token_id=t.token_id("bos_token_id"),
        eos_token_ids=t.token_ids("eos_token_id"),
        pad_token_id=t.token_id("padding_token_id"),
    )
