"""Training data of the feature drafter: the LLM's features at every position of the corpus sequences.

One teacher-forced LLM pass per sequence (prefill cost, far cheaper than generating) gives, at every
position p, the post-norm final hidden state g_p (what the LM head reads; stored as float16) and the
LLM's own next-token argmax over the full vocabulary (int32; the agreement metric's reference). One
``features-XXXXX.npz`` per corpus shard, written atomically and fingerprinted by the shard's bytes and
the model config, so an interrupted run resumes where it stopped and a changed corpus is recomputed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import numpy as np

from specjax.boost.corpus import read_shard
from specjax.errors import InputError

WIDTH_MULTIPLE = 64  # teacher batches are padded to a multiple of this: few shapes, few compiles


def _teacher_fn(model):
    import jax
    import jax.numpy as jnp

    from specjax.attention.meta import causal_meta
    from specjax.models import forward
    from specjax.models.cache import init_cache
    from specjax.models.common import rms_norm

    cfg = model.config

    @jax.jit
    def run(params, tokens):
        batch, width = tokens.shape
        cache = init_cache(cfg, batch, width, jnp.float32)
        positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
        out = forward(params, tokens, positions, cache, causal_meta(jnp.zeros((batch,), jnp.int32)), cfg,
                      hidden=(cfg.num_layers,))
        g = rms_norm(out.hidden[:, :, 0], params["final_norm"], cfg.norm_eps)
        return g.astype(jnp.float16), jnp.argmax(out.logits, axis=-1).astype(jnp.int32)

    return run


def teacher_features(model, sequences, batch_size: int = 8, run=None):
    """[(features [T, D] float16, argmax [T] int32), ...] for sequences [(ids, prompt_len), ...]."""
    import jax.numpy as jnp

    run = run or _teacher_fn(model)
    out = []
    order = np.argsort([len(s) for s, _ in sequences], kind="stable")
    results = [None] * len(sequences)
    for start in range(0, len(order), batch_size):
        index = order[start:start + batch_size]
        longest = max(len(sequences[i][0]) for i in index)
        width = -(-longest // WIDTH_MULTIPLE) * WIDTH_MULTIPLE
        padded = np.zeros((len(index), width), np.int32)
        for row, i in enumerate(index):
            padded[row, :len(sequences[i][0])] = sequences[i][0]
        g, top = run(model.params, jnp.asarray(padded))
        g, top = np.asarray(g), np.asarray(top)
        for row, i in enumerate(index):
            n = len(sequences[i][0])
            results[i] = (g[row, :n], top[row, :n])
    out.extend(results)
    return out


def _fingerprint(shard_path: str, model) -> str:
    digest = hashlib.sha256(json.dumps(model.config.to_dict()).encode())
    with open(shard_path, "rb") as f:
        digest.update(f.read())
    return digest.hexdigest()


def feature_shards(model, shard_paths, out_dir: str, batch_size: int = 8, progress: bool = True,
                   log=print) -> list[str]:
    """The features of every corpus shard (``out_dir/features-XXXXX.npz``, resumable); returns their paths."""
    from tqdm import tqdm

    os.makedirs(out_dir, exist_ok=True)
    run = None
    paths = []
    for index, shard in enumerate(tqdm(shard_paths, desc="LLM features", disable=not progress)):
        path = os.path.join(out_dir, f"features-{index:05d}.npz")
        paths.append(path)
        fingerprint = _fingerprint(shard, model)
        if os.path.exists(path):
            with np.load(path) as z:
                if str(z["fingerprint"]) == fingerprint:
                    continue
            log(f"{path}: made from another shard or model; recomputing")
        run = run or _teacher_fn(model)
        sequences = read_shard(shard)
        results = teacher_features(model, sequences, batch_size, run)
        tmp = path + ".tmp.npz"
        np.savez(tmp, features=np.concatenate([g for g, _ in results]),
                 argmax=np.concatenate([t for _, t in results]),
                 offsets=np.cumsum([0] + [len(s) for s, _ in sequences]).astype(np.int64),
                 fingerprint=np.str_(fingerprint), shard=np.str_(os.path.abspath(shard)))
        os.replace(tmp, path)
    return paths


@dataclasses.dataclass
class FeatureSet:
    """Sequences with their LLM features, flat: sequence i is rows offsets[i]:offsets[i+1].

    tokens [N] int32; features [N, D] float16 (post-norm LLM features g); argmax [N] int32 (the LLM's
    next token after each position); prompt_lens [S]; parts [S] (index into ``part_names``)."""

    tokens: np.ndarray
    features: np.ndarray
    argmax: np.ndarray
    offsets: np.ndarray
    prompt_lens: np.ndarray
    parts: np.ndarray
    part_names: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.prompt_lens)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def sequence(self, i: int):
        a, b = self.offsets[i], self.offsets[i + 1]
        return self.tokens[a:b], self.features[a:b], self.argmax[a:b], int(self.prompt_lens[i])

    def subset(self, index: np.ndarray) -> "FeatureSet":
        index = np.asarray(index)
        rows = [np.arange(self.offsets[i], self.offsets[i + 1]) for i in index]
        flat = np.concatenate(rows) if rows else np.zeros((0,), np.int64)
        return FeatureSet(self.tokens[flat], self.features[flat], self.argmax[flat],
                          np.cumsum([0] + [len(r) for r in rows]).astype(np.int64), self.prompt_lens[index],
                          self.parts[index], self.part_names)

    def continuation_tokens(self) -> int:
        return int(np.sum(self.lengths - self.prompt_lens))


def load_feature_set(parts: dict[str, tuple[list[str], list[str]]], max_len: int | None = None) -> FeatureSet:
    """parts: {name: (corpus shard paths, feature shard paths)}. Sequences longer than ``max_len`` are
    cut from the left of their prompt (the continuation is kept whole; positions restart at 0)."""
    tokens, feats, tops, lens, offs, part_ids = [], [], [], [], [0], []
    names = tuple(parts)
    for pi, name in enumerate(names):
        shards, features = parts[name]
        if len(shards) != len(features):
            raise InputError(f"part {name}: {len(shards)} corpus shards but {len(features)} feature files")
        for shard, fpath in zip(shards, features):
            sequences = read_shard(shard)
            with np.load(fpath) as z:
                f, top, o = z["features"], z["argmax"], z["offsets"]
            if len(o) != len(sequences) + 1:
                raise InputError(f"{fpath}: {len(o) - 1} sequences, its shard {shard} has {len(sequences)}")
            for i, (ids, prompt_len) in enumerate(sequences):
                cut = 0 if max_len is None else max(0, len(ids) - max_len)
                if cut >= prompt_len:
                    raise InputError(f"{shard}: a continuation of {len(ids) - prompt_len} tokens exceeds max_len "
                                     f"{max_len}")
                tokens.append(np.asarray(ids[cut:], np.int32))
                feats.append(f[o[i] + cut:o[i + 1]])
                tops.append(top[o[i] + cut:o[i + 1]])
                lens.append(prompt_len - cut)
                offs.append(offs[-1] + len(ids) - cut)
                part_ids.append(pi)
    if not tokens:
        raise InputError("no feature data: the corpus parts are empty")
    return FeatureSet(np.concatenate(tokens), np.concatenate(feats), np.concatenate(tops), np.asarray(offs, np.int64),
                      np.asarray(lens, np.int32), np.asarray(part_ids, np.int32), names)


def split_held_out(data: FeatureSet, fraction: float, seed: int = 0) -> tuple[FeatureSet, FeatureSet]:
    """(train, held out): a seeded ``fraction`` of the sequences (each from a distinct prompt) held out."""
    order = np.random.default_rng(seed).permutation(len(data))
    n = max(1, int(round(len(data) * fraction)))
    return data.subset(np.sort(order[n:])), data.subset(np.sort(order[:n]))


def draft_vocabulary(data: FeatureSet, size: int, vocab_size: int) -> tuple[tuple[int, ...], float]:
    """The ``size`` tokens the LLM emits most often in the continuations, and the share of continuation
    tokens they cover (a drafter with this vocabulary can never propose the rest)."""
    counts = np.zeros(vocab_size, np.int64)
    for i in range(len(data)):
        ids, _, _, prompt_len = data.sequence(i)
        np.add.at(counts, ids[prompt_len:], 1)
    if size > vocab_size:
        raise InputError(f"draft vocabulary of {size} tokens exceeds the vocabulary ({vocab_size})")
    top = np.argsort(-counts, kind="stable")[:size]
    return tuple(sorted(int(t) for t in top)), float(counts[top].sum() / max(counts.sum(), 1))
