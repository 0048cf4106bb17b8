"""Check the feature drafter's training path on a GPU machine before a long run there, and time it.

Runs what ``specjax feature-tune`` runs after its corpus, on the few corpus shards that hold two batches
of the width 99% of the run's batches stay within (a step's cost follows its width): the LLM's features
(``BatchShapes.gpu()``), a continued drafter's training steps (orbax checkpoints, resume), held-out
agreement and the export. The LLM can be SmolLM2's architecture with random weights, built on the GPU
machine from the tracked config in one step (``scripts/random_weights_model.py``, first line below;
SmolLM2's GGUF takes two calls to reach that machine), since a pass costs the same whatever the weights.
Prints its command and device kind, then one JSON line (with both): seconds per training step at ``--batch-size``
and what each stage took, so the real run's ``--epochs`` can be sized to the time it has
(``scripts/gpu_feature_tune.sh``'s STEP_SECONDS, in a later session: this check's compiles take minutes). Run as a
script, its matmuls run at the precision the training run uses (``JAX_DEFAULT_MATMUL_PRECISION``, default
"highest" as there; a caller that imported jax first keeps its own). The step time is an upper bound for batches
of its width or less (the JSON has the run's share of each width, ``run_widths``): the timed call follows a first
call of 5 steps but compiles its step function again (one per call), and meets checkpoint saves. From the
repository root there (specjax importable: installed, or ``PYTHONPATH=$PWD``; $OUT is what comes back):

    python scripts/random_weights_model.py --config scripts/data/smollm2-135m-config.json --out /tmp/smollm2-random
    PYTHONPATH=$PWD python scripts/gpu_feature_check.py --model /tmp/smollm2-random \
        --corpus feature-out/feature-corpus --init-from smollm2-feature --out /tmp/feature-check \
        --json-out $OUT/check.json
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import sys
import time

import numpy as np


def shards_of(corpus: str, parts: str) -> list[tuple[str, np.ndarray]]:
    """(path, sequence lengths) of every shard of ``parts`` ("auto": every training part: not the requests
    the LLM wrote, the evaluation sets or the features)."""
    if parts == "auto":
        names = [d for d in sorted(os.listdir(corpus)) if os.path.isdir(os.path.join(corpus, d))
                 and not d.endswith("-written") and not d.startswith(("eval-", "features"))]
    else:
        names = parts.split(",")
    found = []
    for name in names:
        paths = sorted(glob.glob(os.path.join(corpus, name, "shard-*.npz")))
        if not paths and parts != "auto":
            raise SystemExit(f"{corpus}/{name}: no shards")
        for path in paths:
            with np.load(path) as z:
                found.append((path, np.diff(z["offsets"])))
    if not found:
        raise SystemExit(f"{corpus}: no corpus shards")
    return found


class _Lengths:
    """What ``distill.epoch_batches`` reads of a training set: its size and its sequences' lengths."""

    def __init__(self, lengths: np.ndarray):
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)


def run_widths(lengths: list, batch_size: int, window: int, width_multiple: int, seed: int = 0,
               epochs: int = 4) -> dict:
    """The widths of the training run's batches over ``epochs`` epochs, batched as the run batches
    (``epoch_batches``: shuffled, similar lengths together): each width's share, their mean, and the width
    99% of them stay within."""
    from specjax.boost.distill import epoch_batches
    from specjax.boost.feature_train import batch_width

    examples = _Lengths(np.concatenate(lengths))
    drawn = np.array([batch_width(int(examples.lengths[b].max()), window, width_multiple)
                      for epoch in range(epochs) for b in epoch_batches(examples, batch_size, seed, epoch)])
    if not len(drawn):
        raise SystemExit(f"{len(examples)} sequences: fewer than a batch ({batch_size})")
    values, counts = np.unique(drawn, return_counts=True)
    return {"share": {int(v): round(c / len(drawn), 4) for v, c in zip(values, counts)}, "mean": float(drawn.mean()),
            "p99": int(np.percentile(drawn, 99, method="higher"))}


def choose_shards(shards: list, width: int, batch_size: int, window: int, width_multiple: int) -> list[str]:
    """The fewest shards that hold two batches of sequences exactly ``width`` wide (all that hold any, where
    fewer), refused where they hold less than one batch: checked before the LLM loads."""
    from specjax.boost.feature_train import batch_width

    if width <= 0 or width % width_multiple:
        raise SystemExit(f"--width {width}: a batch width is a positive multiple of {width_multiple}")
    counted = sorted(((sum(batch_width(int(n), window, width_multiple) == width for n in lengths), path)
                      for path, lengths in shards), key=lambda item: -item[0])
    chosen, found = [], 0
    for count, path in counted:
        if found >= 2 * batch_size or count == 0:
            break
        chosen.append(path)
        found += count
    if found < batch_size:
        raise SystemExit(f"{found} sequences make batches {width} wide, fewer than a batch ({batch_size}); "
                         f"name another --width")
    return chosen


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the LLM (a registered name or a directory)")
    ap.add_argument("--corpus", required=True, help="a feature corpus directory (parts with shard-*.npz)")
    ap.add_argument("--parts", default="auto",
                    help="comma-separated parts whose sequences are timed (default: every training part)")
    ap.add_argument("--width", type=int, default=None,
                    help="the batch width to time (default: the width that 99%% of the training run's batches "
                         "stay within, from the parts' sequence lengths)")
    ap.add_argument("--init-from", default="smollm2-feature", help="the drafter to continue")
    ap.add_argument("--layers", type=int, default=None,
                    help="decoder layers of the drafter to time (more than --init-from's: deepened, as feature-tune "
                         "--layers does; default: its own)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--steps", type=int, default=40, help="timed training steps")
    ap.add_argument("--out", required=True, help="scratch directory (features, run, export)")
    ap.add_argument("--json-out", help="also write the JSON line here")
    args = ap.parse_args(argv)
    # what gpu_feature_tune.sh's runs use: a step timed at TF32 (XLA's GPU default) would plan too many steps
    os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")

    import jax

    # what ran and on what, beside the numbers (argv: the arguments given to main, as when a test calls it)
    command = shlex.join(["python", sys.argv[0] if argv is None else "scripts/gpu_feature_check.py",
                          *(sys.argv[1:] if argv is None else argv)])
    device_kind = jax.devices()[0].device_kind
    print(f"# command: {command}\n# device: {device_kind} ({jax.default_backend()})", flush=True)

    from specjax.boost.feature_corpus import CorpusPlan
    from specjax.boost.feature_loading import load_feature_set
    from specjax.boost.feature_train import (
        FeatureTrainConfig,
        batch_width,
        depth_agreement,
        split_params,
        train_feature,
    )
    from specjax.boost.feature_tune import BatchShapes, deepen_bound, resolve_layers, training_window, weights_digest
    from specjax.io.feature_checkpoint import save_feature_drafter
    from specjax.io.loader import load_model
    from specjax.speculation.drafters.feature import load_feature_drafter

    shapes = BatchShapes.gpu()
    window = training_window(CorpusPlan(), FeatureTrainConfig().unrolled_steps)  # gpu_feature_tune.sh's runs'
    # A step's cost follows its batch's width, the longest of its sequences padded: time the width that
    # nearly every batch of the run stays within, with sequences of that width only, so STEP_SECONDS bounds
    # the run's steps and --epochs never plans more than fit. (Until stop 91 the check read the first shard
    # of two parts, which hold their shortest prompts: 256-column batches, where the whole corpus's batches
    # of 32 are mostly 512 or 768 columns wide.) Chosen before the LLM loads: a bad --width costs nothing.
    shards = shards_of(args.corpus, args.parts)
    widths = run_widths([lengths for _, lengths in shards], args.batch_size, window, shapes.width_multiple)
    width = widths["p99"] if args.width is None else args.width
    chosen = choose_shards(shards, width, args.batch_size, window, shapes.width_multiple)
    report = {"command": command, "device_kind": device_kind,
              "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()], "jax": jax.__version__,
              "width": width, "run_widths": widths["share"], "run_mean_width": widths["mean"]}
    stage = time.perf_counter()
    llm = load_model(args.model, progress=False)
    report["load_s"] = time.perf_counter() - stage
    bound = load_feature_drafter(args.init_from, llm)
    cfg = bound.drafter.config
    params = jax.tree.map(lambda a: a.astype(llm.params["embed"].dtype), bound.params)
    cfg, params = deepen_bound(params, cfg, resolve_layers(llm, args.init_from, args.layers), llm)
    report["drafter_layers"] = cfg.layers
    stage = time.perf_counter()
    parts = {}
    for path in chosen:  # a fused drafter trains on the raw layers it reads, stored beside g
        name = os.path.relpath(path, args.corpus).replace(os.sep, "-")
        parts[name] = ([path], shapes.features(llm, [path], os.path.join(args.out, "features", name), False, print,
                                               cfg.raw_layers))
    report["features_s"] = time.perf_counter() - stage
    data = load_feature_set(parts)
    data = data.subset(np.flatnonzero([batch_width(int(n), window, shapes.width_multiple) == width
                                       for n in data.lengths]))  # every batch exactly `width` wide
    tc = FeatureTrainConfig(epochs=max(1.0, (args.steps + 60) * args.batch_size / len(data)),
                            batch_size=args.batch_size, learning_rate=3e-4, window=window, checkpoint_every=20,
                            eval_every=10_000)
    held = data.subset(np.arange(min(16, len(data))))
    run_dir = os.path.join(args.out, "run")
    # the starting weights are part of the run's recipe: an --out reused with another drafter is refused, not resumed
    common = dict(held_out=held, progress=False, width_multiple=shapes.width_multiple,
                  full_batches=shapes.full_batches, start=weights_digest(split_params(params, cfg)[0]))
    stage = time.perf_counter()
    params, _ = train_feature(params, data, cfg, tc, run_dir, stop_after=5, **common)  # compiles, checkpoints
    report["first_steps_s"] = time.perf_counter() - stage
    stage = time.perf_counter()
    params, _ = train_feature(params, data, cfg, tc, run_dir, stop_after=args.steps, **common)  # resumes
    report["step_s"] = (time.perf_counter() - stage) / args.steps
    stage = time.perf_counter()
    report["agreement"] = depth_agreement(params, held, cfg, steps=6, window=tc.window,
                                          width_multiple=shapes.width_multiple,
                                          full_batches=shapes.full_batches)["all"]
    trained, _ = split_params(params, cfg)
    save_feature_drafter(os.path.join(args.out, "export"), cfg, trained, {"depth": 6, "beam": 4, "nodes": 16,
                                                                         "ladder": (0, 1, 3, 6, 10, 16)})
    load_feature_drafter(os.path.join(args.out, "export"), llm)  # what was exported loads back
    report["eval_export_s"] = time.perf_counter() - stage
    report["sequences"] = len(data)
    report["shards"] = [os.path.relpath(path, args.corpus) for path in chosen]
    line = json.dumps(report)
    print(line)
    if args.json_out:
        os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
        with open(args.json_out, "w") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
