"""specjax's CPU prefill attention kernel (``specjax.kernels.cpu.prefill_attention``): a prefill chunk's
queries over the committed prefix and, causally, the chunk's own K/V. Against a float64 reference,
with the floor from XLA's own float32 attention of a causal chunk (``specjax.attention.xla.attend``,
the path it replaces): GQA, MQA, MHA, head dims that are not a multiple of 16, chunks and prefixes
that are not multiples of the kernel's blocks, empty prefixes, the few-unit split; non-finite K/V
reaching exactly the queries that see them; results independent of the buffer's length, the batch
and threads; and ``prefill`` choosing it exactly where the CPU kernels are on."""

from __future__ import annotations

import ctypes

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.attention.meta import causal_meta
from specjax.attention.xla import attend as xla_attend
from specjax.kernels import cpu as cpu_kernels
from specjax.kernels.cpu import prefill_attention
from tests import precision

needs_kernel = pytest.mark.skipif(cpu_kernels.status() is not None,
                                  reason=f"kernels unavailable: {cpu_kernels.status()}")

# (batch, chunk tokens, heads, kv heads, head_dim, prefix lengths): GQA over prefixes inside one key
# block, across two and three (one empty), a chunk that is no multiple of 64; MQA with an odd
# head_dim; MHA with head_dim 128 and 8; one KV head of one request (the few-unit split of 16 queries).
CASES = [
    (2, 70, 9, 3, 64, [0, 130]),
    (1, 130, 4, 1, 40, [65]),
    (1, 17, 2, 2, 128, [3]),
    (3, 5, 6, 3, 8, [0, 1, 64]),
    (1, 40, 3, 1, 64, [200]),
]


def _case(rng, batch, num_q, heads, kv_heads, head_dim, lengths, layers=2, spare=40):
    """Random queries, the chunk's own K/V, and caches whose slots past each prefix are NaN."""
    slots = max(lengths) + num_q + spare
    q = rng.standard_normal((batch, num_q, heads, head_dim), dtype=np.float32)
    kb = 1.5 * rng.standard_normal((batch, num_q, kv_heads, head_dim), dtype=np.float32)
    vb = rng.standard_normal((batch, num_q, kv_heads, head_dim), dtype=np.float32)
    k = np.full((layers, batch, slots, kv_heads, head_dim), np.nan, np.float32)
    v = np.full_like(k, np.nan)
    for b, n in enumerate(lengths):
        k[:, b, :n] = 1.5 * rng.standard_normal((layers, n, kv_heads, head_dim))
        v[:, b, :n] = rng.standard_normal((layers, n, kv_heads, head_dim))
    return q, k, v, kb, vb, np.asarray(lengths, np.int32)


def _reference(q, k, v, kb, vb, layer, lengths, scale):
    """float64: query t over the prefix and the chunk's slots 0..t."""
    batch, num_q, heads, _ = q.shape
    groups = heads // k.shape[3]
    out = np.zeros(q.shape, np.float64)
    for b in range(batch):
        n = int(lengths[b])
        for h in range(heads):
            keys = np.concatenate([k[layer, b, :n, h // groups], kb[b, :, h // groups]]).astype(np.float64)
            vals = np.concatenate([v[layer, b, :n, h // groups], vb[b, :, h // groups]]).astype(np.float64)
            s = (q[b, :, h] * np.float32(scale)).astype(np.float64) @ keys.T  # [T, n + T]
            s[np.arange(num_q)[:, None] < np.arange(n + num_q)[None, :] - n] = -np.inf
            p = np.exp(s - s.max(axis=1, keepdims=True))
            out[b, :, h] = p @ vals / p.sum(axis=1, keepdims=True)
    return out


def _kernel(q, k, v, kb, vb, layer, lengths, scale, fn=prefill_attention.attend):
    return np.asarray(fn(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), layer, jnp.asarray(lengths),
                         jnp.asarray(kb), jnp.asarray(vb), scale))


def _xla(q, k, v, kb, vb, layer, lengths, scale):
    """specjax's XLA attention of a causal chunk over the same inputs (the cache with the chunk written
    after each prefix, as a pass writes it): the float32 floor."""
    kw, vw = k.copy(), v.copy()
    for b, n in enumerate(lengths):
        kw[layer, b, n:n + q.shape[1]], vw[layer, b, n:n + q.shape[1]] = kb[b], vb[b]
    return np.asarray(xla_attend(jnp.asarray(q), jnp.asarray(kb), jnp.asarray(vb), jnp.asarray(kw), jnp.asarray(vw),
                                 causal_meta(jnp.asarray(lengths)), scale, layer=jnp.int32(layer)))


@needs_kernel
class TestKernel(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_matches_float64_within_xla_float32_floor(self):
        rng = np.random.default_rng(0)
        for batch, num_q, heads, kv_heads, head_dim, lengths in CASES:
            q, k, v, kb, vb, lengths = _case(rng, batch, num_q, heads, kv_heads, head_dim, lengths)
            scale = head_dim ** -0.5
            fn = self.variant(prefill_attention.attend, static_argnames=("scale",))
            got = _kernel(q, k, v, kb, vb, 1, lengths, scale, fn=fn)
            chex.assert_shape(got, q.shape)
            exact = _reference(q, k, v, kb, vb, 1, lengths, scale)
            floor = precision.error(_xla(q, k, v, kb, vb, 1, lengths, scale), exact)
            precision.assert_within(got, exact, floor, what=f"{(batch, num_q, heads, kv_heads, head_dim)}")


@needs_kernel
def test_non_finite_kv_reaches_exactly_the_queries_that_see_it():
    """A NaN/inf K or V of the chunk at position 70 turns the queries from 70 on of its KV head NaN and
    leaves every other output bit for bit; one in the committed prefix turns every query of its KV
    head NaN, not the other heads'."""
    rng = np.random.default_rng(2)
    q, k, v, kb, vb, lengths = _case(rng, 1, 150, 4, 2, 64, [100])
    clean = _kernel(q, k, v, kb, vb, 0, lengths, 0.125)
    for bad in (np.nan, np.inf, -np.inf):
        for which in ("k", "v"):
            kk, vv = kb.copy(), vb.copy()
            (kk if which == "k" else vv)[0, 70, 1, 5] = bad  # chunk position 70, KV head 1
            got = _kernel(q, k, v, kk, vv, 0, lengths, 0.125)
            assert np.isnan(got[0, 70:, 2:]).all(), (bad, which)  # query heads 2, 3 (KV head 1) from 70 on
            others = np.ones(got.shape, bool)
            others[0, 70:, 2:] = False
            assert np.array_equal(got[others], clean[others]), (bad, which)
            kc, vc = k.copy(), v.copy()
            (kc if which == "k" else vc)[0, 0, 40, 0, 7] = bad  # prefix slot 40, KV head 0
            got = _kernel(q, kc, vc, kb, vb, 0, lengths, 0.125)
            assert np.isnan(got[0, :, :2]).all() and np.array_equal(got[0, :, 2:], clean[0, :, 2:]), (bad, which)


@needs_kernel
def test_results_do_not_depend_on_the_buffer_the_batch_or_threads():
    """Bit for bit: a longer (NaN-filled) buffer, another request beside it, the one-thread build."""
    rng = np.random.default_rng(3)
    q, k, v, kb, vb, lengths = _case(rng, 1, 200, 9, 3, 64, [700])
    run = jax.jit(prefill_attention.attend, static_argnames=("scale",))
    alone = _kernel(q, k, v, kb, vb, 0, lengths, 0.125, fn=run)
    pad = np.full((2, 1, 3000, 3, 64), np.nan, np.float32)
    longer = _kernel(q, np.concatenate([k, pad], axis=2), np.concatenate([v, pad], axis=2), kb, vb, 0, lengths,
                     0.125, fn=run)
    assert np.array_equal(longer, alone)
    q2, k2, v2, kb2, vb2, _ = _case(rng, 1, 200, 9, 3, 64, [700])
    pair = _kernel(np.concatenate([q2, q]), np.concatenate([k2, k], axis=1), np.concatenate([v2, v], axis=1),
                   np.concatenate([kb2, kb]), np.concatenate([vb2, vb]), 0, np.asarray([40, 700], np.int32), 0.125,
                   fn=run)
    assert np.array_equal(pair[1:], alone)
    one_thread = np.zeros(q.shape, np.float32)
    fn = cpu_kernels.build.library().specjax_cpu_prefill_attention_reference
    fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_long] * 7 + [
        ctypes.c_float]
    arrays = [np.ascontiguousarray(a) for a in (q, k, v, kb, vb)]
    fn(*(a.ctypes.data for a in arrays), 0, lengths.ctypes.data, one_thread.ctypes.data, 1, 200, 9, 3, 64,
       k.shape[0], k.shape[2], 0.125)
    assert np.array_equal(one_thread, alone)


@needs_kernel
def test_bad_inputs_are_named():
    q, k, v, kb, vb, lengths = (jnp.asarray(a) for a in _case(np.random.default_rng(4), 1, 3, 4, 2, 16, [5]))
    with pytest.raises(TypeError, match="float32 only"):
        prefill_attention.attend(q.astype(jnp.bfloat16), k, v, 0, lengths, kb, vb, 0.25)
    with pytest.raises(ValueError, match="does not match the cache"):
        prefill_attention.attend(q[:, :, :3], k, v, 0, lengths, kb, vb, 0.25)
    with pytest.raises(ValueError, match="is not \\[B, T=3"):
        prefill_attention.attend(q, k, v, 0, lengths, kb[:, :2], vb[:, :2], 0.25)
    with pytest.raises(ValueError, match="lengths"):
        prefill_attention.attend(q, k, v, 0, lengths[:0], kb, vb, 0.25)


def _prefill_model():
    from specjax.config import ModelConfig
    from specjax.models import init_params

    cfg = ModelConfig(family="llama", vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2,
                      num_heads=6, num_kv_heads=2, head_dim=16, max_position_embeddings=2048)
    return cfg, init_params(cfg, jax.random.key(5), scale=0.2)


@needs_kernel
def test_prefill_runs_its_chunks_in_the_kernel_where_the_cpu_kernels_are_on(monkeypatch):
    """``prefill`` of a float32 model on one CPU device: the chunks' attention is the kernel's (its FFI
    call is in the program; not under SPECJAX_CPU_DOTS=eigen, not for a float64 model), and the last
    logits and the cache it writes (prompts of 600 and 37 tokens: 512-, 64- and tail chunks over a
    committed prefix) match float64 within the floor of the XLA route."""
    from specjax.decoding.incremental import prefill
    from specjax.decoding.programs import ENV
    from specjax.models.cache import init_cache

    cfg, params = _prefill_model()
    rng = np.random.default_rng(6)
    lens = np.asarray([600, 37], np.int32)
    tokens = np.zeros((2, 600), np.int32)
    for b, n in enumerate(lens):
        tokens[b, :n] = rng.integers(0, cfg.vocab_size, n)

    def run(p, dtype=jnp.float32):
        cache = init_cache(cfg, 2, 700, dtype)
        fn = jax.jit(lambda p, t, n, c: prefill(p, t, n, c, cfg))
        text = str(jax.make_jaxpr(lambda p, t, n, c: prefill(p, t, n, c, cfg))(p, tokens, lens, cache))
        logits, cache = fn(p, jnp.asarray(tokens), jnp.asarray(lens), cache)
        return np.asarray(logits), np.asarray(cache.k), "specjax_cpu_prefill_attention" in text

    got, k, used = run(params)
    assert used
    monkeypatch.setenv(ENV, "eigen")
    floor_logits, floor_k, used_xla = run(params)
    assert not used_xla
    monkeypatch.delenv(ENV)
    with precision.float64():
        exact, exact_k, used64 = run(precision.params64(params), jnp.float64)
    assert not used64
    precision.assert_within(got, exact, precision.error(floor_logits, exact), what="last logits")
    for b, n in enumerate(lens):  # the K written at every prompt position (layer 1 reads layer 0's attention)
        precision.assert_within(k[:, b, :n], exact_k[:, b, :n], precision.error(floor_k[:, b, :n], exact_k[:, b, :n]),
                                what=f"cache K of request {b}")
