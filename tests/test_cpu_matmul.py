"""specjax's CPU matmul kernel (``specjax.kernels.cpu.matmul``) and where the step programs use it
(``specjax.decoding.programs.step_params``): against a float64 reference with a floor from XLA's own
float32 matmul, over shapes that exercise every path (one row, row tiles and their remainders, row
blocks, a last panel narrower than the others, K not a multiple of the L1 chunk); the packed layout;
the packed params of a step program; a tree pass through them; and a kernel that cannot be built
reported by name."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.decoding.programs import ENV, step_library, step_params
from specjax.kernels import cpu as cpu_kernels
from specjax.kernels.cpu import matmul as cpu_matmul
from specjax.models.params import TIED_HEAD, stack_layers
from specjax.models.weights import MATMUL_WEIGHTS, PackedWeight
from tests import precision

# Where the kernel is not built (neither AVX-512F nor AVX2, no compiler) only the tests of that case and
# of the AVX2 build (any x86-64 CPU with AVX2, FMA and F16C) run.
needs_kernel = pytest.mark.skipif(cpu_kernels.matmul_status() is not None,
                                  reason=f"kernel unavailable: {cpu_kernels.matmul_status()}")

# (rows, K, N): one row; row tiles (AVX-512: 4 rows; AVX2: 2 rows, and from 8 rows on 6 rows x half a
# panel) and every remainder after them (AVX2's wide shape: 1-2 rows over the whole panel, 3-5 over
# each half); a row block of 64 and a second one; N below, at and past a panel's width and not a
# multiple of it; K below and past the 64-row chunk of 1-2 row tiles and the 128-row chunk of 3+
# tiles (whose next chunk is prefetched by all tiles).
SHAPES = [(1, 64, 64), (2, 100, 70), (3, 130, 200), (5, 33, 129), (7, 300, 50), (8, 140, 40), (9, 300, 70),
          (10, 64, 33), (11, 129, 96), (12, 70, 64), (13, 290, 70), (17, 200, 130), (64, 65, 64), (65, 64, 257),
          (130, 150, 100)]


@needs_kernel
class TestKernel(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_matches_float64_within_xla_float32_floor(self):
        rng = np.random.default_rng(0)
        for m, k, n in SHAPES:
            x = rng.standard_normal((m, k), dtype=np.float32)
            w = rng.standard_normal((k, n), dtype=np.float32) / np.sqrt(k)
            exact = x.astype(np.float64) @ w.astype(np.float64)
            packed = cpu_matmul.pack(jnp.asarray(w))
            chex.assert_shape(packed, (-(-n // cpu_matmul.panel_width()), k, cpu_matmul.panel_width()))
            got = self.variant(lambda x, p, n=n: cpu_matmul.matmul(x, p, n))(jnp.asarray(x), packed)
            chex.assert_shape(got, (m, n))
            floor = precision.error(jnp.asarray(x) @ jnp.asarray(w), exact)
            precision.assert_within(got, exact, floor, what=f"kernel {m}x{k}x{n}")

    @chex.variants(with_jit=True, without_jit=True)
    def test_float16_panels_round_the_weights_once(self):
        """float16 panels: float64's product with the weights rounded to float16 (each widened exactly,
        products summed in float32), within the floor of XLA's float32 matmul of those rounded weights."""
        rng = np.random.default_rng(4)
        for m, k, n in SHAPES:
            x = rng.standard_normal((m, k), dtype=np.float32)
            w = rng.standard_normal((k, n), dtype=np.float32) / np.sqrt(k)
            packed = cpu_matmul.pack(jnp.asarray(w), dtype=jnp.float16)
            chex.assert_type(packed, jnp.float16)
            # the weights the kernel multiplies, each within half a float16 step of the float32 weight
            rounded = np.asarray(packed, np.float32).transpose(1, 0, 2).reshape(k, -1)[:, :n]
            assert (np.abs(rounded - w) <= np.abs(w) * 2.0 ** -11 + 2.0 ** -25).all()  # half-steps: normal, subnormal
            exact = x.astype(np.float64) @ rounded.astype(np.float64)
            got = self.variant(lambda x, p, n=n: cpu_matmul.matmul(x, p, n))(jnp.asarray(x), packed)
            chex.assert_shape(got, (m, n))
            floor = precision.error(jnp.asarray(x) @ jnp.asarray(rounded), exact)
            precision.assert_within(got, exact, floor, what=f"float16 kernel {m}x{k}x{n}")
            assert precision.error(got, x.astype(np.float64) @ w.astype(np.float64)) > 10 * floor  # rounded

    def test_a_row_does_not_depend_on_its_batch_mates(self):
        """Every path of the build this CPU runs (the few-rows and, on AVX2, the wide shape with each
        remainder, the next chunk prefetched by all tiles, a second row block) sums a row in the same
        order, so a row's result is bitwise the same whatever rows share the call."""
        rng = np.random.default_rng(2)
        x = jnp.asarray(rng.standard_normal((70, 300), dtype=np.float32))
        packed = cpu_matmul.pack(jnp.asarray(rng.standard_normal((300, 130), dtype=np.float32)))
        full = np.asarray(cpu_matmul.matmul(x, packed, 130))
        for rows in (2, 3, 5, 7, 8, 9, 10, 11, 12, 13, 17, 33):
            np.testing.assert_array_equal(np.asarray(cpu_matmul.matmul(x[:rows], packed, 130)), full[:rows],
                                          err_msg=f"{rows} rows")
        np.testing.assert_array_equal(np.asarray(cpu_matmul.matmul(x[64:], packed, 130)), full[64:])

    def test_threads_do_not_change_results(self):
        """Each output element is summed by one thread in one order: repeated calls are bitwise equal."""
        rng = np.random.default_rng(1)
        x = jnp.asarray(rng.standard_normal((17, 576), dtype=np.float32))
        packed = cpu_matmul.pack(jnp.asarray(rng.standard_normal((576, 3000), dtype=np.float32)))
        run = jax.jit(lambda x, p: cpu_matmul.matmul(x, p, 3000))
        first = np.asarray(run(x, packed))
        for _ in range(5):
            np.testing.assert_array_equal(np.asarray(run(x, packed)), first)


@needs_kernel
def test_pack_layout_and_checks():
    width = cpu_matmul.panel_width()
    w = np.arange(3 * 2 * (width + 5), dtype=np.float32).reshape(3, 2, width + 5)  # an output projection [H, Dh, D]
    packed = np.asarray(cpu_matmul.pack(jnp.asarray(w), contracted=2))
    flat = w.reshape(6, width + 5)
    assert packed.shape == (2, 6, width)
    np.testing.assert_array_equal(packed[0], flat[:, :width])
    np.testing.assert_array_equal(packed[1, :, :5], flat[:, width:])
    assert not packed[1, :, 5:].any()  # the last panel's columns past N are zero
    with pytest.raises(TypeError, match="float32 rows by float32 or float16 panels"):
        cpu_matmul.matmul(jnp.zeros((2, 6), jnp.bfloat16), jnp.asarray(packed), width + 5)
    with pytest.raises(TypeError, match="float32 or float16 weights, not bfloat16"):
        cpu_matmul.pack(jnp.asarray(w), contracted=2, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="does not match packed weight"):
        cpu_matmul.matmul(jnp.zeros((2, 7)), jnp.asarray(packed), width + 5)
    # float16 panels: a weight past float16's range would turn inf (a drafter's drafts all NaN), so refused
    big = w.copy()
    big[1, 0, 3] = 7e4
    with pytest.raises(ValueError, match="a weight of 7e\\+04 is past float16's range"):
        cpu_matmul.pack(jnp.asarray(big), contracted=2, dtype=jnp.float16)
    assert cpu_matmul.pack(jnp.asarray(w), contracted=2, dtype=jnp.float16).dtype == jnp.float16
    big[1, 0, 3] = 65519.0  # rounds to float16's largest, 65504: taken
    assert np.isfinite(np.asarray(cpu_matmul.pack(jnp.asarray(big), contracted=2, dtype=jnp.float16))).all()


@needs_kernel
def test_rows_the_kernel_takes():
    """2..KERNEL_MAX_ROWS rows go to the kernel; one row and more rows to XLA's dot (plain weight)."""
    from specjax.models.weights import KERNEL_MAX_ROWS, matmul_rows

    w = jnp.ones((8, 16), jnp.float32)
    both = PackedWeight(w, cpu_matmul.pack(w))
    for rows, kernel in ((1, False), (2, True), (KERNEL_MAX_ROWS, True), (KERNEL_MAX_ROWS + 1, False)):
        x = jnp.ones((8,) if rows == 1 else (rows, 8), jnp.float32)
        text = str(jax.make_jaxpr(matmul_rows)(x, both))
        assert (cpu_matmul.TARGET in text) == kernel, rows
        np.testing.assert_allclose(np.asarray(matmul_rows(x, both)), np.asarray(x @ w), rtol=1e-6)
    assert cpu_matmul.TARGET not in str(jax.make_jaxpr(matmul_rows)(jnp.ones((2, 8), jnp.bfloat16), both))
    # float16 panels (a drafter's): one row too, as streaming half the bytes beats XLA's vector product
    half = PackedWeight(w, cpu_matmul.pack(w, dtype=jnp.float16))
    for rows, kernel in ((1, True), (2, True), (KERNEL_MAX_ROWS, True), (KERNEL_MAX_ROWS + 1, False)):
        x = jnp.ones((8,) if rows == 1 else (rows, 8), jnp.float32)
        assert (cpu_matmul.TARGET_F16 in str(jax.make_jaxpr(matmul_rows)(x, half))) == kernel, rows
        np.testing.assert_allclose(np.asarray(matmul_rows(x, half)), np.asarray(x @ w), rtol=1e-6)


@needs_kernel
def test_step_params_pack_every_matmul_weight_once(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv(ENV, "auto")
    model = specjax.load_model(tiny_llama_dir, progress=False)
    assert step_library(1).startswith("kernel+")
    packed = step_params(model.params)
    again = step_params(model.params)
    for lp, plain, lp2 in zip(packed["layers"], model.params["layers"], again["layers"]):
        for name, w in lp.items():
            assert isinstance(w, PackedWeight) == (name in MATMUL_WEIGHTS), name
            if isinstance(w, PackedWeight):
                assert w.plain is plain[name] and lp2[name].packed is w.packed  # each weight packed once
            else:
                assert w is plain[name]
    head = "lm_head" if "lm_head" in model.params else TIED_HEAD
    assert isinstance(packed[head], PackedWeight)
    # Params that share the packed weights and differ elsewhere keep their own entries.
    other = {**model.params, "final_norm": model.params["final_norm"] * 2}
    assert step_params(other)["final_norm"] is other["final_norm"]
    assert step_params(other)["layers"][0]["wqkv"].packed is packed["layers"][0]["wqkv"].packed
    # Not packed: XLA's libraries chosen, stacked layers, a mesh, bfloat16 weights.
    assert step_params(stack_layers(model.params))["layers"] is not packed["layers"]
    assert step_params(model.params, parallel=object()) is model.params
    bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), model.params)
    assert step_params(bf16) is bf16
    monkeypatch.setenv(ENV, "eigen")
    assert step_params(model.params) is model.params and step_library(1) == "eigen"
    # The cache keeps packed copies only while their plain weights live.
    import gc

    from specjax.decoding import programs

    before = len(programs._PACKED)
    del model, packed, again, other, plain, lp, lp2, w, bf16
    gc.collect()
    assert len(programs._PACKED) < before


@needs_kernel
def test_drafters_step_params(tiny_llama_dir, monkeypatch):
    """step_drafter_params: an SSM's weights packed as the LLM's are (the same packed arrays), a drafter
    without weights (lookup) unchanged, nothing packed on a mesh or with XLA's libraries chosen."""
    from specjax.decoding.programs import step_drafter_params
    from specjax.speculation.drafters.lookup import LookupDrafter
    from specjax.speculation.drafters.ssm import ssm_drafters

    monkeypatch.setenv(ENV, "auto")
    model = specjax.load_model(tiny_llama_dir, progress=False)
    (ssm,) = ssm_drafters([model.config], [(2, 1)])
    lookup = LookupDrafter()
    packed, none = step_drafter_params((ssm, lookup), (model.params, None))
    assert none is None
    want = step_params(model.params)
    for lp, lw in zip(packed["layers"], want["layers"]):
        for name, w in lp.items():
            assert isinstance(w, PackedWeight) == (name in MATMUL_WEIGHTS), name
            assert not isinstance(w, PackedWeight) or w.packed is lw[name].packed
    assert step_drafter_params((ssm,), (model.params,), parallel=object())[0] is model.params
    monkeypatch.setenv(ENV, "eigen")
    assert step_drafter_params((ssm,), (model.params,))[0] is model.params


@needs_kernel
@pytest.mark.parametrize("nodes", [1, 2, 5, 17])
def test_tree_pass_through_packed_weights(tiny_llama_dir, nodes, monkeypatch):
    """A tree pass multiplying by the packed weights (2+ rows through the kernel, 1 row through XLA)
    gives the float64 logits within the floor of the same pass over plain weights."""
    from specjax.models.cache import init_cache
    from specjax.speculation.commit import tree_forward
    from specjax.speculation.tree import from_parents

    monkeypatch.setenv(ENV, "auto")
    model = specjax.load_model(tiny_llama_dir, progress=False)
    cfg = model.config
    rng = np.random.RandomState(nodes)
    parents = [-1] + [(i - 1) // 2 for i in range(1, nodes)]
    tree = from_parents([rng.randint(0, cfg.vocab_size, nodes).tolist()], [parents], n_max=nodes)
    cache = init_cache(cfg, 1, 8 + nodes)

    def logits(params):
        return np.asarray(tree_forward(params, tree, cache, cfg, "xla").logits)

    with precision.float64():
        exact = np.asarray(tree_forward(precision.params64(model.params), tree, init_cache(cfg, 1, 8 + nodes,
                                                                                            jnp.float64),
                                        cfg, "xla").logits)
    plain = logits(model.params)
    packed = logits(step_params(model.params))
    precision.assert_within(packed, exact, precision.error(plain, exact), what=f"{nodes}-node pass")


CHECK = """
import os, sys, warnings
from specjax.kernels.cpu import build
from specjax.decoding import programs
from specjax.errors import InputError
# each case names its one missing piece: the no-compiler case on an AVX-512 CPU whatever this one is
build._cpu_flags = {"no-avx512": lambda: "fpu sse2 avx avx2 fma",
                    "no-compiler": lambda: "fpu sse2 avx avx2 fma avx512f"}[sys.argv[1]]
why = build.status()
assert why and sys.argv[2] in why, why
os.environ["SPECJAX_CPU_DOTS"] = "kernel"
try:
    programs.step_library(1, "cpu")
    raise SystemExit("kernel setting accepted without a kernel")
except InputError as e:
    assert "SPECJAX_CPU_DOTS=kernel" in str(e) and sys.argv[2] in str(e), e
os.environ["SPECJAX_CPU_DOTS"] = "auto"
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert programs.step_library(1, "cpu") == "eigen"
    assert programs.step_library(2, "cpu") == "eigen"
warned = sum("CPU kernels are unavailable" in str(w.message) for w in caught)
assert warned == int(sys.argv[3]), caught
print("ok")
"""


@pytest.mark.parametrize("case,reason,warnings", [
    ("no-compiler", "C++ compiler", 1),  # a failure: auto warns once
    ("no-avx512", "no AVX-512F", 0),  # a CPU the kernel is not made for: the rule, no warning
])
def test_a_kernel_that_cannot_be_built_is_named(tmp_path, case, reason, warnings):
    """status() says why; SPECJAX_CPU_DOTS=kernel refuses by name; auto runs XLA's matmuls."""
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "SPECJAX_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", CHECK, case, reason, str(warnings)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


# Tunings GCC's -march=native picks on Xeons (a KVM guest reporting model 167 is "rocketlake"), and the
# generic one. Under rocketlake and icelake-server tuning, generic vectors moved with memcpy kept the
# accumulator tile on the stack: 37 FMAs read it from (%rsp) and 17 rows ran 5.5x slower.
@needs_kernel
@pytest.mark.parametrize("tune", ["rocketlake", "icelake-server", "sapphirerapids", "generic", "avx2"])
def test_the_accumulator_tile_stays_in_registers_under_every_tuning(tmp_path, tune):
    """The kernel as the build compiles it, with -mtune=TUNE (or its AVX2 build, ``-march=haswell``): no
    FMA takes an operand from the stack."""
    from specjax.kernels.cpu import build

    flags = [f for f in build.FLAGS if f not in ("-shared", "-fPIC")]
    if tune == "avx2":
        flags, tune = [("-march=haswell" if f == "-march=native" else f) for f in flags], "haswell"
    out = tmp_path / "matmul.s"
    cmd = [*build._compiler(), *flags, f"-mtune={tune}", "-DSPECJAX_NO_FFI", "-I", str(build.HERE), "-S",
           str(build.HERE / "matmul.cc"), "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode != 0 and f"-mtune={tune}" in done.stderr:
        pytest.skip(f"this compiler does not know -mtune={tune}")
    assert done.returncode == 0, done.stderr[-2000:]
    fmas = [line.strip() for line in out.read_text().splitlines() if line.strip().startswith("vfmadd")]
    assert fmas, "no FMA instructions in the kernel"
    on_stack = [f for f in fmas if "(%rsp)" in f or "(%rbp)" in f]
    assert not on_stack, f"{len(on_stack)} of {len(fmas)} FMAs read the stack under -mtune={tune}: {on_stack[:3]}"


AVX2_CPU = all(f in cpu_kernels.build._cpu_flags().split() for f in cpu_kernels.build.AVX2)


@pytest.mark.skipif(not AVX2_CPU or not shutil.which(os.environ.get("CXX") or "c++"),
                    reason="needs an x86-64 CPU with AVX2, FMA and F16C and a C++ compiler")
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_the_avx2_build_matches_float64(tmp_path, dtype):
    """matmul.cc built for AVX2 (``-march=haswell``: what CPUs without AVX-512F run, whatever this one
    is): every shape of ``SHAPES`` (its 2-row tiles, its 6-row half-panel tiles from 8 rows on, their
    remainders, panels past N, chunks past K) is float64's product of the packed (float32, or
    float16-rounded) weights within numpy's float32 floor, and each row's result is bitwise the same
    with fewer rows in the call (so on an AVX-512 machine too the AVX2 shapes sum in one order)."""
    import ctypes

    from specjax.kernels.cpu import build

    lib_path = tmp_path / "matmul_avx2.so"
    flags = [("-march=haswell" if f == "-march=native" else f) for f in build.FLAGS]
    done = subprocess.run([*build._compiler(), *flags, "-DSPECJAX_NO_FFI", "-I", str(build.HERE),
                           str(build.HERE / "matmul.cc"), "-o", str(lib_path)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lib = ctypes.cdll.LoadLibrary(str(lib_path))
    width = lib.specjax_cpu_matmul_panel_width()
    assert width == 32  # 4 AVX2 vectors of 8
    fn = lib.specjax_cpu_matmul_reference if dtype == np.float32 else lib.specjax_cpu_matmul_reference_f16
    rng = np.random.default_rng(7)
    for m, k, n in SHAPES:
        x = rng.standard_normal((m, k), dtype=np.float32)
        w = (rng.standard_normal((k, n), dtype=np.float32) / np.sqrt(k)).astype(dtype).astype(np.float32)
        panels = np.zeros((k, -(-n // width) * width), dtype)
        panels[:, :n] = w
        panels = np.ascontiguousarray(panels.reshape(k, -1, width).transpose(1, 0, 2))
        y = np.full((m, n), np.nan, np.float32)
        fn(*(a.ctypes.data_as(ctypes.c_void_p) for a in (x, panels, y)), ctypes.c_long(m), ctypes.c_long(k),
           ctypes.c_long(n))
        exact = x.astype(np.float64) @ w.astype(np.float64)
        precision.assert_within(y, exact, precision.error(x @ w, exact), what=f"AVX2 {dtype.__name__} {m}x{k}x{n}")
        # a row's sum does not depend on its batch mates, whichever shape and remainder takes it
        for rows in range(1, m):
            part = np.full((rows, n), np.nan, np.float32)
            fn(*(a.ctypes.data_as(ctypes.c_void_p) for a in (x, panels, part)), ctypes.c_long(rows), ctypes.c_long(k),
               ctypes.c_long(n))
            np.testing.assert_array_equal(part, y[:rows], err_msg=f"AVX2 {dtype.__name__} {rows} of {m}x{k}x{n}")
    # K = 0: every product is the empty sum, 0, in the whole panels and the last partial one. The kernel once
    # left whole panels unwritten (the NaN put there stays) and copied the partial panel's stack scratch,
    # which the calls above left holding their sums.
    for m, n in ((3, 2 * width + 5), (1, width), (70, 7)):
        y = np.full((m, n), np.nan, np.float32)
        fn(*(a.ctypes.data_as(ctypes.c_void_p) for a in (np.zeros((m, 1), np.float32), np.zeros((1, 1, width), dtype),
                                                          y)), ctypes.c_long(m), ctypes.c_long(0), ctypes.c_long(n))
        np.testing.assert_array_equal(y, np.zeros((m, n), np.float32), err_msg=f"AVX2 {dtype.__name__} K = 0, {m}x{n}")
