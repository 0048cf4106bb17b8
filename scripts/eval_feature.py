"""Evaluation of the feature drafter against the other drafters (issue 17, deliverable 6).

Part ``kinds`` (batch 1, greedy, N new tokens, chat template, one prompt at a time): for every drafter
configuration, tokens per LLM pass and tokens/s by task kind, acceptance by depth, the distribution of
tokens per pass (CDF), and, for the configurations in ``SAMPLED``, tokens per pass at temperature 1
with seeded verification. Every greedy output is checked against incremental decoding and every
seeded one against seeded incremental sampling (identical tokens required; mismatches are printed and
fail the script). Configurations at equal node budget: feature drafter (N nodes), lookup (N nodes),
SSM (a chain of min(N, 8) nodes), merged feature + lookup (N/2 + N/2); then lookup alone under the tree
budget (the default before stop 58) and **the default** itself: ``specjax.generate`` given no mode,
drafter or SSM (for SmolLM2 the shipped feature drafter merged with lookup under the tree budget,
``registry.default_drafters``), so the row measures whatever the default is. One configuration runs
over all prompts at a time, compiled programs dropped in between.

Part ``budget``: tokens/s and tokens per LLM pass against the feature drafter's node budget at batch 1,
2, 4, 8 (whole tree every step, no tree budget), with incremental decoding at the same batch sizes as
the reference. Tokens per pass at large budgets say what the drafter gives where an LLM pass of many
nodes costs about one of a single node (an accelerator); on a CPU the tree budget picks smaller trees.

    python scripts/eval_feature.py --drafter feature:auto --max-new-tokens 128 --out bench_out/feature
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import _bench_common as common  # noqa: E402

TASKS = os.path.join(os.path.dirname(__file__), "data", "task_kinds.jsonl")
PARTS = ("kinds", "budget")  # the parts of the evaluation, as the module docstring describes them
DEFAULT = "the default"  # the configuration with no drafting arguments: whatever specjax.generate defaults to


def _configs(llm, feature_arg: str, nodes: int, ssm_name: str):
    import specjax
    from specjax.speculation.drafters.feature import from_arg
    from specjax.speculation.drafters.lookup import LookupDrafter

    half = max(1, nodes // 2)
    feat = from_arg(f"{feature_arg},nodes={nodes}", llm, load=True, expansion=None, draft="topk")
    feat_half = from_arg(f"{feature_arg},nodes={half}", llm, load=True, expansion=None, draft="topk")
    ssm = specjax.load_model(ssm_name, progress=False)
    return {
        "incremental": {"mode": "incremental"},
        f"feature ({nodes} nodes)": {"drafters": [feat]},
        f"lookup ({nodes} nodes)": {"drafters": [specjax.Bound(LookupDrafter(depth=half, branches=2))]},
        f"SSM chain ({min(nodes, 8)} nodes)": {"ssms": [ssm], "expansion": (1,) * min(nodes, 8)},
        f"feature + lookup ({half} + {half})": {"drafters": [feat_half,
                                                             specjax.Bound(LookupDrafter(depth=half, branches=1))]},
        # the default before stop 58, and the default itself (no drafting arguments at all)
        "lookup + budget": {"drafters": [specjax.Bound(LookupDrafter())], "budget": "auto"},
        DEFAULT: {},
    }


# configurations also run at temperature 1 (seeded verification against seeded incremental sampling)
SAMPLED = ("incremental", "feature", DEFAULT)


def part_kinds(llm, records, configs, n: int, results: dict) -> None:
    import jax

    import specjax

    prompts = specjax.api.encode_prompts(llm, [r["prompt"] for r in records])
    kinds = [r.get("category", "?") for r in records]
    seeded = specjax.SamplingParams(temperature=1.0, seed=17)
    # per kind: [tokens, seconds, LLM passes, seconds after prefill, requests]; the prefill emits each
    # request's first token, so the decode rate is (tokens - 1) / (seconds - prefill) per request: the part
    # speculation changes (tok/s end to end include the prefill, alike for every configuration)
    per = {name: collections.defaultdict(lambda: [0, 0.0, 0, 0.0, 0]) for name in configs}
    depth_hits = {name: None for name in configs}
    hist = {name: collections.Counter() for name in configs}
    sampled = {name: [0, 0] for name in configs}
    mismatches = collections.Counter()
    reference, seeded_ref = {}, {}
    # one configuration at a time over every prompt, compiled programs dropped in between: XLA:CPU maps
    # memory per executable and all configurations at once exceeded vm.max_map_count (65530 by default)
    for name, kw in configs.items():
        specjax.generate(llm, [prompts[0]], max_new_tokens=8, **kw)  # compile and measure cost tables first
        for i, (ids, kind) in enumerate(zip(prompts, kinds)):
            res = specjax.generate(llm, [ids], max_new_tokens=n, on_tokens=lambda i, t: None, **kw)
            toks = res.token_ids[0]
            if reference.setdefault(i, toks) != toks:
                mismatches[name] += 1
            cell = per[name][kind]
            cell[0] += len(toks)
            cell[1] += res.stats["seconds"]
            cell[2] += res.stats["llm_passes"]
            cell[3] += res.stats["seconds"] - res.stats["prefill_seconds"]
            cell[4] += 1
            if name != "incremental":
                acc = np.asarray(res.stats["accepted_at_depth"], float)
                depth_hits[name] = acc if depth_hits[name] is None else _add(depth_hits[name], acc)
                for k, c in enumerate(res.stats["tokens_per_pass_histogram"]):
                    hist[name][k] += c
            if not any(name.split(" (")[0] == s for s in SAMPLED):
                continue
            t = specjax.generate(llm, [ids], max_new_tokens=n, sampling=seeded,
                                 **({"verifier": "seeded"} if "drafters" in kw else {}), **kw)
            if seeded_ref.setdefault(i, t.token_ids[0]) != t.token_ids[0]:
                mismatches[name + " (seeded)"] += 1
            sampled[name][0] += len(t.token_ids[0])
            sampled[name][1] += t.stats["llm_passes"]
        cells = [f"{k} {c[0] / max(c[2], 1):.2f}" for k, c in sorted(per[name].items())]
        rate = sum(c[0] for c in per[name].values()) / sum(c[1] for c in per[name].values())
        print(f"# {name}: tokens per pass " + ", ".join(cells) + f"; {rate:.2f} tok/s", flush=True)
        jax.clear_caches()
    kind_names = sorted(set(kinds))
    out = {"kinds": kind_names, "tokens_per_pass": {}, "tokens_per_s": {}, "decode_tokens_per_s": {},
           "t1_tokens_per_pass": {},
           "accepted_at_depth": {}, "histogram": {}, "mismatches": dict(mismatches)}
    print(f"\n# tokens per LLM pass by task kind (batch 1, greedy, {n} new tokens, {len(records)} prompts)")
    print(f"{'drafter':<30} " + " ".join(f"{k[:11]:>11}" for k in kind_names) + f" {'all':>6} {'tok/s':>7} "
          f"{'vs inc':>7} {'decode':>7} {'vs inc':>7} {'T=1':>5}")

    def decode_rate(cells):
        return sum(c[0] - c[4] for c in cells) / sum(c[3] for c in cells)

    base = sum(c[0] for c in per["incremental"].values()) / sum(c[1] for c in per["incremental"].values())
    decode_base = decode_rate(per["incremental"].values())
    for name in configs:
        tpp = {k: per[name][k][0] / max(per[name][k][2], 1) for k in kind_names}
        tokens = sum(c[0] for c in per[name].values())
        passes = sum(c[2] for c in per[name].values())
        rate = tokens / sum(c[1] for c in per[name].values())
        t1 = sampled[name][0] / sampled[name][1] if sampled[name][1] else float("nan")
        out["tokens_per_pass"][name] = {**tpp, "all": tokens / passes}
        out["tokens_per_s"][name] = rate
        decode = out["decode_tokens_per_s"][name] = decode_rate(per[name].values())
        out["t1_tokens_per_pass"][name] = t1
        if depth_hits[name] is not None:
            out["accepted_at_depth"][name] = (depth_hits[name] / passes).tolist()
            out["histogram"][name] = [hist[name][k] for k in range(max(hist[name]) + 1)]
        print(f"{name:<30} " + " ".join(f"{tpp[k]:>11.2f}" for k in kind_names)
              + f" {tokens / passes:>6.2f} {rate:>7.2f} {rate / base:>6.2f}x"
              f" {decode:>7.2f} {decode / decode_base:>6.2f}x {t1:>5.2f}")
    print(f"# outputs different from incremental decoding (greedy / seeded): {dict(mismatches) or 'none'}")
    results["kinds"] = out


def _add(a, b):
    n = max(len(a), len(b))
    return np.pad(a, (0, n - len(a))) + np.pad(b, (0, n - len(b)))


def part_budget(llm, records, feature_arg: str, n: int, batches, node_counts, results: dict, save) -> None:
    import jax

    import specjax
    from specjax.speculation.drafters.feature import from_arg

    prompts = specjax.api.encode_prompts(llm, [r["prompt"] for r in records])
    rows, tpp = {}, {}
    # filled in place, so each save() below writes the batch sizes measured so far
    results["budget"], results["budget_tokens_per_pass"] = rows, tpp
    print(f"\n# tokens/s vs node budget (whole tree every step), {len(prompts)} prompts, {n} new tokens")
    for b in batches:
        groups = [prompts[i:i + b] for i in range(0, len(prompts), b)]
        row, per_pass = {}, {}
        for nodes in [0] + list(node_counts):
            kw = {"mode": "incremental"} if nodes == 0 else {
                "drafters": [from_arg(f"{feature_arg},nodes={nodes}", llm, load=True, expansion=None, draft="topk")]}
            specjax.generate(llm, groups[0], max_new_tokens=8, **kw)
            tokens, seconds, passes = 0, 0.0, 0
            for g in groups:
                res = specjax.generate(llm, g, max_new_tokens=n, on_tokens=lambda i, t: None, **kw)
                tokens += sum(len(t) for t in res.token_ids)
                seconds += res.stats["seconds"]
                # per request (prefill included), as the kinds part counts them: requests of a batch end apart
                passes += sum(r["llm_passes"] for r in res.stats["requests"])
            row[nodes] = tokens / seconds
            per_pass[nodes] = tokens / passes
            # as in part_kinds: every executable kept would exhaust XLA:CPU's memory maps (stop 90 failed at
            # batch 8, "LLVM compilation error: Cannot allocate memory", with those of 21 settings kept)
            jax.clear_caches()
        rows[b], tpp[b] = row, per_pass
        save()
        print(f"batch {b}: " + ", ".join(f"{k} nodes {v:.1f} tok/s ({per_pass[k]:.2f} per pass)"
                                         for k, v in row.items()), flush=True)


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in ("kinds", "depth", "cdf", "budget", "budget_tokens_per_pass")
              if p in results or (p in ("depth", "cdf") and "kinds" in results)]
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 4.2 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, panel in zip(axes.flat, panels):
        if panel == "kinds":
            r = results["kinds"]
            names = [k for k in r["tokens_per_pass"] if k != "incremental"]
            w = 0.8 / len(names)
            for i, name in enumerate(names):
                ax.bar(np.arange(len(r["kinds"])) + i * w, [r["tokens_per_pass"][name][k] for k in r["kinds"]], w,
                       label=name)
            ax.set_xticks(np.arange(len(r["kinds"])) + 0.4 - w / 2, r["kinds"], rotation=30, fontsize=7)
            ax.set_ylabel("tokens per LLM pass (greedy)")
            ax.legend(fontsize=6)
        elif panel == "depth":
            for name, acc in results["kinds"]["accepted_at_depth"].items():
                ax.plot(range(1, len(acc) + 1), acc, marker="o", label=name)
            ax.set_xlabel("depth")
            ax.set_ylabel("share of passes accepting a token at this depth")
            ax.legend(fontsize=6)
        elif panel == "cdf":
            for name, h in results["kinds"]["histogram"].items():
                h = np.asarray(h, float)
                ax.step(np.arange(len(h)), np.cumsum(h) / h.sum(), where="post", label=name)
            ax.set_xlabel("tokens per LLM pass")
            ax.set_ylabel("CDF over passes")
            ax.legend(fontsize=6)
        else:
            for b, row in results[panel].items():
                ax.plot([int(k) for k in row], list(row.values()), marker="o", label=f"batch {b}")
            ax.set_xlabel("feature drafter node budget (0 = incremental)")
            ax.set_ylabel("tokens/s" if panel == "budget" else "tokens per LLM pass (greedy)")
            ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(f"SmolLM2-135M-Instruct, float32, {common.machine().split(';')[0]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts-file", type=common.existing_file, default=TASKS)
    ap.add_argument("--drafter", default="feature:auto", help="feature:NAME or feature:PATH")
    ap.add_argument("--max-new-tokens", type=common.positive_int, default=128)
    ap.add_argument("--nodes", type=common.positive_int, default=16, help="node budget of the equal-budget comparison")
    ap.add_argument("--ssm", default="smollm2-ssm-a")
    ap.add_argument("--parts", type=common.name_list(PARTS), default=list(PARTS),
                    help=f"comma-separated, from {', '.join(PARTS)}")
    ap.add_argument("--batch-sizes", type=common.int_list(), default=[1, 2, 4, 8], help="comma-separated")
    ap.add_argument("--budget-nodes", type=common.int_list(), default=[2, 4, 8, 16, 32, 48], help="comma-separated")
    ap.add_argument("--budget-tokens", type=common.positive_int, default=64)
    ap.add_argument("--out", default="bench_out/feature")
    args = ap.parse_args()
    common.require_plotting()
    import specjax

    common.print_header("feature drafter evaluation (SmolLM2-135M-Instruct, float32)")
    records = common.load_prompts(args.prompts_file, None)  # before the model loads: a bad file fails at once
    llm = specjax.load_model("smollm2-135m-instruct", progress=False)
    arg = args.drafter.split(":", 1)[1] if args.drafter.startswith("feature:") else args.drafter
    results = {"machine": common.machine(), "command": sys.argv}
    parts = set(args.parts)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)

    def save():  # after every part (and every batch size): a later failure keeps what was measured
        with open(args.out + ".json", "w") as f:
            json.dump(results, f, indent=1, default=str)

    if "kinds" in parts:
        part_kinds(llm, records, _configs(llm, arg, args.nodes, args.ssm), args.max_new_tokens, results)
        save()
    if "budget" in parts:
        part_budget(llm, records, arg, args.budget_tokens, args.batch_sizes, args.budget_nodes, results, save)
    save()
    plot(results, args.out + ".png")
    print(f"# results: {args.out}.json, plot: {args.out}.png")
    if results.get("kinds", {}).get("mismatches"):
        sys.exit("outputs differ from incremental decoding")


if __name__ == "__main__":
    main()
