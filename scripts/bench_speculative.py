"""Benchmark: speculative generation vs incremental decoding vs transformers, side by side.

Per prompt (batch 1, greedy, float32, N new tokens, chat template), in one run: specjax incremental,
specjax sequence- and tree-speculative with the given SSM (several expansions), transformers
``generate`` and transformers assisted generation with the SAME SSM (exported as an HF directory).
Prints tokens/s, LLM passes per token, mean accepted tokens per pass and speedups; saves a PNG.

    python scripts/bench_speculative.py --ssm derived:4 --num-dev-prompts 14 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
import _bench_common as common  # noqa: E402

OTHER_TASKS = os.path.join(os.path.dirname(__file__), "data", "other_tasks.jsonl")


def expansion_list(text: str) -> list[tuple[int, ...]]:
    """argparse type of --expansions: semicolon-separated expansions, each comma-separated widths >= 1."""
    return [tuple(common.int_list()(item)) for item in text.split(";")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ssm", default="smollm2-ssm-a",
                    help="a registered SSM name, derived:K (the LLM's first K layers) or a model path")
    ap.add_argument("--num-dev-prompts", type=common.positive_int, default=14)
    ap.add_argument("--stride", type=common.positive_int, default=6)
    ap.add_argument("--max-new-tokens", type=common.positive_int, default=128)
    ap.add_argument("--expansions", type=expansion_list, default="1,1,1,1;1,1,3,1,1,1,1,1;2,1,1",
                    help="semicolon-separated; all-ones = sequence mode")
    ap.add_argument("--out", default="bench_out/speculative.png")
    args = ap.parse_args()
    common.require_plotting()

    import torch
    from transformers import AutoModelForCausalLM

    import specjax
    from specjax.io.hf_export import draft_vocab_mask, export_hf
    from specjax.io.registry import resolve

    common.print_header("speculative vs incremental vs transformers (greedy, float32, batch 1)")
    records = common.load_prompts(common.DEFAULT_PROMPTS, args.num_dev_prompts, args.stride)
    num_dev = len(records)
    records += common.load_prompts(OTHER_TASKS, None)
    llm = specjax.load_model("smollm2-135m-instruct", progress=False)
    ssm = common.load_ssm(llm, args.ssm)
    ssm_dir = tempfile.mkdtemp(prefix="specjax_ssm_")
    export_hf(ssm, ssm_dir)
    hf = common.load_hf_reference(resolve("smollm2-135m-instruct"))
    hf_ssm = AutoModelForCausalLM.from_pretrained(ssm_dir, dtype=torch.float32).eval()
    mask = draft_vocab_mask(ssm_dir, llm.config.vocab_size)
    if mask is not None:  # a shrunk-head SSM: the same -inf outside its draft vocabulary as in specjax
        mask = torch.tensor(mask)
        hf_ssm.lm_head.register_forward_hook(lambda module, inputs, out: out + mask)
    prompts = specjax.api.encode_prompts(llm, [r["prompt"] for r in records])
    n = args.max_new_tokens

    systems = {"specjax incremental": lambda ids: specjax.generate(llm, [ids], max_new_tokens=n, mode="incremental")}
    for widths in args.expansions:
        text = ",".join(map(str, widths))
        mode = "sequence" if set(widths) == {1} else "tree"
        systems[f"specjax {mode} <{text}>"] = (lambda w, m: lambda ids: specjax.generate(
            llm, [ids], max_new_tokens=n, mode=m, ssms=[ssm], expansion=w))(widths, mode)

    def hf_run(ids, assisted):
        kw = dict(assistant_model=hf_ssm) if assisted else {}
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, **kw)
        return out[0, len(ids):].tolist()

    systems["transformers generate"] = lambda ids: hf_run(ids, False)
    systems["transformers assisted (same SSM)"] = lambda ids: hf_run(ids, True)

    for fn in systems.values():  # warm-up: compile and first-call costs stay out of the timings
        fn(prompts[0])
    totals = {k: {"tokens": 0, "seconds": 0.0, "passes": 0, "mismatch": 0} for k in systems}
    for rec, ids in zip(records, prompts):
        reference = None
        for name, fn in systems.items():
            t0 = time.perf_counter()
            res = fn(ids)
            dt = time.perf_counter() - t0
            toks = res if isinstance(res, list) else res.token_ids[0]
            reference = toks if reference is None else reference
            t = totals[name]
            t["tokens"] += len(toks)
            t["seconds"] += dt
            t["passes"] += 0 if isinstance(res, list) else res.stats["llm_passes"]
            t["mismatch"] += toks != reference
        print(f"# done {rec.get('id')} ({rec.get('category')})", flush=True)

    base = totals["specjax incremental"]
    base_tps = base["tokens"] / base["seconds"]
    assisted = totals["transformers assisted (same SSM)"]
    assisted_tps = assisted["tokens"] / assisted["seconds"]
    print(f"# prompts: {len(records)} ({num_dev} dev, {len(records) - num_dev} other task kinds); SSM {args.ssm}; "
          f"{n} new tokens")
    print(f"{'system':<42} {'tok/s':>7} {'vs incr':>8} {'vs HF asst':>10} {'passes/tok':>10} {'tok/pass':>9} "
          f"{'outputs != incr':>15}")
    rows = []
    for name, t in totals.items():
        tps = t["tokens"] / t["seconds"]
        ppt = t["passes"] / t["tokens"] if t["passes"] else float("nan")
        print(f"{name:<42} {tps:>7.2f} {tps / base_tps:>7.2f}x {tps / assisted_tps:>9.2f}x {ppt:>10.3f} "
              f"{(1 / ppt if t['passes'] else float('nan')):>9.2f} {t['mismatch']:>15}")
        rows.append((name, tps))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:  # before plotting: the numbers survive a plot failure
        json.dump({"totals": totals, "machine": common.machine(), "command": common.command(), "ssm": args.ssm}, f,
                  indent=1)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    ax.barh([r[0] for r in rows], [r[1] for r in rows], color="tab:blue")
    ax.set_xlabel("tokens/s (batch 1, greedy, float32)")
    ax.set_title(f"SmolLM2-135M-Instruct, SSM {args.ssm}, {len(records)} prompts, {common.machine().split(';')[0]}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"# plot: {args.out}")


if __name__ == "__main__":
    main()
