"""The feature drafter: its training data and unrolled training, the same features at drafting time
as in training, the dynamic tree's shape, and lossless speculation with it (greedy and seeded equal
incremental decoding, alone, budgeted, merged and in the engine; exact laws under MSS, RRS and naive,
with a mutation the law test must catch)."""

from __future__ import annotations

import dataclasses
import json
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.attention.meta import AttentionMeta, causal_meta
from specjax.boost.feature_data import FeatureSet, draft_vocabulary, split_held_out, teacher_features
from specjax.boost.feature_train import (
    FeatureTrainConfig,
    depth_agreement,
    make_batch,
    sequence_agreement,
    summarise_agreement,
    train_feature,
    unrolled,
)
from specjax.boost.feature_tune import _steps_done
from specjax.decoding import programs
from specjax.decoding.incremental import prefill
from specjax.errors import CheckpointError, InputError
from specjax.kernels import cpu as cpu_kernels
from specjax.models.cache import init_cache
from specjax.models.feature import (
    FeatureConfig,
    bind,
    feature_forward,
    final_features,
    init_feature_cache,
    init_trained,
    llm_features,
    logits_of,
)
from specjax.models.params import take_layers
from specjax.models.weights import MATMUL_WEIGHTS, PackedWeight
from specjax.speculation.budget import Budget, default_levels
from specjax.speculation.drafters.base import DraftContext
from specjax.speculation.drafters.feature import FeatureDrafter, node_depths
from specjax.speculation.drafters.lookup import LookupDrafter
from specjax.speculation.loop import SpecConfig, generate_speculative_jit
from specjax.types import Model
from tests import precision
from tests.conftest import random_ids
from tests.stats import assert_fits, fits
from tests.toy import exact_sequence_law, sampling_arrays, toy_model


def _feature_set(model: Model, sequences) -> FeatureSet:
    """Greedy continuations: the next token of every continuation position is the LLM's greedy token."""
    greedy = [np.asarray(s[1:] + [-1], np.int32) for s, _ in sequences]
    for g, (s, p) in zip(greedy, sequences):
        g[:p - 1] = -1
    return FeatureSet(np.concatenate([np.asarray(s, np.int32) for s, _ in sequences]),
                      np.concatenate(teacher_features(model, sequences)), np.concatenate(greedy),
                      np.cumsum([0] + [len(s) for s, _ in sequences]).astype(np.int64),
                      np.asarray([p for _, p in sequences], np.int32), np.zeros(len(sequences), np.int32), ("toy",))


@pytest.fixture(scope="module")
def corpus(llama):
    """The tiny LLM's own greedy continuations of random prompts (it soon repeats itself: learnable)."""
    rng = np.random.RandomState(0)
    prompts = [random_ids(rng, llama.config.vocab_size, int(rng.randint(4, 12))) for _ in range(24)]
    out = specjax.generate(llama, prompts, max_new_tokens=40, ignore_eos=True, mode="incremental")
    return _feature_set(llama, [(p + c, len(p)) for p, c in zip(prompts, out.token_ids)])


TC = FeatureTrainConfig(epochs=60, batch_size=8, window=48, warmup_steps=10, eval_every=1000, unrolled_steps=3,
                        learning_rate=3e-3, checkpoint_every=100)


@pytest.fixture(scope="module")
def trained(llama, corpus, tmp_path_factory):
    """(FeatureConfig, bound params before training, after training, history). The tiny random LLM's
    text does not generalise from 24 sequences: the drafter learns them (what the tests need: a drafter
    whose drafts the LLM accepts on these prompts); held-out agreement is measured on SmolLM2."""
    vocab, coverage = draft_vocabulary(corpus, 100, llama.config.vocab_size)
    assert 0.9 < coverage <= 1.0
    cfg = FeatureConfig(llama.config, vocab)
    start = bind(init_trained(llama.params, cfg, jax.random.key(1)), llama.params, cfg)
    params, history = train_feature(start, corpus, cfg, TC, str(tmp_path_factory.mktemp("feature_run")),
                                    held_out=corpus.subset(np.arange(8)), eval_steps=4, progress=False)
    return cfg, start, params, history


# -- data and training -----------------------------------------------------------------------------------


def test_teacher_features_are_the_llms_post_norm_hidden_states(llama):
    from specjax.models import forward

    seqs = [([3, 9, 4, 1, 7], 2), ([5, 5, 6], 1)]
    got = teacher_features(llama, seqs)
    for (ids, _), g in zip(seqs, got):
        tokens = jnp.asarray([ids])
        out = forward(llama.params, tokens, jnp.arange(len(ids))[None], init_cache(llama.config, 1, len(ids)),
                      causal_meta(jnp.zeros((1,), jnp.int32)), llama.config, hidden=(llama.config.num_layers,))
        cfg = FeatureConfig(llama.config, (0, 1))
        want = llm_features({"final_norm": llama.params["final_norm"]}, out.hidden[0], cfg)
        chex.assert_trees_all_close(g.astype(np.float32), np.asarray(want), atol=1e-2, rtol=1e-2)  # stored float16


def test_teacher_pass_takes_the_prefill_kernels_route_where_prefill_does(llama, monkeypatch):
    """The teacher-forced pass runs its attention where prefill does (the CPU prefill kernel with the
    kernels on, XLA under SPECJAX_CPU_DOTS=eigen), so the features are those of the same computation."""
    from specjax.boost.feature_data import _teacher_fn
    from specjax.decoding.incremental import cpu_prefill_route

    def uses_kernel():
        text = str(jax.make_jaxpr(_teacher_fn(llama))(jnp.zeros((2, 64), jnp.int32)))
        return "specjax_cpu_prefill_attention" in text

    built = cpu_kernels.status() is None
    assert cpu_prefill_route(llama.params, llama.config) == built and uses_kernel() == built
    monkeypatch.setenv(programs.ENV, "eigen")
    assert not cpu_prefill_route(llama.params, llama.config) and not uses_kernel()


def test_feature_shards_resume_and_load_with_greedy_targets(llama, tmp_path):
    import os

    from specjax.boost.corpus import generate_corpus
    from specjax.boost.feature_data import feature_shards
    from specjax.boost.feature_loading import load_feature_set

    shards = generate_corpus(llama, [[1, 2, 3], [4, 5]], str(tmp_path / "corpus"), max_new_tokens=6, batch_size=2,
                             temperatures=(0.0, 1.0), chat_template=False, progress=False)
    files = feature_shards(llama, shards, str(tmp_path / "features"), progress=False)
    stamps = [os.stat(f).st_mtime_ns for f in files]
    assert feature_shards(llama, shards, str(tmp_path / "features"), progress=False) == files
    assert [os.stat(f).st_mtime_ns for f in files] == stamps  # resumed: nothing recomputed
    data = load_feature_set({"mixed": (shards, files)})
    assert len(data) == 4 and data.features.shape == (len(data.tokens), llama.config.hidden_size)
    for i in range(4):
        ids, f, greedy, prompt_len = data.sequence(i)
        if i < 2:  # the greedy shard: every continuation position knows the LLM's greedy next token
            assert (greedy[prompt_len - 1:-1] == ids[prompt_len:]).all()
            assert (greedy[:prompt_len - 1] == -1).all() and greedy[-1] == -1
        else:  # sampled continuations say nothing about the greedy token
            assert (greedy == -1).all()
    with pytest.raises(InputError, match="exceeds max_len"):
        load_feature_set({"mixed": (shards, files)}, max_len=4)
    # another checkpoint of the same config (a fine-tune): its features are its own
    from tests.toy import perturbed

    tuned = llama._replace(params=perturbed(llama.params, seed=1, eps=1e-3))
    logged = []
    assert feature_shards(tuned, shards, str(tmp_path / "features"), progress=False, log=logged.append) == files
    assert len(logged) == 2 and all("made from other weights" in line for line in logged)
    with np.load(files[0]) as z:  # a file from before the digest was recorded: taken as it is
        legacy = {k: z[k] for k in z.files if k != "weights"}
    np.savez(files[0], **legacy)
    stamp = os.stat(files[0]).st_mtime_ns
    feature_shards(llama, shards, str(tmp_path / "features"), progress=False, log=logged.append)
    assert os.stat(files[0]).st_mtime_ns == stamp and len(logged) == 3 and files[1] in logged[2]


def test_make_batch_left_pads_so_continuations_end_together(corpus):
    batch = make_batch(corpus, np.array([0, 1, 2]), window=48)
    width = batch["tokens"].shape[1]
    for row, i in enumerate([0, 1, 2]):
        ids, f, top, prompt_len = corpus.sequence(i)
        s = batch["start"][row]
        assert s == width - len(ids) and (batch["tokens"][row, s:] == ids).all()
        assert (batch["positions"][row, s:] == np.arange(len(ids))).all()
        assert (batch["features"][row, :s] == 0).all()
        want = np.zeros(width)
        want[s + prompt_len - 1:width - 1] = 1  # position p predicts token p + 1 of the continuation
        assert (batch["loss"][row] == want).all()
    with pytest.raises(InputError, match="does not fit the training window"):
        make_batch(corpus, np.array([0]), window=10)
    train, held = split_held_out(corpus, 0.25, seed=1)
    assert len(held) == 6 and len(train) == len(corpus) - 6
    seqs = lambda d: {tuple(d.sequence(i)[0].tolist()) for i in range(len(d))}  # noqa: E731
    assert not seqs(train) & seqs(held) and seqs(train) | seqs(held) == seqs(corpus)


def test_gpu_batch_shapes_pad_more_and_change_nothing_else(llama, corpus, trained):
    """BatchShapes.gpu(): feature batches full and widths a multiple of 256 give the same features,
    training batches the same rows, only further left-padded, and the same held-out agreement."""
    from specjax.boost.feature_tune import BatchShapes

    shapes = BatchShapes.gpu()
    seqs = [(list(range(3, 3 + n)), 2) for n in (5, 70, 9)]
    plain = teacher_features(llama, seqs, batch_size=2)
    padded = teacher_features(llama, seqs, batch_size=shapes.teacher_batch, width_multiple=shapes.width_multiple,
                              full_batches=shapes.full_batches)
    for a, b in zip(plain, padded):
        assert a.shape == b.shape
        chex.assert_trees_all_close(a.astype(np.float32), b.astype(np.float32), atol=1e-2, rtol=1e-2)
    small, wide = make_batch(corpus, np.array([0, 1]), window=48), make_batch(corpus, np.array([0, 1]), 48, 256)
    assert wide["tokens"].shape[1] == 256 and small["tokens"].shape[1] < 256
    cut = small["tokens"].shape[1]
    for key in small:
        if key == "start":
            assert (wide[key] == small[key] + 256 - cut).all()
        else:
            assert (wide[key][:, -cut:] == small[key]).all(), key
            assert key not in ("tokens", "features", "loss") or not wide[key][:, :-cut].any()
    cfg, _, params, _ = trained
    plain = depth_agreement(params, corpus, cfg, steps=3, window=TC.window, batch_size=5)  # a 4-row last batch
    padded = depth_agreement(params, corpus, cfg, steps=3, window=TC.window, batch_size=5,
                             width_multiple=shapes.width_multiple, full_batches=True)
    assert padded["positions"] == plain["positions"]  # the repeated rows are not counted
    np.testing.assert_allclose(padded["all"], plain["all"], atol=1.0 / plain["positions"])


def test_training_raises_agreement_at_every_trained_depth(trained, corpus):
    cfg, start, params, history = trained
    before = depth_agreement(start, corpus, cfg, steps=4, window=TC.window)["all"]
    after = depth_agreement(params, corpus, cfg, steps=4, window=TC.window)["all"]
    assert [h["step"] for h in history] == [0, history[-1]["step"]] and history[-1]["step"] > 100
    assert history[-1]["held_out"]["all"][0] > history[0]["held_out"]["all"][0]  # the evaluation was recorded
    for d in range(3):  # the trained steps: the drafter fed its own features (measured: +0.15 to +0.24)
        assert after[d] > before[d] + 0.1, (before, after)


def test_one_pass_gives_the_agreement_of_every_subset(trained, corpus):
    """feature-tune's summary reports the final drafter on the held-out sequences the history evaluated,
    from the one pass over all of them: per-sequence counts summed over a subset equal evaluating it."""
    cfg, _, params, _ = trained
    hits, counts = sequence_agreement(params, corpus, cfg, steps=3, window=TC.window, batch_size=5)
    assert hits.shape == counts.shape == (len(corpus), 3) and (hits <= counts).all()
    whole = depth_agreement(params, corpus, cfg, steps=3, window=TC.window, batch_size=5)
    assert summarise_agreement(hits, counts, corpus.parts, corpus.part_names) == whole
    index = np.array([1, 4, 5, 9, 16, 23])
    direct = depth_agreement(params, corpus.subset(index), cfg, steps=3, window=TC.window, batch_size=5)
    summed = summarise_agreement(hits[index], counts[index], corpus.parts[index], corpus.part_names)
    assert summed["positions"] == direct["positions"] < whole["positions"]
    # other batch companions pad to other widths: at most a rounding-level tie may flip
    np.testing.assert_allclose(summed["all"], direct["all"], atol=1.0 / direct["positions"])
    assert summed["all"] != whole["all"]  # the subset is its own measurement, not the whole set's


def test_training_resumes_bit_exactly(llama, corpus, tmp_path, monkeypatch):
    cfg = FeatureConfig(llama.config, tuple(range(llama.config.vocab_size)))
    start = bind(init_trained(llama.params, cfg, jax.random.key(2)), llama.params, cfg)
    tc = FeatureTrainConfig(epochs=1, batch_size=8, window=48, warmup_steps=1, unrolled_steps=2, eval_every=2,
                            checkpoint_every=2)
    straight, straight_history = train_feature(start, corpus, cfg, tc, str(tmp_path / "a"), progress=False)
    train_feature(start, corpus, cfg, tc, str(tmp_path / "b"), progress=False, stop_after=2)
    resumed, resumed_history = train_feature(start, corpus, cfg, tc, str(tmp_path / "b"), progress=False)
    chex.assert_trees_all_equal(resumed, straight)
    # the history written at every evaluation resumes as it was: no row lost or repeated
    assert [r["step"] for r in resumed_history] == [r["step"] for r in straight_history]
    # a deadline passed after the first step (a clock that ticks once a step, checked before each): that
    # step is checkpointed though it is not a checkpoint step, and the rest resumes to the same weights
    import specjax.boost.feature_train as feature_train

    clock = iter(range(1000))
    monkeypatch.setattr(feature_train, "_now", lambda: next(clock))
    train_feature(start, corpus, cfg, tc, str(tmp_path / "c"), progress=False, deadline=0.5)
    assert _steps_done(str(tmp_path / "c")) == 1
    # a deadline already passed when training would start (after the step-0 evaluation): no step
    train_feature(start, corpus, cfg, tc, str(tmp_path / "d"), progress=False, deadline=-1.0)
    assert _steps_done(str(tmp_path / "d")) == 0
    # its step-0 evaluation is on disk without a checkpoint (a watchdog that stops a run early returns it)
    with open(tmp_path / "d" / "history.json") as f:
        assert [row["step"] for row in json.load(f)] == [0]
    resumed, _ = train_feature(start, corpus, cfg, tc, str(tmp_path / "c"), progress=False)
    chex.assert_trees_all_equal(resumed, straight)
    with pytest.raises(InputError, match="another recipe"):
        train_feature(start, corpus, cfg, dataclasses.replace(tc, reg_weight=0.1), str(tmp_path / "b"), progress=False)
    with pytest.raises(InputError, match="another recipe"):  # features of the bfloat16 teacher are other data
        train_feature(start, corpus, cfg, tc, str(tmp_path / "b"), progress=False, teacher_dots="bfloat16")


# -- drafting-time features are the training-time features --------------------------------------------------


def _draft_route(llm_params, params, cfg, llm_cfg, ids, P, skip_ancestor=False):
    """The drafter's own route to f_P (the root's pair), f_{P+1} and f_{P+2} (a chain below it through
    tree attention over its cache and the path): init-style prefill of pairs 0..P, then two frontier passes."""
    tokens = jnp.asarray([ids[:P]])
    _, _, hidden = prefill(llm_params, tokens, jnp.asarray([P]), init_cache(llm_cfg, 1, P + 8,
                                                                            jax.tree.leaves(llm_params)[0].dtype),
                           llm_cfg, hidden=cfg.hidden_layers)
    prev = jnp.pad(llm_features(params, hidden, cfg), ((0, 0), (1, 0), (0, 0)))
    cache = init_feature_cache(cfg, 1, P + 16, prev.dtype)
    f, cache = feature_forward(params, jnp.asarray([ids[:P + 1]]), prev, jnp.arange(P + 1)[None], cache,
                               causal_meta(jnp.zeros((1,), jnp.int32)), cfg)
    cache = cache.replace(length=jnp.asarray([P + 1]))
    out, feat = [f[0, P]], f[:, P]
    for depth, bits in ((1, 0b01), (2, 0b10 if skip_ancestor else 0b11)):  # slot 0: depth 1, slot 1: depth 2
        meta = AttentionMeta(lengths=cache.length, ancestor=jnp.asarray([[[bits]]], jnp.uint32),
                             slots=jnp.asarray([[depth - 1]]), region=2, impl="xla")
        feat, cache = feature_forward(params, jnp.asarray([[ids[P + depth]]]), feat[:, None],
                                      jnp.asarray([[P + depth]]), cache, meta, cfg)
        feat = feat[:, 0]
        out.append(feat[0])
    return np.stack([np.asarray(x) for x in out])


def _check_draft_route(llama, cfg, params, data):
    """Depth k of a draft (the drafter fed its own features, tree attention over its cache and the
    path) computes what training step k + 1 computes for the same tokens: within the float32 error
    of the drafting route itself (both against the drafting route in float64); dropping the depth-1
    node from the depth-2 node's ancestors lands far outside."""
    from specjax.models import forward
    from tests.precision import assert_within, error, float64, params64

    ids, _, greedy, prompt_len = data.sequence(3)
    window = 48
    P = prompt_len + 5
    # the sequence's LLM features in float32 (the stored ones are float16: not the drafting route's inputs)
    out = forward(llama.params, jnp.asarray([ids]), jnp.arange(len(ids))[None], init_cache(llama.config, 1, len(ids)),
                  causal_meta(jnp.zeros((1,), jnp.int32)), llama.config,
                  hidden=cfg.raw_layers + (llama.config.num_layers,))
    g = np.asarray(final_features(llama.params, out.hidden[0, :, -1], cfg))
    one = FeatureSet(np.asarray(ids), g, greedy, np.asarray([0, len(ids)]), np.asarray([prompt_len]),
                     np.zeros(1, np.int32), ("one",), np.asarray(out.hidden[0, :, :-1]) if cfg.fused else None)
    batch = make_batch(one, np.array([0]), window)
    feats = unrolled(params, {k: jnp.asarray(v) for k, v in batch.items()}, cfg, 3, window)
    col = [window - (len(ids) - p) for p in (P, P + 1, P + 2)]
    trained_route = np.stack([np.asarray(feats[k][0, col[k]]) for k in range(3)])
    with float64():
        ref = _draft_route(params64(llama.params), params64(params), cfg, llama.config, ids, P)
    f32 = _draft_route(llama.params, params, cfg, llama.config, ids, P)
    floor = error(f32, ref)
    assert_within(trained_route, ref, floor, what="unrolled training vs drafting")
    wrong = _draft_route(llama.params, params, cfg, llama.config, ids, P, skip_ancestor=True)
    with pytest.raises(AssertionError):
        assert_within(wrong, ref, floor, what="mutation: the depth-2 node does not see its parent")


def test_draft_features_equal_the_unrolled_training_features(llama, trained, corpus):
    cfg, _, params, _ = trained
    _check_draft_route(llama, cfg, params, corpus)


@pytest.mark.parametrize("final", [False, True], ids=["layers", "layers-and-final"])
def test_fused_draft_features_equal_the_unrolled_training_features(llama, corpus, final):
    """The EAGLE-3 input (the fusion of several LLM layers' hidden states, with or without the final
    feature g, which training reads from the stored features) on both routes."""
    layers = (0, 1)
    cfg = FeatureConfig(llama.config, tuple(range(llama.config.vocab_size)),
                        fused=layers + ((llama.config.num_layers,) if final else ()))
    assert cfg.raw_layers == layers
    start = init_trained(llama.params, cfg, jax.random.key(4))
    d = llama.config.hidden_size
    # a random fusion: every slot matters (a final-reading fusion starts passing g through)
    start["fuse"] = jax.random.normal(jax.random.key(5), (len(cfg.fused) * d, d)) / np.sqrt(len(cfg.fused) * d)
    # the zero-initialised output projections would make the layer's attention invisible (and the
    # ancestor mutation below harmless): give it the LLM's last layer's, as a trained drafter has some
    last = take_layers(llama.params, [llama.config.num_layers - 1])
    start["layers"] = {**start["layers"], "wo": last["wo"], "w_down": last["w_down"]}
    params = bind(start, llama.params, cfg)
    seqs = [(corpus.sequence(i)[0].tolist(), corpus.sequence(i)[3]) for i in range(4)]
    stacked = teacher_features(llama, seqs, layers=layers)
    assert stacked[0].shape == (len(seqs[0][0]), len(layers) + 1, llama.config.hidden_size)
    for x, (ids, _) in zip(stacked, seqs):  # the last entry is the final feature, as without fused layers
        np.testing.assert_allclose(x[:, -1].astype(np.float32),  # float16 storage: a few of its ulps
                                   teacher_features(llama, [(ids, 1)])[0].astype(np.float32), rtol=4e-3, atol=4e-3)
    _check_draft_route(llama, cfg, params, corpus)


def test_a_fusion_started_from_a_final_feature_drafter_drafts_exactly_as_it(llama, trained, tmp_path):
    """``with_fusion``: the EAGLE-3 drafter that training starts from a trained EAGLE-1 one (fusion rows
    of the raw layers zero, g passed through) computes the same input features bit for bit, so the same
    drafts: the same tokens and the same LLM passes in the loop (greedy and seeded, merged with lookup).
    Mutation: one raw-layer fusion weight moved changes the features."""
    from specjax.boost.feature_train import split_params
    from specjax.models.feature import with_fusion

    cfg, _, params, _ = trained
    L = llama.config.num_layers
    fcfg = dataclasses.replace(cfg, fused=(1, L))
    fparams = bind(with_fusion(split_params(params, cfg)[0], fcfg), llama.params, fcfg)
    hidden = jax.random.normal(jax.random.key(0), (2, 5, 2, llama.config.hidden_size))
    g = llm_features(params, hidden[:, :, 1:], cfg)
    chex.assert_trees_all_equal(llm_features(fparams, hidden, fcfg), g)
    moved = {**fparams, "fuse": fparams["fuse"].at[3, 0].set(0.5)}
    assert not np.array_equal(np.asarray(llm_features(moved, hidden, fcfg)), np.asarray(g))

    prompts = _prompts(llama.config.vocab_size)
    kw = dict(max_new_tokens=30, ignore_eos=True)
    for sampling, verifier in ((None, "auto"), (specjax.SamplingParams(temperature=0.8, seed=5), "seeded")):
        outs = [specjax.generate(llama, prompts, sampling=sampling, verifier=verifier,
                                 drafters=[specjax.Bound(FeatureDrafter(c, depth=4, beam=3, nodes=8,
                                                                        ladder=(0, 1, 3, 8)), p),
                                           specjax.Bound(LookupDrafter(depth=4))], **kw)
                for c, p in ((cfg, params), (fcfg, fparams))]
        assert outs[1].token_ids == outs[0].token_ids
        assert outs[1].stats["llm_passes"] == outs[0].stats["llm_passes"]
    # saved and loaded: its fusion (one normalised raw layer, then g) comes back as it was
    from specjax.io.feature_checkpoint import save_feature_drafter
    from specjax.speculation.drafters.feature import load_feature_drafter

    save_feature_drafter(str(tmp_path / "f"), fcfg, split_params(fparams, fcfg)[0],
                         {"depth": 4, "beam": 3, "nodes": 8, "ladder": (0, 1, 3, 8)}, dtype="float32")
    bound = load_feature_drafter(str(tmp_path / "f"), llama)
    assert bound.drafter.config == fcfg and bound.params["fuse_norm"].shape == (1, llama.config.hidden_size)
    chex.assert_trees_all_equal(bound.params, fparams)


def test_a_fusion_widened_by_more_layers_computes_the_same_features(llama, trained, tmp_path):
    """``widen_fusion``: a trained fusion (here of layer 1 and g, its weights moved off the pass-through
    start) given layer 0 too computes the same features, as close to the float64 features of the
    narrow fusion as the narrow fusion's own float32 ones (layer 1's rows moved to their new place,
    layer 0's zero); one added-layer weight moved changes them. Refusals named; ``feature-tune``
    takes more layers for a fused ``--init-from`` and refuses fewer or others."""
    from specjax.boost.feature_train import split_params
    from specjax.models.feature import widen_fusion, with_fusion

    cfg, _, params, _ = trained
    L = llama.config.num_layers
    narrow_cfg, wide_cfg = dataclasses.replace(cfg, fused=(1, L)), dataclasses.replace(cfg, fused=(0, 1, L))
    narrow = with_fusion(split_params(params, cfg)[0], narrow_cfg)
    k1, k2 = jax.random.split(jax.random.key(7))
    narrow = {**narrow, "fuse": narrow["fuse"] + 0.05 * jax.random.normal(k1, narrow["fuse"].shape),
              "fuse_norm": narrow["fuse_norm"] + 0.1 * jax.random.normal(k2, narrow["fuse_norm"].shape)}
    wide = widen_fusion(narrow, narrow_cfg, wide_cfg)
    d = llama.config.hidden_size
    assert wide["fuse"].shape == (3 * d, d) and wide["fuse_norm"].shape == (2, d)
    hidden = jax.random.normal(jax.random.key(0), (2, 5, 3, d))
    narrow_bound, wide_bound = bind(narrow, llama.params, narrow_cfg), bind(wide, llama.params, wide_cfg)
    want = np.asarray(llm_features(narrow_bound, hidden[:, :, 1:], narrow_cfg))
    with precision.float64():
        ref = np.asarray(llm_features(precision.params64(narrow_bound), jnp.asarray(hidden[:, :, 1:], jnp.float64),
                                      narrow_cfg))
    got = np.asarray(llm_features(wide_bound, hidden, wide_cfg))
    precision.assert_within(got, ref, precision.error(want, ref), what="widened fusion")
    moved = {**wide_bound, "fuse": wide_bound["fuse"].at[3, 0].set(0.5)}  # a row of the added layer 0
    assert np.abs(np.asarray(llm_features(moved, hidden, wide_cfg)) - got).max() > 1e-3
    with pytest.raises(InputError, match="must add some and keep the final feature's slot"):
        widen_fusion(narrow, narrow_cfg, dataclasses.replace(cfg, fused=(0, 1)))
    with pytest.raises(InputError, match="must add some"):
        widen_fusion(narrow, narrow_cfg, narrow_cfg)
    with pytest.raises(InputError, match=r"lack \['fuse_norm'\]"):
        widen_fusion({k: v for k, v in narrow.items() if k != "fuse_norm"}, narrow_cfg, wide_cfg)

    # feature-tune --init-from <this fusion> --fused ...: more layers are taken, fewer or others refused
    from specjax.boost.feature_tune import resolve_fusion
    from specjax.io.feature_checkpoint import save_feature_drafter

    path = str(tmp_path / "narrow")
    save_feature_drafter(path, narrow_cfg, narrow, {"depth": 4, "beam": 3, "nodes": 8, "ladder": (0, 1, 3, 8)},
                         dtype="float32")
    assert resolve_fusion(llama, path, ()) == (1, L) and resolve_fusion(llama, path, (1, L)) == (1, L)
    assert resolve_fusion(llama, path, (0, 1, L)) == (0, 1, L)
    for other in ((0, L), (0, 1)):
        with pytest.raises(InputError, match="a trained fusion can only add layers"):
            resolve_fusion(llama, path, other)


def test_fusion_settings_are_refused_by_name(llama):
    from specjax.models.feature import fusion_passing_final, with_fusion

    L = llama.config.num_layers
    vocab = (0, 1, 2)
    with pytest.raises(InputError, match="the final feature alone"):
        FeatureConfig(llama.config, vocab, fused=(L,))
    with pytest.raises(InputError, match=rf"indices in \[0, {L}\]"):
        FeatureConfig(llama.config, vocab, fused=(0, L + 1))
    with pytest.raises(InputError, match="does not read the final feature"):
        fusion_passing_final(FeatureConfig(llama.config, vocab, fused=(0, 1)))
    final = FeatureConfig(llama.config, vocab)
    with pytest.raises(InputError, match="final-feature drafter's params"):
        with_fusion({"fc": 0}, dataclasses.replace(final, fused=(0, L)))


# -- the dynamic tree ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("width", [80, 600])
def test_init_reads_the_prompt_in_chunks_as_one_pass_would(width):
    """``FeatureDrafter.init`` runs the prompt's pairs in the LLM prefill's chunks, only as many as the
    longest prompt needs (two 64-pair chunks here, whatever the array's width): its cache (committed
    pairs), first feature and logits are those of one causal pass over every pair."""
    cfg, params = toy_model(12, 0, layers=2)
    fcfg = FeatureConfig(cfg, tuple(range(1, 12)))
    fp = bind(init_trained(params, fcfg, jax.random.key(3)), params, fcfg)
    d = FeatureDrafter(fcfg, depth=3, beam=2, nodes=4, ladder=(0, 4))
    batch, cache_len = 2, 640
    rng = np.random.RandomState(1)
    prompts = jnp.asarray(rng.randint(0, 12, (batch, width)), jnp.int32)
    lens = jnp.asarray([70, 5], jnp.int32)
    first = jnp.asarray([3, 9], jnp.int32)
    _, _, hidden = prefill(params, prompts, lens, init_cache(cfg, batch, cache_len), cfg, hidden=(cfg.num_layers,))
    state = jax.jit(lambda h: d.init(fp, prompts, lens, cache_len=cache_len, hidden=h, first=first))(hidden)

    g = llm_features(fp, hidden, fcfg)
    prev = jnp.pad(g, ((0, 0), (1, 0), (0, 0)))
    tokens = jnp.pad(prompts, ((0, 0), (0, 1))).at[jnp.arange(batch), lens].set(first)
    positions = jnp.broadcast_to(jnp.arange(width + 1, dtype=jnp.int32), (batch, width + 1))
    cache = init_feature_cache(fcfg, batch, d._cache_len(cache_len))
    f, cache = feature_forward(fp, tokens, prev, positions, cache, causal_meta(jnp.zeros((batch,), jnp.int32)), fcfg)
    last = f[jnp.arange(batch), lens]
    np.testing.assert_array_equal(np.asarray(state["cache"].length), np.asarray(lens) + 1)
    np.testing.assert_allclose(np.asarray(state["feat"]), np.asarray(last), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(state["logits"]), np.asarray(logits_of(fp, last)), rtol=1e-5, atol=1e-5)
    for b in range(batch):
        n = int(lens[b]) + 1
        for got, want in ((state["cache"].k, cache.k), (state["cache"].v, cache.v)):
            np.testing.assert_allclose(np.asarray(got[:, b, :n]), np.asarray(want[:, b, :n]), rtol=1e-5, atol=1e-5)


def _toy_drafter_after_prefill(prompt_seed: int, lens, first):
    """(cfg, bound params, a 4-deep beam-3 drafter of 12 nodes, its state after a 3-request prefill of
    8-token random prompts cut at ``lens`` with ``first`` the first generated tokens, the history): a
    drafter about to propose, over a 12-token toy LLM whose token 0 can never be drafted."""
    cfg, params = toy_model(12, 0, layers=2)
    fcfg = FeatureConfig(cfg, tuple(range(1, 12)))  # token 0 can never be drafted
    fp = bind(init_trained(params, fcfg, jax.random.key(3)), params, fcfg)
    d = FeatureDrafter(fcfg, depth=4, beam=3, nodes=12, ladder=(0, 4, 12))
    batch, width = 3, 8
    prompts = jnp.asarray(np.random.RandomState(prompt_seed).randint(0, 12, (batch, width)), jnp.int32)
    lens, first = jnp.asarray(lens, jnp.int32), jnp.asarray(first, jnp.int32)
    _, _, hidden = prefill(params, prompts, lens, init_cache(cfg, batch, 32), cfg, hidden=(cfg.num_layers,))
    state = d.init(fp, prompts, lens, cache_len=32, hidden=hidden, first=first)
    history = jnp.zeros((batch, 32), jnp.int32).at[:, :width].set(prompts).at[jnp.arange(batch), lens].set(first)
    return cfg, fp, d, state, history


class TestDynamicTree(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_best_first_closed_and_within_the_beam(self):
        lens, first = jnp.asarray([8, 5, 2], jnp.int32), jnp.asarray([4, 0, 7], jnp.int32)
        cfg, fp, d, state, history = _toy_drafter_after_prefill(0, lens, first)
        batch = 3
        ctx = DraftContext(history=history, length=lens, sampling=sampling_arrays(batch, 0.0), impl="xla")
        proposal, new = self.variant(lambda s: d.propose(fp, s, ctx))(state)
        tokens, parent, ok = (np.asarray(x) for x in (proposal.tokens, proposal.parent, proposal.ok))
        score = np.asarray(new["score"])
        depth = np.asarray(node_depths(proposal.parent))
        assert (tokens[:, 0] == np.asarray(first)).all() and (parent[:, 0] == -1).all()
        for b in range(batch):
            assert (np.diff(score[b]) <= 0).all()  # best first
            for i in range(1, d.nodes + 1):
                assert 0 <= parent[b, i] < i  # parents first: every prefix is a tree
                assert ok[b, i] and ok[b, parent[b, i]] and score[b, i - 1] < (score[b, parent[b, i] - 1]
                                                                                if parent[b, i] else 0)
                assert 1 <= depth[b, i] <= d.depth and tokens[b, i] != 0
            for i in range(d.nodes + 1):
                kids = tokens[b, 1:][parent[b, 1:] == i]
                assert len(kids) <= d.beam and len(set(kids.tolist())) == len(kids)
        expected = np.asarray(d.expected_accepted(fp, new, (0, 4, 12)))
        assert (expected[:, 0] == 0).all() and (np.diff(expected, axis=1) >= 0).all()


def test_drafts_from_the_seeded_verifiers_noise_equal_its_own_draws():
    """Under the seeded verifier the loop hands the drafter its rows of noise (``DraftContext.noise``,
    positions length + 1 ..): the proposal is the one the drafter makes drawing G(seed, t) itself, at
    temperature 1 and with a greedy request beside; rows keyed elsewhere (the seeded_by_depth mutant's)
    change it."""
    from specjax.decoding.sampling import SamplingArrays, SamplingParams
    from specjax.speculation.verify.seeded import seeded_noise

    lens = jnp.asarray([8, 5, 6], jnp.int32)
    cfg, fp, d, state, history = _toy_drafter_after_prefill(1, lens, [4, 1, 7])
    sampling = SamplingArrays.from_params([SamplingParams(1.0, seed=2), SamplingParams(), SamplingParams(1.0, seed=9)])
    propose = jax.jit(lambda s, ctx: d.propose(fp, s, ctx)[0])
    ctx = DraftContext(history=history, length=lens, sampling=sampling, impl="xla", max_depth=5)
    own = propose(state, ctx)
    shared = propose(state, ctx.replace(noise=seeded_noise(sampling, lens, 6, cfg.vocab_size)))
    chex.assert_trees_all_equal(own, shared)
    elsewhere = propose(state, ctx.replace(noise=seeded_noise(sampling, lens, 6, cfg.vocab_size,
                                                              fault="seeded_by_depth")))
    assert not np.array_equal(np.asarray(own.tokens), np.asarray(elsewhere.tokens))


def test_feature_drafter_refuses_bad_settings(llama):
    cfg = FeatureConfig(llama.config, (1, 2, 3))
    with pytest.raises(InputError, match="beam 4 exceeds the draft vocabulary"):
        FeatureDrafter(cfg)
    big = FeatureConfig(llama.config, tuple(range(64)))
    with pytest.raises(InputError, match="grows only 6 candidates"):
        FeatureDrafter(big, depth=2, beam=2, nodes=7, ladder=(0, 7))
    with pytest.raises(InputError, match="ladder must be increasing"):
        FeatureDrafter(big, ladder=(0, 20))
    # a float rung failed later as a budget error; a list made the spec unhashable inside the loop's jit
    with pytest.raises(InputError, match=r"ladder must be increasing int node counts in \[0, 16\], got \(0, 2.5, 8\)"):
        FeatureDrafter(big, ladder=(0, 2.5, 8))
    assert FeatureDrafter(big, ladder=[0, 4, np.int64(8)]).ladder == (0, 4, 8)
    hash(FeatureDrafter(big, ladder=[0, 4, 8]))
    # depths a tree of so few nodes cannot reach: one more drafter pass each, compiled and run for nothing
    with pytest.raises(InputError, match="depth 9 exceeds nodes 8; a tree of 8 nodes is at most 8 deep"):
        FeatureDrafter(big, depth=9, nodes=8, ladder=(0, 8))
    assert FeatureDrafter(big, depth=8, nodes=8, ladder=(0, 8)).max_depth == 8


def test_a_feature_drafter_for_another_llm_is_refused_before_any_work(llama, compile_log, caplog):
    """Through the API and the Engine (only load_feature_drafter compared the configs): the drafter failed
    inside the tree pass, after compiling, with a message about layer indices."""
    other = specjax.derive_ssm(llama, 1)  # another config: fewer layers
    d = FeatureDrafter(FeatureConfig(llama.config, tuple(range(16))), depth=2, beam=2, nodes=4, ladder=(0, 4))
    bound = specjax.Bound(d, None)
    with pytest.raises(InputError, match=r"feature\(depth 2, beam 2, nodes 4\) was trained for another LLM "
                                         r"\(config differs in \['num_layers'\]\)"):
        specjax.generate(other, [[1, 2, 3]], max_new_tokens=2, drafters=[bound])
    from specjax.engine import Engine

    with pytest.raises(InputError, match="was trained for another LLM"):
        Engine(other, slots=1, max_prompt_tokens=8, max_new_tokens=4, drafters=[bound], budget=None)
    assert not [r for r in caplog.records if r.getMessage().startswith("Compiling")]  # nothing compiled first
    with pytest.raises(InputError, match="distinct token ids"):
        FeatureConfig(llama.config, (1, 1))
    with pytest.raises(InputError, match="LLaMA-family"):
        FeatureConfig(toy_opt_config(), (1,))


def toy_opt_config():
    from specjax.config import ModelConfig

    return ModelConfig(family="opt", vocab_size=16, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                       num_kv_heads=2, head_dim=8, max_position_embeddings=32)


# -- lossless speculation ------------------------------------------------------------------------------------


def _prompts(vocab):
    """Three of the training prompts (the corpus fixture's), where the trained drafter is right."""
    rng = np.random.RandomState(0)
    prompts = [random_ids(rng, vocab, int(rng.randint(4, 12))) for _ in range(24)]
    return [prompts[1], prompts[4], prompts[9]]


def test_feature_speculation_equals_incremental_greedy_and_seeded(llama, trained):
    cfg, _, params, _ = trained
    prompts = _prompts(llama.config.vocab_size)
    d = FeatureDrafter(cfg, depth=4, beam=3, nodes=8, ladder=(0, 1, 3, 8))
    want = specjax.generate(llama, prompts, max_new_tokens=30, ignore_eos=True, mode="incremental")
    got = specjax.generate(llama, prompts, max_new_tokens=30, ignore_eos=True, drafters=[specjax.Bound(d, params)])
    assert got.token_ids == want.token_ids
    assert got.stats["mean_tokens_per_pass"] > 1.5  # the trained drafter's tokens are really accepted
    budget = Budget(default_levels((d,)), costs=(1.0, 1.1, 1.3, 1.6))
    got = specjax.generate(llama, prompts, max_new_tokens=30, ignore_eos=True, drafters=[specjax.Bound(d, params)],
                           budget=budget)
    assert got.token_ids == want.token_ids
    assert (np.asarray(got.stats["budget"]["passes_at_level"]) > 0).sum() >= 2  # levels switched within the run
    merged = specjax.generate(llama, prompts, max_new_tokens=30, ignore_eos=True,
                              drafters=[specjax.Bound(d, params), specjax.Bound(LookupDrafter(depth=5))])
    assert merged.token_ids == want.token_ids
    seeded = specjax.SamplingParams(temperature=0.8, top_p=0.95, seed=5)
    inc = specjax.generate(llama, prompts, max_new_tokens=30, ignore_eos=True, sampling=seeded, mode="incremental")
    spec = specjax.generate(llama, prompts, max_new_tokens=30, ignore_eos=True, sampling=seeded, verifier="seeded",
                            drafters=[specjax.Bound(d, params)])
    assert spec.token_ids == inc.token_ids
    assert spec.stats["mean_tokens_per_pass"] > 1.2  # coupled drafts are accepted at T > 0 too


def test_feature_speculation_on_a_dp_mesh_equals_incremental_and_compiles_its_chunk_once(llama, trained,
                                                                                          tiny_llama_dir, compile_log):
    """On a dp=2 mesh, streamed: incremental decoding's tokens, and the chunk program compiled once (the
    drafter's init leaves its per-request arrays over dp, as every step does; its zeroed arrays had come
    out replicated, and the second chunk compiled the loop again)."""
    from specjax.sharding import Parallel

    cfg, _, params, _ = trained
    parallel = Parallel.create("dp=2", jax.devices()[:2])
    stacked = specjax.load_model(tiny_llama_dir, progress=False, split_layers=False)  # a mesh takes stacked layers
    placed = stacked._replace(params=parallel.put_params(stacked.params, stacked.config))
    prompts = _prompts(llama.config.vocab_size)
    want = specjax.generate(llama, prompts, max_new_tokens=30, ignore_eos=True, mode="incremental")
    d = FeatureDrafter(cfg, depth=4, beam=3, nodes=8, ladder=(0, 1, 3, 8))
    got = specjax.generate(placed, prompts, max_new_tokens=30, ignore_eos=True, parallel=parallel,
                           drafters=[specjax.Bound(d, params)], on_tokens=lambda i, ids: None)
    assert got.token_ids == want.token_ids
    assert got.stats["mean_tokens_per_pass"] > 1.5  # several chunks ran, with drafts accepted
    assert compile_log("host_step") == 1


def test_feature_drafter_init_leaves_its_cache_and_state_over_dp(trained, tiny_llama_dir):
    """Inside jit on a dp=2 mesh, the drafter's prefilled cache (k, v, length) and per-request arrays come out
    with the shardings the step leaves them in (requests over dp, the drafter's weights replicated), whatever
    the prompts' placement: pinned in ``init`` as the SSMs' caches are, not left to XLA's propagation (which
    follows replicated prompts, as here, to a replicated cache)."""
    from specjax.sharding import Parallel

    cfg, _, params, _ = trained
    parallel = Parallel.create("dp=2", jax.devices()[:2])
    stacked = specjax.load_model(tiny_llama_dir, progress=False, split_layers=False)
    llm = parallel.put_params(stacked.params, stacked.config)
    d = FeatureDrafter(cfg, depth=3, beam=2, nodes=4, ladder=(0, 4))
    batch, width, cache_len = 4, 8, 32
    tokens = parallel.put(jnp.asarray(random_ids(np.random.RandomState(7), stacked.config.vocab_size, batch * width),
                                      jnp.int32).reshape(batch, width), parallel.replicated())
    lens = parallel.put(jnp.asarray([8, 5, 6, 3], jnp.int32), parallel.replicated())

    def run(llm, tokens, lens):
        cache = parallel.constrain_cache(init_cache(stacked.config, batch, cache_len, jnp.float32), stacked.config)
        _, _, hidden = prefill(llm, tokens, lens, cache, stacked.config, parallel, hidden=cfg.hidden_layers)
        return d.init(params, tokens, lens, cache_len=cache_len, parallel=parallel, hidden=hidden, first=lens)

    state = jax.jit(run)(llm, tokens, lens)
    want = parallel.cache_shardings(cfg.layer_config, batch, state["cache"].max_len, parallel.ssm_rules)
    for got, expected in [(state["cache"].k, want.k), (state["cache"].v, want.v), (state["cache"].length, want.length)]:
        assert got.sharding.is_equivalent_to(expected, got.ndim), (got.sharding, expected)
    assert want.k.spec[1] == "dp"  # the cache's batch axis
    for name, x in state.items():
        if name != "cache":
            assert x.sharding.is_equivalent_to(parallel.batch_sharding(x.shape), x.ndim), (name, x.sharding)


@pytest.mark.skipif(cpu_kernels.matmul_status() is not None,
                    reason=f"kernel unavailable: {cpu_kernels.matmul_status()}")
def test_step_params_pack_the_drafters_matmuls_and_keep_its_features(llama, trained, monkeypatch):
    """``FeatureDrafter.step_params`` (what the step programs multiply by): fc, the layer's fused matmul
    weights and the head's [D, Vd] copy packed once for the CPU kernel as float16 panels; the drafter's
    features and logits through them (the matmul and attention kernels) are float64's with those
    weights rounded to float16, within the floor of the same rounded weights through XLA's float32:
    the weights are rounded once, nothing else is lost."""
    monkeypatch.setenv(programs.ENV, "auto")
    cfg, _, params, _ = trained
    d = FeatureDrafter(cfg, depth=3, beam=2, nodes=4, ladder=(0, 4))
    (packed,), (again,) = programs.step_drafter_params((d,), (params,)), programs.step_drafter_params((d,), (params,))
    (layer,) = packed["layers"]
    assert {"wqkv", "w_gate_up"} <= set(layer)
    for name, w in [("fc", packed["fc"]), ("head", packed["head"])] + [(n, layer[n]) for n in layer]:
        assert isinstance(w, PackedWeight) == (name in MATMUL_WEIGHTS or name in ("fc", "head")), name
    assert again["head"].packed is packed["head"].packed and again["layers"][0]["wqkv"].packed is layer["wqkv"].packed
    assert programs.step_drafter_params((d,), (params,), parallel=object())[0] is params
    monkeypatch.setenv(programs.ENV, "eigen")
    assert programs.step_drafter_params((d,), (params,))[0] is params

    rng = np.random.RandomState(3)
    tokens = jnp.asarray(rng.randint(0, cfg.llm.vocab_size, (1, 6)), jnp.int32)
    prev = rng.randn(1, 6, cfg.llm.hidden_size)
    positions = jnp.arange(6, dtype=jnp.int32)[None]

    def run(p, dtype):
        cache = init_feature_cache(cfg, 1, 16, dtype)
        f, _ = feature_forward(p, tokens, jnp.asarray(prev, dtype), positions, cache,
                               causal_meta(jnp.zeros((1,), jnp.int32)), cfg)
        return f, logits_of(p, f)

    assert packed["head"].packed.dtype == jnp.float16 and layer["w_gate_up"].packed.dtype == jnp.float16
    half = lambda w: w.astype(jnp.float16).astype(w.dtype)  # noqa: E731
    rounded = {**params, "fc": half(params["fc"]), "head": half(params["head"]),
               "layers": {n: half(w) if n in MATMUL_WEIGHTS else w for n, w in params["layers"].items()}}
    plain_f, plain_l = jax.jit(run, static_argnums=1)(rounded, jnp.float32)
    packed_f, packed_l = jax.jit(run, static_argnums=1)(packed, jnp.float32)
    with precision.float64():
        exact_f, exact_l = (np.asarray(a) for a in run(precision.params64(rounded), jnp.float64))
        unrounded_f = np.asarray(run(precision.params64(params), jnp.float64)[0])
    precision.assert_within(packed_f, exact_f, precision.error(plain_f, exact_f), what="features")
    precision.assert_within(packed_l, exact_l, precision.error(plain_l, exact_l), what="logits")
    assert precision.error(packed_f, unrounded_f) > precision.error(packed_f, exact_f)  # the rounding is real


def test_feature_drafter_in_the_engine_mid_batch_insert(llama, trained):
    from specjax.engine import Engine

    cfg, _, params, _ = trained
    d = FeatureDrafter(cfg, depth=3, beam=2, nodes=5, ladder=(0, 5))
    prompts = _prompts(llama.config.vocab_size)
    want = specjax.generate(llama, prompts, max_new_tokens=20, ignore_eos=True, mode="incremental").token_ids
    engine = Engine(llama, slots=2, max_prompt_tokens=16, max_new_tokens=20, drafters=[specjax.Bound(d, params)])
    state = engine.insert(engine.init(), engine.prefill(prompts[0]), slot=1)
    for _ in range(3):
        state = engine.step(state)
    state = engine.insert(state, engine.prefill(prompts[2]), slot=0)  # joins a running batch
    while not engine.read(state).done.all():
        state = engine.step(state)
    view = engine.read(state)
    assert view.tokens[1, :view.num_generated[1]].tolist() == want[0]
    assert view.tokens[0, :view.num_generated[0]].tolist() == want[2]


VOCAB, PROMPT, NUM_TOKENS = 6, [3, 2, 4, 2, 3, 2, 4], 3


def _law_samples(verifier, fault=None, n=60_000):
    cfg, params = toy_model(VOCAB, 0, sharpness=1.5)
    fcfg = FeatureConfig(cfg, tuple(range(VOCAB)))
    fp = bind(init_trained(params, fcfg, jax.random.key(7)), params, fcfg)
    d = FeatureDrafter(fcfg, depth=2, beam=2, nodes=4, ladder=(0, 4))
    spec = SpecConfig((d,), impl="xla", verifier=verifier, fault=fault)
    width = len(PROMPT) + 1
    prompts = np.zeros((n, width), np.int32)
    prompts[:, :len(PROMPT)] = PROMPT
    out = generate_speculative_jit(params, (fp,), jnp.asarray(prompts), jnp.full((n,), len(PROMPT), jnp.int32),
                                   jnp.full((n,), NUM_TOKENS, jnp.int32),
                                   sampling_arrays(n, 1.0, seeds=np.arange(n) + 3),
                                   cfg=cfg, spec=spec, cache_len=width + NUM_TOKENS + spec.num_nodes + 2,
                                   max_out=NUM_TOKENS)
    assert not np.asarray(out.failed).any()
    assert np.asarray(out.tokens_per_pass)[:, 2:].sum() > 1000  # drafts were accepted
    law = exact_sequence_law(cfg, params, PROMPT, NUM_TOKENS, 1.0)
    return list(map(tuple, np.asarray(out.tokens).tolist())), law


@pytest.mark.parametrize("verifier", ["mss", "rrs", "naive"])
def test_feature_drafts_sample_the_exact_law(verifier):
    samples, law = _law_samples(verifier)
    assert_fits(samples, law, f"feature + {verifier}")


def test_the_law_test_catches_ranked_entries_declaring_the_drafters_q():
    """The paper's rule on this drafter (top-k ranked entries verified by MSS as if drawn from q) is
    biased, and the same chi-square test sees it."""
    samples, law = _law_samples("mss", fault="allow_mss_on_topk")
    assert not fits(samples, law)


# -- shipping: checkpoints, names, the command line ------------------------------------------------------


def test_checkpoint_round_trip_and_loading_by_path(llama, trained, tmp_path):
    from specjax.boost.feature_train import split_params
    from specjax.io.feature_checkpoint import read_feature_meta, save_feature_drafter
    from specjax.speculation.drafters.feature import from_arg, load_feature_drafter

    cfg, _, params, _ = trained
    drafting = {"depth": 4, "beam": 3, "nodes": 8, "ladder": (0, 1, 3, 8)}
    trained_part, _ = split_params(params, cfg)
    save_feature_drafter(str(tmp_path / "d"), cfg, trained_part, drafting, dtype="float32", extra={"note": "test"})
    got_cfg, got_drafting, meta = read_feature_meta(str(tmp_path / "d"))
    assert got_cfg == cfg and got_drafting == drafting and meta["note"] == "test"
    bound = load_feature_drafter(str(tmp_path / "d"), llama)
    assert bound.drafter == FeatureDrafter(cfg, **drafting)
    chex.assert_trees_all_equal(bound.params, params)  # float32 storage: exact
    light = from_arg(f"{tmp_path / 'd'},nodes=5", llama, load=False, expansion=None, draft="topk")
    assert light.params is None and light.drafter.nodes == 5 and light.drafter.ladder == (0, 1, 3, 5)
    with pytest.raises(InputError, match="expected feature:NAME"):
        from_arg(f"{tmp_path / 'd'},width=3", llama, load=False, expansion=None, draft="topk")
    with pytest.raises(InputError, match="not a registered name"):
        load_feature_drafter(str(tmp_path / "nothing"), llama)
    other = Model(dataclasses.replace(llama.config, norm_eps=1e-3), llama.params, None)
    with pytest.raises(InputError, match=r"trained for another LLM \(config differs in \['norm_eps'\]\)"):
        load_feature_drafter(str(tmp_path / "d"), other)
    # the same weights with other end-of-sequence / padding ids (a generation_config.json's extra eos
    # ids): no hidden state changes, so the drafter stays usable
    retokened = Model(dataclasses.replace(llama.config, eos_token_ids=llama.config.eos_token_ids + (5,),
                                          bos_token_id=3, pad_token_id=4), llama.params, None)
    assert load_feature_drafter(str(tmp_path / "d"), retokened, load=False).drafter == FeatureDrafter(cfg, **drafting)
    FeatureDrafter(cfg, **drafting).check_llm(retokened.config)
    with pytest.raises(CheckpointError, match="not empty"):
        save_feature_drafter(str(tmp_path / "d"), cfg, trained_part, drafting)


def test_merged_drafters_climb_their_ladders_together(llama, trained):
    cfg, _, _, _ = trained
    feature = FeatureDrafter(cfg, depth=4, beam=3, nodes=8, ladder=(0, 1, 3, 8))
    lookup = LookupDrafter(depth=4, branches=2)  # ladder (0, 2, 4, 8)
    # rung i of both ((0, 0), (1, 2), (3, 4), (8, 8)) and each drafter's inner rungs alone, by node count
    assert default_levels((feature, lookup)) == ((0, 0), (1, 2), (3, 0), (0, 4), (3, 4), (8, 8))
    short = LookupDrafter(depth=2, branches=1)  # ladder (0, 2): it stays on its top rung, has no inner rung
    assert default_levels((feature, short)) == ((0, 0), (1, 2), (3, 0), (3, 2), (8, 2))


def test_a_resumed_training_run_replaces_only_its_own_unfinished_export(tmp_path):
    """`feature-tune --stop-after N` exports what it has; the same command run again (which resumes) had its
    export refused as "not empty". Only an unfinished export of the same run is replaced; a finished one, or
    another run's, still is not."""
    from specjax.io import registry
    from specjax.io.feature_checkpoint import restore_feature_drafter, save_feature_drafter, unfinished_export_of

    cfg, trained, drafting = restore_feature_drafter(registry.resolve("smollm2-feature"))
    run, other = str(tmp_path / "run"), str(tmp_path / "other")
    export = str(tmp_path / "export")

    def save(done, replace_of=None):
        extra = {"trained": {"run": os.path.abspath(run), "steps": {"done": done, "planned": 5}}}
        save_feature_drafter(export, cfg, trained, drafting, extra=extra, replace_unfinished_of=replace_of)

    save(1)
    assert unfinished_export_of(export, run) and not unfinished_export_of(export, other)
    with pytest.raises(CheckpointError, match="not empty"):
        save(3, replace_of=other)
    save(5, replace_of=run)  # resumed and finished: replaces the unfinished one
    with open(os.path.join(export, "feature_drafter.json")) as f:
        assert json.load(f)["trained"]["steps"]["done"] == 5
    assert not unfinished_export_of(export, run)
    with pytest.raises(CheckpointError, match="not empty"):
        save(5, replace_of=run)  # a finished export is never replaced
    assert sorted(os.listdir(tmp_path)) == ["export"], "a partial or replaced directory was left"
