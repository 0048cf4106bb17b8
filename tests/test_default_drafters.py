"""The default drafters of `specjax generate` and `specjax serve` for SmolLM2: the shipped feature drafter
(models/smollm2-feature) merged with the lookup drafter under the tree budget; where models/ lacks its
files the shipped corpus, then the lookup drafter alone (``registry.default_drafters``). Speculating
with them is lossless: the command's tokens are incremental decoding's when greedy, and seeded
incremental sampling's when sampling, for a batch of dev prompts."""

from __future__ import annotations

import json

import pytest

import specjax
from specjax.io import registry
from tests.conftest import dev_prompts, requires_smollm2

pytestmark = requires_smollm2


def test_the_default_falls_back_from_the_feature_drafter_to_the_corpus_to_lookup(smollm2, tmp_path, monkeypatch):
    assert registry.default_drafters(smollm2.config) == ("feature:auto", "lookup:auto")
    monkeypatch.setitem(registry._FEATURE_DRAFTERS, "smollm2-feature", ("no-such-drafter", "smollm2-135m-instruct"))
    assert registry.default_drafters(smollm2.config) == ("corpus:auto",)  # its feature_drafter.json is missing
    monkeypatch.undo()
    monkeypatch.setattr(registry, "MODELS_DIR", str(tmp_path))  # a plain install: no models/ at all
    assert registry.default_drafters(smollm2.config) == ("lookup:auto",)
    assert registry.describe_default_drafters() == (
        "feature:auto,lookup:auto for smollm2-135m-instruct; where those files are missing, corpus:auto for "
        "smollm2-135m-instruct; otherwise lookup:auto")


def _run(capsys, prompts_file: str, *flags: str) -> list[dict]:
    from specjax.cli import main

    assert main(["generate", "--prompts-file", prompts_file, "--batch-size", "3", "--max-new-tokens", "32",
                 "--json", *flags]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


@pytest.fixture(scope="module")
def three_prompts(tmp_path_factory) -> tuple[str, list[str]]:
    prompts = dev_prompts()[:3]
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return str(path), prompts


def test_default_generate_command_and_api_draft_with_the_feature_drafter_and_equal_incremental(smollm2, capsys,
                                                                                               three_prompts):
    """No --drafter: the records' speculation names feature:auto + lookup:auto; batched greedy tokens are exactly
    incremental decoding's, and drafts were accepted. ``specjax.generate`` with no drafter drafts the same way."""
    path, prompts = three_prompts
    records = _run(capsys, path)
    assert all(r["speculation"].startswith("tree, feature:auto, lookup:auto: feature(depth 4, beam 4, nodes 16); "
                                           "lookup(") for r in records), records[0]["speculation"]
    want = specjax.generate(smollm2, prompts, max_new_tokens=32, mode="incremental").token_ids
    assert [r["token_ids"] for r in records] == want
    assert sum(r["llm_passes"] for r in records) < sum(len(w) for w in want), "no drafted token was accepted"
    api = specjax.generate(smollm2, prompts, max_new_tokens=32)
    assert ": " + "; ".join(api.stats["drafters"]) in records[0]["speculation"], api.stats["drafters"]
    assert "budget" in api.stats and api.token_ids == want
    assert sum(r["llm_passes"] for r in api.stats["requests"]) < sum(len(w) for w in want), "nothing accepted"


def test_default_generate_command_samples_what_seeded_incremental_sampling_does(smollm2, capsys, three_prompts):
    """At temperature 1 (the seeded verifier, coupled drafts) the default's tokens equal `--mode
    incremental` with the same seed, request by request."""
    path, _ = three_prompts
    sampling = ("--temperature", "1", "--seed", "11")
    speculative = _run(capsys, path, *sampling)
    assert speculative[0]["speculation"].startswith("tree, feature:auto, lookup:auto")
    incremental = _run(capsys, path, *sampling, "--mode", "incremental")
    assert incremental[0]["speculation"] == "incremental"
    assert [r["token_ids"] for r in speculative] == [r["token_ids"] for r in incremental]
    assert len({tuple(r["token_ids"]) for r in speculative}) == 3  # three different prompts, three texts
