"""The jittable cores' input contract, checked where it can be: every shape is static even inside a
caller's ``jax.jit``, so a batch that disagrees with itself or a cache narrower than the prompts is refused
at trace time, naming the argument; values are checked only where they are concrete (an eager call).

What stays the caller's contract inside jit (traced values): every prompt length in [1, T],
max_new_tokens in [1, max_out], and a cache that holds each prompt, its new tokens and the tree's scratch
slots. The host API (``specjax.generate``) builds its inputs to meet them.
"""

from __future__ import annotations

import jax
import numpy as np

from specjax.errors import InputError


def _concrete(x) -> np.ndarray | None:
    """``x``'s values when they are known now (not traced), else None."""
    if isinstance(x, jax.core.Tracer):
        return None
    return np.asarray(x)


def check_batch(prompt_tokens, prompt_lens, max_new_tokens, sampling, *, cache_len: int, max_out: int,
                stop_ids=None, where: str, tree_slots: int = 0) -> None:
    """Refuse inputs of ``where`` (the function's name) that do not describe one batch of B requests.
    ``tree_slots``: the token tree's scratch slots, which the cache must hold after each request's tokens."""
    shape = tuple(np.shape(prompt_tokens))
    if len(shape) != 2 or shape[1] < 1:
        raise InputError(f"{where}: prompt_tokens must be [B, T] right-padded token ids, got shape {shape}")
    batch, width = shape
    rows = {"prompt_lens": prompt_lens, "max_new_tokens": max_new_tokens}
    rows.update({f"sampling.{f}": getattr(sampling, f) for f in ("temperature", "top_k", "top_p", "seed")})
    for name, value in rows.items():
        if tuple(np.shape(value)) != (batch,):
            raise InputError(f"{where}: {name} must have shape ({batch},), one entry per prompt of prompt_tokens "
                             f"{shape}, got {tuple(np.shape(value))}")
    seed = sampling.seed
    seed_dtype = seed.dtype if hasattr(seed, "dtype") else np.asarray(seed).dtype
    if jax.dtypes.issubdtype(seed_dtype, jax.dtypes.prng_key) or not jax.dtypes.issubdtype(seed_dtype, np.integer):
        # a PRNG key array failed deep inside sampling ("key accepts a scalar seed")
        raise InputError(f"{where}: sampling.seed must be [B] int32 seeds in [0, 2**31), one per request (not PRNG "
                         f"keys), got dtype {seed_dtype}")
    seeds = _concrete(seed)
    if seeds is not None and ((seeds < 0) | (seeds >= 2 ** 31)).any():  # SamplingParams refuses them too
        raise InputError(f"{where}: sampling.seed must be in [0, 2**31), got {seeds.tolist()}")
    if stop_ids is not None and (np.ndim(stop_ids) != 2 or np.shape(stop_ids)[0] != batch):
        raise InputError(f"{where}: stop_ids must be [{batch}, E] (-1 padded), got shape {tuple(np.shape(stop_ids))}")
    if isinstance(max_out, bool) or not isinstance(max_out, (int, np.integer)) or max_out < 1:
        raise InputError(f"{where}: max_out must be an int >= 1 (the output buffer's width), got {max_out!r}")
    if isinstance(cache_len, bool) or not isinstance(cache_len, (int, np.integer)) or cache_len < width:
        raise InputError(f"{where}: cache_len={cache_len!r} is narrower than the prompts' width T={width}: the "
                         f"cache holds each prompt, its new tokens and any tree scratch")
    lens, budget = _concrete(prompt_lens), _concrete(max_new_tokens)
    if lens is not None and ((lens < 1) | (lens > width)).any():
        raise InputError(f"{where}: prompt_lens must be in [1, {width}] (the prompts' width), got {lens.tolist()}")
    if budget is not None and ((budget < 1) | (budget > max_out)).any():
        raise InputError(f"{where}: max_new_tokens must be in [1, max_out={max_out}], got {budget.tolist()}")
    if lens is not None and budget is not None and (lens + budget + tree_slots > cache_len).any():
        # Past the cache's end the tree's keys and values are dropped when written (the Pallas path and
        # pipelined meshes read them back from there): requests then failed near their end.
        tree = f" + {tree_slots} tree slots" if tree_slots else ""
        raise InputError(f"{where}: prompt_lens + max_new_tokens{tree} {(lens + budget + tree_slots).tolist()} "
                         f"exceed cache_len={cache_len}")


def host_value(x, what: str):
    """A concrete JAX array given to the host API as NumPy (a 0-d one as a NumPy scalar), as NumPy inputs are
    taken; a traced value is refused, naming ``what``: the host API runs on the host, and inside ``jax.jit``
    the jittable cores (``generate_incremental``, ``speculation.loop.generate_speculative``) are the way.
    Anything else is returned unchanged."""
    if isinstance(x, jax.core.Tracer):
        raise InputError(f"{what} is a traced value (inside jax.jit or another transform): specjax.generate runs on "
                         f"the host; inside jit call specjax.generate_incremental or "
                         f"specjax.speculation.loop.generate_speculative")
    if isinstance(x, jax.Array):
        if not jax.dtypes.issubdtype(x.dtype, np.number) and x.dtype != np.bool_:
            return x  # a PRNG key array: left for the caller's own check to name
        value = np.asarray(x)
        return value[()] if value.ndim == 0 else value
    return x
