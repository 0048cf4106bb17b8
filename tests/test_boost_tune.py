"""Students with a draft vocabulary, distillation (learns, resumes bit-exactly), collective boosting
(later members train only on what earlier ones miss; the pool speculates losslessly), HF export."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.boost.distill import Examples, TrainConfig, evaluate, train
from specjax.boost.pool import Member, boost_tune, read_corpus
from specjax.boost.student import draft_vocabulary, make_student
from specjax.decoding.incremental import full_logits
from specjax.errors import ConfigError, InputError
from tests import precision
from tests.toy import mesh_model, mesh_prompts


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from specjax.boost.corpus import generate_corpus

    llm = mesh_model("llama")
    prompts = mesh_prompts(llm.config.vocab_size, lens=(5, 9, 3, 7, 4, 6, 8, 2)) * 3
    out = str(tmp_path_factory.mktemp("corpus"))
    generate_corpus(llm, prompts, out, max_new_tokens=10, batch_size=12, temperatures=(0.0, 1.0),
                    chat_template=False, progress=False)
    return llm, out, read_corpus(out)


def test_full_student_reproduces_the_llm_and_scatters_minus_inf(corpus):
    llm, _, seqs = corpus
    vocab = llm.config.vocab_size
    full = make_student(llm, seqs, layers=range(llm.config.num_layers), draft_vocab_size=vocab - 3)
    missing = sorted(set(range(vocab)) - set(full.config.draft_vocab))
    tokens = jnp.asarray([seqs[0][0]])
    want, got = full_logits(llm.params, tokens, cfg=llm.config), full_logits(full.params, tokens, cfg=full.config)
    keep = np.asarray(full.config.draft_vocab)
    exact = precision.logits64(llm, np.asarray(tokens).tolist())[0][..., keep]
    floor = precision.error(np.asarray(want)[0][..., keep], exact)
    precision.assert_within(np.asarray(got)[0][..., keep], exact, floor, what="full student vs the LLM")
    assert np.all(np.asarray(got)[..., missing] == -np.inf)
    counts = np.bincount(np.concatenate([s[n:] for s, n in seqs]), minlength=vocab)
    assert counts[list(full.config.draft_vocab[:5])].min() >= counts[missing].max()  # most frequent kept
    small = make_student(llm, seqs, layers=(0, 2), draft_vocab_size=40, mlp_size=24)
    assert small.params["layers"]["w_up"].shape == (2, 64, 24) and small.params["embed"].shape == (41, 64)
    with pytest.raises(InputError, match="layers"):
        make_student(llm, seqs, layers=(2, 1))
    with pytest.raises(ConfigError, match="distinct"):
        dataclasses.replace(llm.config, draft_vocab=(1, 1))
    assert draft_vocabulary([([3, 1, 1, 2], 1)], 2, 8) == (1, 2)


def test_a_training_batch_of_64_tokens_or_more_differentiates(corpus):
    """From 64 queries on, a pass read its prefix in a blocked loop whose trip count depends on the lengths,
    which reverse-mode differentiation cannot follow: boost-tune crashed at its first step on SmolLM2's
    chat-templated sequences (the corpus above has shorter ones). Training reads no prefix now, and its logits
    are those of the pass that reads its empty prefix."""
    from specjax.attention.meta import causal_meta
    from specjax.boost.distill import _row_logits, loss_fn
    from specjax.models import llama
    from specjax.models.cache import init_cache

    llm, _, seqs = corpus
    student = make_student(llm, seqs, layers=(0,), draft_vocab_size=60, mlp_size=32)
    width = 70
    assert width <= student.config.max_positions
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, llm.config.vocab_size, (2, width)), jnp.int32)
    grads = jax.grad(loss_fn)(student.params, student.config, tokens, jnp.roll(tokens, -1, axis=1),
                              jnp.ones(tokens.shape, jnp.float32))
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), tokens.shape)
    read = llama.forward(student.params, tokens, positions, init_cache(student.config, 2, width, jnp.float32),
                         causal_meta(jnp.zeros((2,), jnp.int32)), student.config, row_logits=True).logits
    np.testing.assert_array_equal(np.asarray(_row_logits(student.params, student.config, tokens)), np.asarray(read))


def test_distillation_learns_and_resumes_bit_exactly(corpus, tmp_path):
    llm, _, seqs = corpus
    examples, held = Examples.build(seqs[1:]), Examples.build(seqs[:1])
    student = make_student(llm, seqs, layers=(0,), draft_vocab_size=60, mlp_size=32)
    tc = TrainConfig(epochs=4, batch_size=8, learning_rate=3e-3, warmup_steps=2, eval_every=100, checkpoint_every=3)
    before = evaluate(student.params, student.config, examples)[0]
    whole, history = train(student, examples, tc, str(tmp_path / "a"), eval_examples=held, progress=False)
    after = evaluate(whole.params, whole.config, examples)[0]
    assert after > before + 0.1, (before, after)
    assert history[0]["step"] == 0 and history[-1]["step"] == 4 * (len(examples) // 8)
    part, _ = train(student, examples, tc, str(tmp_path / "b"), eval_examples=held, progress=False, stop_after=5)
    resumed, history_b = train(student, examples, tc, str(tmp_path / "b"), eval_examples=held, progress=False)
    for a, b in zip(jax.tree.leaves(whole.params), jax.tree.leaves(resumed.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert history_b == history
    with pytest.raises(InputError, match="another recipe"):
        train(student, examples, dataclasses.replace(tc, learning_rate=1e-3), str(tmp_path / "b"), progress=False)


def test_boosting_trains_later_members_on_what_earlier_ones_miss(corpus, tmp_path):
    llm, corpus_dir, _ = corpus
    tc = TrainConfig(epochs=3, batch_size=8, learning_rate=3e-3, warmup_steps=2, eval_every=100, checkpoint_every=3)
    members = [Member.parse("a:0,1:32:60"), Member.parse("b:0,1:32:60")]
    summary = boost_tune(llm, corpus_dir, str(tmp_path), members, tc, progress=False, log=lambda *a: None)
    # Interrupted runs continue as the uninterrupted one: stopped after member a (b started from a's float32
    # weights in one run and from its float16 checkpoint in the other), or within b after a checkpoint
    # (its checkpoints were of stacked layers, the reloaded a's split: orbax refused the restore).
    def b_of(run):
        return jax.tree.leaves(specjax.load_model(str(run / "b"), split_layers=False).params)

    keys = ("trained_on_tokens", "newly_predicted_tokens", "eval_top_k", "eval_top_k_missed_by_earlier")
    after_a, within_b = tmp_path / "after-a", tmp_path / "within-b"
    shutil.copytree(tmp_path / "a", after_a / "a")
    shutil.copytree(tmp_path / "train" / "a", after_a / "train" / "a")
    shutil.copytree(tmp_path / "a", within_b / "a")
    shutil.copytree(tmp_path / "train", within_b / "train")
    steps = sorted(int(n) for n in os.listdir(within_b / "train" / "b" / "steps") if n.isdigit())
    assert len(steps) == 2
    shutil.rmtree(within_b / "train" / "b" / "steps" / str(steps[-1]))  # b stopped after its step steps[0]
    for run in (after_a, within_b):
        said = []
        resumed = boost_tune(llm, corpus_dir, str(run), members, tc, progress=False, log=said.append)
        assert [[s[k] for k in keys] for s in resumed] == [[s[k] for k in keys] for s in summary]
        chex.assert_trees_all_equal(b_of(run), b_of(tmp_path))
        assert any(line.startswith("member a: already trained") for line in said)
        if run == within_b:  # continued from its checkpoint, not trained again from step 0
            resumed_at = f"resumed {within_b / 'train' / 'b'} at step {steps[0]}/"
            assert any(line.startswith(resumed_at) for line in said), said
    first, second = summary
    assert first["newly_predicted_tokens"] > 0
    assert second["trained_on_tokens"] == first["trained_on_tokens"] - first["newly_predicted_tokens"]
    with open(tmp_path / "train" / "b" / "recipe.json") as f:
        assert json.load(f)["weighted"] == second["trained_on_tokens"]
    ssms = [specjax.load_model(str(tmp_path / m.name)) for m in members]
    assert ssms[0].params["embed"].dtype == jnp.float32  # shipped as float16, loaded as float32
    prompts = mesh_prompts(llm.config.vocab_size, lens=(4, 7))
    want = specjax.generate(llm, prompts, max_new_tokens=12, mode="incremental").token_ids
    got = specjax.generate(llm, prompts, max_new_tokens=12, ssms=ssms, mode="tree", expansion=(1, 2, 1))
    assert got.token_ids == want
    again = boost_tune(llm, corpus_dir, str(tmp_path), members, tc, progress=False, log=lambda *a: None)
    assert [s["eval_top_k"] for s in again] == [s["eval_top_k"] for s in summary]  # reloaded, not retrained
    assert first["eval_top_k_missed_by_earlier"] == first["eval_top_k"]  # nothing earlier to miss

    # soft boosting: member a reused, b keeps weight 0.25 on the tokens a already predicts
    soft = tmp_path / "soft"
    shutil.copytree(tmp_path / "a", soft / "a")
    shutil.copytree(tmp_path / "train" / "a", soft / "train" / "a")
    soft_summary = boost_tune(llm, corpus_dir, str(soft), members, tc, boost_weight=0.25, progress=False,
                              log=lambda *a: None)
    assert soft_summary[0]["eval_top_k"] == first["eval_top_k"]
    assert soft_summary[0]["train_config"]["epochs"] == tc.epochs  # read back from a's own recipe
    with open(soft / "train" / "b" / "recipe.json") as f:
        weighted = json.load(f)["weighted"]
    assert weighted == pytest.approx(second["trained_on_tokens"] + 0.25 * first["newly_predicted_tokens"])
    with pytest.raises(InputError, match="boost_weight"):
        boost_tune(llm, corpus_dir, str(soft), members, tc, boost_weight=1.0)
    # a finished member is reused only as trained: another spec or another corpus is refused, not mixed in
    # (the summary then reported this run's spec and corpus for it)
    with pytest.raises(InputError, match=r"this member was trained otherwise: layers \[0, 1\] \(this run: \[1\]\)"):
        boost_tune(llm, corpus_dir, str(tmp_path), [Member.parse("a:1:32:60")], tc, progress=False,
                   log=lambda *a: None)
    other = tmp_path / "other-corpus"
    shutil.copytree(corpus_dir, other)
    shard = sorted(other.glob("shard-*.npz"))[0]
    shard.unlink()  # a corpus of fewer sequences
    with pytest.raises(InputError, match="this member was trained otherwise: corpus_digest"):
        boost_tune(llm, str(other), str(tmp_path), members, tc, progress=False, log=lambda *a: None)
    with pytest.raises(InputError, match="NAME:LAYERS"):
        Member.parse("a")


def test_exported_draft_vocab_ssm_matches_in_transformers(corpus, tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from specjax.io.hf_export import draft_vocab_mask, export_hf

    llm, _, seqs = corpus
    ssm = make_student(llm, seqs, layers=(1, 3), draft_vocab_size=50, mlp_size=40)
    export_hf(ssm, str(tmp_path))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    mask = torch.tensor(draft_vocab_mask(str(tmp_path), llm.config.vocab_size))
    hf.lm_head.register_forward_hook(lambda module, inputs, out: out + mask)
    ids = seqs[3][0]
    with torch.no_grad():
        got = hf(torch.tensor([ids])).logits.numpy()
        hf64 = copy.deepcopy(hf).double()  # the hook (and its float32 mask) comes along: -inf stays -inf
        ref = hf64(torch.tensor([ids])).logits.numpy()
    want = np.asarray(full_logits(ssm.params, jnp.asarray([ids]), cfg=ssm.config))
    assert np.array_equal(np.isinf(got), np.isinf(want)) and np.array_equal(np.isinf(ref), np.isinf(want))
    finite = np.isfinite(want)
    precision.assert_within(want[finite], ref[finite], precision.error(got[finite], ref[finite]),
                            what="draft-vocab SSM: specjax vs transformers")
    assert os.path.exists(tmp_path / "config.json") and draft_vocab_mask(str(tmp_path / "none"), 4) is None


def test_shipped_ssms_are_registered_small_and_share_the_llm_vocabulary():
    from specjax.io import registry

    total = 0
    for name in ("smollm2-ssm-a", "smollm2-ssm-b"):
        path = registry.resolve(name)
        total += sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)
        ssm = specjax.load_model(name, progress=False)
        assert ssm.config.vocab_size == 49152 and len(ssm.config.draft_vocab) >= 1024
        assert os.path.isfile(os.path.join(path, "README.md")), f"{name} has no model card"
    assert total <= 40e6, f"shipped SSM artifacts take {total / 1e6:.1f} MB"
    assert set(registry.DEFAULT_SSMS) <= {"smollm2-ssm-a", "smollm2-ssm-b"}


def test_kl_loss_is_cross_entropy_for_a_one_hot_teacher_and_trains(corpus, tmp_path):
    from specjax.boost.distill import loss_fn

    llm, _, seqs = corpus
    examples = Examples.build(seqs)
    student = make_student(llm, seqs, layers=(0,), draft_vocab_size=60, mlp_size=32)
    tokens, targets, weights = examples.batch(np.arange(8))
    one_hot = (jnp.maximum(jnp.asarray(targets), 0)[..., None], jnp.zeros(targets.shape + (1,), jnp.float32))
    ce = loss_fn(student.params, student.config, tokens, targets, weights)
    kl = loss_fn(student.params, student.config, tokens, targets, weights, one_hot)
    with precision.float64():
        ce64 = float(loss_fn(precision.params64(student.params), student.config, tokens, targets, weights))
    precision.assert_within(float(kl), ce64, abs(float(ce) - ce64), what="KL with a one-hot teacher vs cross-entropy")
    tc = TrainConfig(epochs=1, batch_size=8, learning_rate=3e-3, warmup_steps=1, loss="kl", teacher_top_k=8)
    trained, history = train(student, examples, tc, str(tmp_path), llm=llm, eval_examples=examples, progress=False)
    assert history[-1]["top1"] > history[0]["top1"]
    with pytest.raises(InputError, match="needs a teacher"):
        train(student, examples, tc, str(tmp_path / "x"), progress=False)


def test_precomputed_teacher_trains_like_the_per_batch_teacher_and_is_cached(corpus, tmp_path):
    from specjax.boost.teacher import cached_teacher_targets

    llm, _, seqs = corpus
    examples = Examples.build(seqs)
    student = make_student(llm, seqs, layers=(0,), draft_vocab_size=60, mlp_size=32)
    tc = TrainConfig(epochs=1, batch_size=8, learning_rate=3e-3, warmup_steps=1, loss="kl", teacher_top_k=8)
    online, _ = train(student, examples, tc, str(tmp_path / "online"), llm=llm, progress=False)
    cache = str(tmp_path / "teacher.npz")
    targets = cached_teacher_targets(llm, seqs, cache, 8, progress=False)
    with_teacher = examples.with_teacher(seqs, targets)
    offline, _ = train(student, with_teacher, tc, str(tmp_path / "offline"), progress=False)  # no LLM needed
    # The same training in float64 (precomputed teacher): both float32 runs must be as close to it as
    # the offline one is (its float32 error, amplified by training, is the floor).
    with precision.float64():
        exact, _ = train(student._replace(params=precision.params64(student.params)), with_teacher, tc,
                         str(tmp_path / "float64"), progress=False)
        exact = [np.asarray(a, np.float64) for a in jax.tree.leaves(exact.params)]
    assert exact[0].dtype == np.float64
    floor = max(precision.error(b, e) for b, e in zip(jax.tree.leaves(offline.params), exact))
    for a, e in zip(jax.tree.leaves(online.params), exact):
        precision.assert_within(a, e, floor, what="per-batch teacher run vs the float64 run")
    logp = with_teacher.teacher[1][with_teacher.weights > 0]  # [positions, k], most likely first
    tiny = 8 * float(np.finfo(np.float32).eps) * logp.shape[-1]  # float32 exp and sum of k terms
    assert np.all(logp <= 0) and np.all(np.diff(logp, axis=-1) <= 0) and np.all(np.exp(logp).sum(-1) <= 1 + tiny)
    # the cache is reused for the same sequences ...
    mtime = os.path.getmtime(cache)
    again = cached_teacher_targets(llm, seqs, cache, 8, progress=False)
    assert os.path.getmtime(cache) == mtime
    assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(targets, again))
    # ... and recomputed (with a message) for other sequences
    said = []
    fewer = cached_teacher_targets(llm, seqs[:5], cache, 8, progress=False, log=said.append)
    assert len(fewer) == 5 and said and "recomputing" in said[0]
    with pytest.raises(InputError, match="top-8, TrainConfig.teacher_top_k is 4"):
        train(student, with_teacher, dataclasses.replace(tc, teacher_top_k=4), str(tmp_path / "k4"), progress=False)
    # boost_tune with the KL loss precomputes the teacher next to the corpus, once
    _, corpus_dir, _ = corpus
    pool = [Member.parse("a:0:32:60")]
    boost_tune(llm, corpus_dir, str(tmp_path / "kl"), pool, tc, progress=False, log=lambda *a: None)
    with open(tmp_path / "kl" / "train" / "a" / "recipe.json") as f:
        assert json.load(f)["teacher"] == "precomputed"
    assert os.path.isfile(os.path.join(corpus_dir, "teacher-top8.npz"))
