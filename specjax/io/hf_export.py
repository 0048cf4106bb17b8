"""Export a LLaMA-family model (e.g. an SSM) as a HuggingFace directory, so transformers can use it."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np

from specjax.errors import InputError
from specjax.io.checkpoint import check_destination, written_aside
from specjax.io.hf import DRAFT_VOCAB_FILE, LLAMA_HF, hf_dir_config
from specjax.io.keymap import export_params
from specjax.models.llama import draft_rows
from specjax.models.params import stack_layers
from specjax.types import Model


def draft_vocab_mask(hf_dir: str, vocab_size: int) -> np.ndarray | None:
    """[vocab_size] float32 additive logit mask (0 on the draft vocabulary, -inf elsewhere) of an
    exported SSM, or None when it has the full vocabulary."""
    if not os.path.exists(os.path.join(hf_dir, DRAFT_VOCAB_FILE)):
        return None
    ids = hf_dir_config(hf_dir).draft_vocab  # the list beside the export, read and checked as the loader does
    mask = np.full((vocab_size,), -np.inf, np.float32)
    mask[np.asarray(ids, np.int64)] = 0.0
    return mask


def export_hf(model: Model, path: str) -> None:
    """Write a LLaMA-family model as an HF directory (config.json + model.safetensors + tokenizer),
    e.g. so transformers can use an SSM as ``assistant_model``. Inverse of the loader's key map.

    A model with a draft vocabulary is written with the full vocabulary (every token outside it
    embeds as the "other" row; its head column is zero) plus ``DRAFT_VOCAB_FILE``: transformers must
    add ``draft_vocab_mask`` to the logits (e.g. a forward hook on lm_head) to get the same model;
    ``specjax.load_model`` reads it back as the model it was. ``path``: a new or empty directory."""
    cfg = model.config
    if cfg.family != "llama":
        raise InputError(f"HF export supports the llama family only, got {cfg.family!r}")
    # A new or empty directory, written aside and renamed into place: files of an earlier model left there
    # (shards and their index beside the new model.safetensors) would be loaded with the new config.
    path = check_destination(path)
    with written_aside(path) as tmp:
        _write_hf(model, cfg, tmp)


def _write_hf(model: Model, cfg, path: str) -> None:
    from safetensors.numpy import save_file

    p = stack_layers(jax.tree.map(lambda a: np.asarray(a, np.float32), model.params))
    tied = cfg.tie_word_embeddings
    if cfg.draft_vocab is not None:  # back to the full vocabulary, untied (see the docstring)
        head = p["embed"] if tied else p["lm_head"].T  # [rows, D]
        full_head = np.zeros((cfg.vocab_size, head.shape[1]), np.float32)
        full_head[np.asarray(cfg.draft_vocab)] = head[:-1]
        p = dict(p, embed=p["embed"][draft_rows(cfg)], lm_head=full_head.T)
        cfg, tied = dataclasses.replace(cfg, draft_vocab=None, tie_word_embeddings=False), False
        with open(os.path.join(path, DRAFT_VOCAB_FILE), "w") as f:
            json.dump(list(model.config.draft_vocab), f)
    tensors = export_params(cfg, LLAMA_HF, p)  # the loader's own key-map table, inverted
    save_file(tensors, os.path.join(path, "model.safetensors"))
    hf = hf_config(cfg, tied)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=1)
    if model.tokenizer is not None:
        model.tokenizer.save_pretrained(path)


def hf_config(cfg, tied: bool | None = None) -> dict:
    """The transformers ``config.json`` of a LLaMA-family config (``tied`` defaults to the config's own)."""
    if cfg.family != "llama":
        raise InputError(f"HF export supports the llama family only, got {cfg.family!r}")
    tied = cfg.tie_word_embeddings if tied is None else tied
    hf = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": cfg.vocab_size,
          "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
          "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
          "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
          "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.norm_eps,
          "rope_theta": cfg.rope_theta, "tie_word_embeddings": tied,
          "hidden_act": "silu", "torch_dtype": "float32", "bos_token_id": cfg.bos_token_id,
          "attention_bias": bool(cfg.attention_bias), "mlp_bias": bool(cfg.mlp_bias),
          "eos_token_id": list(cfg.eos_token_ids) or None, "pad_token_id": cfg.pad_token_id}
    if cfg.rope_scaling is not None:
        rs = cfg.rope_scaling
        hf["rope_scaling"] = {"rope_type": rs.kind, "factor": rs.factor} if rs.kind == "linear" else {
            "rope_type": "llama3", "factor": rs.factor, "low_freq_factor": rs.low_freq_factor,
            "high_freq_factor": rs.high_freq_factor,
            "original_max_position_embeddings": rs.original_max_position_embeddings}
    return hf
