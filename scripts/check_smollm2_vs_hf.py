"""Greedy equivalence on the embedded model: specjax vs transformers, token for token, every prompt.

    python scripts/check_smollm2_vs_hf.py --max-new-tokens 64 [--batch-size 8]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import _bench_common as common  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts-file", default=common.DEFAULT_PROMPTS)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8, help="specjax decodes prompts in mixed-length batches")
    args = ap.parse_args()

    import torch

    import specjax
    from specjax.io.registry import resolve

    common.print_header("greedy equivalence: specjax vs transformers on SmolLM2-135M-Instruct (float32)")
    records = common.load_prompts(args.prompts_file, None)
    model = specjax.load_model("smollm2-135m-instruct", progress=False)
    hf = common.load_hf_reference(resolve("smollm2-135m-instruct"))
    prompts = [r["prompt"] for r in records]
    mismatches = []
    for start in range(0, len(prompts), args.batch_size):
        batch = prompts[start:start + args.batch_size]
        res = specjax.generate(model, batch, max_new_tokens=args.max_new_tokens, mode="incremental")
        for j, (ids, ours) in enumerate(zip(res.prompt_token_ids, res.token_ids)):
            with torch.no_grad():
                out = hf.generate(torch.tensor([ids]), max_new_tokens=args.max_new_tokens, do_sample=False)
            theirs = out[0, len(ids):].tolist()
            rec = records[start + j]
            status = "identical" if ours == theirs else "DIFFERENT"
            print(f"{rec['id']:>3} {rec['category']:<15} {len(ours):>3} tokens {status}", flush=True)
            if ours != theirs:
                mismatches.append(rec["id"])
    print(f"# {len(prompts) - len(mismatches)}/{len(prompts)} prompts identical; mismatching ids: {mismatches}")
    sys.exit(1 if mismatches else 0)


if __name__ == "__main__":
    main()
