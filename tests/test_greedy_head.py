"""The greedy head kernel (``specjax.kernels.cpu.greedy_head``): each row's first argmax and finiteness,
bit for bit what ``first_argmax`` and ``finite_rows`` decide on the float32 matmul kernel's logits,
though the head streams as float16: on random heads of every tile shape, on near-ties that float16
rounding reorders (with a mutation: zero error bounds pick the rounded order), exact ties, and rows
that are not finite (NaN weights or inputs, weights past float16's range, logits that overflow);
the bound itself against float64; the AVX2 build; and a SmolLM2 tree pass with ``greedy`` against its
logits."""

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

from specjax.decoding.sampling import SamplingArrays, finite_rows, first_argmax, seeded_tokens
from specjax.kernels import cpu as cpu_kernels
from specjax.kernels.cpu import greedy_head
from specjax.kernels.cpu import matmul as cpu_matmul

needs_kernel = pytest.mark.skipif(cpu_kernels.matmul_status() is not None,
                                  reason=f"kernel unavailable: {cpu_kernels.matmul_status()}")

# (rows, K, N): one row, the tile shapes and their remainders, N not a multiple of a panel.
SHAPES = [(1, 64, 64), (2, 100, 70), (3, 130, 200), (5, 33, 129), (8, 140, 1000), (9, 300, 70), (17, 200, 130),
          (17, 576, 3000)]


def reference(x, w) -> tuple[np.ndarray, np.ndarray]:
    """What greedy verification decides from the float32 kernel's logits."""
    logits = cpu_matmul.matmul(jnp.asarray(x), cpu_matmul.pack(jnp.asarray(w)), w.shape[1])
    return np.asarray(first_argmax(logits)), np.asarray(finite_rows(logits))


def decide(x, w, head=None):
    head = greedy_head.pack_head(jnp.asarray(w)) if head is None else head
    ids, finite = greedy_head.greedy_decision(jnp.asarray(x), head)
    chex.assert_shape((ids, finite), (x.shape[0],))
    chex.assert_type((ids, finite), (jnp.int32, jnp.bool_))
    return np.asarray(ids), np.asarray(finite)


def near_ties(rng, m: int, k: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Columns that differ by far less than float16's rounding: the rounded head orders them at random."""
    x = rng.standard_normal((m, k)).astype(np.float32)
    base = rng.standard_normal((k, 1)) / np.sqrt(k)
    w = (base + 1e-6 * rng.standard_normal((k, n))).astype(np.float32)
    return x, w


@needs_kernel
class TestGreedyHead(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_decides_as_the_float32_kernel_on_random_heads(self):
        rng = np.random.default_rng(0)
        for m, k, n in SHAPES:
            x = rng.standard_normal((m, k)).astype(np.float32)
            w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
            head = greedy_head.pack_head(jnp.asarray(w))
            ids, finite = self.variant(greedy_head.greedy_decision)(jnp.asarray(x), head)
            want = reference(x, w)
            np.testing.assert_array_equal(np.asarray(ids), want[0], err_msg=f"{m}x{k}x{n}")
            np.testing.assert_array_equal(np.asarray(finite), want[1])

    def test_near_ties_resolve_as_float32_does(self):
        """Columns within float16 rounding of each other: the approximate logits' argmax differs from the
        float32 one in most rows, the kernel's never; with its error bounds zeroed (the mutation) it
        returns the rounded head's choice."""
        rng = np.random.default_rng(1)
        x, w = near_ties(rng, 17, 576, 512)
        want_ids, _ = reference(x, w)
        rounded = np.asarray(x, np.float64) @ w.astype(np.float16).astype(np.float64)
        assert (rounded.argmax(axis=1) != want_ids).sum() >= 8  # the rounding does reorder them
        ids, finite = decide(x, w)
        np.testing.assert_array_equal(ids, want_ids)
        assert finite.all()
        head = greedy_head.pack_head(jnp.asarray(w))
        blind = greedy_head.GreedyHead(head.packed, head.rows, jnp.zeros_like(head.err))
        assert (decide(x, w, blind)[0] != want_ids).sum() >= 8

    def test_exact_ties_take_the_first_column(self):
        rng = np.random.default_rng(2)
        x = rng.standard_normal((5, 64)).astype(np.float32)
        col = rng.standard_normal((64, 1)).astype(np.float32)
        w = np.concatenate([rng.standard_normal((64, 7)).astype(np.float32) * 0.01, col, col * 0.5, col, col], axis=1)
        ids, _ = decide(x, w)
        np.testing.assert_array_equal(ids, reference(x, w)[0])
        positive = (x @ col)[:, 0] > 0
        np.testing.assert_array_equal(ids[positive], 7)  # the first of the three equal columns

    def test_rows_that_are_not_finite(self):
        rng = np.random.default_rng(3)
        k, n = 64, 300
        x = rng.standard_normal((6, k)).astype(np.float32)
        x[1, 5] = np.nan  # every logit of row 1 NaN: the first NaN (column 0)
        x[2] *= 1e4  # with the huge column below: overflows to +-inf
        w = (rng.standard_normal((k, n)) / 8).astype(np.float32)
        w[:, 200] = 1e36  # past float16's range (inf when rounded): rows recomputed in full
        w[3, 250] = np.nan  # a NaN weight: that column NaN in every row
        got, want = decide(x, w), reference(x, w)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
        assert not want[1].any() and want[0][1] == 0 and (want[0][[0, 3, 4, 5]] == 250).all()
        w[3, 250] = 0.5  # without the NaN: the finite rows take the huge column where it is positive
        got, want = decide(x, w), reference(x, w)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
        assert want[1][[0, 3, 4, 5]].all() and not want[1][[1, 2]].any()

    def test_a_dot_product_that_overflows_on_its_way_is_not_finite(self):
        """The float32 sum of column 0 passes float32's range at its first product, then comes back: its logit
        is inf. The rounded head's final value and error stayed in range, so the row was called finite and
        column 1 chosen; a bound on every partial sum (|x| |w_j|) sends such rows to the full computation."""
        x = np.full((1, 2), 5.197e33, np.float32)
        w = np.array([[65480.0, 16.0], [-65472.0, 16.0]], np.float32)
        got, want = decide(x, w), reference(x, w)
        assert want[0][0] == 0 and not want[1][0]  # logits [inf, 1.66e35]
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])

    def test_a_head_of_no_hidden_width_decides_on_zero_logits(self):
        """K = 0: the matmul left the last partial panel's rows unwritten (stack garbage), and the head chose
        from them."""
        ids, finite = decide(np.zeros((2, 0), np.float32), np.zeros((0, 40), np.float32))
        np.testing.assert_array_equal(ids, [0, 0])
        assert finite.all()

    def test_the_bound_holds_against_float64(self):
        """|exact - approximate logit| <= |x| err_j for the float32 sums of both weights, measured against
        float64; the bound is not loose by more than Cauchy-Schwarz makes it."""
        rng = np.random.default_rng(4)
        x = rng.standard_normal((64, 576)).astype(np.float32) * 30
        w = (rng.standard_normal((576, 2000)) / 24).astype(np.float32)
        head = greedy_head.pack_head(jnp.asarray(w))
        exact = np.asarray(cpu_matmul.matmul(jnp.asarray(x), cpu_matmul.pack(jnp.asarray(w)), 2000), np.float64)
        approx = np.asarray(cpu_matmul.matmul(jnp.asarray(x), head.packed, 2000), np.float64)
        bound = np.linalg.norm(x.astype(np.float64), axis=1)[:, None] * np.asarray(head.err, np.float64)[None]
        gap = np.abs(exact - approx)
        assert (gap <= bound).all()
        assert gap.max() > bound.max() / 1000  # float16 rounding is what it bounds

    def test_bounds_computed_in_row_blocks_equal_the_whole_head_formula(self):
        """``column_errors`` works in blocks of rows (whole-head float64 temporaries cost seconds of page
        faults); each row's bound is the whole-head formula's, bit for bit, across block edges and for
        rows that are not finite or past float16's range."""
        rng = np.random.default_rng(5)
        n, k = 2 * greedy_head._ROW_BLOCK + 37, 96
        rows = (rng.standard_normal((n, k)) / 10).astype(np.float32)
        edge = greedy_head._ROW_BLOCK
        rows[edge - 1, 3], rows[edge, 0], rows[2 * edge, 5], rows[n - 1, 1] = np.nan, np.inf, 7e4, -np.inf
        w = rows.astype(np.float64)
        with np.errstate(over="ignore", invalid="ignore"):
            half = rows.astype(np.float16).astype(np.float64)
            gamma = k * 2.0 ** -24 / (1 - k * 2.0 ** -24)
            bound = (np.linalg.norm(w - half, axis=1) + gamma * (np.linalg.norm(w, axis=1)
                                                                 + np.linalg.norm(half, axis=1))) * greedy_head._SLACK
        want = np.nextafter(bound.astype(np.float32), np.float32(np.inf))
        got = greedy_head.column_errors(rows)
        chex.assert_shape(got, (n,))
        np.testing.assert_array_equal(got, want)
        assert not np.isfinite(got[[edge - 1, edge, n - 1]]).any() and np.isinf(got[2 * edge])  # NaN, inf - inf
        assert np.isfinite(got[[0, edge + 1, n - 2]]).all()

    def test_refuses_a_head_that_is_not_float32(self):
        with pytest.raises(TypeError, match="float32 head"):
            greedy_head.pack_head(jnp.zeros((4, 8), jnp.float16))
        head = greedy_head.pack_head(jnp.zeros((4, 8), jnp.float32))
        with pytest.raises(ValueError, match="does not match"):
            greedy_head.greedy_decision(jnp.zeros((2, 5), jnp.float32), head)
        wide = greedy_head.pack_head(jnp.zeros((4, 200), jnp.float32))  # panels of another head
        with pytest.raises(Exception, match="shapes do not match"):
            greedy_head.greedy_decision(jnp.zeros((2, 4), jnp.float32),
                                        greedy_head.GreedyHead(wide.packed, head.rows, head.err))


@needs_kernel
@pytest.mark.parametrize("family", ["llama", "opt"])
def test_step_params_carry_the_greedy_head(family, tiny_llama_dir, tiny_opt_dir):
    """A greedy step program's params hold the head as the greedy kernel reads it, made once: a tied
    model's rows are its embedding itself, an untied head's its transpose; other programs' params do not."""
    import specjax
    from specjax.decoding.programs import step_params
    from specjax.models.params import GREEDY_HEAD

    model = specjax.load_model(tiny_llama_dir if family == "llama" else tiny_opt_dir, progress=False)
    head = step_params(model.params, decides=True)[GREEDY_HEAD]
    assert isinstance(head, greedy_head.GreedyHead)
    assert step_params(model.params, decides=True)[GREEDY_HEAD].packed is head.packed  # packed once
    assert GREEDY_HEAD not in step_params(model.params)  # only programs that verify greedily carry it
    plain = model.params.get("lm_head")
    if plain is None:
        assert head.rows is model.params["embed"]
    else:
        np.testing.assert_array_equal(np.asarray(head.rows), np.asarray(plain).T)
    chex.assert_shape(head.err, (head.rows.shape[0],))


def smollm2_tree_pass(smollm2):
    """(params as a deciding step program has them, a 9-node tree of two requests at 24 and 17 tokens of
    committed random context, that cache, a jitted ``tree_forward``): a SmolLM2 tree pass to decide from."""
    from specjax.attention.meta import causal_meta
    from specjax.decoding.programs import step_params
    from specjax.models import forward
    from specjax.models.cache import init_cache
    from specjax.speculation.commit import tree_forward
    from specjax.speculation.tree import from_parents

    cfg = smollm2.config
    params = step_params(smollm2.params, decides=True)
    rng = np.random.default_rng(5)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 24)), jnp.int32)
    cache = init_cache(cfg, 2, 64, jnp.float32)
    _, cache, _ = forward(params, prompt, jnp.broadcast_to(jnp.arange(24), (2, 24)), cache,
                          causal_meta(jnp.zeros((2,), jnp.int32)), cfg)
    cache = cache.replace(length=jnp.asarray([24, 17], jnp.int32))
    parents = [[-1, 0, 0, 1, 1, 2, 3, 3, 5], [-1, 0, 1, 2, 3, 4, 5, 6, 7]]
    tokens = [rng.integers(0, cfg.vocab_size, 9).tolist() for _ in parents]
    tree = from_parents(tokens, parents, n_max=9)
    run = jax.jit(tree_forward, static_argnames=("cfg", "impl", "block_only", "greedy"))
    return params, tree, cache, run


@needs_kernel
def test_smollm2_tree_pass_decides_as_its_logits(smollm2):
    """A SmolLM2 tree pass asked for ``greedy`` (through the step programs' params, as the speculative
    loop runs it) gives every node the argmax and finiteness of the same pass's logits."""
    cfg = smollm2.config
    params, tree, cache, run = smollm2_tree_pass(smollm2)
    logits = run(params, tree, cache, cfg=cfg, impl="xla", block_only=True).logits
    got = run(params, tree, cache, cfg=cfg, impl="xla", block_only=True, greedy=True)
    chex.assert_shape((got.token, got.finite), (2, 9))
    np.testing.assert_array_equal(np.asarray(got.token), np.asarray(first_argmax(logits)))
    np.testing.assert_array_equal(np.asarray(got.finite), np.asarray(finite_rows(logits)))
    assert np.asarray(got.finite).all()


@pytest.mark.skipif(not shutil.which(os.environ.get("CXX") or "c++"), reason="needs a C++ compiler")
def test_the_avx2_build_decides_as_its_float32_kernel(tmp_path):
    """greedy_head.cc and matmul.cc built for AVX2 (``-march=haswell``, 32-column panels, its own tile
    shapes), without the FFI: the same decisions as its float32 matmul's logits on near-ties, exact
    ties and rows that are not finite, greedy and seeded (temperature 1)."""
    from specjax.kernels.cpu import build
    from tests.test_cpu_matmul import AVX2_CPU

    if not AVX2_CPU:
        pytest.skip("needs an x86-64 CPU with AVX2, FMA and F16C")
    lib_path = tmp_path / "greedy_avx2.so"
    flags = [("-march=haswell" if f == "-march=native" else f) for f in build.FLAGS]
    done = subprocess.run([*build._compiler(), *flags, "-DSPECJAX_NO_FFI", "-I", str(build.HERE),
                           str(build.HERE / "matmul.cc"), str(build.HERE / "greedy_head.cc"), "-o", str(lib_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lib = ctypes.cdll.LoadLibrary(str(lib_path))
    width = lib.specjax_cpu_matmul_panel_width()
    ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    longs = lambda *v: [ctypes.c_long(int(i)) for i in v]  # noqa: E731

    def panels(w, dtype):
        k, n = w.shape
        out = np.zeros((k, -(-n // width) * width), dtype)
        out[:, :n] = w
        return np.ascontiguousarray(out.reshape(k, -1, width).transpose(1, 0, 2))

    rng = np.random.default_rng(9)
    x, w = near_ties(rng, 17, 576, 300)
    x2 = rng.standard_normal((6, 64)).astype(np.float32)
    x2[1, 5], x2[2] = np.nan, x2[2] * 1e4
    w2 = (rng.standard_normal((64, 300)) / 8).astype(np.float32)
    w2[:, 200], w2[3, 250] = 1e36, np.nan
    # logits that underflow: both exactly 2**-149 (a tie: column 0), though float16's rounding of column 0
    # is not; the bound needs an absolute term for subnormal rounding (XLA's threads flush them to zero)
    x3, w3 = np.full((1, 1), 2.0**-149, np.float32), np.array([[0.5 + 2.0**-13, 0.75]], np.float32)
    for x, w in ((x, w), (x2, w2), (x[:3, :64], np.repeat(w2[:, :1] * 0 + w[:64, :1], 5, axis=1)), (x3, w3)):
        m, (k, n) = x.shape[0], w.shape
        logits = np.full((m, n), np.nan, np.float32)
        lib.specjax_cpu_matmul_reference(ptr(x), ptr(panels(w, np.float32)), ptr(logits), *longs(m, k, n))
        want = np.asarray(first_argmax(jnp.asarray(logits))), np.asarray(finite_rows(jnp.asarray(logits)))
        ids, finite = np.full(m, -1, np.int32), np.zeros(m, np.bool_)
        approx = np.zeros((m, n), np.float32)
        rows = np.ascontiguousarray(w.T)
        err = greedy_head.column_errors(rows)
        lib.specjax_cpu_greedy_head_reference(ptr(x), ptr(panels(w, np.float16)), ptr(rows), ptr(err), ptr(ids),
                                              ptr(finite), ptr(approx), *longs(m, k, n))
        np.testing.assert_array_equal(ids, want[0])
        np.testing.assert_array_equal(finite, want[1])
        # the seeded decision at temperature 1 (and greedy rows), from the same panels
        noise = rng.gumbel(size=(2, n)).astype(np.float32)
        inv_t = np.where(np.arange(m) % 3 == 2, 0.0, 1.0).astype(np.float32)
        row = (np.arange(m) % 2).astype(np.int32)
        lib.specjax_cpu_sampled_head_reference(ptr(x), ptr(panels(w, np.float16)), ptr(rows), ptr(err), ptr(inv_t),
                                               ptr(noise), ptr(row), ptr(ids), ptr(finite), ptr(approx),
                                               *longs(m, k, n))
        sampling = SamplingArrays(temperature=jnp.asarray(inv_t), top_k=jnp.zeros((m,), jnp.int32),
                                  top_p=jnp.ones((m,), jnp.float32), seed=jnp.zeros((m,), jnp.int32))
        want_sampled = seeded_tokens(jnp.asarray(logits), sampling, jnp.asarray(noise[row]))
        np.testing.assert_array_equal(ids, np.asarray(want_sampled))
        np.testing.assert_array_equal(finite, want[1])
