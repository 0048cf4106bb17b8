"""Training data of the feature drafter: the LLM's features at every position of the corpus sequences.

One teacher-forced LLM pass per sequence (prefill cost, far cheaper than generating) gives, at every
position p, the post-norm final hidden state g_p (what the LM head reads; stored as float16). One
``features-XXXXX.npz`` per corpus shard, written atomically and fingerprinted by the shard's bytes, the
model config, the stored layers and the teacher's dots, so an interrupted run resumes where it stopped and
a changed corpus (or another way of computing it) is recomputed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import zipfile

import numpy as np

from specjax.boost.corpus import read_shard
from specjax.errors import InputError
from specjax.models.params import llm_weights_digest

WIDTH_MULTIPLE = 64  # teacher batches are padded to a multiple of this: few shapes, few compiles
# How the teacher pass multiplies: "float32" (exactly the LLM as it runs in the loop), or "bfloat16":
# the layers' matmul weights stored as bfloat16, the dots summed in float32, everything else float32
# (``specjax.models.weights.product``). On an Intel Xeon with AMX (2 cores) SmolLM2's teacher pass ran
# 2.8x faster (656 -> 1,831 tokens/s on 400-token sequences) and its features moved by 0.4% (median
# relative error; 0.7-0.8% at the 99th percentile), against the training's +-0.1 input noise (~6% of a
# post-norm feature's norm).
TEACHER_DOTS = ("float32", "bfloat16")


def check_dots(dots: str) -> str:
    """``dots`` if it names a way the teacher pass multiplies (``TEACHER_DOTS``); an InputError otherwise."""
    if dots not in TEACHER_DOTS:
        raise InputError(f"teacher dots must be one of {TEACHER_DOTS}, got {dots!r}")
    return dots


def teacher_params(model, dots: str = "float32") -> dict:
    """The parameters the teacher pass reads: the model's own, or for ``dots="bfloat16"`` its layers' matmul
    weights as bfloat16 (a copy, made once per feature run)."""
    from specjax.models.weights import bfloat16_matmul_weights

    return model.params if check_dots(dots) == "float32" else bfloat16_matmul_weights(model.params)


def _teacher_fn(model, layers: tuple[int, ...] = (), dots: str = "float32"):
    """``run(tokens [B, W]) -> [B, W, (len(layers) + 1,) D] float16``: the jitted teacher pass over
    ``teacher_params(model, dots)`` (the copy made once, here)."""
    import functools

    import jax
    import jax.numpy as jnp

    from specjax.attention.meta import causal_meta
    from specjax.decoding.incremental import cpu_prefill_route
    from specjax.models import forward
    from specjax.models.cache import init_cache
    from specjax.models.common import rms_norm

    cfg = model.config
    kernel = cpu_prefill_route(model.params, cfg)  # the prefill kernel's route: 5-10% faster here

    @jax.jit
    def run(params, tokens):
        batch, width = tokens.shape
        cache = init_cache(cfg, batch, width, jnp.float32)
        positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
        # the head for one position only: its full-vocabulary logits at every position would cost a fifth
        # of the pass and are not needed (the training targets come from the features through the head)
        out = forward(params, tokens, positions, cache, causal_meta(jnp.zeros((batch,), jnp.int32), kernel), cfg,
                      logits_indices=jnp.zeros((batch, 1), jnp.int32), hidden=tuple(layers) + (cfg.num_layers,),
                      all_hidden=True)
        g = rms_norm(out.hidden[:, :, -1], params["final_norm"], cfg.norm_eps)
        if not layers:
            return g.astype(jnp.float16)
        return jnp.concatenate([out.hidden[:, :, :-1], g[:, :, None]], axis=2).astype(jnp.float16)

    return functools.partial(run, teacher_params(model, dots))


def teacher_features(model, sequences, batch_size: int = 8, run=None, layers: tuple[int, ...] = (),
                     width_multiple: int = WIDTH_MULTIPLE, full_batches: bool = False,
                     dots: str = "float32") -> list:
    """[features [T, D] float16, ...]: the LLM's post-norm final hidden state at every position of
    every sequence [(ids, prompt_len), ...]; with ``layers``, [T, len(layers) + 1, D]: the input
    hidden states of those layers (raw), then the post-norm final one. Batches are padded to a
    multiple of ``width_multiple`` columns, and with ``full_batches`` to ``batch_size`` rows: fewer
    shapes to compile, where compiling costs more than the padding's compute (a GPU). ``dots``: how the
    pass multiplies (``TEACHER_DOTS``; ``run``, a ``_teacher_fn``, carries its own)."""
    import jax.numpy as jnp

    run = run or _teacher_fn(model, layers, dots)
    order = np.argsort([len(s) for s, _ in sequences], kind="stable")
    results = [None] * len(sequences)
    for start in range(0, len(order), batch_size):
        index = order[start:start + batch_size]
        longest = max(len(sequences[i][0]) for i in index)
        width = -(-longest // width_multiple) * width_multiple
        padded = np.zeros((batch_size if full_batches else len(index), width), np.int32)
        for row, i in enumerate(index):
            padded[row, :len(sequences[i][0])] = sequences[i][0]
        g = np.asarray(run(jnp.asarray(padded)))
        for row, i in enumerate(index):
            results[i] = g[row, :len(sequences[i][0])]
    return results


def _fingerprint(shard_path: str, model, layers, dots: str = "float32") -> str:
    # float32 keeps the fingerprint it always had: features computed before the choice existed stay valid
    digest = hashlib.sha256(json.dumps([model.config.to_dict(), list(layers)] + ([] if dots == "float32" else [dots]))
                            .encode())
    with open(shard_path, "rb") as f:
        digest.update(f.read())
    return digest.hexdigest()


def feature_shards(model, shard_paths, out_dir: str, batch_size: int = 8, progress: bool = True,
                   log=print, layers: tuple[int, ...] = (), width_multiple: int = WIDTH_MULTIPLE,
                   full_batches: bool = False, dots: str = "float32") -> list[str]:
    """The features of every corpus shard (``out_dir/features-XXXXX.npz``, resumable; ``layers``,
    ``width_multiple``, ``full_batches`` and ``dots`` as in ``teacher_features``; a file made with other
    dots is recomputed); returns their paths."""
    from tqdm import tqdm

    check_dots(dots)
    os.makedirs(out_dir, exist_ok=True)
    run = None
    paths = []
    weights = llm_weights_digest(model.params)
    bar = tqdm(shard_paths, desc=f"LLM features ({os.path.basename(os.path.normpath(out_dir))})", disable=not progress)
    for index, shard in enumerate(bar):
        path = os.path.join(out_dir, f"features-{index:05d}.npz")
        paths.append(path)
        fingerprint = _fingerprint(shard, model, layers, dots)
        if os.path.exists(path):
            try:
                with np.load(path) as z:
                    # files from before the weights digest was recorded have none: taken as this model's
                    same_weights = "weights" not in z.files or str(z["weights"]) == weights
                    if str(z["fingerprint"]) == fingerprint and same_weights:
                        continue
                why = ("made from another shard, model or teacher dots" if same_weights
                       else "made from other weights (another checkpoint of the same config)")
            except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:  # a cache: recompute it
                why = f"unreadable ({type(e).__name__})"
            log(f"{path}: {why}; recomputing")
        run = run or _teacher_fn(model, layers, dots)
        sequences = read_shard(shard)
        results = teacher_features(model, sequences, batch_size, run, width_multiple=width_multiple,
                                   full_batches=full_batches)
        # a name of this process's own: two runs sharing a corpus (gpu_feature_tune.sh's second run beside the
        # first) may compute the same file at once, each replacing it whole with the same content
        tmp = f"{path}.{os.getpid()}.tmp.npz"
        np.savez(tmp, features=np.concatenate(results),
                 offsets=np.cumsum([0] + [len(s) for s, _ in sequences]).astype(np.int64),
                 fingerprint=np.str_(fingerprint), weights=np.str_(weights), shard=np.str_(os.path.abspath(shard)))
        os.replace(tmp, path)
    return paths


@dataclasses.dataclass
class FeatureSet:
    """Sequences with their LLM features, flat: sequence i is rows offsets[i]:offsets[i+1].

    tokens [N] int32; features [N, D] float16 (post-norm LLM features g); inputs None or [N, n, D] float16
    (the input hidden states of the layers a fused drafter reads); greedy [N] int32: the LLM's
    greedy next token after each position where the corpus shows it (the continuation positions of
    greedy continuations; the agreement metric's reference), -1 elsewhere; prompt_lens [S]; parts [S]
    (index into ``part_names``)."""

    tokens: np.ndarray
    features: np.ndarray
    greedy: np.ndarray
    offsets: np.ndarray
    prompt_lens: np.ndarray
    parts: np.ndarray
    part_names: tuple[str, ...]
    inputs: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.prompt_lens)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def sequence(self, i: int):
        a, b = self.offsets[i], self.offsets[i + 1]
        return self.tokens[a:b], self.features[a:b], self.greedy[a:b], int(self.prompt_lens[i])

    def sequence_inputs(self, i: int) -> np.ndarray:
        return self.inputs[self.offsets[i]:self.offsets[i + 1]]

    def subset(self, index: np.ndarray) -> "FeatureSet":
        index = np.asarray(index)
        rows = [np.arange(self.offsets[i], self.offsets[i + 1]) for i in index]
        flat = np.concatenate(rows) if rows else np.zeros((0,), np.int64)
        return FeatureSet(self.tokens[flat], self.features[flat], self.greedy[flat],
                          np.cumsum([0] + [len(r) for r in rows]).astype(np.int64), self.prompt_lens[index],
                          self.parts[index], self.part_names, None if self.inputs is None else self.inputs[flat])

    def continuation_tokens(self) -> int:
        return int(np.sum(self.lengths - self.prompt_lens))


def held_out_indices(count: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, held out) sequence indices, each sorted: a seeded ``fraction`` of ``count`` held out."""
    order = np.random.default_rng(seed).permutation(count)
    n = max(1, int(round(count * fraction)))
    return np.sort(order[n:]), np.sort(order[:n])


def split_held_out(data: FeatureSet, fraction: float, seed: int = 0) -> tuple[FeatureSet, FeatureSet]:
    """(train, held out): a seeded ``fraction`` of the sequences (each from a distinct prompt) held out.
    (Copies the set; ``feature_loading.load_split`` splits while loading.)"""
    train, held = held_out_indices(len(data), fraction, seed)
    return data.subset(train), data.subset(held)


def vocabulary_coverage(data: FeatureSet, vocab) -> float:
    """The share of ``data``'s continuation tokens that a drafter with draft vocabulary ``vocab`` can name."""
    cont = [ids[prompt_len:] for ids, _, _, prompt_len in map(data.sequence, range(len(data)))]
    cont = np.concatenate(cont) if cont else np.zeros((0,), np.int32)
    return float(np.isin(cont, np.asarray(vocab)).mean()) if len(cont) else 0.0


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
