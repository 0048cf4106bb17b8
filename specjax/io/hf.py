"""HuggingFace model directories: config.json + safetensors (single or sharded), torch-free."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from specjax.config import ModelConfig, config_from_hf_file
from specjax.errors import CheckpointError, ConfigError
from specjax.io.keymap import (
    HEADS_BIAS,
    HEADS_IN,
    HEADS_OUT,
    LINEAR,
    KeyMapEntry,
    load_params,
)
from specjax.io.safetensors import open_hf_weights

E = KeyMapEntry

LLAMA_HF = [
    E("embed", "model.embed_tokens.weight"),
    E("layers.attn_norm", "model.layers.{i}.input_layernorm.weight"),
    E("layers.wq", "model.layers.{i}.self_attn.q_proj.weight", HEADS_IN),
    E("layers.wk", "model.layers.{i}.self_attn.k_proj.weight", HEADS_IN),
    E("layers.wv", "model.layers.{i}.self_attn.v_proj.weight", HEADS_IN),
    E("layers.wo", "model.layers.{i}.self_attn.o_proj.weight", HEADS_OUT),
    E("layers.bq", "model.layers.{i}.self_attn.q_proj.bias", HEADS_BIAS),
    E("layers.bk", "model.layers.{i}.self_attn.k_proj.bias", HEADS_BIAS),
    E("layers.bv", "model.layers.{i}.self_attn.v_proj.bias", HEADS_BIAS),
    E("layers.bo", "model.layers.{i}.self_attn.o_proj.bias"),
    E("layers.mlp_norm", "model.layers.{i}.post_attention_layernorm.weight"),
    E("layers.w_gate", "model.layers.{i}.mlp.gate_proj.weight", LINEAR),
    E("layers.w_up", "model.layers.{i}.mlp.up_proj.weight", LINEAR),
    E("layers.w_down", "model.layers.{i}.mlp.down_proj.weight", LINEAR),
    E("layers.b_gate", "model.layers.{i}.mlp.gate_proj.bias"),
    E("layers.b_up", "model.layers.{i}.mlp.up_proj.bias"),
    E("layers.b_down", "model.layers.{i}.mlp.down_proj.bias"),
    E("final_norm", "model.norm.weight"),
    E("lm_head", "lm_head.weight", LINEAR),
]

_D = "model.decoder."
_L = _D + "layers.{i}."
OPT_HF = [
    E("embed", _D + "embed_tokens.weight"),
    E("pos_embed", _D + "embed_positions.weight"),
    E("project_in", _D + "project_in.weight", LINEAR),
    E("project_out", _D + "project_out.weight", LINEAR),
    E("final_norm_scale", _D + "final_layer_norm.weight"),
    E("final_norm_bias", _D + "final_layer_norm.bias"),
    E("layers.attn_norm_scale", _L + "self_attn_layer_norm.weight"),
    E("layers.attn_norm_bias", _L + "self_attn_layer_norm.bias"),
    E("layers.wq", _L + "self_attn.q_proj.weight", HEADS_IN),
    E("layers.wk", _L + "self_attn.k_proj.weight", HEADS_IN),
    E("layers.wv", _L + "self_attn.v_proj.weight", HEADS_IN),
    E("layers.wo", _L + "self_attn.out_proj.weight", HEADS_OUT),
    E("layers.bq", _L + "self_attn.q_proj.bias", HEADS_BIAS),
    E("layers.bk", _L + "self_attn.k_proj.bias", HEADS_BIAS),
    E("layers.bv", _L + "self_attn.v_proj.bias", HEADS_BIAS),
    E("layers.bo", _L + "self_attn.out_proj.bias"),
    E("layers.mlp_norm_scale", _L + "final_layer_norm.weight"),
    E("layers.mlp_norm_bias", _L + "final_layer_norm.bias"),
    E("layers.fc1", _L + "fc1.weight", LINEAR),
    E("layers.fc1_bias", _L + "fc1.bias"),
    E("layers.fc2", _L + "fc2.weight", LINEAR),
    E("layers.fc2_bias", _L + "fc2.bias"),
    E("lm_head", "lm_head.weight", LINEAR),
]

TABLES = {"llama": LLAMA_HF, "opt": OPT_HF}
# An SSM's draft vocabulary beside its HF export (specjax.io.hf_export), read back by load_hf_dir.
DRAFT_VOCAB_FILE = "specjax_draft_vocab.json"
_EMBED_KEY = {"llama": "model.embed_tokens.weight", "opt": _D + "embed_tokens.weight"}


def hf_dir_config(model_dir: str) -> ModelConfig:
    """The config of an HF directory as ``load_hf_dir`` loads it (``describe_model`` reads the same): its
    config.json, generation_config.json's eos ids, and an exported SSM's draft vocabulary."""
    cfg = config_from_hf_file(os.path.join(model_dir, "config.json"))
    path = os.path.join(model_dir, DRAFT_VOCAB_FILE)
    if not os.path.exists(path):
        return cfg
    try:
        with open(path, encoding="utf-8") as f:
            ids = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if cfg.family != "llama" or cfg.tie_word_embeddings:
        raise CheckpointError(f"{path}: a draft vocabulary belongs to an untied llama-family export "
                              f"(specjax.io.hf_export.export_hf), and {model_dir} is not one")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise CheckpointError(f"{path}: expected a JSON list of token ids")
    try:
        return dataclasses.replace(cfg, draft_vocab=tuple(ids))
    except ConfigError as e:
        raise CheckpointError(f"{path}: {e}") from None


def load_hf_dir(model_dir: str, dtype=np.float32, progress: bool = True) -> tuple[ModelConfig, dict]:
    if not os.path.isdir(model_dir):
        raise CheckpointError(f"{model_dir}: not a directory")
    cfg = hf_dir_config(model_dir)
    draft_vocab, cfg = cfg.draft_vocab, dataclasses.replace(cfg, draft_vocab=None)  # the file holds every token
    keys, get, shape = open_hf_weights(model_dir)
    if cfg.family == "opt" and keys and all(k.startswith("decoder.") or k == "lm_head.weight" for k in keys):
        # Saved from OPTModel rather than OPTForCausalLM: same tensors without the "model." prefix.
        raw_get, raw_shape = get, shape
        keys = [k if k == "lm_head.weight" else "model." + k for k in keys]
        stored = lambda k: k if k == "lm_head.weight" else k[len("model."):]  # noqa: E731
        get, shape = (lambda k: raw_get(stored(k))), (lambda k: raw_shape(stored(k)))
    ignored = {}
    if cfg.tie_word_embeddings and "lm_head.weight" in keys:
        # Some exporters write the tied head out; accept it only if it really is the embedding (a missing
        # embedding is reported by name below).
        embed = _EMBED_KEY[cfg.family]
        if embed in keys and not np.array_equal(np.asarray(get("lm_head.weight")), np.asarray(get(embed))):
            raise CheckpointError(f"{model_dir}: config ties the embeddings but 'lm_head.weight' differs "
                                  f"from {embed!r}")
        ignored["lm_head.weight"] = "tied duplicate of the embedding"
    for key in keys:
        if key.endswith("rotary_emb.inv_freq"):
            ignored[key] = "recomputed from the config"
    params = load_params(cfg, TABLES[cfg.family], keys, get, shape, source=model_dir, dtype=dtype,
                         optional_ignored=ignored, progress=progress)
    if draft_vocab is not None:
        cfg, params = _restore_draft_vocab(model_dir, dataclasses.replace(cfg, draft_vocab=draft_vocab), params)
    return cfg, params


def _restore_draft_vocab(model_dir: str, cfg: ModelConfig, params: dict) -> tuple[ModelConfig, dict]:
    """An SSM with a draft vocabulary as ``export_hf`` writes it (the full vocabulary, untied, plus the list
    of draft tokens) back to the model it was: the draft tokens' rows, then one "other" row (the embedding
    of every token outside the list; its head column is never read: those logits are -inf)."""
    path = os.path.join(model_dir, DRAFT_VOCAB_FILE)
    rows = np.asarray(cfg.draft_vocab, np.int64)
    outside = np.setdiff1d(np.arange(cfg.vocab_size), rows)
    embed = np.asarray(params["embed"])
    other = embed[outside[0]] if len(outside) else np.zeros_like(embed[0])
    if len(outside) and not np.array_equal(embed[outside], np.broadcast_to(other, (len(outside), embed.shape[1]))):
        raise CheckpointError(f"{path}: the tokens outside the draft vocabulary have different embeddings, so "
                              f"{model_dir} is not a draft-vocabulary export (they all share one 'other' row)")
    head = np.asarray(params["lm_head"])  # [D, vocab]
    params = dict(params, embed=np.concatenate([embed[rows], other[None]]),
                  lm_head=np.concatenate([head[:, rows], np.zeros_like(head[:, :1])], axis=1))
    return cfg, params
