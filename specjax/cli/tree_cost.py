"""`specjax tree-cost`: the measured LLM pass cost by tree size and batch size on this machine.

This is the table the tree budget (``--budget auto``) decides with; ``generate`` measures the rows it
needs on first use and caches them, this command shows (or refreshes) them.
"""

from __future__ import annotations

import json
import sys

from specjax.cli.layers import add_layers_flag, split_layers_arg
from specjax.errors import InputError
from specjax.io import registry


def _ints(flag: str, text: str) -> list[int]:
    items = text.split(",")
    if not all(x.strip().isascii() and x.strip().isdigit() and int(x) >= 1 for x in items):
        raise InputError(f"{flag} {text!r}: expected comma-separated ints >= 1")
    return [int(x) for x in items]


def _cmd_tree_cost(args, out) -> int:
    nodes = _ints("--nodes", args.nodes)
    batches = _ints("--batch-sizes", args.batch_sizes)
    import specjax
    from specjax.attention import resolve_impl
    from specjax.decoding.programs import step_library
    from specjax.models.params import layers_split
    from specjax.speculation.cost import cached_pass_costs, machine_key

    context = specjax.describe_model(args.model).config.max_positions
    if max(nodes) >= context:  # before the weights load: such a pass has no positions to run at
        raise InputError(f"--nodes {max(nodes)}: a tree pass of that many nodes does not fit the model's context "
                         f"window of {context} positions")

    model = specjax.load_model(args.model, dtype=args.dtype, progress=not args.json,
                               split_layers=split_layers_arg(args))
    split = layers_split(model.params)
    impl = resolve_impl("auto")
    rows = {}
    for b in batches:
        def progress(n, b=b):
            print(f"# measuring batch {b}, {n} nodes ...", file=sys.stderr, flush=True)

        rows[b], source = cached_pass_costs(model.params, model.config, b, nodes, impl, progress=progress,
                                            remeasure=args.remeasure, head=_head(args))
    if args.json:
        out.write(json.dumps({"model": args.model, "machine": machine_key(), "dtype": args.dtype,
                              "layers": "split" if split else "stacked", "head": _head(args),
                              "step_matmuls": {str(b): step_library(b) for b in batches},
                              "seconds_per_pass": {str(b): {str(n): s for n, s in r.items()} for b, r in rows.items()}})
                  + "\n")
        return 0
    layers = "split layers" if split else "stacked layers"
    head = {"logits": "", "greedy": ", greedy verifier's passes", "seeded": ", seeded verifier's passes"}[_head(args)]
    out.write(f"# LLM pass time by tree size: {args.model}, {args.dtype}, {layers}{head}, {machine_key()}\n")
    out.write("# step matmuls ($SPECJAX_CPU_DOTS): "
              + ", ".join(f"batch {b} {step_library(b)}" for b in batches) + "\n")
    out.write(f"# ms per pass (x = relative to one node at the same batch size); {source.split(',')[-1].strip()}\n")
    out.write(f"{'nodes':>6} " + " ".join(f"{'batch ' + str(b):>18}" for b in batches) + "\n")
    for n in nodes:
        cells = [f"{rows[b][n] * 1e3:>9.1f} ms {rows[b][n] / rows[b][min(nodes)]:>5.2f}x" for b in batches]
        out.write(f"{n:>6} " + " ".join(cells) + "\n")
    return 0


def _head(args) -> str:
    return "greedy" if args.greedy else "seeded" if args.seeded else "logits"


def add_parser(sub, fmt) -> None:
    t = sub.add_parser("tree-cost", formatter_class=fmt,
                       help="show (measuring once, then cached) the LLM pass time by tree size and batch size",
                       description="The LLM's tree-pass time on this machine by tree size and batch size: the cost "
                                   "table `generate --budget auto` chooses its tree size with. Measured on first use "
                                   "(a warm median of 15 passes per cell, or of at least 5 once passes took 10 s; "
                                   "a row's sizes timed together, round-robin, one process at a time) and cached in "
                                   "~/.cache/specjax/tree_costs.json ($SPECJAX_CACHE_DIR); shown as the budget "
                                   "reads it: non-decreasing in the tree size (the running maximum).")
    t.add_argument("--model", default=registry.DEFAULT_MODEL, help="registered name, HF directory, .gguf or checkpoint")
    t.add_argument("--nodes", default="1,2,3,5,9,17", help="tree sizes (nodes, root included)")
    t.add_argument("--batch-sizes", default="1", help="batch sizes")
    t.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weight dtype")
    add_layers_flag(t)  # each layout's costs are cached separately
    which = t.add_mutually_exclusive_group()
    which.add_argument("--greedy", action="store_true",
                       help="the greedy verifier's passes (temperature 0 with `generate`'s default verifier): each "
                            "node's argmax, not its logits, which the CPU kernels compute for less; cached separately")
    which.add_argument("--seeded", action="store_true",
                       help="the seeded verifier's passes (sampling with `generate`'s default verifier): each node's "
                            "seeded token at temperature 1, which the CPU kernels decide for less; cached separately")
    t.add_argument("--remeasure", action="store_true", help="measure again instead of reading the cached table")
    t.add_argument("--json", action="store_true", help="one JSON object on stdout")
    t.set_defaults(func=_cmd_tree_cost)
