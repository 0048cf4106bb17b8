"""Student SSMs for distillation: a few of the LLM's own layers with a shrunk head.

A tiny model's cost is dominated by its head (SmolLM2: 49152 x 576), so a student keeps only a
*draft vocabulary* (the tokens the LLM actually writes, most frequent first) plus one "other" row,
and optionally a narrower MLP (the most important neurons of each kept layer). Everything starts
from the LLM's weights, which on a small corpus beats random init by far.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from specjax.errors import InputError
from specjax.models.params import take_layers
from specjax.types import Model


def draft_vocabulary(sequences, size: int, vocab_size: int) -> tuple[int, ...]:
    """The ``size`` most frequent continuation tokens of ``sequences`` ([(ids, prompt_len), ...]);
    ties and never-seen fillers go by token id, so the choice is deterministic."""
    if not 1 <= size <= vocab_size - 1:
        raise InputError(f"draft vocabulary size must be in [1, {vocab_size - 1}], got {size}")
    counts = np.zeros((vocab_size,), np.int64)
    for ids, prompt_len in sequences:
        np.add.at(counts, np.asarray(ids[prompt_len:], np.int64), 1)
    order = np.lexsort((np.arange(vocab_size), -counts))  # count desc, then id asc
    return tuple(int(i) for i in order[:size])


def _neuron_order(layers: dict, keep: int) -> np.ndarray:
    """Per layer, the ``keep`` MLP neurons with the largest |up column| * |down row| (sorted ids)."""
    score = np.linalg.norm(layers["w_up"], axis=1) * np.linalg.norm(layers["w_down"], axis=2)  # [L, F]
    return np.sort(np.argsort(-score, axis=1, kind="stable")[:, :keep], axis=1)


def make_student(llm: Model, sequences, layers=(0, 1), draft_vocab_size: int = 8192,
                 mlp_size: int | None = None) -> Model:
    """A student initialised from ``llm``: its layers ``layers`` (MLP cut to ``mlp_size`` neurons),
    final norm, and the embedding/head rows of the draft vocabulary chosen from ``sequences`` (the
    "other" row starts as the mean of the remaining rows). Shares the LLM's tokenizer."""
    cfg = llm.config
    if cfg.family != "llama" or cfg.draft_vocab is not None:
        raise InputError("students are cut from a full-vocabulary LLaMA-family LLM")
    idx = [int(i) for i in layers]
    if not idx or idx != sorted(set(idx)) or idx[0] < 0 or idx[-1] >= cfg.num_layers:
        raise InputError(f"student layers must be increasing indices in 0..{cfg.num_layers - 1}, got {layers!r}")
    mlp = cfg.intermediate_size if mlp_size is None else int(mlp_size)
    if not 1 <= mlp <= cfg.intermediate_size:
        raise InputError(f"mlp_size must be in [1, {cfg.intermediate_size}], got {mlp_size}")
    ids = draft_vocabulary(sequences, draft_vocab_size, cfg.vocab_size)
    p = jax.tree.map(lambda a: np.asarray(a, np.float32), llm.params)
    rest = np.ones((cfg.vocab_size,), bool)
    rest[np.asarray(ids)] = False
    lay = dict(take_layers(p, idx))
    if mlp < cfg.intermediate_size:
        keep = _neuron_order(lay, mlp)
        cols = keep[:, None, :]  # w_gate / w_up [L, D, F]: neurons on axis 2
        lay["w_gate"] = np.take_along_axis(lay["w_gate"], cols, axis=2)
        lay["w_up"] = np.take_along_axis(lay["w_up"], cols, axis=2)
        lay["w_down"] = np.take_along_axis(lay["w_down"], keep[:, :, None], axis=1)  # [L, F, D]
        if cfg.mlp_bias:
            lay["b_gate"] = np.take_along_axis(lay["b_gate"], keep, axis=1)
            lay["b_up"] = np.take_along_axis(lay["b_up"], keep, axis=1)
    params = {"embed": np.concatenate([p["embed"][np.asarray(ids)], p["embed"][rest].mean(0, keepdims=True)]),
              "layers": lay, "final_norm": p["final_norm"]}
    if not cfg.tie_word_embeddings:
        head = p["lm_head"]
        params["lm_head"] = np.concatenate([head[:, np.asarray(ids)], head[:, rest].mean(1, keepdims=True)], 1)
    scfg = dataclasses.replace(cfg, num_layers=len(idx), intermediate_size=mlp, draft_vocab=ids)
    return Model(scfg, jax.tree.map(jax.numpy.asarray, params), llm.tokenizer)


def param_count(model: Model) -> int:
    return int(sum(np.size(a) for a in jax.tree.leaves(model.params)))
