"""bfloat16 dots for the teacher pass of feature-drafter training (``feature-tune --teacher-dots``): a float32
activation meeting a bfloat16 weight is a bfloat16 dot summed in float32, never a widened float32 dot, and
the features it gives are the float32 LLM's to bfloat16 rounding, kept apart from float32 features."""

from __future__ import annotations

import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.boost.feature_data import TEACHER_DOTS, feature_shards, teacher_features, teacher_params
from specjax.boost.feature_tune import features_dir
from specjax.errors import InputError
from specjax.models.weights import (
    MATMUL_WEIGHTS,
    LayerSwitch,
    bfloat16_matmul_weights,
    dense,
    matmul_rows,
    weight_einsum,
)

BF16_EPS = 2.0 ** -8  # bfloat16's unit roundoff (8 significand bits)
F32_EPS = 2.0 ** -24


def _bf16_dots(fn, *args) -> list[tuple[str, str]]:
    """The operand dtypes of every dot in ``fn``'s jaxpr (nested jaxprs included)."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                found.append(tuple(str(v.aval.dtype) for v in eqn.invars))
            for sub in _subjaxprs(eqn):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def _subjaxprs(eqn):
    """The jaxprs an equation holds (a jit's, a scan's body, a switch's branches)."""
    for value in eqn.params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):
                yield v.jaxpr
            elif hasattr(v, "eqns"):
                yield v


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_float32_activation_times_bfloat16_weight_is_a_bfloat16_dot_summed_in_float32(jit):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((5, 48)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((48, 3, 8)), jnp.float32).astype(jnp.bfloat16)
    # the reference: both operands as bfloat16 values, multiplied and summed in float64
    xr = np.asarray(x.astype(jnp.bfloat16), np.float64)
    wr = np.asarray(w, np.float64).reshape(48, 24)
    want = xr @ wr
    # float32 summation of K products: |error| <= K * eps32 * sum |x_i w_i| (the standard bound)
    bound = 48 * F32_EPS * (np.abs(xr) @ np.abs(wr))
    calls = {
        "weight_einsum": lambda x, w: weight_einsum("td,dhk->thk", x, w).reshape(5, 24),
        "matmul_rows": lambda x, w: matmul_rows(x, w),
        "dense": lambda x, w: dense(x, w.reshape(48, 24)),
        "switched": lambda x, w: weight_einsum("td,dhk->thk", x, LayerSwitch((w, w), jnp.int32(1))).reshape(5, 24),
    }
    for name, fn in calls.items():
        run = jax.jit(fn) if jit else fn
        got = run(x, w)
        assert got.dtype == jnp.float32, name
        assert np.all(np.abs(np.asarray(got, np.float64) - want) <= bound), name
        assert all(d == ("bfloat16", "bfloat16") for d in _bf16_dots(fn, x, w)), name
    # other pairs are untouched: float32 stays float32, a bfloat16 model stays bfloat16
    w32 = jnp.asarray(w, jnp.float32)
    chex.assert_trees_all_equal(weight_einsum("td,dhk->thk", x, w32), jnp.einsum("td,dhk->thk", x, w32))
    xb = x.astype(jnp.bfloat16)
    assert weight_einsum("td,dhk->thk", xb, w).dtype == jnp.bfloat16
    assert matmul_rows(x, w32).dtype == jnp.float32


def test_bfloat16_matmul_weights_casts_only_the_layers_matmul_weights(llama):
    cast = bfloat16_matmul_weights(llama.params)
    for lp, old in zip(cast["layers"], llama.params["layers"]):
        for name, value in lp.items():
            want = jnp.bfloat16 if name in MATMUL_WEIGHTS else old[name].dtype
            assert value.dtype == want, name
    for name in cast:
        if name != "layers":
            assert cast[name] is llama.params[name]
    assert teacher_params(llama, "float32") is llama.params


def test_bfloat16_teacher_features_are_the_float32_ones_to_bfloat16_rounding(llama):
    from specjax.boost.feature_data import _teacher_fn

    seqs = [(list(range(3, 3 + n)), 2) for n in (9, 40, 17)]
    f32 = teacher_features(llama, seqs, layers=(1,))
    b16 = teacher_features(llama, seqs, layers=(1,), dots="bfloat16")
    # the tiny LLaMA's pass runs 4 dots per layer in a chain (qkv, o, gate/up, down), 2 layers: each rounds
    # its input and (once) its weight to bfloat16, so a feature may move by about 2 eps per dot
    bound = 2 * 4 * llama.config.num_layers * BF16_EPS
    moved = False
    for a, b in zip(f32, b16):
        a, b = a.astype(np.float64), b.astype(np.float64)
        assert a.shape == b.shape
        rel = np.linalg.norm(a - b, axis=-1) / np.linalg.norm(a, axis=-1)
        assert np.all(rel <= bound), rel.max()
        moved |= bool(np.any(rel > 0))
    assert moved, "the bfloat16 teacher computed exactly the float32 features: its dots were not bfloat16"
    # the jitted teacher pass reads bfloat16 weights through bfloat16 dots, the float32 one through none
    run, tokens = _teacher_fn(llama, (1,)), jnp.zeros((2, 64), jnp.int32)
    dots16 = _bf16_dots(run, teacher_params(llama, "bfloat16"), tokens)
    assert dots16 and ("bfloat16", "bfloat16") in dots16
    assert ("bfloat16", "bfloat16") not in _bf16_dots(run, llama.params, tokens)


def test_feature_shards_keep_each_dots_choice_apart_and_refuse_others(llama, tmp_path):
    from specjax.boost.corpus import generate_corpus

    assert features_dir((15,)) == "features-l15" and features_dir((15,), "bfloat16") == "features-l15-bf16dots"
    assert TEACHER_DOTS == ("float32", "bfloat16")
    shards = generate_corpus(llama, [[1, 2, 3], [4, 5]], str(tmp_path / "corpus"), max_new_tokens=6, batch_size=2,
                             temperatures=(0.0,), chat_template=False, progress=False)
    out = str(tmp_path / "features")
    files = feature_shards(llama, shards, out, progress=False)
    stamps = [os.stat(f).st_mtime_ns for f in files]
    logged = []
    # the same directory under the other choice: its files are not these features, so they are recomputed
    assert feature_shards(llama, shards, out, progress=False, log=logged.append, dots="bfloat16") == files
    assert logged and all("recomputing" in line for line in logged)
    assert [os.stat(f).st_mtime_ns for f in files] != stamps
    logged.clear()
    assert feature_shards(llama, shards, out, progress=False, log=logged.append, dots="bfloat16") == files
    assert not logged  # resumed: nothing recomputed
    with pytest.raises(InputError, match="teacher dots must be one of .* got 'float16'"):
        feature_shards(llama, shards, out, progress=False, dots="float16")
    with pytest.raises(InputError, match="float16"):
        teacher_params(llama, "float16")


def test_feature_tune_refuses_unknown_teacher_dots_before_any_work(llama, tmp_path):
    from specjax.boost.feature_corpus import CorpusPlan
    from specjax.boost.feature_train import FeatureTrainConfig
    from specjax.boost.feature_tune import feature_tune

    with pytest.raises(InputError, match="teacher dots"):
        feature_tune(llama, str(tmp_path / "corpus"), str(tmp_path / "run"), CorpusPlan(tasks=8), FeatureTrainConfig(),
                     {}, draft_vocab=16, held_out=0.1, max_eval=4, teacher_dots="int8", progress=False)
    assert not os.path.exists(tmp_path / "corpus")


def test_cli_teacher_dots_flag():
    from specjax.cli import build_parser

    args = build_parser().parse_args(["feature-tune", "--corpus", "c", "--out", "o", "--teacher-dots", "bfloat16"])
    assert args.teacher_dots == "bfloat16"
    assert build_parser().parse_args(["feature-tune", "--corpus", "c", "--out", "o"]).teacher_dots == "float32"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["feature-tune", "--corpus", "c", "--out", "o", "--teacher-dots", "float16"])
