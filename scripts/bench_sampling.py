"""Benchmark: stochastic speculative decoding — acceptance per verifier and speed, side by side.

For each temperature, per prompt (batch 1, float32, chat template, N new tokens), in one run and
with the SAME SSM, expansion and prompts: specjax incremental sampling; tree speculation verified
by naive sampling (one-hot, top-k drafts), MSS (i.i.d. drafts), RRS (drafts without replacement)
and seeded Gumbel coupling (coupled drafts); transformers sampling and transformers assisted
generation with sampling (the same SSM exported to HF). Prints mean accepted tokens per LLM pass
and tokens/s; the seeded rows must equal specjax incremental sampling token for token.

    python scripts/bench_sampling.py --ssm derived:24 --num-dev-prompts 8 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
import _bench_common as common

OTHER_TASKS = os.path.join(os.path.dirname(__file__), "data", "other_tasks.jsonl")
VERIFIERS = [("naive", "topk"), ("mss", "iid"), ("rrs", "wor"), ("seeded", "coupled")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ssm", default="derived:24", help="derived:K (the LLM's first K layers) or a model path")
    ap.add_argument("--num-dev-prompts", type=common.positive_int, default=8)
    ap.add_argument("--stride", type=common.positive_int, default=9)
    ap.add_argument("--other-tasks", type=common.nonnegative_int, default=3, help="prompts of other task kinds to add")
    ap.add_argument("--max-new-tokens", type=common.positive_int, default=64)
    ap.add_argument("--temperatures", default="1.0,0.7")
    ap.add_argument("--expansion", type=common.int_list(), default=[1, 1, 3, 1, 1, 1, 1, 1], help="comma-separated")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers rows")
    ap.add_argument("--out", default="bench_out/sampling.json")
    args = ap.parse_args()

    import specjax
    from specjax.io.hf_export import export_hf
    from specjax.io.registry import resolve

    common.print_header("stochastic speculative decoding: naive vs MSS vs RRS vs seeded (float32, batch 1)")
    records = common.load_prompts(common.DEFAULT_PROMPTS, args.num_dev_prompts, args.stride)
    if args.other_tasks:  # 0: none (load_prompts takes no count of 0)
        records += common.load_prompts(OTHER_TASKS, args.other_tasks)
    llm = specjax.load_model("smollm2-135m-instruct", progress=False)
    ssm = common.load_ssm(llm, args.ssm)
    prompts = specjax.api.encode_prompts(llm, [r["prompt"] for r in records])
    n = args.max_new_tokens
    widths = tuple(args.expansion)

    hf = hf_ssm = None
    if not args.no_hf:
        import torch
        from transformers import AutoModelForCausalLM

        ssm_dir = tempfile.mkdtemp(prefix="specjax_ssm_")
        export_hf(ssm, ssm_dir)
        hf = common.load_hf_reference(resolve("smollm2-135m-instruct"))
        hf_ssm = AutoModelForCausalLM.from_pretrained(ssm_dir, dtype=torch.float32).eval()

    results = {}
    for temperature in [float(t) for t in args.temperatures.split(",")]:
        def sampling(i):
            return specjax.SamplingParams(temperature=temperature, seed=1000 + i)

        systems = {"specjax incremental": lambda ids, i: specjax.generate(llm, [ids], max_new_tokens=n,
                                                                          sampling=sampling(i), mode="incremental")}
        for verifier, draft in VERIFIERS:
            systems[f"specjax tree {verifier} ({draft} drafts)"] = (lambda v, d: lambda ids, i: specjax.generate(
                llm, [ids], max_new_tokens=n, sampling=sampling(i), ssms=[ssm], expansion=widths, verifier=v,
                draft=d))(verifier, draft)
        if hf is not None:
            def hf_run(ids, i, assisted):
                import torch

                torch.manual_seed(1000 + i)
                kw = dict(assistant_model=hf_ssm) if assisted else {}
                with torch.no_grad():
                    out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=True, temperature=temperature,
                                      top_k=0, top_p=1.0, **kw)
                return out[0, len(ids):].tolist()

            systems["transformers sample"] = lambda ids, i: hf_run(ids, i, False)
            systems["transformers assisted sample (same SSM)"] = lambda ids, i: hf_run(ids, i, True)

        for fn in systems.values():  # warm-up: compilation and first-call costs stay out of the timings
            fn(prompts[0], 0)
        totals = {k: {"tokens": 0, "seconds": 0.0, "passes": 0, "requests_passes": 0, "mismatch": 0} for k in systems}
        for i, (rec, ids) in enumerate(zip(records, prompts)):
            reference = None
            for name, fn in systems.items():
                t0 = time.perf_counter()
                res = fn(ids, i)
                dt = time.perf_counter() - t0
                toks = res if isinstance(res, list) else res.token_ids[0]
                reference = toks if reference is None else reference
                t = totals[name]
                t["tokens"] += len(toks)
                t["seconds"] += dt
                if not isinstance(res, list):
                    t["passes"] += res.stats["llm_passes"] - 1  # the prefill pass emits the first token
                t["mismatch"] += toks != reference
            print(f"# T={temperature} done {rec.get('id')} ({rec.get('category')})", flush=True)
        results[temperature] = totals
        base = totals["specjax incremental"]
        base_tps = base["tokens"] / base["seconds"]
        naive = totals["specjax tree naive (topk drafts)"]
        naive_tpp = (naive["tokens"] - len(records)) / max(naive["passes"], 1)
        asst = totals.get("transformers assisted sample (same SSM)")
        asst_tps = asst["tokens"] / asst["seconds"] if asst else float("nan")
        print(f"# temperature {temperature}; {len(records)} prompts; SSM {args.ssm}; "
              f"expansion <{','.join(map(str, widths))}>; {n} new tokens")
        print(f"{'system':<42} {'tok/s':>7} {'vs incr':>8} {'vs HF asst':>10} {'tok/pass':>9} {'vs naive':>9} "
              f"{'== incr':>8}")
        for name, t in totals.items():
            tps = t["tokens"] / t["seconds"]
            tpp = (t["tokens"] - len(records)) / t["passes"] if t["passes"] else float("nan")
            same = f"{len(records) - t['mismatch']}/{len(records)}"
            print(f"{name:<42} {tps:>7.2f} {tps / base_tps:>7.2f}x {tps / asst_tps:>9.2f}x {tpp:>9.3f} "
                  f"{tpp / naive_tpp:>8.3f}x {same:>8}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"results": results, "machine": common.machine(), "ssm": args.ssm, "argv": sys.argv}, f, indent=1)
    print(f"# raw numbers: {args.out}")


if __name__ == "__main__":
    main()
