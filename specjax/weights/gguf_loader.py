"""GGUF files of llama architecture via the ``gguf`` package: dequantize, undo Q/K permutation."""

from __future__ import annotations

import os

import numpy as np

from specjax.config import ModelConfig, config_from_gguf
from specjax.errors import CheckpointError
from specjax.weights.keymap import HEADS_IN, HEADS_OUT, LINEAR, KeyMapEntry, load_params


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


def _field_value(field):
    try:
        return field.contents()
    except Exception:  # noqa: BLE001 - gguf raises assorted errors on unusual field types
        return None


def read_gguf_metadata(path: str):
    from gguf import GGUFReader

    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: GGUF file not found")
    try:
        reader = GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - corrupt files surface as many exception types
        raise CheckpointError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    skip = {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"}
    fields = {k: _field_value(f) for k, f in reader.fields.items() if k not in skip}
    n_tokens = len(reader.fields["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in reader.fields else None
    return reader, fields, n_tokens


def load_gguf(path: str, dtype=np.float32, progress: bool = True) -> tuple[ModelConfig, dict]:
    from gguf.quants import dequantize

    reader, fields, n_tokens = read_gguf_metadata(path)
    cfg = config_from_gguf(fields, source=path, vocab_size=n_tokens)
    tensors = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in tensors:
        raise CheckpointError(f"{path}: tensor 'rope_freqs.weight' (llama3 RoPE factors in GGUF) is not "
                              f"supported yet; load the HF directory of this model instead")
    if "output.weight" in tensors:
        import dataclasses
        cfg = dataclasses.replace(cfg, tie_word_embeddings=False)

    def get(name: str) -> np.ndarray:
        t = tensors[name]
        try:
            return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{path}: cannot dequantize tensor {name!r} "
                                  f"({t.tensor_type.name}): {e}") from None

    params = load_params(cfg, gguf_table(cfg), list(tensors), get, source=path, dtype=dtype, progress=progress)
    return cfg, params
