"""GGUF files of llama architecture via the ``gguf`` package: dequantize, undo Q/K permutation."""

from __future__ import annotations

import dataclasses

import numpy as np

from specjax.config import ModelConfig, config_from_gguf
from specjax.errors import CheckpointError
from specjax.io.gguf_file import GGUFFile, open_gguf
from specjax.io.keymap import HEADS_IN, HEADS_OUT, LINEAR, KeyMapEntry, load_params


def _unpermute(num_heads: int):
    """llama.cpp's converter interleaves the two RoPE halves of each head's rows; undo it."""

    def fix(w: np.ndarray) -> np.ndarray:
        rows = w.shape[0]
        if rows % (2 * num_heads):
            raise CheckpointError(f"cannot un-permute a tensor of {rows} rows for {num_heads} heads")
        return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    return fix


def gguf_table(cfg: ModelConfig) -> list[KeyMapEntry]:
    E = KeyMapEntry
    return [
        E("embed", "token_embd.weight"),
        E("layers.attn_norm", "blk.{i}.attn_norm.weight"),
        E("layers.wq", "blk.{i}.attn_q.weight", HEADS_IN, prepare=_unpermute(cfg.num_heads)),
        E("layers.wk", "blk.{i}.attn_k.weight", HEADS_IN, prepare=_unpermute(cfg.num_kv_heads)),
        E("layers.wv", "blk.{i}.attn_v.weight", HEADS_IN),
        E("layers.wo", "blk.{i}.attn_output.weight", HEADS_OUT),
        E("layers.mlp_norm", "blk.{i}.ffn_norm.weight"),
        E("layers.w_gate", "blk.{i}.ffn_gate.weight", LINEAR),
        E("layers.w_up", "blk.{i}.ffn_up.weight", LINEAR),
        E("layers.w_down", "blk.{i}.ffn_down.weight", LINEAR),
        E("final_norm", "output_norm.weight"),
        E("lm_head", "output.weight", LINEAR),
    ]


def read_gguf_metadata(path: str) -> tuple[GGUFFile, dict, int | None]:
    """(the open file, its metadata without the big tokenizer arrays, the token count or None)."""
    gguf = open_gguf(path)
    skip = {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"}
    fields = {k: v for k, v in gguf.fields.items() if k not in skip}
    tokens = gguf.fields.get("tokenizer.ggml.tokens")
    return gguf, fields, len(tokens) if isinstance(tokens, list) else None


def gguf_config(gguf: GGUFFile, fields: dict, n_tokens: int | None) -> ModelConfig:
    cfg = config_from_gguf(fields, source=gguf.path, vocab_size=n_tokens)
    if "output.weight" in gguf.tensors:
        cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
    return cfg


def load_gguf(path: str, dtype=np.float32, progress: bool = True) -> tuple[ModelConfig, dict]:
    gguf, fields, n_tokens = read_gguf_metadata(path)
    cfg = gguf_config(gguf, fields, n_tokens)
    if "rope_freqs.weight" in gguf.tensors:
        raise CheckpointError(f"{path}: tensor 'rope_freqs.weight' (llama3 RoPE factors in GGUF) is not "
                              f"supported yet; load the HF directory of this model instead")
    params = load_params(cfg, gguf_table(cfg), list(gguf.tensors), gguf.dequantized,
                         lambda name: gguf.tensors[name].shape, source=path, dtype=dtype, progress=progress)
    return cfg, params
