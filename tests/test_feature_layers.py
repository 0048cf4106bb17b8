"""Feature drafters of several decoder layers (``FeatureConfig.layers``): the same features at drafting
time as in unrolled training, packed step params for every layer, ``deepen`` (a deeper drafter that
starts as exactly a trained one), checkpoints, and lossless speculation with a deeper drafter."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.attention.meta import causal_meta
from specjax.boost.feature_train import split_params
from specjax.decoding import programs
from specjax.errors import InputError
from specjax.kernels import cpu as cpu_kernels
from specjax.models.feature import FeatureConfig, bind, deepen, feature_forward, init_feature_cache, init_trained
from specjax.models.params import take_layers
from specjax.models.weights import MATMUL_WEIGHTS, PackedWeight
from specjax.speculation.drafters.feature import FeatureDrafter
from specjax.speculation.drafters.lookup import LookupDrafter
from tests import precision
from tests.test_feature import _check_draft_route, _prompts, corpus, trained  # noqa: F401 (fixtures)

DRAFTING = {"depth": 4, "beam": 3, "nodes": 8, "ladder": (0, 1, 3, 8)}


def _deep(llama, fixture):
    """(2-layer config, the trained drafter deepened exactly, the same with its new layer's output
    projections set to the LLM's last layer's, so that layer changes the features)."""
    cfg, _, params, _ = fixture
    deep_cfg = dataclasses.replace(cfg, layers=2)
    exact = bind(deepen(split_params(params, cfg)[0], cfg, deep_cfg), llama.params, deep_cfg)
    last = take_layers(llama.params, [llama.config.num_layers - 1])
    layers = {n: w.at[1].set(last[n][0]) if n in ("wo", "w_down") else w for n, w in exact["layers"].items()}
    return deep_cfg, exact, {**exact, "layers": layers}


def _features(params, cfg, tokens, prev):
    cache = init_feature_cache(cfg, tokens.shape[0], 16, prev.dtype)
    f, _ = feature_forward(params, tokens, prev, jnp.arange(tokens.shape[1], dtype=jnp.int32)[None], cache,
                           causal_meta(jnp.zeros((tokens.shape[0],), jnp.int32)), cfg)
    return f


def test_two_layer_draft_features_equal_the_unrolled_training_features(llama, trained, corpus):  # noqa: F811
    """Both layers on both routes, each attending over its own keys and values (the cache's layer on
    the drafting route, the step's own on the training route); dropping an ancestor lands outside."""
    cfg, _, moved = _deep(llama, trained)
    _check_draft_route(llama, cfg, moved, corpus)


def test_a_deepened_drafter_drafts_exactly_as_the_trained_one(llama, trained, tmp_path):  # noqa: F811
    """``deepen``: the added layer passes its residual stream on unchanged, so the same features bit for
    bit and the same drafts: the same tokens and LLM passes in the loop (greedy and seeded, merged with
    lookup). Mutation: the added layer's output projections moved change the features. Saved and
    loaded, the depth comes back from the config."""
    cfg, _, params, _ = trained
    deep_cfg, exact, moved = _deep(llama, trained)
    assert deep_cfg.layer_config.num_layers == 2 and exact["layers"]["wq"].shape[0] == 2
    assert FeatureDrafter(deep_cfg, **DRAFTING).describe() == "feature(2 layers, depth 4, beam 3, nodes 8)"
    rng = np.random.RandomState(2)
    tokens = jnp.asarray(rng.randint(0, cfg.llm.vocab_size, (2, 6)), jnp.int32)
    prev = jnp.asarray(rng.randn(2, 6, cfg.llm.hidden_size), jnp.float32)
    want = _features(params, cfg, tokens, prev)
    chex.assert_trees_all_equal(_features(exact, deep_cfg, tokens, prev), want)
    assert not np.allclose(np.asarray(_features(moved, deep_cfg, tokens, prev)), np.asarray(want), atol=1e-3)

    prompts = _prompts(llama.config.vocab_size)
    kw = dict(max_new_tokens=30, ignore_eos=True)
    for sampling, verifier in ((None, "auto"), (specjax.SamplingParams(temperature=0.8, seed=5), "seeded")):
        outs = [specjax.generate(llama, prompts, sampling=sampling, verifier=verifier,
                                 drafters=[specjax.Bound(FeatureDrafter(c, **DRAFTING), p),
                                           specjax.Bound(LookupDrafter(depth=4))], **kw)
                for c, p in ((cfg, params), (deep_cfg, exact))]
        assert outs[1].token_ids == outs[0].token_ids
        assert outs[1].stats["llm_passes"] == outs[0].stats["llm_passes"]

    from specjax.io.feature_checkpoint import read_feature_meta, save_feature_drafter
    from specjax.speculation.drafters.feature import load_feature_drafter

    save_feature_drafter(str(tmp_path / "d"), deep_cfg, split_params(moved, deep_cfg)[0], DRAFTING, dtype="float32")
    assert read_feature_meta(str(tmp_path / "d"))[2]["config"]["layers"] == 2
    bound = load_feature_drafter(str(tmp_path / "d"), llama)
    assert bound.drafter.config == deep_cfg
    chex.assert_trees_all_equal(bound.params, moved)
    # a one-layer drafter's config says nothing of layers (as every drafter saved before deeper ones)
    assert "layers" not in cfg.to_dict() and FeatureConfig.from_dict(cfg.to_dict()) == cfg


def test_deepen_and_layers_refuse_what_they_cannot_do(llama, trained):  # noqa: F811
    cfg, _, params, _ = trained
    two = dataclasses.replace(cfg, layers=2)
    part = split_params(params, cfg)[0]
    with pytest.raises(InputError, match="must add some"):
        deepen(part, cfg, cfg)
    with pytest.raises(InputError, match="change nothing else"):
        deepen(part, cfg, dataclasses.replace(two, fused=(0, llama.config.num_layers)))
    with pytest.raises(InputError, match=r"expected 2 stacked layer"):
        deepen(part, two, dataclasses.replace(cfg, layers=3))
    with pytest.raises(InputError, match="lack"):
        deepen({k: v for k, v in part.items() if k != "fc"}, cfg, two)
    for bad in (0, True, 1.5):
        with pytest.raises(InputError, match="layers"):
            dataclasses.replace(cfg, layers=bad)
    for bad in ("2", 0):  # the file's message names it
        with pytest.raises(InputError, match="drafter.json: layers must be an integer >= 1"):
            FeatureConfig.from_dict({**cfg.to_dict(), "layers": bad}, source="drafter.json")
    with pytest.raises(InputError, match="expected keys llm and draft_vocab"):
        FeatureConfig.from_dict({"llm": cfg.to_dict()["llm"]})
    # params of two layers under a one-layer config: refused, not trained or drafted on their first layer only
    with pytest.raises(InputError, match=r"hold \[2\] decoder layers .* config says 1"):
        bind(deepen(part, cfg, two), llama.params, cfg)
    with pytest.raises(InputError, match="cannot start from the LLM's last layers"):
        init_trained(llama.params, dataclasses.replace(cfg, layers=llama.config.num_layers + 1), jax.random.key(0))
    from specjax.boost.feature_tune import resolve_layers

    assert resolve_layers(llama, None, None) == 1 and resolve_layers(llama, None, 2) == 2
    for bad in (0, llama.config.num_layers + 1, True):
        with pytest.raises(InputError, match="--layers must be an integer"):
            resolve_layers(llama, None, bad)
    # a fresh two-layer start: the LLM's last two layers, each passing its residual stream on
    fresh = init_trained(llama.params, two, jax.random.key(0))
    last = take_layers(llama.params, range(llama.config.num_layers - 2, llama.config.num_layers))
    np.testing.assert_array_equal(np.asarray(fresh["layers"]["wq"]), np.asarray(last["wq"]))
    assert not np.any(np.asarray(fresh["layers"]["wo"])) and not np.any(np.asarray(fresh["layers"]["w_down"]))


def test_a_two_layer_drafter_speculates_losslessly(llama, trained):  # noqa: F811
    """Greedy, budgeted and seeded speculation with a drafter whose second layer matters equal
    incremental decoding, and its drafts are accepted."""
    deep_cfg, _, moved = _deep(llama, trained)
    prompts = _prompts(llama.config.vocab_size)
    d = specjax.Bound(FeatureDrafter(deep_cfg, **DRAFTING), moved)
    kw = dict(max_new_tokens=30, ignore_eos=True)
    want = specjax.generate(llama, prompts, mode="incremental", **kw)
    got = specjax.generate(llama, prompts, drafters=[d], **kw)
    assert got.token_ids == want.token_ids
    assert got.stats["mean_tokens_per_pass"] > 1.0
    seeded = specjax.SamplingParams(temperature=0.8, top_p=0.95, seed=5)
    inc = specjax.generate(llama, prompts, sampling=seeded, mode="incremental", **kw)
    spec = specjax.generate(llama, prompts, sampling=seeded, verifier="seeded", drafters=[d], **kw)
    assert spec.token_ids == inc.token_ids


@pytest.mark.skipif(cpu_kernels.matmul_status() is not None,
                    reason=f"kernel unavailable: {cpu_kernels.matmul_status()}")
def test_step_params_pack_every_layer_and_keep_the_features(llama, trained, monkeypatch):  # noqa: F811
    """The step programs' packed params hold one fused, packed layer per decoder layer, and the features
    through them are float64's with the weights rounded to float16, within the floor of XLA's float32
    on the same rounded weights (a packing that dropped or repeated a layer lands far outside)."""
    monkeypatch.setenv(programs.ENV, "auto")
    deep_cfg, _, moved = _deep(llama, trained)
    d = FeatureDrafter(deep_cfg, depth=3, beam=2, nodes=4, ladder=(0, 4))
    (packed,) = programs.step_drafter_params((d,), (moved,))
    assert len(packed["layers"]) == 2
    assert all(isinstance(layer["wqkv"], PackedWeight) for layer in packed["layers"])
    # layer 2's output projection is the LLM's last layer's, layer 1's the trained one: each packed from its own
    wo = [np.asarray(layer["wo"].packed) for layer in packed["layers"]]
    assert not np.array_equal(wo[0], wo[1])

    rng = np.random.RandomState(3)
    tokens = jnp.asarray(rng.randint(0, deep_cfg.llm.vocab_size, (1, 6)), jnp.int32)
    prev = rng.randn(1, 6, deep_cfg.llm.hidden_size)
    half = lambda w: w.astype(jnp.float16).astype(w.dtype)  # noqa: E731
    rounded = {**moved, "fc": half(moved["fc"]), "head": half(moved["head"]),
               "layers": {n: half(w) if n in MATMUL_WEIGHTS else w for n, w in moved["layers"].items()}}
    plain = jax.jit(lambda p: _features(p, deep_cfg, tokens, jnp.asarray(prev, jnp.float32)))
    with precision.float64():
        exact = np.asarray(_features(precision.params64(rounded), deep_cfg, tokens, jnp.asarray(prev)))
    got = plain(packed)
    precision.assert_within(got, exact, precision.error(plain(rounded), exact), what="two-layer packed features")
    first_only = _features({**rounded, "layers": {n: w[:1] for n, w in rounded["layers"].items()}},
                           dataclasses.replace(deep_cfg, layers=1), tokens, jnp.asarray(prev, jnp.float32))
    with pytest.raises(AssertionError):
        precision.assert_within(first_only, exact, precision.error(plain(rounded), exact),
                                what="mutation: the second layer dropped")
