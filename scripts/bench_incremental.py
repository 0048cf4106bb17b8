"""Benchmark: specjax incremental decoding vs transformers' generate, side by side in one run.

Same model file (the embedded SmolLM2 GGUF, dequantized to float32 by both), same prompts (chat
template applied once, the same token ids fed to both), greedy, batch 1, N new tokens. Prompts
alternate between the two systems so that machine drift affects both alike.

    python scripts/bench_incremental.py --num-prompts 10 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import _bench_common as common  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts-file", type=common.existing_file, default=common.DEFAULT_PROMPTS)
    ap.add_argument("--num-prompts", type=common.positive_int, default=10)
    ap.add_argument("--stride", type=common.positive_int, default=7,
                    help="take every STRIDE-th prompt (spans categories)")
    ap.add_argument("--max-new-tokens", type=common.positive_int, default=128)
    ap.add_argument("--json-out", help="write per-prompt records here")
    args = ap.parse_args()

    import torch

    import specjax
    from specjax.io.registry import resolve

    common.print_header("specjax incremental decoding vs transformers generate (greedy, float32, batch 1)")
    print(f"# torch {torch.__version__} ({torch.get_num_threads()} threads)")
    records = common.load_prompts(args.prompts_file, args.num_prompts, args.stride)

    t0 = time.perf_counter()
    model = specjax.load_model(args.model, progress=False)
    sj_load = time.perf_counter() - t0
    prompts = specjax.api.encode_prompts(model, [r["prompt"] for r in records])
    t0 = time.perf_counter()
    specjax.generate(model, [prompts[0]], max_new_tokens=args.max_new_tokens, mode="incremental")
    sj_first = time.perf_counter() - t0

    t0 = time.perf_counter()
    hf = common.load_hf_reference(resolve(args.model))
    hf_load = time.perf_counter() - t0
    t0 = time.perf_counter()
    with torch.no_grad():
        hf.generate(torch.tensor([prompts[0]]), max_new_tokens=args.max_new_tokens, do_sample=False)
    hf_first = time.perf_counter() - t0

    rows, same = [], 0
    sj_tokens = sj_time = hf_tokens = hf_time = 0.0
    print(f"{'id':>4} {'prompt_len':>10} {'new':>5} {'specjax tok/s':>14} {'hf tok/s':>10} {'ratio':>6} same")
    for rec, ids in zip(records, prompts):
        ours, dt_sj, theirs, dt_hf = common.greedy_pair(model, hf, ids, args.max_new_tokens)
        same += ours == theirs
        sj_tokens += len(ours)
        sj_time += dt_sj
        hf_tokens += len(theirs)
        hf_time += dt_hf
        r = {"id": rec.get("id"), "prompt_len": len(ids), "specjax_tokens": len(ours), "specjax_s": dt_sj,
             "hf_tokens": len(theirs), "hf_s": dt_hf, "identical": ours == theirs}
        rows.append(r)
        print(f"{rec.get('id', ''):>4} {len(ids):>10} {len(ours):>5} {len(ours) / dt_sj:>14.2f} "
              f"{len(theirs) / dt_hf:>10.2f} {(len(ours) / dt_sj) / (len(theirs) / dt_hf):>6.2f} {ours == theirs}")
    sj_tps, hf_tps = sj_tokens / sj_time, hf_tokens / hf_time
    print(f"# prompts: {len(records)}; identical outputs: {same}/{len(records)}")
    print(f"# specjax incremental: {sj_tps:.2f} tokens/s ({sj_tokens:.0f} tokens in {sj_time:.1f}s)")
    print(f"# transformers generate: {hf_tps:.2f} tokens/s ({hf_tokens:.0f} tokens in {hf_time:.1f}s)")
    print(f"# ratio specjax / transformers: {sj_tps / hf_tps:.2f}x")
    print(f"# cold start specjax: load {sj_load:.1f}s + first generate (compile + run) {sj_first:.1f}s")
    print(f"# cold start transformers: load {hf_load:.1f}s + first generate {hf_first:.1f}s")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"rows": rows, "specjax_tps": sj_tps, "hf_tps": hf_tps, "machine": common.machine()}, f, indent=1)


if __name__ == "__main__":
    main()
