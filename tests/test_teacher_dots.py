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

F32_EPS = 2.0 ** -24  # float32's unit roundoff


def _dot_operand_dtypes(fn, *args) -> list[tuple[str, ...]]:
    """The operand dtypes of every dot in ``fn``'s jaxpr, nested jaxprs (jit, scan, switch) included."""
    from jax.extend.core import jaxprs_in_params

    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                found.append(tuple(str(v.aval.dtype) for v in eqn.invars))
            for sub in jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


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
        dots = _dot_operand_dtypes(fn, x, w)
        assert dots and all(d == ("bfloat16", "bfloat16") for d in dots), (name, dots)
    # other pairs are untouched, value for value: float32 with float32, a bfloat16 model's bfloat16 with bfloat16
    w32, xb = jnp.asarray(w, jnp.float32), x.astype(jnp.bfloat16)
    for a, b in ((x, w32), (xb, w)):
        chex.assert_trees_all_equal(weight_einsum("td,dhk->thk", a, b), jnp.einsum("td,dhk->thk", a, b))
        chex.assert_trees_all_equal(matmul_rows(a, b), a @ b.reshape(48, 24))
        chex.assert_trees_all_equal(dense(a, b.reshape(48, 24)), a @ b.reshape(48, 24))


@pytest.mark.parametrize("layout", ["split", "stacked"])
def test_bfloat16_matmul_weights_casts_only_the_layers_matmul_weights(llama, layout):
    params = llama.params
    if layout == "stacked":  # one [L, ...] array per weight, as a GPU's scan reads them
        params = {**params, "layers": {n: jnp.stack([lp[n] for lp in params["layers"]]) for n in params["layers"][0]}}
    cast = bfloat16_matmul_weights(params)
    layers = cast["layers"] if layout == "split" else [cast["layers"]]
    old = params["layers"] if layout == "split" else [params["layers"]]
    assert len(layers) == len(old)
    for lp, before in zip(layers, old):
        assert set(lp) == set(before)
        for name, value in lp.items():
            assert value.dtype == (jnp.bfloat16 if name in MATMUL_WEIGHTS else before[name].dtype), name
            chex.assert_trees_all_equal(value, before[name].astype(value.dtype))
    assert any(name in MATMUL_WEIGHTS for name in layers[0]) and any(name not in MATMUL_WEIGHTS for name in layers[0])
    for name in cast:
        if name != "layers":
            assert cast[name] is params[name]
    assert teacher_params(llama, "float32") is llama.params


def test_bfloat16_teacher_features_are_the_float32_ones_to_bfloat16_rounding(llama):
    from specjax.boost.feature_data import _teacher_fn

    seqs = [(list(range(3, 3 + n)), 2) for n in (9, 40, 17)]

    def features(model, dots="float32"):
        return np.concatenate(teacher_features(model, seqs, layers=(1,), dots=dots)).astype(np.float64)

    f32, b16 = features(llama), features(llama, "bfloat16")
    # the floor: the same float32 pass over bfloat16-rounded weights (what storing them as bfloat16 costs
    # alone). bfloat16 dots also round each dot's input, an error of about the same size and independent of
    # the weights', so the features should move ~sqrt(2) times the floor; all activations in bfloat16 as
    # well (a model loaded as bfloat16, the mutation below) moved them ~2.8 times it on this model
    rounded = {**llama.params, "layers": tuple({n: (v.astype(jnp.bfloat16).astype(jnp.float32) if n in MATMUL_WEIGHTS
                                                   else v) for n, v in lp.items()} for lp in llama.params["layers"])}
    floor = features(llama._replace(params=rounded))

    def moved(a):  # relative error of every stored feature vector (layer 1's input, then g) against float32's
        return np.linalg.norm(a - f32, axis=-1) / np.linalg.norm(f32, axis=-1)

    assert np.all(np.median(moved(floor), axis=0) > 0)  # bfloat16 rounding is visible at this size
    for got, ok in ((b16, True), (features(llama._replace(params=jax.tree.map(
            lambda a: a.astype(jnp.bfloat16), llama.params))), False)):
        within = bool(np.all(np.median(moved(got), axis=0) <= 2 * np.median(moved(floor), axis=0))
                      and np.all(moved(got).max(axis=0) <= 2 * moved(floor).max(axis=0)))
        assert within == ok, (np.median(moved(got), axis=0), np.median(moved(floor), axis=0))
    # the jitted teacher pass reads bfloat16 weights through bfloat16 dots, the float32 one through none
    tokens = jnp.zeros((2, 64), jnp.int32)
    dots16 = _dot_operand_dtypes(_teacher_fn(llama, (1,), "bfloat16"), tokens)
    assert ("bfloat16", "bfloat16") in dots16
    assert ("bfloat16", "bfloat16") not in _dot_operand_dtypes(_teacher_fn(llama, (1,)), tokens)


def test_feature_shards_keep_each_dots_choice_apart_and_refuse_others(llama, tmp_path):
    from specjax.boost.corpus import generate_corpus, read_shard
    from specjax.boost.feature_tune import eval_prompt_set

    assert features_dir((15,)) == "features-l15" and features_dir((15,), "bfloat16") == "features-l15-bf16dots"
    assert len({features_dir((15,), dots) for dots in TEACHER_DOTS}) == len(TEACHER_DOTS)
    shards = generate_corpus(llama, [[1, 2, 3], [4, 5]], str(tmp_path / "corpus"), max_new_tokens=6, batch_size=2,
                             temperatures=(0.0,), chat_template=False, progress=False)
    sequences = [s for shard in shards for s in read_shard(shard)]
    want = {dots: np.concatenate(teacher_features(llama, sequences, dots=dots)) for dots in TEACHER_DOTS}
    assert not np.array_equal(want["float32"], want["bfloat16"])

    def stored(files):
        return np.concatenate([np.load(f)["features"] for f in files])

    out = str(tmp_path / "features")
    # one directory under each choice in turn: a file of the other choice is recomputed, one of its own resumed
    for dots, recomputed in (("float32", False), ("bfloat16", True), ("bfloat16", False), ("float32", True)):
        logged = []
        files = feature_shards(llama, shards, out, progress=False, log=logged.append, dots=dots)
        assert len(logged) == (len(shards) if recomputed else 0) and all("recomputing" in m for m in logged)
        np.testing.assert_array_equal(stored(files), want[dots])
    with pytest.raises(InputError, match="teacher dots must be one of .* got 'float16'"):
        feature_shards(llama, shards, out, progress=False, dots="float16")
    with pytest.raises(InputError, match="float16"):
        teacher_params(llama, "float16")
    # the --eval-prompts set is the float32 LLM's, whatever the corpus's teacher: what the loop sees
    from specjax.boost.feature_corpus import CorpusPlan

    plan = CorpusPlan(tasks=8, max_new_tokens=6)
    data = eval_prompt_set(llama, str(tmp_path / "corpus"), [[5, 6, 7]], plan, progress=False)
    ids, got, _, prompt_len = data.sequence(0)
    np.testing.assert_array_equal(got, teacher_features(llama, [(ids, prompt_len)])[0])


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
