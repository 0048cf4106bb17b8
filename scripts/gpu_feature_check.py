"""Check the feature drafter's training path on a GPU machine before a long run there, and time it.

Runs what ``specjax feature-tune`` runs after its corpus, on a few corpus shards: the LLM's features
(``BatchShapes.gpu()``), a continued drafter's training steps (orbax checkpoints, resume), held-out
agreement and the export. The LLM can be SmolLM2's architecture with random weights, built on the GPU
machine from the tracked config in one step (``scripts/random_weights_model.py``, first line below;
SmolLM2's GGUF takes two calls to reach that machine), since a pass costs the same whatever the weights.
Prints one JSON line: seconds per training step at ``--batch-size`` and what each stage took, so the real
run's ``--epochs`` can be sized to the time it has (``scripts/gpu_feature_tune.sh``'s STEP_SECONDS, in a
later session: this check's compiles take minutes). Run as a script, its matmuls run at the precision the
training run uses (``JAX_DEFAULT_MATMUL_PRECISION``, default "highest" as there; a caller that imported jax
first keeps its own). The step time is an upper bound: the timed
call follows a first call of 5 steps but compiles its step function again (one per call), and may meet new
batch widths and checkpoint saves. From the repository root there (specjax importable: installed, or
``PYTHONPATH=$PWD``; $OUT is what comes back):

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
import time


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the LLM (a registered name or a directory)")
    ap.add_argument("--corpus", required=True, help="a feature corpus directory (parts with shard-*.npz)")
    ap.add_argument("--parts", default="tasks-greedy,requests", help="parts whose first shard is used")
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
    import numpy as np

    from specjax.boost.feature_loading import load_feature_set
    from specjax.boost.feature_train import FeatureTrainConfig, depth_agreement, split_params, train_feature
    from specjax.boost.feature_tune import BatchShapes, deepen_bound, resolve_layers, weights_digest
    from specjax.io.feature_checkpoint import save_feature_drafter
    from specjax.io.loader import load_model
    from specjax.speculation.drafters.feature import load_feature_drafter

    report = {"backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()], "jax": jax.__version__}
    stage = time.perf_counter()
    llm = load_model(args.model, progress=False)
    report["load_s"] = time.perf_counter() - stage
    bound = load_feature_drafter(args.init_from, llm)
    cfg = bound.drafter.config
    params = jax.tree.map(lambda a: a.astype(llm.params["embed"].dtype), bound.params)
    cfg, params = deepen_bound(params, cfg, resolve_layers(llm, args.init_from, args.layers), llm)
    report["drafter_layers"] = cfg.layers
    shapes = BatchShapes.gpu()
    parts = {}
    stage = time.perf_counter()
    for name in args.parts.split(","):
        shards = sorted(glob.glob(os.path.join(args.corpus, name, "shard-*.npz")))[:1]
        if not shards:
            raise SystemExit(f"{args.corpus}/{name}: no shards")
        # a fused drafter trains on the raw layers it reads, stored beside g
        parts[name] = (shards, shapes.features(llm, shards, os.path.join(args.out, "features", name), False, print,
                                               cfg.raw_layers))
    report["features_s"] = time.perf_counter() - stage
    data = load_feature_set(parts)
    tc = FeatureTrainConfig(epochs=max(1.0, (args.steps + 60) * args.batch_size / len(data)),
                            batch_size=args.batch_size, learning_rate=3e-4, window=172, checkpoint_every=20,
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
    line = json.dumps(report)
    print(line)
    if args.json_out:
        os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
        with open(args.json_out, "w") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
