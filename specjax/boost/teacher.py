"""The teacher: the LLM's top-k next-token log-probabilities at every continuation position, cached per corpus."""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from specjax.decoding.incremental import full_logits
from specjax.errors import InputError
from specjax.models.params import llm_weights_digest


def top_k_logprobs(logits, top_k: int):
    """(ids int32, log-probabilities) of the ``top_k`` most likely next tokens: [..., V] -> [..., k]."""
    import jax
    import jax.numpy as jnp

    values, ids = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), top_k)
    return ids.astype(jnp.int32), values


def teacher_targets(model, sequences, top_k: int = 32, batch_size: int = 16, width_multiple: int = 64,
                    progress: bool = False):
    """The LLM's top-k next-token log-probabilities at every continuation position.

    sequences: [(token ids, prompt length), ...] as ``read_shard`` returns them. Returns one
    (ids [T, k] int32, logprobs [T, k] float32) pair per sequence, where row j is the LLM's
    distribution for token ``prompt_len + j`` given everything before it (T = continuation length).
    Full-sequence logits (``specjax.decoding.incremental.full_logits``) in padded batches of ``batch_size``.
    """
    import jax
    import jax.numpy as jnp


    if top_k < 1 or top_k > model.config.vocab_size:
        raise InputError(f"top_k must be in [1, {model.config.vocab_size}], got {top_k}")

    from tqdm import tqdm

    top = jax.jit(lambda logits: top_k_logprobs(logits, top_k))
    out = []
    for start in tqdm(range(0, len(sequences), batch_size), desc=f"teacher top-{top_k}", disable=not progress):
        chunk = sequences[start:start + batch_size]
        longest = max(len(s) for s, _ in chunk)
        width = -(-longest // width_multiple) * width_multiple  # few distinct shapes -> few compiles
        padded = np.zeros((len(chunk), width), np.int32)
        for i, (seq, _) in enumerate(chunk):
            padded[i, :len(seq)] = seq
        ids, logp = top(full_logits(model.params, jnp.asarray(padded), cfg=model.config))
        ids, logp = np.asarray(ids), np.asarray(logp)
        for i, (seq, n) in enumerate(chunk):
            rows = slice(n - 1, len(seq) - 1)  # logits at position p predict token p + 1
            out.append((ids[i, rows], logp[i, rows]))
    return out


def _fingerprint(model, sequences, top_k: int) -> str:
    digest = hashlib.sha256(json.dumps([model.config.to_dict(), top_k]).encode())
    for ids, prompt_len in sequences:
        digest.update(np.asarray(ids, np.int32).tobytes())
        digest.update(np.int64(prompt_len).tobytes())
    return digest.hexdigest()


def cached_teacher_targets(model, sequences, path: str, top_k: int, progress: bool = True, log=print):
    """``teacher_targets`` stored at ``path`` (.npz) and reused while the model, the sequences and
    ``top_k`` are unchanged (fingerprinted); otherwise recomputed and the file replaced."""
    fingerprint, weights = _fingerprint(model, sequences, top_k), llm_weights_digest(model.params)
    if os.path.exists(path):
        with np.load(path) as z:
            # files from before the weights digest was recorded have none: taken as this model's
            if str(z["fingerprint"]) == fingerprint and ("weights" not in z.files or str(z["weights"]) == weights):
                ids, logp, offsets = z["ids"], z["logp"], z["offsets"]
                return [(ids[offsets[i]:offsets[i + 1]], logp[offsets[i]:offsets[i + 1]])
                        for i in range(len(sequences))]
        log(f"{path}: computed for other sequences, model, weights or top-k; recomputing")
    targets = teacher_targets(model, sequences, top_k=top_k, progress=progress)
    offsets = np.cumsum([0] + [len(t[0]) for t in targets]).astype(np.int64)
    tmp = path + ".tmp.npz"
    np.savez(tmp, ids=np.concatenate([t[0] for t in targets]), logp=np.concatenate([t[1] for t in targets]),
             offsets=offsets, fingerprint=np.str_(fingerprint), weights=np.str_(weights))
    os.replace(tmp, path)
    return targets
