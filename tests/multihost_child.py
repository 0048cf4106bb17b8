"""One process of the 2-process tests (tests/test_multihost.py), started by ``specjax launch``:
joins the cluster from the SPECJAX_* variables, builds the same tiny model as every other process,
and runs incremental and tree-speculative generation on each given mesh (PP=2 x TP=4: the pipeline
axis across the processes; DP=2 x TP=4: the requests across them). Process 0 prints one JSON line.

    python -m tests.multihost_child "pp=2,tp=4;dp=2,tp=4" [INIT_TIMEOUT_S] [die]

``die``: process 1 crashes (exit code 3) right after joining, while process 0 goes on into collectives.
``SPECJAX_TEST_LATE_S``: process 1 starts its programs that many seconds after process 0 (a slower
host's compilation), longer than the 30 s gloo gives a first collective.
"""

import json
import os
import sys
import time

_T0 = time.monotonic()


def _phase(what: str) -> None:
    """A timestamped line on stderr: when a run fails, the test's message shows how far each process got."""
    print(f"phase {time.monotonic() - _T0:7.1f}s {what}", file=sys.stderr, flush=True)


from specjax.sharding import distributed  # noqa: E402 (the phase clock starts first)

meshes = (sys.argv[1] if len(sys.argv) > 1 else "pp=2,tp=4").split(";")
distributed.initialize(distributed.detect_cluster(), timeout_s=float(sys.argv[2]) if len(sys.argv) > 2 else 60.0)

import jax  # noqa: E402

if sys.argv[3:] == ["die"] and jax.process_index() == 1:
    os._exit(3)  # a crash: no interpreter shutdown, so no JAX shutdown barrier either

import specjax  # noqa: E402
from specjax.sharding import Parallel  # noqa: E402
from specjax.speculation.drafters.ssm import derive_ssm  # noqa: E402
from tests.toy import mesh_model, mesh_prompts  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
model = mesh_model("llama")
prompts = mesh_prompts(model.config.vocab_size)
report = {"process_count": jax.process_count(), "devices": jax.device_count()}
_phase("joined; model built")
if jax.process_index() == 1 and os.environ.get("SPECJAX_TEST_LATE_S"):
    time.sleep(float(os.environ["SPECJAX_TEST_LATE_S"]))
    _phase("late start")
for shape in meshes:
    parallel = Parallel.create(shape)
    kw = dict(max_new_tokens=12, ignore_eos=True, parallel=parallel)
    tree_kw = dict(mode="tree", ssms=[derive_ssm(model, 2)], expansion=(1, 2, 1), **kw)
    specjax.generate(model, prompts, mode="incremental", **kw), specjax.generate(model, prompts, **tree_kw)  # compile
    _phase(f"{shape}: compiled")
    incremental = specjax.generate(model, prompts, mode="incremental", **kw)  # warm: timed for docs/scale_out.md
    tree = specjax.generate(model, prompts, **tree_kw)
    _phase(f"{shape}: generated")
    mesh = parallel.mesh.devices  # [pp, dp, tp]
    report[shape] = {
        "stage_processes": [sorted({d.process_index for d in mesh[s].flat}) for s in range(mesh.shape[0])],
        "replica_processes": [sorted({d.process_index for d in mesh[:, r].flat}) for r in range(mesh.shape[1])],
        "incremental": incremental.token_ids, "tree": tree.token_ids, "tree_passes": tree.stats["llm_passes"],
        "histogram": tree.stats["tokens_per_pass_histogram"],
        "incremental_ms_per_pass": 1e3 * incremental.stats["seconds"] / incremental.stats["llm_passes"],
        "tree_ms_per_pass": 1e3 * tree.stats["seconds"] / tree.stats["llm_passes"]}
if jax.process_index() == 0:
    print(json.dumps(report), flush=True)
_phase("done; exiting (JAX's shutdown barrier follows)")
