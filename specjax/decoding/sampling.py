"""Sampling: one warp pipeline and position-keyed Gumbel-max sampling.

Definition (shared by incremental decoding and seeded speculative verification): the token
at ABSOLUTE position t of a request with seed s is

    y_t = argmax_v( score(logits_{t-1})[v] + G(s, t)[v] ),   G(s, t) = Gumbel(fold_in(key(s), t))

with score = logits * r (r = 1 / temperature), -inf outside top-k / top-p (``gumbel_scores``): an
exact sample from softmax(warp(logits)), the warp being temperature -> top-k -> top-p -> renormalise,
in float32 (the renormalisation shifts every score alike, so Gumbel-max does not need it).
Greedy (temperature 0) is argmax of the raw logits, first index on ties.

Why the scores are not the warped log-probabilities: a token decided from them needs only the few
logits that can win (``specjax.kernels.cpu.greedy_head.sampled_decision`` decides seeded verification at
temperature 1 from float16 panels, recomputing those exactly), where a log-softmax depends on every
logit's rounding. (At other temperatures the product and the sum are one FMA or two roundings as XLA
fuses them, so those requests are decided from the full logits, by this same function.)
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.decoding.contract import host_value
from specjax.decoding.keys import sampling_key
from specjax.errors import InputError

MIN_TEMPERATURE = 1e-6  # below it, float32 logits / temperature can overflow to inf
MAX_TEMPERATURE = float(np.finfo(np.float32).max)


MIN_TOP_P = float(np.finfo(np.float32).tiny)  # top_p is a float32 on the device; CPUs may flush subnormals to 0


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings. temperature=0 means greedy (top_k/top_p then ignored)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    seed: int = 0

    def __post_init__(self):
        for name in ("temperature", "top_k", "top_p", "seed"):  # NumPy or JAX scalars (read from an array)
            value = host_value(getattr(self, name), f"SamplingParams.{name}")
            if isinstance(value, (np.integer, np.floating)):
                object.__setattr__(self, name, value.item())
        t, k, p, s = self.temperature, self.top_k, self.top_p, self.seed
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise InputError(f"temperature must be a finite number >= 0, got {t!r}")
        if 0 < t < MIN_TEMPERATURE:  # logits / t would overflow float32: use 0 for greedy decoding
            raise InputError(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE:g}, got {t!r}")
        if t > MAX_TEMPERATURE:  # inf on the device (uniform sampling), with a NumPy overflow warning
            raise InputError(f"temperature must be at most {MAX_TEMPERATURE:.4g} (float32's largest: it is held in "
                             f"float32), got {t!r}")
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < 2**31:
            raise InputError(f"top_k must be an int in [0, 2**31) (0 = off), got {k!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):
            raise InputError(f"top_p must be in (0, 1], got {p!r}")
        if p < MIN_TOP_P:
            raise InputError(f"top_p must be in (0, 1] and at least {MIN_TOP_P:.3g} (float32's smallest normal "
                             f"number: a smaller one is 0 on the device, where it would keep no token), got {p!r}")
        if isinstance(s, bool) or not isinstance(s, int) or not (0 <= s < 2**31):
            raise InputError(f"seed must be an int in [0, 2**31), got {s!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@struct.dataclass
class SamplingArrays:
    """Batched sampling settings as arrays, so changing them never recompiles."""

    temperature: jax.Array  # [B] float32, 0 = greedy
    top_k: jax.Array  # [B] int32, 0 = off
    top_p: jax.Array  # [B] float32, 1 = off
    seed: jax.Array  # [B] int32

    @property
    def sampled(self) -> jax.Array:
        """[B] bool: requests that sample (temperature > 0) rather than decode greedily."""
        return self.temperature > 0

    @classmethod
    def from_params(cls, params: list[SamplingParams]) -> "SamplingArrays":
        return cls(temperature=jnp.asarray([p.temperature for p in params], jnp.float32),
                   top_k=jnp.asarray([p.top_k for p in params], jnp.int32),
                   top_p=jnp.asarray([p.top_p for p in params], jnp.float32),
                   seed=jnp.asarray([p.seed for p in params], jnp.int32))


# The candidates a filter reads without sorting the vocabulary. XLA:CPU sorts a 49152-token row in ~10 ms
# (2 Xeon cores): the filter of a 33-node tree's rows took 338 ms with the sort, more than the tree pass
# itself, and 20-22 ms from 1024 candidates. A row whose kept tokens may lie past them (a flat
# law under a high top-p, a top-k above them) is sorted in full, as before.
FILTER_CANDIDATES = 1024


def _filter_top_k_top_p(x: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """x [B, V] -> x with -inf outside each row's top-k, then outside its top-p (the smallest set of
    most likely tokens, in descending order, whose mass reaches top_p; ties with the last kept value are
    kept): from the ``FILTER_CANDIDATES`` largest values where the kept tokens are among them, else from
    the whole row sorted."""
    vocab = x.shape[-1]
    cand = min(vocab, FILTER_CANDIDATES)
    if cand == vocab:
        return _filter_sorted(x, top_k, top_p)
    top = jax.lax.top_k(x, cand)[0]  # [B, C] descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    at_k = jnp.take_along_axis(top, (jnp.minimum(k, cand) - 1)[:, None], axis=-1)
    kth = jnp.where((k <= cand)[:, None], at_k, -jnp.inf)
    masked = jnp.where(x < kth, -jnp.inf, x)  # ties with the k-th value are kept
    head = jnp.where(top < kth, -jnp.inf, top)
    # the candidates' probabilities under the whole (top-k filtered) row's normaliser
    probs = jnp.exp(head - jax.nn.logsumexp(masked, axis=-1, keepdims=True))
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    # A row is settled by its candidates unless its top-k reaches past them, or its top-p (with no top-k:
    # a top-k within the candidates keeps only them and their ties) still keeps the last of them, so the
    # tokens after it might be kept too.
    past = (top_k > cand) | ((top_k == 0) & (top_p < 1.0) & keep[:, -1])

    def from_candidates(x):
        last_kept = jnp.sum(keep, axis=-1) - 1
        threshold = jnp.where(top_p >= 1.0, -jnp.inf, jnp.take_along_axis(head, last_kept[:, None], axis=-1)[:, 0])
        return jnp.where(masked < threshold[:, None], -jnp.inf, masked)

    return jax.lax.cond(jnp.any(past), lambda x: _filter_sorted(x, top_k, top_p), from_candidates, x)


def _filter_sorted(x: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """``_filter_top_k_top_p`` from the whole row sorted in descending order."""
    vocab = x.shape[-1]
    sorted_x = -jnp.sort(-x, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_x, (k - 1)[:, None], axis=-1)  # [B, 1]
    x = jnp.where(x < kth, -jnp.inf, x)  # ties with the k-th value are kept
    sorted_x = jnp.where(sorted_x < kth, -jnp.inf, sorted_x)
    probs = jax.nn.softmax(sorted_x, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # The top token always has mass_before 0 < top_p. top_p = 1 keeps everything exactly: the float32
    # cumulative sum can round to 1.0 before the tail, and a request's law must not depend on whether
    # another request in its batch switched the filter on.
    keep = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    last_kept = jnp.sum(keep, axis=-1) - 1
    threshold = jnp.take_along_axis(sorted_x, last_kept[:, None], axis=-1)
    return jnp.where(x < threshold, -jnp.inf, x)


def warp_logits(logits: jax.Array, sampling: SamplingArrays) -> jax.Array:
    """logits [B, ..., V] -> warped log-probabilities, same shape, float32 (-inf outside top-k/top-p):
    ``gumbel_scores`` normalised into a law.

    Request b's settings apply to every row logits[b, ...]. Rows with temperature 0 are warped as
    temperature 1 (their token is the raw argmax anyway). The verifiers' targets at every tree node and
    the drafters' laws read it; Gumbel-max sampling reads the same scores unnormalised.
    """
    shape = logits.shape
    rows = int(np.prod(shape[1:-1], dtype=np.int64))
    per_row = jax.tree.map(lambda a: jnp.repeat(a, rows, axis=0), sampling)
    x = gumbel_scores(logits.reshape(shape[0] * rows, shape[-1]), per_row)
    return jax.nn.log_softmax(x, axis=-1).reshape(shape)


def inverse_temperature(sampling: SamplingArrays) -> jax.Array:
    """[B] float32 r = fl(1 / temperature) (1 for greedy requests): the scale of a request's scores."""
    return 1.0 / jnp.where(sampling.temperature > 0, sampling.temperature, 1.0)


def needs_filter(sampling: SamplingArrays) -> jax.Array:
    """[] bool: some request asks for top-k or top-p (its scores need every logit, sorted)."""
    return jnp.any((sampling.top_k > 0) | (sampling.top_p < 1.0))


def gumbel_scores(logits: jax.Array, sampling: SamplingArrays) -> jax.Array:
    """logits [B, V] -> the scores Gumbel-max sampling adds the noise to: fl(logits * r) (r =
    ``inverse_temperature``), -inf outside the request's top-k / top-p, float32. Written as a product by
    the reciprocal because that is what XLA makes of a division by a per-row temperature anyway (it
    rewrites x / broadcast(t) as x * broadcast(1 / t)); here it is the definition, on every backend."""
    x = logits.astype(jnp.float32) * inverse_temperature(sampling)[:, None]
    # The sort costs O(V log V) per row; skip it when no request asks for top-k/top-p.
    return jax.lax.cond(needs_filter(sampling), _filter_top_k_top_p, lambda x, *_: x, x, sampling.top_k,
                        sampling.top_p)


def seeded_tokens(logits: jax.Array, sampling: SamplingArrays, noise: jax.Array) -> jax.Array:
    """logits [B, V], noise [B, V] (each request's G(s, t)) -> [B] int32: the first argmax of scores +
    noise for sampling requests, of the logits for greedy ones."""
    sampled = first_argmax(gumbel_scores(logits, sampling) + noise)
    return jnp.where(sampling.temperature > 0, sampled, first_argmax(logits))


def gumbel_noise(seed: jax.Array, position: jax.Array, vocab: int) -> jax.Array:
    """G(seed, t): [B, V] float32 Gumbel noise keyed ONLY by the request seed and absolute position."""

    def one(s, t):
        return jax.random.gumbel(sampling_key(s, t), (vocab,), jnp.float32)

    return jax.vmap(one)(seed, position)


def finite_rows(logits: jax.Array) -> jax.Array:
    """[..., V] -> [...] bool: the row has no NaN or infinite logit. A request whose LLM logits fail
    this fails; nothing is sampled from such a row (argmax over NaN would invent token 0)."""
    return jnp.all(jnp.isfinite(logits), axis=-1)


def first_argmax(x: jax.Array) -> jax.Array:
    """``jnp.argmax(x, axis=-1)`` as int32, the same index in every case (first index on ties; the first
    NaN if a row has one), computed as a max, then the first index reaching it. XLA:CPU lowers argmax to
    a variadic (value, index) reduce that does not vectorise: 1.5 ms for 17 x 49152 logits on 2 Xeon
    cores, this form 0.8 ms (greedy verification reads one argmax per tree node every step)."""
    nan = jnp.isnan(x)
    peak = jnp.max(x, axis=-1, keepdims=True)
    hit = jnp.where(jnp.any(nan, axis=-1, keepdims=True), nan, x == peak)
    index = jnp.arange(x.shape[-1], dtype=jnp.int32)
    return jnp.min(jnp.where(hit, index, x.shape[-1]), axis=-1)


def sample_tokens(logits: jax.Array, sampling: SamplingArrays, positions: jax.Array) -> jax.Array:
    """Sample one token per request. logits [B, V]; positions [B] = absolute position of the new token."""
    greedy_tokens = first_argmax(logits)

    def with_sampling(_):
        return seeded_tokens(logits, sampling, gumbel_noise(sampling.seed, positions, logits.shape[-1]))

    # The noise and the softmax cost O(V) per row (threefry dominates on a CPU: at 8 requests x 17
    # tree nodes, more than the LLM's tree pass); an all-greedy batch needs neither. Same tokens.
    return jax.lax.cond(jnp.any(sampling.temperature > 0), with_sampling, lambda _: greedy_tokens, None)
