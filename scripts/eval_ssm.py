"""SpecInfer-style evaluation of SSMs for SmolLM2 on prompts NOT used for training.

Prompts: every ``--stride``-th shared dev prompt (all categories) plus the other task kinds in
scripts/data/other_tasks.jsonl (translation, summarisation, passage QA, math, retrieval, code);
none of them is in the boost-tuning corpus (``specjax boost-tune --exclude-prompts``).

* Table 1: is the LLM's token among the SSM's top-k, k = 1..5, teacher-forced along the LLM's own
  continuations; greedy: the LLM's greedy tokens vs the SSM's top-k; stochastic (T = 1): the LLM's
  sampled tokens, scored as P(token among k i.i.d. draws from the SSM) = 1 - (1 - q(token))^k.
* Table 2: mean tokens verified per LLM pass for widths k = 1..5, expansion <1,1,k,1,1,1,1,1>,
  greedy and stochastic (T = 1, MSS with i.i.d. drafts, and seeded verification), plus the pool
  vs its members at equal tree size.
* Figure 9: CDF of tokens per pass. Figure 10: ms per token vs tree width and batch size.

    python scripts/eval_ssm.py --ssm smollm2-ssm-a --ssm smollm2-ssm-b --max-new-tokens 128

docs/ssm_eval.json merges three such runs: write new runs under bench_out/ (the default ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import _bench_common as common  # noqa: E402

OTHER_TASKS = os.path.join(os.path.dirname(__file__), "data", "other_tasks.jsonl")
PARTS = ("tables", "pool", "latency")  # Tables 1-2, the pool vs its members, Figure 10


def table1(llm, ssms, names, prompts, n):
    """{name: {"greedy": [top1..top5], "stochastic": [...]}} teacher-forced on the LLM's continuations."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import specjax
    from specjax.decoding.incremental import full_logits
    from specjax.decoding.sampling import SamplingParams

    out = {name: {} for name in names + ["pool (any member)"]}
    for kind, temperature in (("greedy", 0.0), ("stochastic", 1.0)):
        sampling = [SamplingParams(temperature=temperature, seed=1000 + i) for i in range(len(prompts))]
        res = specjax.generate(llm, prompts, max_new_tokens=n, sampling=sampling, mode="incremental",
                               chat_template=False)
        hits = {name: np.zeros(5) for name in out}
        total = 0
        for ids, cont in zip(res.prompt_token_ids, res.token_ids):
            seq = jnp.asarray([ids + cont])
            target = np.asarray(cont)
            pool = np.zeros((len(cont), 5))
            for name, ssm in zip(names, ssms):
                logits = np.asarray(full_logits(ssm.params, seq, cfg=ssm.config))[0, len(ids) - 1:-1]
                if kind == "greedy":
                    top = np.argsort(-logits, axis=-1, kind="stable")[:, :5]
                    h = np.cumsum(top == target[:, None], axis=1) > 0
                else:
                    q = np.asarray(jax.nn.softmax(jnp.asarray(logits), axis=-1))[np.arange(len(cont)), target]
                    h = 1 - (1 - q[:, None]) ** np.arange(1, 6)[None, :]
                hits[name] += h.sum(0)
                pool = np.maximum(pool, h) if kind == "greedy" else 1 - (1 - pool) * (1 - h)
            hits["pool (any member)"] += pool.sum(0)
            total += len(cont)
        for name in out:
            out[name][kind] = (hits[name] / total).tolist()
    return out


def tokens_per_pass(llm, ssms, prompts, n, expansion, temperature, verifier="auto"):
    import specjax
    from specjax.decoding.sampling import SamplingParams

    sampling = [SamplingParams(temperature=temperature, seed=2000 + i) for i in range(len(prompts))]
    res = specjax.generate(llm, prompts, max_new_tokens=n, sampling=sampling, ssms=ssms, mode="tree",
                           expansion=expansion, verifier=verifier, chat_template=False)
    return res.stats["mean_tokens_per_pass"], res.stats["tokens_per_pass_histogram"], res.stats["tree_nodes"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ssm", action="append", required=True, help="SSM name or path; repeat for a pool (first = main)")
    ap.add_argument("--stride", type=common.positive_int, default=6)
    ap.add_argument("--max-new-tokens", type=common.positive_int, default=128)
    ap.add_argument("--latency-tokens", type=common.positive_int, default=32)
    ap.add_argument("--batches", type=common.int_list(), default=[1, 2, 4, 8], help="comma-separated")
    ap.add_argument("--parts", type=common.name_list(PARTS), default=list(PARTS),
                    help="comma-separated subset of tables (1 and 2), pool, latency (timings: run on an idle machine)")
    ap.add_argument("--out", default="bench_out/ssm_eval",
                    help="path prefix of the JSON and the plots (default: %(default)s)")
    args = ap.parse_args()
    common.require_plotting()

    import specjax

    common.print_header("SSM evaluation on held-out prompts (Tables 1-2, Figures 9-10)")
    records = common.load_prompts(common.DEFAULT_PROMPTS, None, args.stride) + common.load_prompts(OTHER_TASKS, None)
    llm = specjax.load_model("smollm2-135m-instruct", progress=False)
    ssms = [specjax.load_model(s, progress=False) for s in args.ssm]
    names = [os.path.basename(s.rstrip("/")) for s in args.ssm]
    prompts = specjax.api.encode_prompts(llm, [r["prompt"] for r in records])
    kinds = sorted({r.get("category", "?") for r in records})
    print(f"# {len(records)} held-out prompts, kinds: {', '.join(kinds)}; {args.max_new_tokens} new tokens")
    result = {"machine": common.machine(), "command": common.command(), "ssms": args.ssm, "prompts": len(records),
              "kinds": kinds}

    parts = set(args.parts)
    t0 = time.perf_counter()
    if "tables" in parts:
        run_tables(result, llm, ssms, names, prompts, args.max_new_tokens)
    if "pool" in parts and len(ssms) > 1:
        run_pool(result, llm, ssms, names, prompts, args.max_new_tokens)
    elif "pool" in parts:
        print("\n# pool: skipped, it needs two or more --ssm")
    batches = args.batches
    if "latency" in parts:
        run_latency(result, llm, ssms, prompts, batches, args.latency_tokens)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    plot(result, batches, args.out)
    print(f"# wrote {args.out}.json and its plots ({time.perf_counter() - t0:.0f} s)")


MODES = (("greedy", 0.0, "auto"), ("stochastic MSS", 1.0, "mss"), ("stochastic seeded", 1.0, "seeded"))


def run_tables(result, llm, ssms, names, prompts, n):
    t0 = time.perf_counter()
    result["table1"] = table1(llm, ssms, names, prompts, n)
    print("\n## Table 1: LLM token among the SSM's top-k (teacher-forced)")
    print(f"{'SSM':<22} {'mode':<11} " + " ".join(f"{'k=' + str(k):>6}" for k in range(1, 6)))
    for name, row in result["table1"].items():
        for kind in ("greedy", "stochastic"):
            print(f"{name:<22} {kind:<11} " + " ".join(f"{v:>6.3f}" for v in row[kind]))
    print(f"# ({time.perf_counter() - t0:.0f} s)")

    result["table2"] = {}
    print("\n## Table 2: mean tokens per LLM pass, expansion <1,1,k,1,1,1,1,1>, SSM", names[0])
    print(f"{'mode':<18} " + " ".join(f"{'k=' + str(k):>6}" for k in range(1, 6)))
    for label, temperature, verifier in MODES:
        row = []
        for k in range(1, 6):
            mean, hist, _ = tokens_per_pass(llm, ssms[:1], prompts, n, (1, 1, k, 1, 1, 1, 1, 1), temperature, verifier)
            row.append({"k": k, "mean": mean, "histogram": hist})
        result["table2"][label] = row
        print(f"{label:<18} " + " ".join(f"{r['mean']:>6.2f}" for r in row), flush=True)



def run_pool(result, llm, ssms, names, prompts, n):
    chain = (1,) * 8
    wide = (len(ssms),) + (1,) * 7  # one SSM, len(ssms) chains: the same node count as the pool
    print(f"\n## Pool vs members at equal tree size ({1 + 8 * len(ssms)} nodes)")
    result["pool"] = {}
    for label, temperature, verifier in MODES[:2]:
        cells = {}
        for name, ssm in zip(names, ssms):
            cells[f"{name} <{','.join(map(str, wide))}>"] = tokens_per_pass(
                llm, [ssm], prompts, n, wide, temperature, verifier)[0]
        cells[f"pool {'+'.join(names)} <1 x 8> each"] = tokens_per_pass(
            llm, ssms, prompts, n, [chain] * len(ssms), temperature, verifier)[0]
        result["pool"][label] = cells
        for cell, v in cells.items():
            print(f"{label:<18} {cell:<44} {v:.3f}", flush=True)


def run_latency(result, llm, ssms, prompts, batches, tokens):
    import specjax

    print("\n## Figure 10: ms per generated token vs tree width and batch size (greedy)")
    latency = {}
    for b in batches:
        batch_prompts = (prompts * b)[:b]
        for k in [0] + list(range(1, 6)):
            kw = dict(mode="incremental") if k == 0 else dict(ssms=ssms[:1], expansion=(1, 1, k, 1, 1, 1, 1, 1))
            # the first call compiles; the second is timed
            specjax.generate(llm, batch_prompts, max_new_tokens=tokens, chat_template=False, **kw)
            res = specjax.generate(llm, batch_prompts, max_new_tokens=tokens, chat_template=False, **kw)
            ms = 1000 * res.stats["seconds"] / max(res.stats["generated_tokens"] / b, 1)
            latency[f"{b}:{k}"] = ms
        print(f"batch {b}: incremental {latency[f'{b}:0']:.1f} ms/token; tree k=1..5: "
              + " ".join(f"{latency[f'{b}:{k}']:.1f}" for k in range(1, 6)), flush=True)
    result["latency_ms_per_token"] = latency


def plot(result, batches, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    if "table2" not in result:
        return plot_latency(result, batches, out) if "latency_ms_per_token" in result else None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, label in zip(axes, ("greedy", "stochastic MSS")):
        for row in result["table2"][label]:
            hist = np.asarray(row["histogram"], float)
            cdf = np.cumsum(hist) / hist.sum()
            ax.step(np.arange(len(hist)), cdf, where="post", label=f"k={row['k']} (mean {row['mean']:.2f})")
        ax.set_title(f"{label}, <1,1,k,1,1,1,1,1>", fontsize=10)
        ax.set_xlabel("tokens verified per LLM pass")
        ax.legend(fontsize=8)
    axes[0].set_ylabel("CDF over LLM passes")
    fig.suptitle("Figure 9 style: SmolLM2-135M-Instruct + boost-tuned SSM, held-out prompts", fontsize=10)
    fig.tight_layout()
    fig.savefig(out + "_cdf.png", dpi=110)
    if "latency_ms_per_token" in result:
        plot_latency(result, batches, out)


def plot_latency(result, batches, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    lat = result["latency_ms_per_token"]
    for b in batches:
        ax.plot(range(0, 6), [lat[f"{b}:{k}"] for k in range(0, 6)], marker="o", label=f"batch {b}")
    ax.set_xticks(range(6), ["incr."] + [str(k) for k in range(1, 6)])
    ax.set_xlabel("tree width k in <1,1,k,1,1,1,1,1> (incr. = incremental decoding)")
    ax.set_ylabel("ms per generated token (per request)")
    ax.set_title("Figure 10 style: latency vs tree width and batch size (CPU)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out + "_latency.png", dpi=110)


if __name__ == "__main__":
    main()
