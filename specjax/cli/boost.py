"""``specjax boost-tune``: corpus of LLM continuations (resumable), then the boost-tuned SSM pool.
Kept apart from boost_tune.py so the CLI parser imports no JAX. Every argument is checked before
the corpus (which can take an hour) is generated."""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import time

from specjax.cli.signals import interruptible
from specjax.errors import InputError


def add_parser(sub, formatter_class) -> None:
    b = sub.add_parser("boost-tune", formatter_class=formatter_class,
                       help="distil a pool of SSMs from the LLM's own continuations (boost-tuning)",
                       description="Generate (or resume) a corpus of the LLM's own continuations of synthetic "
                                   "prompts, then distil a pool of small speculative models from it, each later member "
                                   "focusing on what the earlier ones miss.")
    b.add_argument("--model", default="smollm2-135m-instruct", help="the LLM")
    b.add_argument("--corpus", required=True, help="corpus directory, created or resumed (required)")
    b.add_argument("--out", required=True,
                   help="output directory: one checkpoint per member + boost_summary.json (required)")
    b.add_argument("--num-prompts", type=int, default=1200, help="synthetic training prompts")
    b.add_argument("--exclude-prompts", action="append", default=[],
                   help="prompt file (.jsonl with 'prompt', or text, one per line) held out of training; "
                        "repeatable (default: none)")
    b.add_argument("--max-new-tokens", type=int, default=128, help="tokens per continuation")
    b.add_argument("--temperatures", default="0,1", help="continuations per prompt: 0 = greedy, else seeded sampling")
    b.add_argument("--corpus-batch", type=int, default=32, help="prompts per corpus generation batch")
    b.add_argument("--member", action="append", default=None,
                   help="NAME:LAYERS[:MLP[:VOCAB]] (LLM layers to start from, MLP width, draft vocabulary); "
                        "repeat for the pool, in boosting order (default: ssm-a:0,1:768:8192 and ssm-b:0,1:768:8192)")
    b.add_argument("--epochs", type=float, default=2.0, help="passes over the corpus per member")
    b.add_argument("--batch-size", type=int, default=16, help="sequences per optimizer step")
    b.add_argument("--learning-rate", type=float, default=3e-4, help="peak AdamW learning rate")
    b.add_argument("--loss", default="tokens", choices=["tokens", "kl"],
                   help="tokens: cross-entropy on the LLM's tokens; kl: against the LLM's top-16, computed once "
                        "per corpus and cached in CORPUS/teacher-top16.npz")
    b.add_argument("--boost-weight", type=float, default=0.0,
                   help="weight later members give the tokens earlier members already predict: 0 drops them "
                        "(SpecInfer's rule), e.g. 0.2 keeps later members generalists")
    b.add_argument("--seed", type=int, default=0, help="seed of the prompts, the sampled continuations and training")
    b.add_argument("--no-progress", action="store_true", help="no progress bars")
    b.set_defaults(func=_cmd_boost_tune)


def _temperatures(text: str) -> tuple[float, ...]:
    from specjax.decoding.sampling import SamplingParams

    try:
        values = tuple(float(t) for t in text.split(","))
    except ValueError:
        raise InputError(f"--temperatures {text!r}: expected comma-separated numbers like 0,1") from None
    for t in values:
        SamplingParams(temperature=t)  # finite, >= 0, not a denormal
    return values


def _writable_dir(path: str, flag: str) -> None:
    if os.path.exists(path) and not os.path.isdir(path):
        raise InputError(f"{flag} {path}: exists and is not a directory")
    parent = os.path.abspath(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"{flag} {path}: cannot write there ({parent} is not a writable directory)")


def check_args(args):
    """Everything the run needs, checked before any work. Returns (members, temperatures, held-out
    prompts, training prompts, TrainConfig, the LLM's config)."""
    from specjax.boost.corpus import training_prompts
    from specjax.boost.distill import TrainConfig
    from specjax.boost.pool import Member, check_members, expected_steps
    from specjax.io.loader import describe_model
    from specjax.io.prompts import read_prompts_file

    if importlib.util.find_spec("optax") is None:  # the optimiser is an optional dependency (the train extra)
        raise InputError("boost-tune trains with optax, which is not installed: pip install -e '.[train]'")
    for flag, value in (("--num-prompts", args.num_prompts), ("--max-new-tokens", args.max_new_tokens),
                        ("--corpus-batch", args.corpus_batch), ("--batch-size", args.batch_size)):
        if value < 1:
            raise InputError(f"{flag} must be >= 1, got {value}")
    if not math.isfinite(args.epochs) or args.epochs <= 0:
        raise InputError(f"--epochs must be a positive number, got {args.epochs}")
    if not math.isfinite(args.learning_rate) or args.learning_rate <= 0:
        raise InputError(f"--learning-rate must be a positive number, got {args.learning_rate}")
    if not 0.0 <= args.boost_weight < 1.0:
        raise InputError(f"--boost-weight {args.boost_weight}: must be in [0, 1)")
    if not 0 <= args.seed < 2**31:
        raise InputError(f"--seed must be in [0, 2**31), got {args.seed}")
    temperatures = _temperatures(args.temperatures)
    members = [Member.parse(m) for m in (args.member or ["ssm-a:0,1:768:8192", "ssm-b:0,1:768:8192"])]
    llm_cfg = describe_model(args.model).config
    check_members(members, llm_cfg)
    held = [p for path in args.exclude_prompts
            for p in read_prompts_file(path, flag="--exclude-prompts", allow_token_ids=False, plain_lines=True)]
    prompts = training_prompts(args.num_prompts, seed=args.seed, exclude=held)
    tc = TrainConfig(epochs=args.epochs, batch_size=args.batch_size, learning_rate=args.learning_rate,
                     loss=args.loss, seed=args.seed)
    steps = expected_steps(len(prompts) * len(temperatures), tc)
    if steps <= tc.warmup_steps:
        raise InputError(f"{len(prompts)} prompts x {len(temperatures)} temperatures at --batch-size {tc.batch_size} "
                         f"and --epochs {tc.epochs:g} give {steps} optimizer steps per member, not more than the "
                         f"{tc.warmup_steps} warm-up steps: raise --num-prompts or --epochs, or lower --batch-size")
    _writable_dir(args.corpus, "--corpus")
    _writable_dir(args.out, "--out")
    return members, temperatures, held, prompts, tc


@interruptible
def _cmd_boost_tune(args, out) -> int:
    members, temperatures, held, prompts, tc = check_args(args)
    from specjax.boost.corpus import generate_corpus
    from specjax.boost.pool import boost_tune
    from specjax.io.loader import load_model

    started = time.perf_counter()
    llm = load_model(args.model, progress=not args.no_progress)
    excluded = ",".join(os.path.basename(p) for p in args.exclude_prompts) or "none"
    generate_corpus(llm, prompts, args.corpus, max_new_tokens=args.max_new_tokens, batch_size=args.corpus_batch,
                    temperatures=temperatures, seed=args.seed, progress=not args.no_progress,
                    recipe={"model": args.model,
                            "prompts": f"training_prompts({args.num_prompts}, seed={args.seed}, exclude={excluded})"})
    corpus_s = time.perf_counter() - started
    os.makedirs(args.out, exist_ok=True)
    boost_tune(llm, args.corpus, args.out, members, tc, boost_weight=args.boost_weight, progress=not args.no_progress,
               log=lambda *parts: print(*parts, file=sys.stderr, flush=True))  # progress beside the bars
    out.write(f"boost-tune done: corpus {corpus_s:.0f} s (this run), total {time.perf_counter() - started:.0f} s; "
              f"members in {args.out}\n")
    return 0
