"""``specjax boost-tune``: corpus of LLM continuations (resumable), then the boost-tuned SSM pool.
Kept apart from boost_tune.py so the CLI parser imports no JAX."""

from __future__ import annotations

import json
import os
import time

from specjax.errors import InputError


def _read_prompt_file(path: str) -> list[str]:
    """Prompts of a .jsonl file ({"prompt": ...} per line) or a plain text file (one per line)."""
    if not os.path.isfile(path):
        raise InputError(f"--exclude-prompts {path}: no such file")
    with open(path) as f:
        lines = [line.rstrip("\n") for line in f if line.strip()]
    if path.endswith(".jsonl"):
        try:
            return [json.loads(line)["prompt"] for line in lines]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise InputError(f"{path}: every line must be a JSON object with a 'prompt' ({e})") from None
    return lines


def add_parser(sub) -> None:
    b = sub.add_parser("boost-tune", help="distil a pool of SSMs from the LLM's own continuations (boost-tuning)")
    b.add_argument("--model", default="smollm2-135m-instruct", help="the LLM (default: %(default)s)")
    b.add_argument("--corpus", required=True, help="corpus directory (created/resumed: LLM continuations)")
    b.add_argument("--out", required=True, help="output directory: one checkpoint per member + boost_summary.json")
    b.add_argument("--num-prompts", type=int, default=1200, help="synthetic training prompts")
    b.add_argument("--exclude-prompts", action="append", default=[],
                   help="prompt file (.jsonl with 'prompt', or text) held out of training; repeatable")
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--temperatures", default="0,1", help="continuations per prompt: 0 = greedy, else seeded sampling")
    b.add_argument("--corpus-batch", type=int, default=32)
    b.add_argument("--member", action="append", default=None,
                   help="NAME:LAYERS[:MLP[:VOCAB]] (LLM layers to start from, MLP width, draft vocabulary); "
                        "repeat for the pool, in boosting order (default: ssm-a:0,1:768:8192 and ssm-b:0,1:768:8192)")
    b.add_argument("--epochs", type=float, default=2.0)
    b.add_argument("--batch-size", type=int, default=16)
    b.add_argument("--learning-rate", type=float, default=3e-4)
    b.add_argument("--loss", default="tokens", choices=["tokens", "kl"],
                   help="tokens: cross-entropy on the LLM's tokens; kl: against the LLM's top-16, computed once "
                        "per corpus and cached in CORPUS/teacher-top16.npz (default: %(default)s)")
    b.add_argument("--boost-weight", type=float, default=0.0,
                   help="weight later members give the tokens earlier members already predict: 0 drops them "
                        "(SpecInfer's rule), e.g. 0.2 keeps later members generalists (default: %(default)s)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--no-progress", action="store_true")
    b.set_defaults(func=_cmd_boost_tune)


def _cmd_boost_tune(args) -> int:
    from specjax import load_model
    from specjax.boost import generate_corpus, training_prompts
    from specjax.boost_tune import Member, boost_tune
    from specjax.distill import TrainConfig

    members = [Member.parse(m) for m in (args.member or ["ssm-a:0,1:768:8192", "ssm-b:0,1:768:8192"])]
    try:
        temperatures = tuple(float(t) for t in args.temperatures.split(","))
    except ValueError:
        raise InputError(f"--temperatures {args.temperatures!r}: expected comma-separated numbers") from None
    if not 0.0 <= args.boost_weight < 1.0:  # checked here too so that a typo fails before the LLM loads
        raise InputError(f"--boost-weight {args.boost_weight}: must be in [0, 1)")
    held = [p for path in args.exclude_prompts for p in _read_prompt_file(path)]
    started = time.perf_counter()
    llm = load_model(args.model, progress=not args.no_progress)
    prompts = training_prompts(args.num_prompts, seed=args.seed, exclude=held)
    excluded = ",".join(os.path.basename(p) for p in args.exclude_prompts) or "none"
    generate_corpus(llm, prompts, args.corpus, max_new_tokens=args.max_new_tokens, batch_size=args.corpus_batch,
                    temperatures=temperatures, seed=args.seed, progress=not args.no_progress,
                    recipe={"model": args.model,
                            "prompts": f"training_prompts({args.num_prompts}, seed={args.seed}, exclude={excluded})"})
    corpus_s = time.perf_counter() - started
    tc = TrainConfig(epochs=args.epochs, batch_size=args.batch_size, learning_rate=args.learning_rate,
                     loss=args.loss, seed=args.seed)
    os.makedirs(args.out, exist_ok=True)
    boost_tune(llm, args.corpus, args.out, members, tc, boost_weight=args.boost_weight, progress=not args.no_progress)
    print(f"boost-tune done: corpus {corpus_s:.0f} s (this run), total {time.perf_counter() - started:.0f} s; "
          f"members in {args.out}")
    return 0
