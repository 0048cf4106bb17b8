"""The feature-drafter recipe end to end on SmolLM2 at a tiny scale (``specjax feature-tune``'s stages):
the task prompts keep held-out prompts out, the corpus and training resume instead of redoing work,
a run stopped early exports what it has and says so, and the exported drafter speculates losslessly."""

from __future__ import annotations

import json
import os

import pytest

import specjax
from specjax.boost.feature_corpus import CorpusPlan
from specjax.boost.feature_train import FeatureTrainConfig
from specjax.boost.task_prompts import passage_prompts, stage1_prompts
from tests.conftest import requires_smollm2


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


@requires_smollm2
@pytest.mark.slow
def test_feature_tune_resumes_exports_and_the_drafter_is_lossless(smollm2, tmp_path):
    from specjax.boost.feature_tune import feature_tune
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
    assert {p: os.path.getmtime(p) for p in stamps} == stamps  # shards and features reused, not redone
    with open(os.path.join(corpus, "provenance.json")) as f:
        again = json.load(f)
    for part, entry in made.items():  # generation time accumulates over runs; a resumed part adds little
        assert entry["seconds"] <= again[part]["seconds"] < entry["seconds"] + 5
    with open(os.path.join(tmp_path / "final", "feature_drafter.json")) as f:
        assert json.load(f)["trained"]["steps"] == done["steps"]

    bound = from_arg(str(tmp_path / "final"), smollm2, load=True, expansion=None, draft="topk")
    prompts = specjax.api.encode_prompts(smollm2, ["Name three rivers in Europe.", "Write a haiku about rain."])
    ref = specjax.generate(smollm2, prompts, max_new_tokens=12)
    got = specjax.generate(smollm2, prompts, max_new_tokens=12, drafters=[bound])
    assert got.token_ids == ref.token_ids


def _files(root):
    return sorted(os.path.join(d, f) for d, _, files in os.walk(root) for f in files)


def _shard_prompts(part_dir):
    from specjax.boost.corpus import read_shard

    for path in sorted(p for p in _files(part_dir) if p.endswith(".npz")):
        for ids, prompt_len in read_shard(path):
            yield ids[:prompt_len]


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
    ref = specjax.generate(smollm2, prompts, max_new_tokens=24)
    got = specjax.generate(smollm2, prompts, max_new_tokens=24, drafters=[bound])
    assert got.token_ids == ref.token_ids
    assert got.stats["llm_passes"] < ref.stats["llm_passes"]  # its drafts are accepted: fewer LLM passes
    seeded = specjax.SamplingParams(temperature=1.0, seed=5)
    assert specjax.generate(smollm2, prompts, max_new_tokens=16, sampling=seeded, drafters=[bound],
                            verifier="seeded").token_ids == \
        specjax.generate(smollm2, prompts, max_new_tokens=16, sampling=seeded).token_ids


@requires_smollm2
def test_the_committed_corpus_v2_is_whole_and_the_readme_command_resumes_it(smollm2, tmp_path, monkeypatch):
    """scripts/data/feature_corpus_v2.tar.xz: every part has the shards and sequences its manifest
    promises (continuations within max_new_tokens, ids within the vocabulary), and the corpus stage of
    the README's command (--tasks 6400, the three held-out prompt files) finds all of it: nothing is
    generated."""
    import tarfile

    import specjax.boost.corpus as corpus
    from specjax.boost.corpus import read_shard
    from specjax.boost.feature_corpus import PARTS, build_feature_corpus
    from specjax.io.prompts import read_prompts_file

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tarfile.open(os.path.join(root, "scripts", "data", "feature_corpus_v2.tar.xz")) as tar:
        tar.extractall(tmp_path, filter="data")
    out = tmp_path / "feature-corpus"
    total = 0
    for part in PARTS:
        manifest = json.load(open(out / part / "manifest.json"))
        shards = sorted((out / part).glob("shard-*.npz"))
        assert len(shards) == -(-manifest["num_prompts"] // manifest["batch_size"]), part
        seqs = [s for path in shards for s in read_shard(str(path))]
        assert len(seqs) == manifest["num_prompts"], part
        for ids, prompt_len in seqs:
            assert 0 < len(ids) - prompt_len <= manifest["max_new_tokens"] and prompt_len > 0, part
            assert 0 <= min(ids) and max(ids) < smollm2.config.vocab_size, part
        total += sum(len(ids) for ids, _ in seqs)
    assert total > 1_500_000

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
