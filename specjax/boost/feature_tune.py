"""The whole feature-drafter recipe, each stage resumable (``specjax feature-tune`` runs it): corpus ->
LLM features -> draft vocabulary -> unrolled training -> held-out agreement by depth -> export."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time

import jax
import numpy as np

from specjax.boost.distill import batches_per_epoch
from specjax.boost.feature_corpus import CorpusPlan, build_feature_corpus
from specjax.boost.feature_data import draft_vocabulary, feature_shards, load_feature_set, split_held_out
from specjax.boost.feature_train import FeatureTrainConfig, depth_agreement, split_params, train_feature
from specjax.models.feature import FeatureConfig, bind, init_trained
from specjax.types import Model

EVAL_DEPTHS = 6


def feature_tune(llm: Model, corpus_dir: str, run_dir: str, plan: CorpusPlan, tc: FeatureTrainConfig, drafting: dict,
                 *, draft_vocab: int, held_out: float, max_eval: int, exclude=(), export: str | None = None,
                 model_name: str = "", stop_after: int | None = None, progress: bool = True, log=print) -> dict:
    """Run (or resume) every stage; returns the summary also written to ``run_dir/summary.json``.
    ``stop_after``: train at most this many steps in this run, then evaluate and export what there is
    (the summary says how many of the planned steps are done; running again resumes the training)."""
    timing = {}
    started = time.perf_counter()
    shards = build_feature_corpus(llm, corpus_dir, plan, exclude=exclude, progress=progress, log=log)
    timing["corpus_s"] = time.perf_counter() - started
    started = time.perf_counter()
    parts = {name: (paths, feature_shards(llm, paths, os.path.join(corpus_dir, "features", name), progress=progress,
                                          log=log))
             for name, paths in shards.items()}
    timing["features_s"] = time.perf_counter() - started
    data = load_feature_set(parts)
    train, held = split_held_out(data, held_out, seed=tc.seed)
    vocab, coverage = draft_vocabulary(train, draft_vocab, llm.config.vocab_size)
    cfg = FeatureConfig(llm.config, vocab)
    params = bind(init_trained(llm.params, cfg, jax.random.key(tc.seed)), llm.params, cfg)
    evaluation = held.subset(np.arange(min(max_eval, len(held))))
    started = time.perf_counter()
    params, history = train_feature(params, train, cfg, tc, run_dir, held_out=evaluation, eval_steps=EVAL_DEPTHS,
                                    progress=progress, log=log, stop_after=stop_after)
    timing["train_s_this_run"] = time.perf_counter() - started
    final = depth_agreement(params, held, cfg, steps=EVAL_DEPTHS, window=tc.window, batch_size=tc.batch_size)
    summary = {"model": model_name, "corpus": os.path.abspath(corpus_dir), "plan": dataclasses.asdict(plan),
               "train": dataclasses.asdict(tc), "drafting": {k: list(v) if isinstance(v, tuple) else v
                                                             for k, v in drafting.items()},
               "sequences": {"train": len(train), "held_out": len(held)},
               "tokens": {"train": int(train.lengths.sum()), "train_continuation": train.continuation_tokens(),
                          "held_out": int(held.lengths.sum())},
               "draft_vocab": {"size": len(vocab), "continuation_coverage": coverage},
               "steps": {"done": _steps_done(run_dir),
                         "planned": math.ceil(tc.epochs * batches_per_epoch(len(train), tc.batch_size))},
               "held_out_agreement": final, "timing": timing, "history": history}
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    if export:
        from specjax.io.feature_checkpoint import save_feature_drafter

        trained, _ = split_params(params, cfg)
        save_feature_drafter(export, cfg, trained, drafting,
                             extra={"trained": {k: summary[k] for k in ("model", "plan", "train", "sequences",
                                                                        "tokens", "draft_vocab", "steps",
                                                                        "held_out_agreement")}})
        log(f"exported the drafter to {export}")
    return summary


def _steps_done(run_dir: str) -> int:
    """The newest checkpointed training step (orbax names each step's directory by its number)."""
    steps = os.path.join(run_dir, "steps")
    return max((int(d) for d in os.listdir(steps) if d.isdigit()), default=0) if os.path.isdir(steps) else 0
