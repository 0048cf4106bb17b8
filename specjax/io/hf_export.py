"""Export a LLaMA-family model (e.g. an SSM) as a HuggingFace directory, so transformers can use it."""

from __future__ import annotations

import json
import os

import jax
import numpy as np

from specjax.errors import InputError
from specjax.models.llama import draft_rows
from specjax.types import Model

DRAFT_VOCAB_FILE = "specjax_draft_vocab.json"


def draft_vocab_mask(hf_dir: str, vocab_size: int) -> np.ndarray | None:
    """[vocab_size] float32 additive logit mask (0 on the draft vocabulary, -inf elsewhere) of an
    exported SSM, or None when it has the full vocabulary."""
    path = os.path.join(hf_dir, DRAFT_VOCAB_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        ids = json.load(f)
    mask = np.full((vocab_size,), -np.inf, np.float32)
    mask[np.asarray(ids, np.int64)] = 0.0
    return mask


def export_hf(model: Model, path: str) -> None:
    """Write a LLaMA-family model as an HF directory (config.json + model.safetensors + tokenizer),
    e.g. so transformers can use an SSM as ``assistant_model``. Inverse of the loader's key map.

    A model with a draft vocabulary is written with the full vocabulary (every token outside it
    embeds as the "other" row; its head column is zero) plus ``DRAFT_VOCAB_FILE``: transformers must
    add ``draft_vocab_mask`` to the logits (e.g. a forward hook on lm_head) to get the same model."""
    from safetensors.numpy import save_file

    cfg = model.config
    if cfg.family != "llama":
        raise InputError(f"HF export supports the llama family only, got {cfg.family!r}")
    os.makedirs(path, exist_ok=True)
    p = jax.tree.map(lambda a: np.asarray(a, np.float32), model.params)
    lay = p["layers"]
    tensors = {"model.embed_tokens.weight": p["embed"], "model.norm.weight": p["final_norm"]}
    tied = cfg.tie_word_embeddings
    if cfg.draft_vocab is not None:

        head = p["embed"] if tied else p["lm_head"].T  # [rows, D]
        full_head = np.zeros((cfg.vocab_size, head.shape[1]), np.float32)
        full_head[np.asarray(cfg.draft_vocab)] = head[:-1]
        tensors["model.embed_tokens.weight"] = p["embed"][draft_rows(cfg)]
        p["lm_head"], tied = full_head.T, False
        with open(os.path.join(path, DRAFT_VOCAB_FILE), "w") as f:
            json.dump(list(cfg.draft_vocab), f)
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        tensors[pre + "input_layernorm.weight"] = lay["attn_norm"][i]
        tensors[pre + "post_attention_layernorm.weight"] = lay["mlp_norm"][i]
        for name, key in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj")):
            w = lay[name][i]  # [D, H, Dh]
            tensors[pre + f"self_attn.{key}.weight"] = w.reshape(w.shape[0], -1).T
        wo = lay["wo"][i]  # [H, Dh, D]
        tensors[pre + "self_attn.o_proj.weight"] = wo.reshape(-1, wo.shape[-1]).T
        for name, key in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
            tensors[pre + f"mlp.{key}.weight"] = lay[name][i].T
        if cfg.attention_bias or cfg.mlp_bias:
            raise InputError("HF export of bias terms is not implemented")
    if not tied:
        tensors["lm_head.weight"] = p["lm_head"].T
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))
    hf = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": cfg.vocab_size,
          "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
          "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
          "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
          "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.norm_eps,
          "rope_theta": cfg.rope_theta, "tie_word_embeddings": tied,
          "hidden_act": "silu", "torch_dtype": "float32", "bos_token_id": cfg.bos_token_id,
          "eos_token_id": list(cfg.eos_token_ids) or None, "pad_token_id": cfg.pad_token_id}
    if cfg.rope_scaling is not None:
        rs = cfg.rope_scaling
        hf["rope_scaling"] = {"rope_type": rs.kind, "factor": rs.factor} if rs.kind == "linear" else {
            "rope_type": "llama3", "factor": rs.factor, "low_freq_factor": rs.low_freq_factor,
            "high_freq_factor": rs.high_freq_factor,
            "original_max_position_embeddings": rs.original_max_position_embeddings}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=1)
    if model.tokenizer is not None:
        model.tokenizer.save_pretrained(path)
