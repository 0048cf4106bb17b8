"""Benchmark: lookup drafting and the tree budget vs incremental decoding and transformers, side by side.

Part 1 (batch 1, greedy, float32, N new tokens, chat template), per prompt in one run: specjax
incremental, the default (``registry.default_drafters``: for SmolLM2 the shipped feature drafter merged
with lookup drafting, under ``--budget auto``), the corpus drafter (``corpus:auto``: lookup drafting that
also copies from the shipped corpus of SmolLM2's own answers; the default of stops 51-57), lookup only
(both under the budget), SSM only
(smollm2-ssm-a, chain <1>), merged (lookup + SSM, whole tree), transformers ``generate``, transformers
prompt-lookup decoding (``prompt_lookup_num_tokens``) and transformers assisted generation with the
same SSM. Tokens/s by task kind. specjax's time excludes compilation (the host loop compiles ahead of time and times the
generation alone); transformers compiles nothing.

Part 2: tokens/s vs batch size for specjax incremental and the default (under the budget, goal
"finish"; with ``--compare-rate`` also goal "rate"), every prompt generated in batches of that size,
the configurations alternating batch by batch (this machine's speed drifts within minutes).

Every specjax output is compared with specjax incremental (greedy: must be identical; in part 2, batch by
batch); the script exits 1, after writing its results, when any differs.

    python scripts/bench_lookup.py --max-new-tokens 128 --batch-sizes 1,2,4,8,16 --out bench_out/lookup.png
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
import _bench_common as common  # noqa: E402

TASKS = os.path.join(os.path.dirname(__file__), "data", "task_kinds.jsonl")
PARTS = ("batch1", "batch")  # part 1 (batch 1, every system) and part 2 (the batch-size sweep)
GROUNDED = ("summarisation", "rag-qa", "passage-qa", "retrieval")  # the input-grounded kinds of both prompt files


def _specjax_seconds(fn):
    """(tokens per request, seconds of generation without compilation) of a specjax call in host-loop mode."""
    res = fn(on_tokens=lambda i, ids: None)
    return res, res.stats["seconds"]


def main() -> None:
    from specjax.cli.layers import add_layers_flag, split_layers_arg

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts-file", type=common.existing_file, default=TASKS)
    ap.add_argument("--max-new-tokens", type=common.positive_int, default=128)
    ap.add_argument("--batch-max-new-tokens", type=common.positive_int, default=64)
    ap.add_argument("--batch-sizes", type=common.int_list(), default=[1, 2, 4, 8, 16], help="comma-separated")
    ap.add_argument("--ssm", default="smollm2-ssm-a")
    ap.add_argument("--prompt-lookup-tokens", type=int, default=10, help="transformers' prompt_lookup_num_tokens")
    ap.add_argument("--compare-rate", action="store_true",
                    help="part 2 also runs the budget with goal 'rate' (the serving engine's) for comparison")
    ap.add_argument("--skip", type=common.name_list(PARTS), default=[],
                    help=f"comma-separated parts to skip: {', '.join(PARTS)}")
    add_layers_flag(ap)
    ap.add_argument("--out", default="bench_out/lookup.png")
    args = ap.parse_args()
    common.require_plotting()

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    import specjax
    from specjax.io.hf_export import draft_vocab_mask, export_hf
    from specjax.io.registry import resolve

    common.print_header("the default drafters and lookup drafting under the tree budget vs incremental vs "
                        "transformers (greedy, float32)")
    records = common.load_prompts(args.prompts_file, None)
    llm = specjax.load_model("smollm2-135m-instruct", progress=False, split_layers=split_layers_arg(args))
    prompts = specjax.api.encode_prompts(llm, [r["prompt"] for r in records])
    kinds = [r.get("category", "?") for r in records]
    n = args.max_new_tokens
    lookup = specjax.Bound(specjax.LookupDrafter())
    from specjax.io.registry import default_drafters
    from specjax.speculation.drafters import build

    answers = build("corpus:auto", llm, load=True, expansion=None, draft="topk")
    specs = default_drafters(llm.config)  # what `specjax generate` drafts with when no --drafter is given
    defaults = [build(spec, llm, load=True, expansion=None, draft="topk") for spec in specs]
    default = f"specjax {' + '.join(specs)} + budget (default)"
    skip = set(args.skip)
    results = {"machine": common.machine(), "command": sys.argv}
    mismatches = collections.Counter()  # system -> outputs different from specjax incremental, both parts

    if "batch1" not in skip:
        ssm = specjax.load_model(args.ssm, progress=False)
        ssm_dir = tempfile.mkdtemp(prefix="specjax_ssm_")
        export_hf(ssm, ssm_dir)
        hf = common.load_hf_reference(resolve("smollm2-135m-instruct"))
        hf_ssm = AutoModelForCausalLM.from_pretrained(ssm_dir, dtype=torch.float32).eval()
        mask = draft_vocab_mask(ssm_dir, llm.config.vocab_size)
        if mask is not None:  # the shrunk head: -inf outside its draft vocabulary, as in specjax
            mask = torch.tensor(mask)
            hf_ssm.lm_head.register_forward_hook(lambda module, inputs, out: out + mask)

        def sj(**kw):
            return lambda ids: _specjax_seconds(lambda **k: specjax.generate(llm, [ids], max_new_tokens=n, **kw, **k))

        def hf_run(**kw):
            def run(ids):
                t0 = time.perf_counter()
                with torch.no_grad():
                    out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, **kw)
                return out[0, len(ids):].tolist(), time.perf_counter() - t0
            return run

        systems = {
            "specjax incremental": sj(mode="incremental"),
            default: sj(drafters=defaults, budget="auto"),
            "specjax corpus:auto + budget": sj(drafters=[answers], budget="auto"),
            "specjax lookup + budget": sj(drafters=[lookup], budget="auto"),
            "specjax SSM <1>": sj(ssms=[ssm], expansion=(1,)),
            "specjax lookup + SSM (whole tree)": sj(drafters=[lookup], ssms=[ssm], expansion=(1,)),
            "transformers greedy": hf_run(),
            "transformers prompt lookup": hf_run(prompt_lookup_num_tokens=args.prompt_lookup_tokens),
            "transformers assisted (same SSM)": hf_run(assistant_model=hf_ssm),
        }
        for fn in systems.values():  # first calls (weights to device, cost table, first compile)
            fn(prompts[0])
        per = {name: collections.defaultdict(lambda: [0, 0.0, 0]) for name in systems}  # kind -> tokens, s, passes
        for rec, ids, kind in zip(records, prompts, kinds):
            reference = None
            for name, fn in systems.items():
                res, seconds = fn(ids)
                toks = res if isinstance(res, list) else res.token_ids[0]
                reference = toks if reference is None else reference
                if name.startswith("specjax") and toks != reference:
                    mismatches[name] += 1
                cell = per[name][kind]
                cell[0] += len(toks)
                cell[1] += seconds
                cell[2] += 0 if isinstance(res, list) else res.stats["llm_passes"]
            print(f"# done {rec.get('id')} ({kind})", flush=True)
        kind_names = sorted(set(kinds))
        table = {name: {k: v[0] / v[1] for k, v in cells.items()} for name, cells in per.items()}

        def total(name, only=None):
            cells = [v for k, v in per[name].items() if only is None or k in only]
            return sum(c[0] for c in cells) / sum(c[1] for c in cells)

        print(f"\n# part 1: tokens/s by task kind, batch 1, {n} new tokens, {len(records)} prompts")
        print(f"{'system':<54} " + " ".join(f"{k[:11]:>11}" for k in kind_names) + f" {'grounded':>9} {'all':>7}")
        for name in systems:
            print(f"{name:<54} " + " ".join(f"{table[name][k]:>11.2f}" for k in kind_names)
                  + f" {total(name, GROUNDED):>9.2f} {total(name):>7.2f}")
        base, plk = "specjax incremental", "transformers prompt lookup"
        dflt = default
        print(f"# default vs transformers prompt lookup, input-grounded kinds {GROUNDED}: "
              f"{total(dflt, GROUNDED) / total(plk, GROUNDED):.2f}x; all kinds: {total(dflt) / total(plk):.2f}x")
        print(f"# default vs specjax incremental: grounded {total(dflt, GROUNDED) / total(base, GROUNDED):.2f}x, "
              f"all {total(dflt) / total(base):.2f}x")
        for name in systems:
            passes = sum(v[2] for v in per[name].values())
            if passes:
                print(f"# {name}: {sum(v[0] for v in per[name].values()) / passes:.2f} tokens per LLM pass")
        print(f"# specjax outputs different from specjax incremental: {dict(mismatches) or 'none'}")
        results["batch1"] = {"tokens_per_s": table, "mismatches": dict(mismatches), "kinds": kind_names}

    if "batch" not in skip:
        from specjax.speculation.budget import default_levels

        sizes = args.batch_sizes
        m = args.batch_max_new_tokens
        configs = {"specjax incremental": {"mode": "incremental"}, default: dict(drafters=defaults, budget="auto")}
        if args.compare_rate:
            configs[f"specjax {' + '.join(specs)} + budget, goal rate"] = dict(
                drafters=defaults, budget=specjax.Budget(default_levels(tuple(d.drafter for d in defaults)),
                                                         goal="rate"))
        sweep = {name: {} for name in configs}
        batch_mismatches = collections.Counter()  # (configuration, batch size) -> differing requests
        print(f"\n# part 2: tokens/s vs batch size, {len(prompts)} prompts, {m} new tokens each; the "
              f"configurations alternate batch by batch")
        for b in sizes:
            batches = [prompts[i:i + b] for i in range(0, len(prompts), b)]
            for kw in configs.values():  # compile, and the cost table's rows for this batch size
                specjax.generate(llm, batches[0], max_new_tokens=m, **kw)
            tokens, seconds = collections.Counter(), collections.Counter()
            for batch in batches:
                reference = None  # incremental's tokens for this batch: the first configuration
                for name, kw in configs.items():
                    res, s = _specjax_seconds(lambda **k: specjax.generate(llm, batch, max_new_tokens=m, **kw, **k))
                    tokens[name] += sum(len(t) for t in res.token_ids)
                    seconds[name] += s
                    reference = res.token_ids if reference is None else reference
                    batch_mismatches[f"{name} (batch {b})"] += sum(t != r for t, r in zip(res.token_ids, reference))
            inc = tokens["specjax incremental"] / seconds["specjax incremental"]
            line = [f"batch {b:>3}: incremental {inc:7.2f} tok/s"]
            for name in configs:
                sweep[name][b] = tokens[name] / seconds[name]
                if name != "specjax incremental":
                    line.append(f"{name.removeprefix('specjax ')} {sweep[name][b]:7.2f} = {sweep[name][b] / inc:.2f}x")
            print(", ".join(line), flush=True)
        results["batch"] = sweep
        results["batch_mismatches"] = dict(+batch_mismatches)
        mismatches.update(+batch_mismatches)  # drop the zero counts
        print(f"# part 2: specjax outputs different from specjax incremental: {dict(+batch_mismatches) or 'none'}")

    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:  # before plotting: the numbers survive a plot failure
        json.dump(results, f, indent=1, default=str)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [p for p in ("batch1", "batch") if p in results]
    fig, axes = plt.subplots(1, len(parts), figsize=(7 * len(parts), 4.5), squeeze=False)
    for ax, part in zip(axes[0], parts):
        if part == "batch1":
            kinds_ = results["batch1"]["kinds"]
            names = list(results["batch1"]["tokens_per_s"])
            width = 0.8 / len(names)
            for i, name in enumerate(names):
                vals = [results["batch1"]["tokens_per_s"][name].get(k, 0) for k in kinds_]
                ax.bar(np.arange(len(kinds_)) + i * width, vals, width, label=name)
            ax.set_xticks(np.arange(len(kinds_)) + 0.4 - width / 2, kinds_, rotation=30, fontsize=8)
            ax.set_ylabel(f"tokens/s (batch 1, greedy, {n} new tokens)")
            ax.legend(fontsize=7)
        else:
            for name, row in results["batch"].items():
                ax.plot(list(row), list(row.values()), marker="o", label=name)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch size")
            ax.set_ylabel(f"tokens/s ({args.batch_max_new_tokens} new tokens)")
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"SmolLM2-135M-Instruct, float32, {common.machine().split(';')[0]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"# plot: {args.out}")
    if mismatches:  # greedy speculation is lossless: a difference is a bug, not a benchmark result
        sys.exit(f"bench_lookup: specjax outputs differ from specjax incremental (must be identical): "
                 f"{dict(mismatches)}")


if __name__ == "__main__":
    main()
