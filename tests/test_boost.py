"""Boost-tuning corpus: synthetic training prompts stay clear of the held-out dev prompts; the corpus
holds exactly the LLM's greedy / seeded continuations, and an interrupted run resumes."""

from __future__ import annotations

import os

import numpy as np
import pytest

import specjax
from specjax.boost.corpus import (
    TEMPLATES,
    TOPICS,
    generate_corpus,
    read_shard,
    training_prompts,
)
from specjax.decoding.sampling import SamplingParams
from specjax.errors import InputError
from tests import precision
from tests.conftest import dev_prompts
from tests.toy import mesh_model, mesh_prompts


def test_training_prompts_are_seeded_distinct_and_exclude_held_out():
    held_out = dev_prompts() + [TEMPLATES["writing"][0].format(t=TOPICS[0])]
    a = training_prompts(300, seed=1, exclude=held_out)
    assert a == training_prompts(300, seed=1, exclude=held_out) != training_prompts(300, seed=2, exclude=held_out)
    assert len(set(a)) == 300 and not set(a) & set(held_out)
    with pytest.raises(InputError, match="templates give"):
        training_prompts(10**6)


def test_corpus_is_the_llm_own_continuations_and_resumes(tmp_path):
    model = mesh_model("llama")
    prompts = mesh_prompts(model.config.vocab_size, lens=(5, 9, 3))
    out = str(tmp_path / "corpus")
    paths = generate_corpus(model, prompts, out, max_new_tokens=6, batch_size=2, temperatures=(0.0, 1.0), seed=7,
                            chat_template=False, progress=False)
    assert len(paths) == 4  # 2 temperatures x 2 batches
    greedy = specjax.generate(model, prompts, max_new_tokens=6, mode="incremental").token_ids
    rows = read_shard(paths[0]) + read_shard(paths[1])
    assert [seq[n:] for seq, n in rows] == greedy and [seq[:n] for seq, n in rows] == prompts
    sampled = read_shard(paths[2]) + read_shard(paths[3])
    want = specjax.generate(model, prompts, max_new_tokens=6,
                            sampling=[SamplingParams(temperature=1.0, seed=7 + 2 * 2 + 0),
                                      SamplingParams(temperature=1.0, seed=7 + 2 * 2 + 1),
                                      SamplingParams(temperature=1.0, seed=7 + 3 * 2)], mode="incremental").token_ids
    assert [seq[n:] for seq, n in sampled] == want
    os.remove(paths[3])
    stamp = os.path.getmtime(paths[0])
    assert generate_corpus(model, prompts, out, max_new_tokens=6, batch_size=2, temperatures=(0.0, 1.0), seed=7,
                           chat_template=False, progress=False) == paths
    assert os.path.getmtime(paths[0]) == stamp and os.path.exists(paths[3])  # only the missing shard is redone
    with pytest.raises(InputError, match="use another directory"):
        generate_corpus(model, prompts, out, max_new_tokens=8, batch_size=2, chat_template=False, progress=False)
    # as many prompts, one of them other (a changed held-out list): the shards made from the old ones are
    # refused, before the missing shard before them is generated
    os.remove(paths[0])
    other = [prompts[0], prompts[1], [t + 1 for t in prompts[2]]]
    with pytest.raises(InputError, match="shard-00001.npz: made from other prompts.*request 0 of the shard"):
        generate_corpus(model, other, out, max_new_tokens=6, batch_size=2, temperatures=(0.0, 1.0), seed=7,
                        chat_template=False, progress=False)
    assert not os.path.exists(paths[0])


def test_the_weights_digest_names_the_weights_in_either_layout():
    import jax
    import numpy as np

    from specjax.models.params import llm_weights_digest, split_layers, stack_layers

    model = mesh_model("llama")
    digest = llm_weights_digest(model.params)
    split = split_layers(model.params)  # fused q/k/v and gate/up, a transposed tied head
    assert llm_weights_digest(split) == digest == llm_weights_digest(stack_layers(split))
    assert llm_weights_digest(jax.tree.map(np.asarray, split)) == digest
    for name in ("wv", "w_down"):  # one weight of every layer moved a little, as a fine-tune moves it
        moved = {**model.params, "layers": {**model.params["layers"], name: model.params["layers"][name] * 1.001}}
        assert llm_weights_digest(moved) != digest, name
    assert llm_weights_digest({**model.params, "embed": model.params["embed"].astype("bfloat16")}) != digest


def test_a_corpus_and_its_teacher_targets_belong_to_the_weights_that_made_them(tmp_path):
    """A fine-tune keeps the config and the tokenizer: its corpus must not be another checkpoint's."""
    import json

    from specjax.boost.teacher import cached_teacher_targets
    from specjax.models.params import llm_weights_digest, split_layers
    from tests.toy import perturbed

    model = mesh_model("llama")
    tuned = model._replace(params=perturbed(model.params, seed=1, eps=1e-3))
    prompts = mesh_prompts(model.config.vocab_size, lens=(5, 3))
    out = str(tmp_path / "corpus")
    kwargs = dict(max_new_tokens=4, batch_size=2, temperatures=(0.0,), chat_template=False, progress=False)
    paths = generate_corpus(model, prompts, out, **kwargs)
    manifest = json.load(open(os.path.join(out, "manifest.json")))
    assert manifest["weights"] == llm_weights_digest(model.params)
    with pytest.raises(InputError, match=r"generated by other weights \(digest [0-9a-f]{12}, this model's is "):
        generate_corpus(tuned, prompts, out, **kwargs)
    same = model._replace(params=split_layers(model.params))  # the same weights, the other layout
    assert generate_corpus(same, prompts, out, **kwargs) == paths
    # a corpus from before the digest: taken as the first model's that resumes it, and then named so
    del manifest["weights"]
    json.dump(manifest, open(os.path.join(out, "manifest.json"), "w"))
    assert generate_corpus(tuned, prompts, out, **kwargs) == paths
    assert json.load(open(os.path.join(out, "manifest.json")))["weights"] == llm_weights_digest(tuned.params)
    with pytest.raises(InputError, match="generated by other weights"):
        generate_corpus(model, prompts, out, **kwargs)

    sequences = read_shard(paths[0])
    logged = []
    cache = str(tmp_path / "teacher.npz")
    first = cached_teacher_targets(model, sequences, cache, top_k=3, progress=False, log=logged.append)
    cached_teacher_targets(model, sequences, cache, top_k=3, progress=False, log=logged.append)
    assert logged == []  # reused
    other = cached_teacher_targets(tuned, sequences, cache, top_k=3, progress=False, log=logged.append)
    assert len(logged) == 1 and "recomputing" in logged[0]
    assert any(not np.array_equal(a[1], b[1]) for a, b in zip(first, other))


def test_teacher_targets_are_the_llm_top_k_at_each_continuation_token():
    import jax
    import numpy as np

    from specjax.boost.teacher import teacher_targets
    from specjax.decoding.incremental import full_logits

    model = mesh_model("opt")
    rng = np.random.RandomState(0)
    sequences = [(rng.randint(0, 256, n).tolist(), p) for n, p in ((9, 4), (20, 1), (5, 5))]
    targets = teacher_targets(model, sequences, top_k=5, batch_size=2, width_multiple=8)
    for (seq, n), (ids, logp) in zip(sequences, targets):
        assert ids.shape == logp.shape == (len(seq) - n, 5)
        ref = np.asarray(jax.nn.log_softmax(full_logits(model.params, np.asarray([seq], np.int32),
                                                        cfg=model.config)[0], axis=-1))
        exact = precision.logits64(model, [seq])[0]
        exact = exact - np.log(np.exp(exact - exact.max(-1, keepdims=True)).sum(-1, keepdims=True)) - \
            exact.max(-1, keepdims=True)  # float64 log-softmax
        for j in range(len(seq) - n):
            row = ref[n - 1 + j]
            np.testing.assert_array_equal(ids[j], np.argsort(-row, kind="stable")[:5])
            want = exact[n - 1 + j][ids[j]]
            precision.assert_within(logp[j], want, precision.error(row[ids[j]], want), what="teacher log-probs")
    with pytest.raises(InputError, match="top_k must be in"):
        teacher_targets(model, sequences, top_k=0)
