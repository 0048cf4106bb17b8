"""Training runs' and corpora's small files: a run directory of other settings is refused naming what differs
(feature-tune: before the corpus is made), and a damaged recipe, history or checkpoint is named with what to
do, not a JSONDecodeError or orbax's "Must provide args of type Composite"."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import pytest

from specjax.boost.distill import RunDir
from specjax.boost.runfiles import differences
from specjax.errors import CheckpointError, InputError


def _run(tmp_path):
    import optax

    params = {"w": jnp.arange(3.0)}
    opt_state = optax.adam(1e-3).init(params)
    run = RunDir(str(tmp_path / "run"), {"train": {"lr": 1, "epochs": 2}})
    run.save(10, params, opt_state, [{"step": 0}, {"step": 10}])
    return params, opt_state


def test_differences_name_each_changed_setting():
    assert differences({"train": {"lr": 1, "seed": 0}, "x": "a"}, {"train": {"lr": 2, "seed": 0}, "y": 3}) == [
        "train.lr 1 -> 2", "x 'a' -> '(unset)'", "y '(unset)' -> 3"]


def test_a_run_of_other_settings_is_refused_naming_them(tmp_path):
    _run(tmp_path)
    with pytest.raises(InputError, match=r"holds a run with another recipe \(train.lr 1 -> 5\); use a fresh "):
        RunDir(str(tmp_path / "run"), {"train": {"lr": 5, "epochs": 2}})


def test_a_damaged_checkpoint_recipe_or_history_is_named_with_what_to_do(tmp_path):
    params, opt_state = _run(tmp_path)
    steps = tmp_path / "run" / "steps"
    os.makedirs(steps / "20")  # a newer step that holds nothing (an interrupted save, a copy gone wrong)
    with pytest.raises(CheckpointError, match=rf"{steps}/20: the newest checkpoint cannot be restored .*remove "
                                              rf"{steps}/20 to resume from the one before it \(\[10\]\)"):
        RunDir(str(tmp_path / "run"), {"train": {"lr": 1, "epochs": 2}}).resume(params, opt_state)
    os.rmdir(steps / "20")
    step, _, _, history = RunDir(str(tmp_path / "run"), {"train": {"lr": 1, "epochs": 2}}).resume(params, opt_state)
    assert step == 10 and history == [{"step": 0}, {"step": 10}]
    (tmp_path / "run" / "history.json").write_text("[{")
    with pytest.raises(InputError, match=r"history.json: cannot be read \(JSONDecodeError: .*\); remove it"):
        RunDir(str(tmp_path / "run"), {"train": {"lr": 1, "epochs": 2}}).resume(params, opt_state)
    (tmp_path / "run" / "recipe.json").write_text("{")
    with pytest.raises(InputError, match=r"recipe.json: cannot be read \(JSONDecodeError: .*\); remove the run "):
        RunDir(str(tmp_path / "run"), {"train": {"lr": 1, "epochs": 2}})


def test_feature_tune_refuses_an_out_of_other_training_settings_before_the_corpus(tiny_llama_dir, tmp_path):
    """It was refused only after the corpus and its features were made (hours at full size)."""
    import dataclasses

    from specjax.cli import build_parser
    from specjax.cli.feature import check_args

    def parse(*flags):
        return build_parser().parse_args(["feature-tune", "--model", tiny_llama_dir, "--corpus", str(tmp_path / "c"),
                                          "--out", str(tmp_path / "o"), "--draft-vocab", "64", *flags])

    tc = check_args(parse("--learning-rate", "5e-4"))[1]
    os.makedirs(tmp_path / "o")
    (tmp_path / "o" / "recipe.json").write_text(json.dumps({"train": dataclasses.asdict(tc), "sequences": 9}))
    check_args(parse("--learning-rate", "5e-4"))  # the same settings resume
    with pytest.raises(InputError, match=r"--out .*/o holds a run with other settings \(train.learning_rate 0.0005 -> "
                                         r"0.001\): use a fresh directory, or that run's settings"):
        check_args(parse("--learning-rate", "1e-3"))
    with pytest.raises(InputError, match=r"teacher_dots 'float32' -> 'bfloat16'"):
        check_args(parse("--learning-rate", "5e-4", "--teacher-dots", "bfloat16"))
    (tmp_path / "o" / "recipe.json").write_text("{")
    with pytest.raises(InputError, match=r"o/recipe.json: cannot be read"):
        check_args(parse())
