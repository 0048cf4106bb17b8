"""specjax's CPU attention kernel (``specjax.kernels.cpu.attention``): against a float64 reference that
walks every query's visible slots, with the floor from XLA's own float32 attention
(``specjax.attention.xla.attend``, the path it replaces) over decode steps, causal chains, token trees
and drafting frontiers; GQA, MQA and head dims that are not a multiple of 16; prefixes across work
chunks; non-finite K/V reaching exactly the queries that see them; results independent of the
buffer's length, of the batch and of threads; and the step programs' tree passes through it. The
source is built here for both ISAs it supports, so a CPU with AVX-512 checks the AVX2 build too."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.attention.meta import AttentionMeta
from specjax.attention.xla import attend as xla_attend
from specjax.kernels import cpu as cpu_kernels
from specjax.kernels.cpu import attention as cpu_attention
from tests import precision

needs_kernel = pytest.mark.skipif(cpu_kernels.attention_status() is not None,
                                  reason=f"kernel unavailable: {cpu_kernels.attention_status()}")

# (batch, queries, heads, kv heads, head_dim, lengths, region, in_cache): a decode step; GQA tree
# passes whose prefixes cross one and two 256-slot work chunks (one empty); MQA with an odd head_dim;
# MHA with head_dim 8 and 128; a drafting pass scoring 3 frontier nodes of an 11-node tree written in
# the cache.
CASES = [
    (1, 1, 9, 3, 64, [300], 1, False),
    (2, 17, 9, 3, 64, [255, 530], 17, False),
    (3, 5, 6, 3, 40, [0, 1, 257], 5, False),
    (1, 7, 5, 1, 12, [40], 7, False),
    (2, 4, 2, 2, 8, [3, 9], 4, False),
    (1, 3, 4, 2, 128, [20], 3, False),
    (2, 3, 9, 3, 64, [100, 7], 11, True),
]

# ... plus a head_dim that leaves 4 floats of a low AVX2 half (20), and scores hundreds apart (K x 40:
# weights down to the subnormals and 0; nothing may turn NaN or inf).
K_SCALED_CASES = [(c, 1.0) for c in CASES] + [((1, 6, 4, 2, 20, [33], 6, False), 1.0),
                                             ((2, 5, 4, 2, 32, [70, 300], 5, False), 40.0)]

def _case(rng, batch, num_q, heads, kv_heads, head_dim, lengths, region, layers=2, spare=40):
    """Random q and caches whose slots past each request's prefix + block are NaN; random ancestor
    rows over the region (every query sees slot 0, as every tree node sees its root)."""
    slots = max(lengths) + region + spare
    q = rng.standard_normal((batch, num_q, heads, head_dim), dtype=np.float32)
    k = np.full((layers, batch, slots, kv_heads, head_dim), np.nan, np.float32)
    v = np.full_like(k, np.nan)
    for b, n in enumerate(lengths):
        k[:, b, :n + region] = 1.5 * rng.standard_normal((layers, n + region, kv_heads, head_dim))
        v[:, b, :n + region] = rng.standard_normal((layers, n + region, kv_heads, head_dim))
    words = -(-region // 32)
    bits = rng.integers(0, 2, (batch, num_q, words * 32)).astype(np.uint64)
    bits[:, :, region:] = 0
    bits[:, :, 0] = 1
    anc = (bits.reshape(batch, num_q, words, 32) << np.arange(32, dtype=np.uint64)).sum(-1).astype(np.uint32)
    return q, k, v, np.asarray(lengths, np.int32), anc


def _reference(q, k, v, layer, lengths, anc, region, scale):
    """float64: query t of request b over its prefix and the block slots its ancestor bits set."""
    batch, num_q, heads, head_dim = q.shape
    groups = heads // k.shape[3]
    out = np.zeros(q.shape, np.float64)
    for b in range(batch):
        n = int(lengths[b])
        for t in range(num_q):
            seen = list(range(n)) + [n + j for j in range(region) if (int(anc[b, t, j // 32]) >> (j % 32)) & 1]
            for h in range(heads):
                keys = k[layer, b, seen, h // groups].astype(np.float64)
                vals = v[layer, b, seen, h // groups].astype(np.float64)
                s = (q[b, t, h] * np.float32(scale)).astype(np.float64) @ keys.T
                p = np.exp(s - s.max())
                out[b, t, h] = p @ vals / p.sum()
    return out


def _block(k, v, layer, lengths, region, in_cache):
    """The pass's own K/V [B, region, KVH, Dh] (from where the cache holds them), or (None, None): the
    block is read from the cache."""
    if in_cache:
        return None, None
    take = lambda c: jnp.asarray(np.stack([c[layer, b, n:n + region] for b, n in enumerate(lengths)]))  # noqa: E731
    return take(k), take(v)


def _kernel(q, k, v, layer, lengths, anc, region, scale, in_cache, fn=None):
    """The kernel with its block either read from the cache (in_cache) or passed as the pass's own K/V."""
    block = _block(k, v, layer, lengths, region, in_cache)
    call = fn or cpu_attention.attend
    return np.asarray(call(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), layer, jnp.asarray(lengths),
                           jnp.asarray(anc), region, scale, *block))


def _xla(q, k, v, layer, lengths, anc, region, scale, in_cache):
    """specjax's XLA attention over the same inputs: the float32 floor."""
    meta = AttentionMeta(lengths=jnp.asarray(lengths), ancestor=jnp.asarray(anc), region=region)
    block = _block(k, v, layer, lengths, region, in_cache)
    return np.asarray(xla_attend(jnp.asarray(q), *block, jnp.asarray(k), jnp.asarray(v), meta, scale,
                                 layer=jnp.int32(layer)))


def _assert_cases_match_float64(fn, seed: int, label: str):
    """``fn`` (``attend``'s signature) on every case of ``K_SCALED_CASES``, within XLA's float32 floor of
    the float64 reference; a query that sees nothing is zero."""
    rng = np.random.default_rng(seed)
    for (batch, num_q, heads, kv_heads, head_dim, lengths, region, in_cache), k_scale in K_SCALED_CASES:
        q, k, v, lengths, anc = _case(rng, batch, num_q, heads, kv_heads, head_dim, lengths, region)
        k = k * np.float32(k_scale)
        scale = head_dim ** -0.5
        got = _kernel(q, k, v, 1, lengths, anc, region, scale, in_cache, fn=fn)
        chex.assert_shape(got, q.shape)
        exact = _reference(q, k, v, 1, lengths, anc, region, scale)
        floor = precision.error(_xla(q, k, v, 1, lengths, anc, region, scale, in_cache), exact)
        case = (batch, num_q, heads, kv_heads, head_dim)
        precision.assert_within(got, exact, floor, what=f"{label} {case} x{k_scale}")
    q, k, v, _, anc = _case(rng, 1, 2, 2, 1, 16, [0], 2)
    got = _kernel(q, k, v, 0, np.zeros(1, np.int32), np.zeros_like(anc), 2, 0.25, False, fn=fn)
    assert np.array_equal(got, np.zeros_like(got)), label

@needs_kernel
class TestKernel(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_matches_float64_within_xla_float32_floor(self):
        _assert_cases_match_float64(self.variant(cpu_attention.attend, static_argnames=("region", "scale")), 0,
                                    "native")

    def test_causal_ancestor_rows(self):
        words = np.asarray(cpu_attention.causal_ancestor(2, 40))
        chex.assert_shape(words, (2, 40, 2))
        for t in range(40):
            seen = [j for j in range(64) if (int(words[1, t, j // 32]) >> (j % 32)) & 1]
            assert seen == list(range(t + 1))


def test_non_finite_kv_reaches_exactly_the_queries_that_see_it(kernel_build):
    """A NaN/inf K or V in the tree turns the queries that see that slot NaN and leaves the others bit
    for bit; one in the committed prefix turns every query of its KV head NaN, not the other heads'.
    In this CPU's build (through XLA) and in the AVX2 build (its one-thread entry), whatever the CPU."""
    _, fn = kernel_build
    rng = np.random.default_rng(2)
    q, k, v, lengths, anc = _case(rng, 1, 6, 4, 2, 64, [300], 6)
    anc[0, :, 0] = [0b1, 0b11, 0b101, 0b1011, 0b10101, 0b100001]  # slot 3 seen by query 3 only
    clean = _kernel(q, k, v, 0, lengths, anc, 6, 0.125, False, fn=fn)
    for bad in (np.nan, np.inf, -np.inf):
        for cache in ("k", "v"):
            kk, vv = k.copy(), v.copy()
            (kk if cache == "k" else vv)[0, 0, 303, 1, 5] = bad  # tree slot 3, KV head 1
            got = _kernel(q, kk, vv, 0, lengths, anc, 6, 0.125, False, fn=fn)
            assert np.isnan(got[0, 3, 2:]).all(), (bad, cache)  # query 3, query heads 2, 3 (KV head 1)
            others = np.ones(got.shape, bool)
            others[0, 3, 2:] = False
            assert np.array_equal(got[others], clean[others]), (bad, cache)
            kk, vv = k.copy(), v.copy()
            (kk if cache == "k" else vv)[0, 0, 100, 0, 7] = bad  # prefix slot 100, KV head 0
            got = _kernel(q, kk, vv, 0, lengths, anc, 6, 0.125, False, fn=fn)
            assert np.isnan(got[0, :, :2]).all() and np.array_equal(got[0, :, 2:], clean[0, :, 2:]), (bad, cache)


@needs_kernel
def test_results_do_not_depend_on_the_buffer_the_batch_or_threads():
    """Bit for bit: a longer (NaN-filled) buffer, another request beside it, repeated calls."""
    rng = np.random.default_rng(3)
    q, k, v, lengths, anc = _case(rng, 1, 17, 9, 3, 64, [700], 17)
    run = jax.jit(cpu_attention.attend, static_argnames=("region", "scale"))
    alone = _kernel(q, k, v, 0, lengths, anc, 17, 0.125, False, fn=run)
    longer = np.concatenate([k, np.full((2, 1, 3000, 3, 64), np.nan, np.float32)], axis=2)
    assert np.array_equal(_kernel(q, longer, np.concatenate([v, longer[:, :, k.shape[2]:]], axis=2), 0, lengths,
                                  anc, 17, 0.125, False, fn=run), alone)
    q2, k2, v2, _, anc2 = _case(rng, 1, 17, 9, 3, 64, [700], 17)
    pair = _kernel(np.concatenate([q2, q]), np.concatenate([k2, k], axis=1), np.concatenate([v2, v], axis=1), 0,
                   np.asarray([40, 700], np.int32), np.concatenate([anc2, anc]), 17, 0.125, False, fn=run)
    assert np.array_equal(pair[1:], alone)
    for _ in range(3):
        assert np.array_equal(_kernel(q, k, v, 0, lengths, anc, 17, 0.125, False, fn=run), alone)


@needs_kernel
def test_bad_inputs_are_named():
    q, k, v, lengths, anc = _case(np.random.default_rng(4), 1, 2, 4, 2, 16, [5], 2)
    args = (jnp.asarray(k), jnp.asarray(v), 0, jnp.asarray(lengths), jnp.asarray(anc))
    with pytest.raises(TypeError, match="float32 only"):
        cpu_attention.attend(jnp.asarray(q, jnp.bfloat16), *args, 2, 0.25)
    with pytest.raises(ValueError, match="does not match the cache"):
        cpu_attention.attend(jnp.asarray(q[:, :, :3]), *args, 2, 0.25)
    with pytest.raises(ValueError, match="does not cover"):
        cpu_attention.attend(jnp.asarray(q), *args, 33, 0.25)
    with pytest.raises(ValueError, match="is not \\[B, region"):
        cpu_attention.attend(jnp.asarray(q), *args, 2, 0.25, jnp.zeros((1, 3, 2, 16)), jnp.zeros((1, 3, 2, 16)))


HAS_COMPILER = bool(shutil.which(os.environ.get("CXX") or "c++"))
AVX2_CPU = all(f in cpu_kernels.build._cpu_flags().split() for f in cpu_kernels.build.AVX2)
needs_avx2_build = pytest.mark.skipif(not AVX2_CPU or not HAS_COMPILER,
                                      reason="needs an x86-64 CPU with AVX2, FMA and F16C and a C++ compiler")


def _compile(out, march: str, *extra: str):
    """attention.cc built with ``-march=<march>`` and without the FFI (its one-thread entries)."""
    from specjax.kernels.cpu import build

    flags = [(f"-march={march}" if f == "-march=native" else f) for f in build.FLAGS]
    done = subprocess.run([*build._compiler(), *flags, *extra, "-DSPECJAX_NO_FFI", "-I", str(build.HERE),
                           str(build.HERE / "attention.cc"), "-o", str(out)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.fixture(scope="module")
def avx2_build(tmp_path_factory):
    """The AVX2 build (``-march=haswell``: two 8-float halves per vector, 3-row groups, outputs summed
    one column block at a time), loaded whatever this CPU is."""
    out = tmp_path_factory.mktemp("avx2") / "attention_haswell.so"
    _compile(out, "haswell")
    return ctypes.cdll.LoadLibrary(str(out))


def _ctypes_attend(lib):
    """``cpu_attention.attend``'s signature over a build's one-thread reference entry."""
    ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731

    def attend(q, k, v, layer, lengths, anc, region, scale, kb=None, vb=None):
        q, k, v = (np.ascontiguousarray(a, np.float32) for a in (q, k, v))
        in_cache = kb is None
        kb, vb = (np.zeros(1, np.float32) if a is None else np.ascontiguousarray(a, np.float32) for a in (kb, vb))
        lengths, anc = np.ascontiguousarray(lengths, np.int32), np.ascontiguousarray(anc, np.uint32)
        out = np.full(q.shape, np.nan, np.float32)
        dims = (*q.shape[:3], k.shape[3], q.shape[3], k.shape[0], k.shape[2], anc.shape[2], region)
        lib.specjax_cpu_attention_reference(ptr(q), ptr(k), ptr(v), ptr(kb), ptr(vb), ctypes.c_int(int(in_cache)),
                                            ctypes.c_long(layer), ptr(lengths), ptr(anc), ptr(out),
                                            *(ctypes.c_long(d) for d in dims), ctypes.c_float(scale))
        return out

    return attend


@needs_avx2_build
def test_the_avx2_build_matches_float64(avx2_build):
    """The AVX2 build, whatever this CPU is, on the cases the native build meets."""
    _assert_cases_match_float64(_ctypes_attend(avx2_build), 6, "AVX2")



@pytest.fixture(params=["native", "avx2"])
def kernel_build(request):
    """(library, attend) of this CPU's build (attend None: ``cpu_attention.attend`` through XLA) or of
    the AVX2 build (its one-thread entry), whatever the CPU; skipped where that build cannot run."""
    if request.param == "native":
        if cpu_kernels.attention_status() is not None:
            pytest.skip(f"kernel unavailable: {cpu_kernels.attention_status()}")
        return cpu_kernels.build.library(), None
    if not (AVX2_CPU and HAS_COMPILER):
        pytest.skip("needs an x86-64 CPU with AVX2, FMA and F16C and a C++ compiler")
    lib = request.getfixturevalue("avx2_build")
    return lib, _ctypes_attend(lib)

def test_the_exponential_matches_float64(kernel_build):
    """The kernel's e^x over [-110, 0] (normal results within 1 ulp of float64's rounded, subnormal ones
    within one step of the smallest subnormal; e^0 = e^-0 = 1; NaN stays NaN), in each build: the AVX2
    build scales by 2^n in two steps where AVX-512 has scalef. (Attention outputs cannot show the
    subnormal weights: they are below float32's resolution beside the row's largest, 1.)"""
    x = np.concatenate([np.linspace(-110.0, 0.0, 160_000, dtype=np.float32),
                        np.float32([0.0, -0.0, np.nan, -87.3, -88.7, -103.0, -103.97, -104.5])])
    x = np.concatenate([x, np.zeros(-len(x) % 16, np.float32)])
    exact = np.exp(x.astype(np.float64))
    tiny = float(np.finfo(np.float32).smallest_subnormal)
    lib, _ = kernel_build
    y = np.full_like(x, -1.0)
    lib.specjax_cpu_attention_exp(x.ctypes.data_as(ctypes.c_void_p), y.ctypes.data_as(ctypes.c_void_p),
                                  ctypes.c_long(len(x)))
    assert np.isnan(y[np.isnan(x)]).all() and not np.isnan(y[~np.isnan(x)]).any()
    assert (y[x == 0] == 1.0).all()
    fine = ~np.isnan(x)
    normal = fine & (exact >= np.finfo(np.float32).tiny)
    ulp = np.spacing(exact[normal].astype(np.float32)).astype(np.float64)
    assert (np.abs(y[normal] - exact[normal]) <= ulp).all()
    sub = fine & ~normal
    assert (np.abs(y[sub] - exact[sub]) <= tiny).all()


@pytest.mark.skipif(not HAS_COMPILER, reason="needs a C++ compiler")
@pytest.mark.parametrize("march", ["skylake-avx512", "haswell"])
def test_each_build_compiles_with_its_fmas_in_registers(tmp_path, march):
    """Both ISAs' builds, whatever this CPU is (a CPU without AVX-512 still compiles that one; it runs
    where the CPU has AVX-512F): no FMA reads an operand from the stack (a spilled tile)."""
    out = tmp_path / "attention.s"
    _compile(out, march, "-S")
    fmas = [line.strip() for line in out.read_text().splitlines() if line.strip().startswith("vfmadd")]
    assert fmas, "no FMA instructions in the kernel"
    on_stack = [f for f in fmas if "(%rsp)" in f or "(%rbp)" in f]
    assert not on_stack, f"{len(on_stack)} of {len(fmas)} FMAs read the stack ({march}): {on_stack[:3]}"
