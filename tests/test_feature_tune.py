"""The feature-drafter recipe end to end on SmolLM2 at a tiny scale (``specjax feature-tune``'s stages):
the task prompts keep held-out prompts out, the corpus and training resume instead of redoing work,
a run stopped early exports what it has and says so, and the exported drafter speculates losslessly."""

from __future__ import annotations

import dataclasses
import glob
import json
import os

import chex
import numpy as np
import pytest

import specjax
from specjax.boost.feature_corpus import CorpusPlan, build_feature_corpus
from specjax.boost.feature_train import FeatureTrainConfig
from specjax.boost.request_prompts import extract_request, meta_prompts
from specjax.boost.task_prompts import passage_prompts, stage1_prompts, stage2_prompts
from specjax.errors import InputError
from specjax.io.feature_checkpoint import restore_feature_drafter
from tests.conftest import load_script, requires_smollm2


def test_stage1_prompts_are_seeded_distinct_and_keep_held_out_prompts_out():
    first = stage1_prompts(300, seed=3)
    assert first == stage1_prompts(300, seed=3) and len({p for _, p in first}) == 300
    kinds = {k for k, _ in stage1_prompts(2000, seed=3)}
    assert {"math", "code"} <= kinds and len(kinds) >= 6
    held = [p for _, p in first[:50]]
    again = stage1_prompts(300, seed=3, exclude=held)
    assert not set(held) & {p for _, p in again}
    passages = passage_prompts(40, seed=3, exclude=held)
    assert len({t for t, _ in passages}) > 20 and len({p for _, p in passages}) == 40


def test_grounded_prompts_that_the_passages_cannot_give_are_refused_not_drawn_forever():
    """2 passages give 110 distinct grounded prompts; asking for more drew without end, printing nothing."""
    words = " ".join(f"word{i}" for i in range(40))
    passages = [("rivers", f"Rivers carve valleys over ages. {words}."), ("stars", f"Stars fuse hydrogen. {words}.")]
    got = stage2_prompts(passages, 80, seed=3)
    assert len({p for _, p in got}) == 80 and got == stage2_prompts(passages, 80, seed=3)
    with pytest.raises(InputError, match=r"2 usable passages \(of 2; 30\+ words each\) give only \d+ distinct "
                                         r"grounded prompts, not the 400 asked for: more --passages"):
        stage2_prompts(passages, 400, seed=3)


def test_meta_prompts_are_seeded_and_vary_kind_writer_and_topic():
    first = meta_prompts(400, seed=3)
    assert first == meta_prompts(400, seed=3) and first != meta_prompts(400, seed=4)
    assert len({k for k, _ in first}) >= 10 and len({p for _, p in first}) > 380
    assert all(p.endswith("Reply with the request only.") for _, p in first)


@pytest.mark.parametrize("text, kept", [
    ("How do I repot a cactus without hurting my hands?", "How do I repot a cactus without hurting my hands?"),
    ("Sure, here's a request:\n\nCan you write a short poem about autumn leaves?",
     "Can you write a short poem about autumn leaves?"),
    ('A student might ask: "What caused the fall of the Roman Empire?" This question is...',
     "What caused the fall of the Roman Empire?"),
    ("Question: What if the moon disappeared tomorrow?", "What if the moon disappeared tomorrow?"),
    ("**Request:** Please list five ideas for a rainy weekend.", "Please list five ideas for a rainy weekend."),
    ("How would I explain the steps of baking bread to a friend who has never", None),  # cut off
    ("I'm sorry, but I cannot write that request.", None),  # a refusal
    ("Why?", None),  # too short
    ("Объясни, пожалуйста, как это работает?", None),  # mostly not ASCII
    ("Sure, here you go:", None),  # nothing after the preamble
])
def test_extract_request_keeps_one_clean_request_or_none(text, kept):
    assert extract_request(text) == kept


def test_a_second_request_round_answers_only_requests_not_already_in_the_corpus(tmp_path):
    """A round keeps the usable written requests that no earlier part holds (a template prompt, a held-out
    prompt or an earlier round's request would be the same greedy sequence in two parts split apart),
    with its own meta prompts and seeds; with none left it says so."""
    from specjax.boost.feature_corpus import REQUEST_ROUNDS, _request_round, part_dirs

    texts = ["How do I repot a cactus without hurting my hands?", "Explain how a bicycle gear works, step by step.",
             "Why?"]  # the third is too short to be a request

    class Tokenizer:
        def decode(self, ids, skip_special_tokens=True):
            return texts[ids[0] - 1]

    shard = str(tmp_path / "written.npz")
    np.savez(shard, tokens=np.array([0, 1, 0, 2, 0, 3], np.int32), offsets=np.array([0, 2, 4, 6], np.int64),
             prompt_lens=np.ones(3, np.int32))
    calls = []

    def run(name, prompts, temperature, max_new, recipe=None, seed=0):
        calls.append((name, prompts, seed))
        return [shard] if name.endswith("-written") else ["answers.npz"]

    plan, shards = CorpusPlan(requests=3, more_requests=3), {}
    kept = _request_round(run, shards, REQUEST_ROUNDS["requests-b"], plan, Tokenizer(), {texts[0]},
                          part_dirs(str(tmp_path)), lambda *a: None)
    assert kept == [texts[1]] and shards == {"requests-b": ["answers.npz"]}
    (written, asked, seed), (answers, answered, answer_seed) = calls
    assert (written, answers, answered) == ("requests-b-written", "requests-b", [texts[1]])
    assert asked == [p for _, p in meta_prompts(3, seed=seed)] and seed == answer_seed != plan.seed
    with pytest.raises(InputError, match="none of the 3 written requests was usable"):
        _request_round(run, {}, REQUEST_ROUNDS["requests-b"], plan, Tokenizer(), set(texts), part_dirs(str(tmp_path)),
                       lambda *a: None)


def test_written_prompts_are_read_deduplicated_split_and_continued_in_parts_of_their_own(tmp_path):
    """Prompts written for training: read from their files in order, duplicates and prompts another part
    holds (or held out) dropped, a seeded sampled_fraction continued at temperature 1 with the round's
    own seeds, the manifests naming the prompts by hash; a second round drops the first round's prompts
    and has other parts and seeds; none left is refused by name."""
    from specjax.boost.feature_corpus import WRITTEN_ROUNDS, _written_parts, split_written, written_prompts

    first, second, third = tmp_path / "a.jsonl", tmp_path / "b.txt", tmp_path / "c.txt"
    first.write_text("".join(json.dumps({"prompt": f"prompt {i}"}) + "\n" for i in range(10)))
    second.write_text("prompt 3\nanother one\nheld\n")
    third.write_text("prompt 1\nnew one\n")
    prompts = written_prompts([str(first), str(second)], taken={"held", "prompt 0"})
    assert prompts == [f"prompt {i}" for i in range(1, 10)] + ["another one"]
    plan = CorpusPlan(written=(str(first), str(second)), more_written=(str(third),), sampled_fraction=0.3, seed=4)
    one, two = WRITTEN_ROUNDS["written"], WRITTEN_ROUNDS["written-b"]
    greedy, sampled = split_written(prompts, plan, one.seed_offset)
    assert (len(greedy), len(sampled)) == (7, 3) and sorted(greedy + sampled) == sorted(prompts)
    assert split_written(prompts, plan, one.seed_offset) == (greedy, sampled)  # seeded
    assert split_written(prompts, dataclasses.replace(plan, seed=5), one.seed_offset) != (greedy, sampled)
    assert split_written(prompts, dataclasses.replace(plan, sampled_fraction=0.0), one.seed_offset) == (prompts, [])
    calls, shards = [], {}

    def run(name, part, temperature, max_new, recipe=None, seed=0, source=None):
        calls.append((name, part, temperature, recipe, seed, source))
        return [f"{name}.npz"]

    taken = {"held", "prompt 0"}
    assert _written_parts(run, shards, plan, one, taken, lambda *a: None) == prompts
    assert shards == {"written-greedy": ["written-greedy.npz"], "written-sampled": ["written-sampled.npz"]}
    (g_name, g_part, g_temp, g_recipe, g_seed, g_src), (s_name, s_part, s_temp, s_recipe, s_seed, _) = calls
    assert (g_part, g_temp, s_part, s_temp) == (greedy, 0.0, sampled, 1.0)
    assert g_seed == s_seed == plan.seed + one.seed_offset and "a.jsonl, b.txt" in g_src
    assert g_recipe == s_recipe and len(g_recipe["written_sha256"]) == 64
    calls.clear()
    assert _written_parts(run, shards, plan, two, taken | set(prompts), lambda *a: None) == ["new one"]
    assert [(c[0], c[1], c[4]) for c in calls] == [("written-b-greedy", ["new one"], plan.seed + two.seed_offset)]
    assert two.seed_offset != one.seed_offset and calls[0][3] != g_recipe
    with pytest.raises(InputError, match="--more-written-prompts .*c.txt: no prompt left"):
        _written_parts(run, {}, plan, two, {"prompt 1", "new one"}, lambda *a: None)
    # a third round: its own parts and seeds, the earlier rounds' prompts dropped
    fourth = tmp_path / "d.txt"
    fourth.write_text("new one\nprompt 2\na third\n")
    three = WRITTEN_ROUNDS["written-c"]
    plan = dataclasses.replace(plan, written_c=(str(fourth),))
    calls.clear()
    assert _written_parts(run, shards, plan, three, taken | set(prompts) | {"new one"}, lambda *a: None) == ["a third"]
    assert [(c[0], c[1], c[4]) for c in calls] == [("written-c-greedy", ["a third"], plan.seed + three.seed_offset)]
    assert len({(r.greedy, r.sampled, r.files_field, r.flag) for r in WRITTEN_ROUNDS.values()}) == len(WRITTEN_ROUNDS)
    with pytest.raises(InputError, match="--written-c-prompts .*d.txt: no prompt left"):
        _written_parts(run, {}, plan, three, {"new one", "prompt 2", "a third"}, lambda *a: None)
    # a fourth round likewise: the third round's prompt dropped, its own parts and seed
    fifth = tmp_path / "e.txt"
    fifth.write_text("a third\na fourth\n")
    four = WRITTEN_ROUNDS["written-d"]
    plan = dataclasses.replace(plan, written_d=(str(fifth),))
    calls.clear()
    assert _written_parts(run, shards, plan, four, {"a third"}, lambda *a: None) == ["a fourth"]
    assert [(c[0], c[1], c[4]) for c in calls] == [("written-d-greedy", ["a fourth"], plan.seed + four.seed_offset)]
    assert shards["written-d-greedy"] == ["written-d-greedy.npz"] and "written-d-sampled" not in shards
    assert len({r.seed_offset for r in WRITTEN_ROUNDS.values()}) == len(WRITTEN_ROUNDS)
    with pytest.raises(InputError, match="--written-prompts .*b.txt: no prompt left"):
        written_prompts([str(second)], taken={"prompt 3", "another one", "held"})
    for written_round in WRITTEN_ROUNDS.values():  # every round's plan field, the seventh's included
        with pytest.raises(InputError, match=f"{written_round.files_field} must be a tuple of prompt file paths"):
            CorpusPlan(**{written_round.files_field: str(first)})
    assert {"written_f", "written_g"} <= {r.files_field for r in WRITTEN_ROUNDS.values()}


def test_the_sequences_evaluated_in_training_keep_every_parts_share():
    from specjax.boost.feature_tune import evaluation_indices

    # stop 74's held-out set: the newest round loaded last, 64 of 464 sequences, and 400 evaluated
    parts = np.repeat(np.arange(4), [300, 60, 40, 64])
    index = evaluation_indices(len(parts), 400)
    assert len(index) == 400 and (np.diff(index) > 0).all() and (index[0], index[-1]) == (0, 463)
    share, whole = np.bincount(parts[index], minlength=4), np.bincount(parts) * 400 / 464
    assert np.abs(share - whole).max() <= 1.0, (share, whole)  # the last part too (the first 400: none of it)
    assert (evaluation_indices(10, 400) == np.arange(10)).all()  # fewer than max_eval: all of them
    assert list(evaluation_indices(5, 1)) == [0] and list(evaluation_indices(7, 2)) == [0, 6]


@requires_smollm2
@pytest.mark.slow
def test_feature_tune_resumes_exports_and_the_drafter_is_lossless(smollm2, tmp_path, monkeypatch):
    import specjax.boost.feature_tune as tune
    from specjax.boost.feature_data import held_out_indices, split_held_out
    from specjax.boost.feature_loading import load_feature_set
    from specjax.boost.feature_tune import feature_tune, split_corpus
    from specjax.speculation.drafters.feature import from_arg

    plan = CorpusPlan(passages=2, tasks=4, grounded=4, sampled_fraction=0.5, max_new_tokens=6, passage_tokens=48,
                      batch_size=4)
    tc = FeatureTrainConfig(epochs=2, batch_size=2, window=64, warmup_steps=1, unrolled_steps=2, eval_every=1000,
                            checkpoint_every=1)
    drafting = {"depth": 3, "beam": 2, "nodes": 4, "ladder": (0, 1, 4)}
    held = [p for _, p in stage1_prompts(2)]  # what the plan would otherwise pick first
    corpus, run = str(tmp_path / "corpus"), str(tmp_path / "run")
    kw = dict(draft_vocab=512, held_out=0.2, max_eval=4, exclude=held, model_name="smollm2-135m-instruct",
              progress=False, log=lambda *a: None)
    partial = feature_tune(smollm2, corpus, run, plan, tc, drafting, export=str(tmp_path / "early"), stop_after=1,
                           **kw)
    assert partial["steps"] == {"done": 1, "planned": partial["steps"]["planned"]} and partial["steps"]["planned"] > 1
    assert set(partial["held_out_agreement"]) >= {"all"} and len(partial["held_out_agreement"]["all"]) == 6
    with open(os.path.join(corpus, "provenance.json")) as f:
        made = json.load(f)
    assert set(made) == {"passages", "grounded-greedy", "grounded-sampled", "tasks-greedy", "tasks-sampled"}
    for part in ("tasks-greedy", "tasks-sampled"):  # the held-out prompts are in no shard
        text = "".join(smollm2.tokenizer.decode(ids) for ids in _shard_prompts(os.path.join(corpus, part)))
        assert not any(p in text for p in held)

    stamps = {p: os.path.getmtime(p) for p in _files(corpus) if not p.endswith("provenance.json")}
    done = feature_tune(smollm2, corpus, run, plan, tc, drafting, export=str(tmp_path / "final"), **kw)
    assert done["steps"] == {"done": done["steps"]["planned"], "planned": partial["steps"]["planned"]}
    # the history's last evaluation (the final step, the final weights) is the summary's on the same set
    last = done["history"][-1]
    assert last["step"] == done["steps"]["planned"] and done["history_set_agreement"]["sequences"] <= 4
    assert last["held_out"]["positions"] == done["history_set_agreement"]["positions"]
    np.testing.assert_allclose(last["held_out"]["all"], done["history_set_agreement"]["all"],
                               atol=1.0 / last["held_out"]["positions"])
    assert {p: os.path.getmtime(p) for p in stamps} == stamps  # shards and features reused, not redone
    with open(os.path.join(corpus, "provenance.json")) as f:
        again = json.load(f)
    for part, entry in made.items():  # generation time accumulates over runs; a resumed part adds little
        assert entry["seconds"] <= again[part]["seconds"] < entry["seconds"] + 5
    with open(os.path.join(tmp_path / "final", "feature_drafter.json")) as f:
        assert json.load(f)["trained"]["steps"] == done["steps"]

    # a time budget spent before training starts (the corpus and features count): no step, still exported
    spent = feature_tune(smollm2, corpus, str(tmp_path / "run-spent"), plan, tc, drafting, time_budget=1e-9,
                         export=str(tmp_path / "spent"), **kw)
    assert spent["steps"]["done"] == 0 and os.path.isdir(tmp_path / "spent" / "params")

    # an EAGLE-3-style fusion continued from the finished final-feature drafter: its LLM features (layer
    # 15's raw input beside g) kept apart from the final-only ones, and it starts as exactly that drafter
    from specjax.models.feature import with_fusion

    last = smollm2.config.num_layers
    with pytest.raises(InputError, match=f"must include {last}, the final feature"):
        feature_tune(smollm2, corpus, str(tmp_path / "run-no"), plan, tc, drafting, stop_after=0,
                     init_from=str(tmp_path / "final"), fused=(15,), **kw)
    assert not os.path.exists(tmp_path / "run-no")  # refused before any work
    fused = feature_tune(smollm2, corpus, str(tmp_path / "run-fused"), plan, tc, drafting, stop_after=0,
                         init_from=str(tmp_path / "final"), fused=(15, last), export=str(tmp_path / "fused"), **kw)
    assert {p: os.path.getmtime(p) for p in stamps} == stamps  # the final-only features untouched
    assert len(glob.glob(os.path.join(corpus, "features-l15", "*", "features-*.npz"))) == \
        len(glob.glob(os.path.join(corpus, "features", "*", "features-*.npz")))
    assert fused["fused"] == [15, last] and fused["steps"]["done"] == 0
    _, start, _ = restore_feature_drafter(str(tmp_path / "final"))
    fused_cfg, after, _ = restore_feature_drafter(str(tmp_path / "fused"))
    assert fused_cfg.fused == (15, last)
    chex.assert_trees_all_equal(after, with_fusion(start, fused_cfg))
    # the same drafts on the same held-out split (its g from the layers' own teacher pass: float16 ulps apart)
    np.testing.assert_allclose(fused["held_out_agreement"]["all"], done["held_out_agreement"]["all"], atol=0.02)

    # a deeper drafter continued from the finished one: it starts as exactly that drafter (its added layer
    # passes its input on), trains, and a drafter is never made shallower
    from specjax.models.feature import deepen

    deeper = feature_tune(smollm2, corpus, str(tmp_path / "run-deep"), plan, tc, drafting, stop_after=0,
                          init_from=str(tmp_path / "final"), drafter_layers=2, export=str(tmp_path / "deep"), **kw)
    final_cfg, start, _ = restore_feature_drafter(str(tmp_path / "final"))
    deep_cfg, deep_start, _ = restore_feature_drafter(str(tmp_path / "deep"))
    assert deep_cfg.layers == 2 and deeper["steps"]["done"] == 0
    chex.assert_trees_all_equal(deep_start, deepen(start, final_cfg, deep_cfg))
    assert deeper["held_out_agreement"] == done["held_out_agreement"]  # the same drafts, bit for bit
    stepped = feature_tune(smollm2, corpus, str(tmp_path / "run-deep"), plan, tc, drafting, stop_after=2,
                           init_from=str(tmp_path / "final"), drafter_layers=2, export=str(tmp_path / "deep-1"), **kw)
    assert stepped["steps"]["done"] == 2  # (the warmup's first step has learning rate 0)
    _, deep_after, _ = restore_feature_drafter(str(tmp_path / "deep-1"))
    assert np.any(np.asarray(deep_after["layers"]["wo"][1]))  # the added layer trains
    with pytest.raises(InputError, match="can only be deepened"):
        feature_tune(smollm2, corpus, str(tmp_path / "run-shallow"), plan, tc, drafting, stop_after=0,
                     init_from=str(tmp_path / "deep"), drafter_layers=1, **kw)
    assert not os.path.exists(tmp_path / "run-shallow")  # refused before any work

    # scripts/gpu_feature_check.py (the GPU run's rehearsal and step timer) on the fused drafter, deepened:
    # it computes the raw layer the fusion reads beside g, trains, evaluates and exports
    check = load_script("gpu_feature_check")
    check.main(["--model", "smollm2-135m-instruct", "--corpus", corpus, "--parts", "tasks-greedy", "--init-from",
                str(tmp_path / "fused"), "--layers", "2", "--batch-size", "2", "--steps", "1",
                "--out", str(tmp_path / "check"), "--json-out", str(tmp_path / "check.json")])
    with open(tmp_path / "check.json") as f:
        report = json.load(f)
    assert report["drafter_layers"] == 2 and report["step_s"] > 0 and len(report["agreement"]) == 6
    # it timed batches of the width nearly all of the run's reach (str: JSON's keys), on sequences of that width
    assert str(report["width"]) in report["run_widths"] and report["sequences"] >= 2 and report["shards"]
    # its --out reused with another drafter of the same shape: refused, not resumed from the first one's weights
    from specjax.io.feature_checkpoint import save_feature_drafter

    fused_cfg, fused_trained, fused_drafting = restore_feature_drafter(str(tmp_path / "fused"))
    save_feature_drafter(str(tmp_path / "fused-moved"), fused_cfg, {**fused_trained, "fc": fused_trained["fc"] * 0.5},
                         fused_drafting)
    with pytest.raises(InputError, match="holds a run with another recipe"):
        check.main(["--model", "smollm2-135m-instruct", "--corpus", corpus, "--parts", "tasks-greedy", "--init-from",
                    str(tmp_path / "fused-moved"), "--layers", "2", "--batch-size", "2", "--steps", "1",
                    "--out", str(tmp_path / "check")])

    bound = from_arg(str(tmp_path / "final"), smollm2, load=True, expansion=None, draft="topk")
    prompts = specjax.api.encode_prompts(smollm2, ["Name three rivers in Europe.", "Write a haiku about rain."])
    ref = specjax.generate(smollm2, prompts, max_new_tokens=12, mode="incremental")
    got = specjax.generate(smollm2, prompts, max_new_tokens=12, drafters=[bound])
    assert got.token_ids == ref.token_ids

    # the corpus grown by self-written requests, the drafter continued from the finished one
    grown = dataclasses.replace(plan, requests=24, request_tokens=40)
    hand_written = ["What should I pack for a weekend hike?", "Explain how a bicycle gear works."]
    excluded = []

    def build(*args, exclude=(), **kwargs):
        excluded.append(list(exclude))
        return build_feature_corpus(*args, exclude=exclude, **kwargs)

    monkeypatch.setattr(tune, "build_feature_corpus", build)
    more = feature_tune(smollm2, corpus, str(tmp_path / "run-more"), grown, tc, drafting,
                        export=str(tmp_path / "continued"), stop_after=0, init_from=str(tmp_path / "final"),
                        eval_prompts=hand_written, **kw)
    assert {p: os.path.getmtime(p) for p in stamps} == stamps  # the template parts are not redone
    assert set(hand_written) <= set(excluded[-1]) and set(held) <= set(excluded[-1])  # evaluation is not training
    with open(os.path.join(corpus, "provenance.json")) as f:
        assert {"requests-written", "requests"} <= set(json.load(f))
    asked = [smollm2.tokenizer.decode(ids) for ids in _shard_prompts(os.path.join(corpus, "requests-written"))]
    answered = [smollm2.tokenizer.decode(ids) for ids in _shard_prompts(os.path.join(corpus, "requests"))]
    assert len(asked) == 24 and 0 < len(answered) <= 24 and not any("Reply with the request only" in a
                                                                     for a in answered)
    assert more["sequences"]["train"] + more["sequences"]["held_out"] == \
        done["sequences"]["train"] + done["sequences"]["held_out"] + len(answered)  # the written part is not data
    assert more["init_from"] == str(tmp_path / "final") and more["steps"]["done"] == 0
    on_prompts = more["eval_prompts_agreement"]  # a second held-out set: the hand-written prompts' continuations
    assert on_prompts["prompts"] == 2 and len(on_prompts["all"]) == 6 and 0 < on_prompts["positions"] <= 12
    assert done["eval_prompts_agreement"] is None
    # the template parts' split is the one the continued drafter was trained under (the split of the
    # parts before requests): none of its training sequences are held out now
    parts = {name: (sorted(glob.glob(os.path.join(corpus, name, "shard-*.npz"))),
                    sorted(glob.glob(os.path.join(corpus, "features", name, "features-*.npz"))))
             for name in ("passages", "grounded-greedy", "grounded-sampled", "tasks-greedy", "tasks-sampled",
                          "requests")}
    base = {k: v for k, v in parts.items() if k != "requests"}
    before, after_split = split_corpus(base, 0.2, 0)[:2], split_corpus(parts, 0.2, 0)[:2]
    for old, new in zip(split_held_out(load_feature_set(base), 0.2, 0), before):
        assert (old.tokens == new.tokens).all() and (old.offsets == new.offsets).all()
    for old, new in zip(before, after_split):
        n = len(old)
        assert (new.tokens[:old.offsets[-1]] == old.tokens).all() and (new.offsets[:n + 1] == old.offsets).all()
        assert set(np.asarray(new.part_names)[new.parts[n:]]) <= {"requests"}
    assert sum(len(s) for s in after_split) == sum(len(s) for s in before) + len(answered)
    _, start, _ = restore_feature_drafter(str(tmp_path / "final"))
    cfg, after, _ = restore_feature_drafter(str(tmp_path / "continued"))
    assert cfg.draft_vocab == bound.drafter.config.draft_vocab  # the vocabulary it was trained with, kept
    chex.assert_trees_all_equal(after, start)  # no step taken: it starts from the finished drafter's weights

    # run again as it was: nothing is generated or recomputed (requests, their answers, the evaluation set)
    stamps = {p: os.path.getmtime(p) for p in _files(corpus) if not p.endswith("provenance.json")}
    feature_tune(smollm2, corpus, str(tmp_path / "run-more"), grown, tc, drafting, stop_after=0,
                 init_from=str(tmp_path / "final"), eval_prompts=hand_written, **kw)
    assert {p: os.path.getmtime(p) for p in stamps} == stamps
    # the same run directory continued from other weights (same vocabulary and split): refused, not resumed
    with pytest.raises(InputError, match="another recipe"):
        feature_tune(smollm2, corpus, str(tmp_path / "run-more"), grown, tc, drafting, stop_after=0,
                     init_from=str(tmp_path / "early"), eval_prompts=hand_written, **kw)
    # another split of the same corpus could hold out what the drafter was trained on: refused
    with pytest.raises(InputError, match="its held-out sequences may be in this run's training set"):
        feature_tune(smollm2, corpus, str(tmp_path / "run-other"), grown, tc, drafting, stop_after=0,
                     init_from=str(tmp_path / "final"), **{**kw, "held_out": 0.4})

    # a second round of requests grows the corpus in a part of its own: new requests (other meta prompts
    # and seeds, none already answered), the earlier parts untouched and their split kept, so the drafter
    # trained on them continues
    grown_b = dataclasses.replace(grown, more_requests=8)
    more_b = feature_tune(smollm2, corpus, str(tmp_path / "run-more-b"), grown_b, tc, drafting, stop_after=0,
                          init_from=str(tmp_path / "continued"), eval_prompts=hand_written, **kw)
    assert {p: os.path.getmtime(p) for p in stamps} == stamps
    with open(os.path.join(corpus, "provenance.json")) as f:
        assert {"requests-b-written", "requests-b"} <= set(json.load(f))
    asked_b = [smollm2.tokenizer.decode(ids) for ids in _shard_prompts(os.path.join(corpus, "requests-b-written"))]
    answered_b = [smollm2.tokenizer.decode(ids) for ids in _shard_prompts(os.path.join(corpus, "requests-b"))]
    assert len(asked_b) == 8 and not set(asked_b) <= set(asked) and 0 < len(answered_b) <= 8
    assert not set(answered_b) & set(answered)
    assert more_b["sequences"]["train"] + more_b["sequences"]["held_out"] == \
        more["sequences"]["train"] + more["sequences"]["held_out"] + len(answered_b)

    # prompts written for training grow it in parts of their own: duplicates and held-out prompts are
    # dropped, the earlier parts are untouched, the drafter trained without them continues, and one trained
    # with them is not continued on a corpus without them
    written_file = tmp_path / "written.jsonl"
    fresh = ["Summarise in one sentence: the bakery on Elm Street now opens at six.",
             "Translate into French: thank you."]
    lines = [*fresh, held[0], hand_written[0], fresh[0]]  # a held-out, an evaluation and a repeated prompt
    written_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in lines))
    grown_w = dataclasses.replace(grown_b, written=(str(written_file),))
    more_w = feature_tune(smollm2, corpus, str(tmp_path / "run-more-w"), grown_w, tc, drafting, stop_after=0,
                          init_from=str(tmp_path / "continued"), eval_prompts=hand_written,
                          export=str(tmp_path / "with-written"), **kw)
    assert {p: os.path.getmtime(p) for p in stamps} == stamps
    with open(os.path.join(corpus, "provenance.json")) as f:
        made_w = json.load(f)
    assert {"written-greedy", "written-sampled"} <= set(made_w)
    assert "written.jsonl" in made_w["written-greedy"]["source"]
    continued_w = sorted(smollm2.tokenizer.decode(ids) for part in ("written-greedy", "written-sampled")
                         for ids in _shard_prompts(os.path.join(corpus, part)))
    assert continued_w == sorted(smollm2.tokenizer.decode(ids) for ids in specjax.api.encode_prompts(smollm2, fresh))
    assert more_w["sequences"]["train"] + more_w["sequences"]["held_out"] == \
        more_b["sequences"]["train"] + more_b["sequences"]["held_out"] + len(fresh)
    with pytest.raises(InputError, match="trained with a requests or written part this corpus plan does not have"):
        feature_tune(smollm2, corpus, str(tmp_path / "run-w-gone"), grown_b, tc, drafting, stop_after=0,
                     init_from=str(tmp_path / "with-written"), eval_prompts=hand_written, **kw)

    # one group trained alone (--train-groups): the LLM's features are computed for its parts only, the other
    # groups are counted from their shards, so the split and the check of the drafter it continues are the
    # whole corpus's; a drafter so trained is continued on every group again
    computed = []  # where LLM features were asked for
    real_features = tune.BatchShapes.features

    def features(self, llm, paths, out_dir, *args, **kwargs):
        computed.append(os.path.relpath(out_dir, corpus))
        return real_features(self, llm, paths, out_dir, *args, **kwargs)

    monkeypatch.setattr(tune.BatchShapes, "features", features)
    with pytest.raises(InputError, match="'written-b' is not a split group of this corpus plan"):
        feature_tune(smollm2, corpus, str(tmp_path / "run-no-group"), grown_w, tc, drafting, stop_after=0,
                     init_from=str(tmp_path / "with-written"), train_groups=("written-b",), **kw)
    assert not computed and not os.path.exists(tmp_path / "run-no-group")  # refused before any work
    alone = feature_tune(smollm2, corpus, str(tmp_path / "run-alone"), grown_w, tc, drafting, stop_after=0,
                         init_from=str(tmp_path / "with-written"), eval_prompts=hand_written,
                         train_groups=("requests",), export=str(tmp_path / "alone"), **kw)
    assert sorted(d for d in computed if not d.startswith("eval-")) == ["features/requests"]
    kept, out = held_out_indices(len(answered), 0.2, 0)
    assert alone["train_groups"] == ["requests"] and alone["sequences"] == {"train": len(kept), "held_out": len(out)}
    assert set(alone["held_out_agreement"]) - {"all", "positions"} <= {"requests"}
    names = [*parts, "requests-b", "written-greedy", "written-sampled"]
    every = {name: (sorted(glob.glob(os.path.join(corpus, name, "shard-*.npz"))),
                    sorted(glob.glob(os.path.join(corpus, "features", name, "features-*.npz")))) for name in names}
    whole = split_corpus(every, 0.2, 0)
    featureless = {name: (shards, found if name == "requests" else []) for name, (shards, found) in every.items()}
    part = split_corpus(featureless, 0.2, 0, ("requests",))
    assert part[2] == whole[2] and list(part[2]) == ["templates", "requests", "requests-b", "written"]
    for mine, all_of_them, side in zip(part[:2], whole[:2], ("train", "held_out")):
        first = whole[2]["templates"][side]  # the requests group follows the template parts in the whole split
        rows = slice(all_of_them.offsets[first], all_of_them.offsets[first + len(mine)])
        assert len(mine) == whole[2]["requests"][side] and (all_of_them.tokens[rows] == mine.tokens).all()
    again = feature_tune(smollm2, corpus, str(tmp_path / "run-after-alone"), grown_w, tc, drafting, stop_after=0,
                         init_from=str(tmp_path / "alone"), eval_prompts=hand_written, **kw)
    assert again["train_groups"] is None and again["sequences"] == more_w["sequences"]

    # scripts/feature_fit_gap.py: the finished drafter on its own split of the template parts (found again
    # from its metadata, as --init-from checks it), its held-out sequences and a sample of its training ones
    held_file = tmp_path / "held.jsonl"
    held_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in held))
    fit_gap = load_script("feature_fit_gap")
    argv = ["--drafter", str(tmp_path / "final"), "--corpus", corpus, "--exclude-prompts", str(held_file),
            "--groups", "templates", "--held-out", "0.2", "--train-sample", "3", "--depths", "2"]
    fit_gap.main(argv + ["--out", str(tmp_path / "gap.json")])
    with open(tmp_path / "gap.json") as f:
        gap = json.load(f)
    assert gap["held_out"]["sequences"] == done["sequences"]["held_out"] and gap["train_sample"]["sequences"] == 3
    assert len(gap["gap"]) == 2 and gap["held_out"]["positions"] == done["held_out_agreement"]["positions"]
    with pytest.raises(InputError, match="its held-out sequences may be in this run's training set"):
        fit_gap.main([*argv[:-6], "--held-out", "0.4", *argv[-4:]])  # another split: refused
    with pytest.raises(SystemExit, match="last run trained on requests only"):  # not its training sequences
        fit_gap.main(["--drafter", str(tmp_path / "alone"), *argv[2:]])


def _files(root):
    return sorted(os.path.join(d, f) for d, _, files in os.walk(root) for f in files)


def _shard_prompts(part_dir):
    from specjax.boost.corpus import read_shard

    for path in sorted(p for p in _files(part_dir) if p.endswith(".npz")):
        for ids, prompt_len in read_shard(path):
            yield ids[:prompt_len]


@requires_smollm2
def test_an_export_drafts_as_the_shipped_drafter_or_its_init_from_unless_told(monkeypatch):
    """feature-tune's --depth defaulted to 6 while the shipped drafter drafts at depth 4 (as every recipe on its
    card passes by hand): the README's command exported another drafting than the shipped one's, and
    continuing a drafter changed how it drafts. Now: each flag given, else --init-from's, else the shipped one's."""
    from specjax.cli.feature import SHIPPED_DRAFTING, resolve_drafting

    with open(os.path.join(os.path.dirname(__file__), os.pardir, "models", "smollm2-feature",
                           "feature_drafter.json")) as f:
        shipped = json.load(f)["drafting"]
    assert {k: shipped[k] for k in SHIPPED_DRAFTING} == SHIPPED_DRAFTING
    llm = specjax.describe_model("smollm2-135m-instruct")
    unset = dict.fromkeys(SHIPPED_DRAFTING)
    assert resolve_drafting(llm, None, unset) == {**SHIPPED_DRAFTING, "ladder": tuple(shipped["ladder"])}
    assert resolve_drafting(llm, None, {**unset, "depth": 6, "nodes": 8}) == {
        "depth": 6, "beam": 4, "nodes": 8, "ladder": (0, 1, 3, 6, 8)}
    # an --init-from drafter that drafts otherwise: the shipped one, read with other drafting settings
    import specjax.speculation.drafters.feature as feature_module

    other = dict(depth=3, beam=2, nodes=6)
    read = feature_module.load_feature_drafter
    monkeypatch.setattr(feature_module, "load_feature_drafter",
                        lambda name, llm, load=True: read(name, llm, load=load, **other, ladder=(0, 1, 3, 6)))
    assert resolve_drafting(llm, "smollm2-feature", unset) == {**other, "ladder": (0, 1, 3, 6)}
    assert resolve_drafting(llm, "smollm2-feature", {**unset, "beam": 4})["beam"] == 4


@requires_smollm2
@pytest.mark.slow
def test_the_shipped_drafter_loads_by_name_drafts_accepted_tokens_and_is_lossless(smollm2):
    from specjax.io import registry
    from specjax.io.feature_checkpoint import read_feature_meta
    from specjax.speculation.drafters.feature import from_arg

    path = registry.resolve(registry.default_feature_drafter(smollm2.config))
    _, drafting, meta = read_feature_meta(path)
    assert meta["trained"]["steps"]["done"] == meta["trained"]["steps"]["planned"]  # a finished run ships
    bound = from_arg("auto", smollm2, load=True, expansion=None, draft="topk")
    assert bound.drafter.nodes == drafting["nodes"]
    prompts = specjax.api.encode_prompts(smollm2, ["Summarise in one sentence: The river flooded the town after "
                                                   "three days of rain, and the school closed for a week.",
                                                   "Write a Python function that reverses a string."])
    ref = specjax.generate(smollm2, prompts, max_new_tokens=24, mode="incremental")
    got = specjax.generate(smollm2, prompts, max_new_tokens=24, drafters=[bound])
    assert got.token_ids == ref.token_ids
    assert got.stats["llm_passes"] < ref.stats["llm_passes"]  # its drafts are accepted: fewer LLM passes
    seeded = specjax.SamplingParams(temperature=1.0, seed=5)
    assert specjax.generate(smollm2, prompts, max_new_tokens=16, sampling=seeded, drafters=[bound],
                            verifier="seeded").token_ids == \
        specjax.generate(smollm2, prompts, max_new_tokens=16, sampling=seeded, mode="incremental").token_ids


def _extract_committed_corpus(name: str, into) -> None:
    """scripts/data/feature_corpus_{name}.tar.xz into ``into`` (its parts land in into/feature-corpus)."""
    import tarfile

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tarfile.open(os.path.join(root, "scripts", "data", f"feature_corpus_{name}.tar.xz")) as tar:
        tar.extractall(into, filter="data")


def _whole_parts_tokens(out, parts, vocab_size: int) -> int:
    """Every part under ``out`` has the shards and sequences its manifest promises (continuations within
    max_new_tokens, ids within the vocabulary); returns their tokens."""
    from specjax.boost.corpus import read_shard

    total = 0
    for part in parts:
        manifest = json.load(open(out / part / "manifest.json"))
        assert manifest["part"] == part, part
        shards = sorted((out / part).glob("shard-*.npz"))
        assert len(shards) == -(-manifest["num_prompts"] // manifest["batch_size"]), part
        seqs = [s for path in shards for s in read_shard(str(path))]
        assert len(seqs) == manifest["num_prompts"], part
        for ids, prompt_len in seqs:
            assert 0 < len(ids) - prompt_len <= manifest["max_new_tokens"] and prompt_len > 0, part
            assert 0 <= min(ids) and max(ids) < vocab_size, part
        total += sum(len(ids) for ids, _ in seqs)
    return total


@requires_smollm2
@pytest.mark.parametrize("name, rounds", [("v4_requests_b", ["requests-b"]), ("v5_written", ["written", "written-b"]),
                                          ("v6_written_c", ["written-c"]), ("v7_written_d", ["written-d"]),
                                          ("v8_written_e", ["written-e"]), ("v9_written_f", ["written-f"]),
                                          ("v10_written_g", ["written-g"])])
def test_the_committed_corpus_growths_are_whole_and_named_by_their_rounds(smollm2, tmp_path, name, rounds):
    """The later committed corpus parts (scripts/data/feature_corpus_v4..v10): each tarball holds exactly its
    rounds' parts, whole, made with their round's seed, and the combined provenance.json records every part."""
    from specjax.boost.feature_corpus import REQUEST_ROUNDS, WRITTEN_ROUNDS

    _extract_committed_corpus(name, tmp_path)
    out = tmp_path / "feature-corpus"
    seed_of = {}  # each part of these rounds -> its round's seed offset
    for r in rounds:
        w = WRITTEN_ROUNDS.get(r)
        names = (w.greedy, w.sampled) if w else (REQUEST_ROUNDS[r].written, REQUEST_ROUNDS[r].answers)
        seed_of.update(dict.fromkeys(names, (w or REQUEST_ROUNDS[r]).seed_offset))
    parts = list(seed_of)
    assert sorted(os.listdir(out)) == sorted(parts + ["provenance.json"])
    assert _whole_parts_tokens(out, parts, smollm2.config.vocab_size) > 100_000 * len(rounds)
    assert set(parts) <= set(json.load(open(out / "provenance.json")))
    for part, offset in seed_of.items():  # the plan's seed 0 plus the round's offset: its sampling seeds and split
        assert json.load(open(out / part / "manifest.json"))["seed"] == offset, part


@requires_smollm2
def test_the_committed_corpus_v2_is_whole_and_the_readme_command_resumes_it(smollm2, tmp_path, monkeypatch):
    """scripts/data/feature_corpus_v2.tar.xz: every part has the shards and sequences its manifest
    promises (continuations within max_new_tokens, ids within the vocabulary), and the corpus stage of
    the README's command (--tasks 6400, the three held-out prompt files) finds all of it: nothing is
    generated; the same for v3's command with the requests parts extracted on top."""
    import specjax.boost.corpus as corpus
    from specjax.boost.corpus import read_shard
    from specjax.boost.feature_corpus import PARTS, build_feature_corpus
    from specjax.io.prompts import read_prompts_file

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _extract_committed_corpus("v2", tmp_path)
    out = tmp_path / "feature-corpus"
    assert _whole_parts_tokens(out, PARTS, smollm2.config.vocab_size) > 1_500_000

    def no_generation(*args, **kwargs):
        raise AssertionError("the committed corpus should be complete: nothing to generate")

    monkeypatch.setattr(corpus, "generate", no_generation)
    held = [p for path in ("../shared/data/dev_prompts.jsonl", "scripts/data/task_kinds.jsonl",
                           "scripts/data/other_tasks.jsonl") if os.path.exists(os.path.join(root, path))
            for p in read_prompts_file(os.path.join(root, path), flag="--exclude-prompts", allow_token_ids=False,
                                       plain_lines=True)]
    shards = build_feature_corpus(smollm2, str(out), CorpusPlan(tasks=6400), exclude=held, progress=False,
                                  log=lambda *_: None)
    assert sum(len(v) for v in shards.values()) == 81

    # v3's requests parts (scripts/data/feature_corpus_v3_requests.tar.xz) on top: the README's v3 command
    # (--requests 4000) finds them whole, the kept requests the same as its manifest names (sha256)
    _extract_committed_corpus("v3_requests", tmp_path)
    shards = build_feature_corpus(smollm2, str(out), CorpusPlan(tasks=6400, requests=4000), exclude=held,
                                  progress=False, log=lambda *_: None)
    assert sum(len(v) for v in shards.values()) == 81 + 22 and "requests-written" not in shards
    answered = [s for path in shards["requests"] for s in read_shard(path)]
    assert len(answered) == json.load(open(out / "requests" / "manifest.json"))["num_prompts"] > 2000
