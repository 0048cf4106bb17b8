"""Speculative decoding against incremental decoding on any model, on whatever backend jax runs:
greedy and seeded outputs must be identical token for token. Exits 1 on the first difference.

A quick end-to-end check for a new machine (the GPU: the tree pass runs the compiled Pallas kernel
through ``impl=auto``), in strict float32 (``highest`` matmul precision, as the equivalence tests;
under a GPU's default TF32 the tree and incremental routes may round near-ties apart), needing no
tokenizer: prompts are seeded random token ids, half of each a
repeat of its first half, so the lookup drafter finds something to copy and trees get accepted.

    python scripts/check_lossless.py --model /tmp/smollm2-random --prompts 4 --max-new-tokens 48
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import _bench_common as common  # noqa: E402


def _prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.RandomState(seed)
    out = []
    for _ in range(n):
        half = rng.randint(3, vocab, (length + 1) // 2).tolist()  # ids 0-2 are special in LLaMA vocabularies
        out.append((half + half)[:length])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a registered name or a model path")
    ap.add_argument("--prompts", type=common.positive_int, default=4)
    ap.add_argument("--prompt-tokens", type=common.positive_int, default=40)
    ap.add_argument("--max-new-tokens", type=common.positive_int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import jax

    jax.config.update("jax_default_matmul_precision", "highest")  # equivalence is checked in true float32
    import specjax
    from specjax.decoding.sampling import SamplingParams
    from specjax.io import registry
    from specjax.speculation.drafters import FACTORIES
    from specjax.speculation.drafters.ssm import parse_derived
    from specjax.speculation.expansion import Expansion

    common.print_header("lossless check: speculative == incremental (greedy and seeded)")
    model = specjax.load_model(args.model, progress=False)
    prompts = _prompts(model.config.vocab_size, args.prompts, args.prompt_tokens, args.seed)
    widths = Expansion(registry.DEFAULT_EXPANSION)
    lookup = FACTORIES["lookup"]("auto", model, load=True, expansion=widths, draft="topk")
    cases = [  # (name, sampling, generate kwargs)
        ("lookup, budget auto", None, dict(drafters=[lookup], budget="auto")),
        ("lookup, whole tree", None, dict(drafters=[lookup])),
        ("lookup, whole tree, xla", None, dict(drafters=[lookup], impl="xla")),
    ]
    # the derived SSM's depth follows the model (derived:auto: the first min(4, max(1, L // 4)) layers), since a
    # derived SSM needs K in [1, L - 1]; a one-layer model has no derived SSM to check
    if model.config.num_layers >= 2:
        ssm = f"derived:{len(parse_derived('derived:auto', model.config))}"
        cases += [
            (f"SSM {ssm} tree", None, dict(drafters=[FACTORIES["ssm"](ssm, model, load=True, expansion=widths,
                                                                     draft="topk")])),
            (f"SSM {ssm} tree, seeded T=1", "seeded", dict(drafters=[FACTORIES["ssm"](
                ssm, model, load=True, expansion=widths, draft="coupled")], verifier="seeded")),
        ]
    else:
        print(f"# SSM cases skipped: a derived SSM needs 2+ layers, {args.model} has {model.config.num_layers}")
    greedy_ref = specjax.generate(model, prompts, args.max_new_tokens, ignore_eos=True,
                                  mode="incremental").token_ids
    seeded = [SamplingParams(temperature=1.0, seed=args.seed + i) for i in range(len(prompts))]
    seeded_ref = specjax.generate(model, prompts, args.max_new_tokens, sampling=seeded, ignore_eos=True,
                                  mode="incremental").token_ids
    failed = 0
    for name, sampling, kw in cases:
        out = specjax.generate(model, prompts, args.max_new_tokens, ignore_eos=True, mode="tree",
                               sampling=seeded if sampling else None, **kw)
        ref = seeded_ref if sampling else greedy_ref
        same = [a == b for a, b in zip(out.token_ids, ref)]
        tpp = out.stats["generated_tokens"] / max(1, out.stats["llm_passes"])
        print(f"  {name:<32} identical {sum(same)}/{len(same)}, {tpp:.2f} tokens per LLM pass", flush=True)
        failed += not all(same)
    print("# all identical" if not failed else f"# {failed} configuration(s) differ from incremental decoding")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
