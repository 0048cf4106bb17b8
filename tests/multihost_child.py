"""One process of the 2-process test (tests/test_multihost.py), started by ``specjax launch``:
joins the cluster from the SPECJAX_* variables, builds the same tiny model as every other process,
and runs incremental and tree-speculative generation on a PP=2 x TP=4 mesh whose pipeline axis
runs across the processes. Process 0 prints one JSON line."""

import json
import sys

from specjax.sharding import distributed

distributed.initialize(distributed.detect_cluster(), timeout_s=float(sys.argv[2]) if len(sys.argv) > 2 else 60.0)

import jax  # noqa: E402

import specjax  # noqa: E402
from specjax.sharding import Parallel  # noqa: E402
from specjax.ssm import derive_ssm  # noqa: E402
from tests.toy import mesh_model, mesh_prompts  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
parallel = Parallel.create(sys.argv[1] if len(sys.argv) > 1 else "pp=2,tp=4")
stage_processes = [sorted({d.process_index for d in parallel.mesh.devices[s].flat}) for s in range(parallel.pp)]
model = mesh_model("llama")
prompts = mesh_prompts(model.config.vocab_size)
kw = dict(max_new_tokens=12, ignore_eos=True, parallel=parallel)
tree_kw = dict(mode="tree", ssms=[derive_ssm(model, 2)], expansion=(1, 2, 1), **kw)
specjax.generate(model, prompts, **kw), specjax.generate(model, prompts, **tree_kw)  # compile
incremental = specjax.generate(model, prompts, **kw)  # warm: timed for docs/scale_out.md
tree = specjax.generate(model, prompts, **tree_kw)
if jax.process_index() == 0:
    print(json.dumps({"process_count": jax.process_count(), "devices": jax.device_count(),
                      "stage_processes": stage_processes, "incremental": incremental.token_ids,
                      "tree": tree.token_ids, "tree_passes": tree.stats["llm_passes"],
                      "incremental_ms_per_pass": 1e3 * incremental.stats["seconds"] / incremental.stats["llm_passes"],
                      "tree_ms_per_pass": 1e3 * tree.stats["seconds"] / tree.stats["llm_passes"]}), flush=True)
