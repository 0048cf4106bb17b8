"""An HF directory with a model's architecture and seeded random weights, for benchmarks on machines
the weights cannot reach (the GPU machine takes 64 MiB per call; SmolLM2's GGUF is 98 MB). A dense
forward pass costs the same whatever the weight values, so timings carry over; tokens do not.

Two steps, the first where the model is, the second where the benchmark runs:

    python scripts/random_weights_model.py --config-of smollm2-135m-instruct --out scripts/data/smollm2-135m-config.json
    python scripts/random_weights_model.py --config scripts/data/smollm2-135m-config.json --out /tmp/smollm2-random

The weights come from transformers' own initialisation (``LlamaForCausalLM(config)``, seeded), so
the directory loads in transformers and in ``specjax.load_model`` alike.
"""

from __future__ import annotations

import argparse
import json
import os


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--config-of", help="write this model's transformers config.json to --out (a file)")
    src.add_argument("--config", help="a transformers config.json: write it with random weights to --out (a directory)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    if args.config_of:
        import specjax
        from specjax.io.hf_export import hf_config

        config = specjax.describe_model(args.config_of).config  # the architecture only, no weights loaded
        with open(args.out, "w") as f:
            json.dump(hf_config(config), f, indent=1)
            f.write("\n")
        print(f"wrote {args.out} ({args.config_of}'s architecture)")
        return

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if not os.path.isfile(args.config):
        raise SystemExit(f"--config {args.config}: no such file")
    config = AutoConfig.from_pretrained(args.config)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(args.out)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.out}: {config.model_type}, {n / 1e6:.1f}M parameters, random weights (seed {args.seed})")


if __name__ == "__main__":
    main()
