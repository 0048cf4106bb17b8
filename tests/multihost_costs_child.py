"""One process of test_multihost's cost-table test, started by ``specjax launch`` (2 processes, the
pipeline axis across them): each process keeps its own tree cost table (``CACHE_BASE/p<i>``, as two
hosts would), and the tables disagree. Generation with ``budget="auto"`` must still agree on what to
measure (measuring runs passes over the whole mesh) and on the costs (they steer every step):

1. both tables empty: measured, once, by both;
2. process 1's table holds made-up costs, process 0's is empty: both measure again, process 0's costs win;
3. process 0's table holds the made-up costs, process 1's is empty: nobody measures, both use them.

Each process prints one line per run on stderr: ``costs {"run": k, "seconds": [...], "source": ..., "tokens": [...]}``.

    python -m tests.multihost_costs_child CACHE_BASE
"""

import json
import os
import sys

from specjax.sharding import distributed

distributed.initialize(distributed.detect_cluster(), timeout_s=60.0)

import jax  # noqa: E402

import specjax  # noqa: E402
from specjax.sharding import Parallel  # noqa: E402
from specjax.speculation.cost import cache_path  # noqa: E402
from specjax.speculation.drafters.lookup import LookupDrafter  # noqa: E402
from tests.toy import mesh_model, mesh_prompts  # noqa: E402

MADE_UP = 5.0  # seconds per pass: no real pass of the toy model takes that long

jax.config.update("jax_default_matmul_precision", "highest")
process = jax.process_index()
os.environ["SPECJAX_CACHE_DIR"] = os.path.join(sys.argv[1], f"p{process}")
model = mesh_model("llama")
prompts = mesh_prompts(model.config.vocab_size)
parallel = Parallel.create("pp=2,tp=4")
kw = dict(max_new_tokens=12, ignore_eos=True, parallel=parallel, budget="auto",
          drafters=[specjax.Bound(LookupDrafter(depth=3, branches=1))])


def run(k: int) -> None:
    out = specjax.generate(model, prompts, **kw)
    budget = out.stats["budget"]
    print("costs " + json.dumps({"run": k, "seconds": budget["seconds_per_pass"], "source": budget["costs_source"],
                                 "tokens": out.token_ids}), file=sys.stderr, flush=True)


def rewrite(holder: int) -> None:
    """The holder's table keeps its key with every cost replaced by MADE_UP; the other's is removed."""
    path = cache_path()
    with open(path) as f:
        table = json.load(f)
    if process == holder:
        table = {key: {n: MADE_UP for n in row} for key, row in table.items()}
        with open(path, "w") as f:
            json.dump(table, f)
    else:
        os.remove(path)


run(1)
rewrite(holder=1)
run(2)
rewrite(holder=0)
run(3)
