"""``specjax feature-tune``: the feature drafter from scratch, every stage resumable: the corpus of the
LLM's own continuations (several task kinds), the LLM's features at every position, unrolled
training, held-out agreement by depth, and the exported drafter. Kept apart from the training code so
the CLI parser imports no JAX; every argument is checked before the corpus (hours) starts."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import time

from specjax.cli.signals import interruptible
from specjax.errors import InputError

# The drafting settings of the shipped drafter (models/smollm2-feature): what an export gets by default.
SHIPPED_DRAFTING = {"depth": 4, "beam": 4, "nodes": 16}


def resolve_drafting(llm, init_from: str | None, given: dict) -> dict:
    """The exported drafter's drafting settings: each one given, else ``init_from``'s own (continuing a
    drafter keeps how it drafts, as it keeps its layers and fusion), else ``SHIPPED_DRAFTING``; and the
    tree budget's ladder of node counts up to ``nodes``."""
    base = dict(SHIPPED_DRAFTING)
    if init_from is not None:
        from specjax.speculation.drafters.feature import load_feature_drafter

        own = load_feature_drafter(init_from, llm, load=False).drafter
        base = {k: getattr(own, k) for k in base}
    drafting = {k: base[k] if given.get(k) is None else given[k] for k in base}
    nodes = drafting["nodes"]
    drafting["ladder"] = tuple(sorted({0, 1, min(3, nodes), min(6, nodes), min(10, nodes), nodes}))
    return drafting


def add_parser(sub, formatter_class) -> None:
    f = sub.add_parser("feature-tune", formatter_class=formatter_class,
                       help="train a feature drafter (EAGLE-style) on the LLM's own continuations",
                       description="Generate (or resume) a corpus of the LLM's continuations of prompts of several "
                                   "task kinds, compute the LLM's features at every position, train the feature "
                                   "drafter with unrolled multi-step drafting, report held-out agreement by depth and "
                                   "export the drafter (load it with --drafter feature:PATH). Rerun the same command "
                                   "to resume after an interruption.")
    f.add_argument("--model", default="smollm2-135m-instruct", help="the LLM")
    f.add_argument("--corpus", required=True, help="corpus directory, created or resumed (required)")
    f.add_argument("--out", required=True, help="training run directory: checkpoints, history, summary (required)")
    f.add_argument("--export", help="write the trained drafter here, a new or empty directory (default: none, "
                                     "the drafter stays in --out's checkpoints)")
    f.add_argument("--exclude-prompts", action="append", default=[],
                   help="prompt file held out of training (.jsonl with 'prompt', or text lines); repeatable "
                        "(default: none)")
    f.add_argument("--eval-prompts", action="append", default=[],
                   help="hand-written prompt file (.jsonl with 'prompt', or text lines) whose greedy continuations "
                        "are a second held-out set, reported beside the corpus split (which shares the training "
                        "prompts' generator and flatters the drafter); its prompts are held out of training too; "
                        "repeatable (default: none)")
    f.add_argument("--passages", type=int, default=1200, help="stage-1 passages the grounded prompts quote")
    f.add_argument("--tasks", type=int, default=6400, help="chat/explain/QA/creative/math/code prompts")
    f.add_argument("--grounded", type=int, default=2400,
                   help="summarise/passage-QA/retrieval/rewrite/translate/extract prompts quoting the passages")
    f.add_argument("--requests", type=int, default=0,
                   help="requests the LLM writes itself (self-instruct: many kinds, users and topics; about half "
                        "are kept), answered greedily into a further part (default: 0, none)")
    f.add_argument("--more-requests", type=int, default=0,
                   help="a second round of self-written requests (other meta prompts and sampling seeds; those "
                        "already in the corpus dropped), answered into a part of its own: grows a corpus without "
                        "changing its earlier parts; it depends on the first round, so keep --requests as it was "
                        "made with (default: 0, none)")
    from specjax.boost.feature_corpus import WRITTEN_ROUNDS

    for written_round in WRITTEN_ROUNDS.values():  # one flag per round, in the plan field it fills
        f.add_argument(written_round.flag, action="append", default=[], dest=written_round.files_field, metavar="FILE",
                       help=_written_help(written_round))
    f.add_argument("--sampled-fraction", type=float, default=0.25,
                   help="share of task and grounded prompts continued at temperature 1 (seeded)")
    f.add_argument("--corpus-batch", type=int, default=128, help="prompts per generation batch")
    f.add_argument("--draft-vocab", type=int, default=8192, help="tokens the drafter can name (most frequent)")
    f.add_argument("--held-out", type=float, default=0.02, help="share of sequences held out for evaluation")
    f.add_argument("--max-eval", type=int, default=400,
                   help="held-out sequences evaluated during training (evenly spaced, so every corpus part keeps its "
                        "share; the summary's history_set_agreement is the final drafter on the same sequences)")
    f.add_argument("--fused", default=None,
                   help="comma-separated LLM layers whose hidden states an EAGLE-3-style drafter reads, fused into "
                        "one feature; the LLM's layer count (30 for SmolLM2) names its final feature, which lets a "
                        "final-feature --init-from start exactly as it drafts; a fused --init-from may be given more "
                        "layers, which start at zero (default: the final feature only, or --init-from's)")
    f.add_argument("--layers", type=int, default=None,
                   help="the drafter's decoder layers (each of the LLM's block shape); more than a --init-from drafter "
                        "has start as exactly it, the added layers passing their input on (default: 1, or "
                        "--init-from's)")
    f.add_argument("--train-groups", default=None,
                   help="comma-separated split groups of the corpus to train on and evaluate (templates, requests, "
                        "requests-b, written, written-b, ...; a round is a group once its flag is given): the LLM's "
                        "features are computed for their parts only, so continuing an --init-from drafter on a new "
                        "round costs that round's features, not the whole corpus's; the other groups are still "
                        "counted, so the held-out split stays the whole corpus's (default: every group)")
    f.add_argument("--init-from", help="continue training this feature drafter (registered name or directory), "
                                        "keeping its draft vocabulary (default: none, a fresh start)")
    f.add_argument("--epochs", type=float, default=1.0, help="passes over the training sequences")
    f.add_argument("--batch-size", type=int, default=8, help="sequences per optimizer step")
    f.add_argument("--learning-rate", type=float, default=5e-4, help="peak AdamW learning rate")
    f.add_argument("--unrolled-steps", type=int, default=4, help="drafting steps unrolled in training")
    f.add_argument("--reg-weight", type=float, default=0.5,
                   help="weight of the smooth-L1 regression of the drafter's features on the LLM's, beside the "
                        "distribution loss (0: the distribution loss alone, as EAGLE-3 trains) (default: 0.5)")
    for flag, what in (("depth", "drafting depth"), ("beam", "beam (children per expanded node)"),
                       ("nodes", "node budget (best nodes kept)")):
        f.add_argument(f"--{flag}", type=int, default=None,
                       help=f"the exported drafter's {what} (default: --init-from's, else the shipped drafter's "
                            f"{SHIPPED_DRAFTING[flag]})")
    f.add_argument("--stop-after", type=int, default=None,
                   help="train at most this many steps in this run (0: no training, evaluate and export the newest "
                        "checkpoint), then evaluate and export what there is; running again resumes (default: "
                        "none, train to the end)")
    f.add_argument("--time-budget", type=float, default=None,
                   help="seconds this run may take before its training stops (counted from its start: the corpus, "
                        "features and evaluations count), then checkpoint, evaluate and export what there is (the "
                        "learning-rate schedule stays the planned one; running again resumes) (default: none)")
    f.add_argument("--batch-shapes", choices=("auto", "cpu", "gpu"), default="auto",
                   help="how feature and training batches are padded: cpu (little padding), gpu (widths a multiple of "
                        "256, full feature batches of 32: few shapes, since compiles cost more than padding there); "
                        "auto: gpu on any accelerator backend (default: auto)")
    from specjax.boost.feature_data import TEACHER_DOTS

    f.add_argument("--teacher-dots", choices=TEACHER_DOTS, default="float32",
                   help="how the LLM's pass over the corpus multiplies: float32 (the LLM as the loop runs it) or "
                        "bfloat16 (its layers' matmul weights as bfloat16, float32 sums, the rest float32: 2.8x "
                        "faster on an Intel Xeon with AMX, features within ~0.4%%; not measured on CPUs without "
                        "bfloat16 units); features are kept apart per choice, and the --eval-prompts set always "
                        "comes from the float32 LLM (default: float32)")
    f.add_argument("--seed", type=int, default=0, help="seed of the prompts, sampling, split and training")
    f.add_argument("--no-progress", action="store_true", help="no progress bars")
    f.set_defaults(func=_cmd_feature_tune)


def _written_help(written_round) -> str:
    if written_round.files_field == "written":
        return ("prompt file written for training outside the LLM (by people or a stronger model; .jsonl with "
                "'prompt', or text lines), continued into the parts written-greedy / written-sampled (a "
                "--sampled-fraction at temperature 1), split on their own; prompts held out or already in the "
                "corpus are dropped; repeatable (default: none)")
    return (f"a {written_round.ordinal} round of written prompt files, continued into parts of their own "
            f"({written_round.greedy} / {written_round.sampled}, split on their own; prompts of the earlier rounds "
            f"dropped): grows a corpus without changing its earlier parts; repeatable (default: none)")


def _check_plan_before_generating(plan, tc, held, written: int) -> None:
    """What the corpus's generation would only find out after hours: the templates give too few prompts, or
    even every sequence the plan can make gives no training step past the warm-up."""
    from specjax.boost.distill import batches_per_epoch
    from specjax.boost.task_prompts import passage_prompts, stage1_prompts

    if plan.grounded and plan.passages < 2:  # found only after the passages were generated
        raise InputError(f"--grounded {plan.grounded} quotes two passages per prompt: it needs --passages >= 2, got "
                         f"{plan.passages} (or --grounded 0)")
    passage_prompts(plan.passages, seed=plan.seed, exclude=held)  # raise InputError when the templates give
    stage1_prompts(plan.tasks, seed=plan.seed, exclude=held)  # fewer than asked for
    # an upper bound of the training sequences (a request round adds its written requests and their answers)
    most = plan.passages + plan.grounded + plan.tasks + 2 * (plan.requests + plan.more_requests) + 2 * written
    steps = math.ceil(tc.epochs * batches_per_epoch(most, tc.batch_size))
    if steps <= tc.warmup_steps:
        raise InputError(f"this corpus plan makes at most {most} sequences: at --batch-size {tc.batch_size} for "
                         f"{tc.epochs:g} epochs they give at most {steps} steps, not more than the "
                         f"{tc.warmup_steps} warm-up steps (more --tasks/--grounded/--passages, or --epochs)")


def _check_run_recipe(out: str, tc, teacher_dots: str) -> None:
    """An --out holding a run of other training settings was refused only after the corpus and its features
    were made (hours at full size): its recipe's settings known now are compared now."""
    import dataclasses

    from specjax.boost.runfiles import differences, read_run_json

    path = os.path.join(out, "recipe.json")
    if not os.path.exists(path):
        return
    held = read_run_json(path, "remove the run directory to start afresh")
    want = {"train": json.loads(json.dumps(dataclasses.asdict(tc))), "teacher_dots": teacher_dots}
    have = {"train": held.get("train") if isinstance(held, dict) else None,
            "teacher_dots": held.get("teacher_dots", "float32") if isinstance(held, dict) else None}
    changed = differences(have, want)
    if changed:
        raise InputError(f"--out {out} holds a run with other settings ({'; '.join(changed[:6])}): use a fresh "
                         f"directory, or that run's settings to resume it")


def check_args(args):
    """Everything checked before any work: (corpus plan, training config, drafting settings, held-out prompts,
    evaluation prompts: ``feature_tune`` holds these out of training too)."""
    from specjax.boost.feature_corpus import WRITTEN_ROUNDS, CorpusPlan, written_prompts
    from specjax.boost.feature_train import FeatureTrainConfig
    from specjax.boost.feature_tune import check_train_groups, resolve_fusion, resolve_layers, training_window
    from specjax.cli.boost import _writable_dir
    from specjax.io.checkpoint import check_destination
    from specjax.io.feature_checkpoint import unfinished_export_of
    from specjax.io.loader import describe_model
    from specjax.io.prompts import read_prompts_file
    from specjax.models.feature import FeatureConfig
    from specjax.speculation.drafters.feature import FeatureDrafter

    if importlib.util.find_spec("optax") is None:
        raise InputError("feature-tune trains with optax, which is not installed: pip install -e '.[train]'")
    if not 0.0 < args.held_out < 0.5:
        raise InputError(f"--held-out must be in (0, 0.5), got {args.held_out}")
    for flag, value in (("--draft-vocab", args.draft_vocab), ("--max-eval", args.max_eval),
                        ("--corpus-batch", args.corpus_batch)):
        if value < 1:
            raise InputError(f"{flag} must be >= 1, got {value}")
    if args.time_budget is not None and not (math.isfinite(args.time_budget) and args.time_budget > 0):
        raise InputError(f"--time-budget must be a positive number of seconds, got {args.time_budget}")
    if args.stop_after is not None and args.stop_after < 0:
        raise InputError(f"--stop-after must be >= 0 steps (0: evaluate and export the newest checkpoint), got "
                         f"{args.stop_after}")
    plan = CorpusPlan(passages=args.passages, tasks=args.tasks, grounded=args.grounded,
                      sampled_fraction=args.sampled_fraction, batch_size=args.corpus_batch, seed=args.seed,
                      requests=args.requests, more_requests=args.more_requests,
                      **{r.files_field: tuple(getattr(args, r.files_field)) for r in WRITTEN_ROUNDS.values()})
    tc = FeatureTrainConfig(epochs=args.epochs, batch_size=args.batch_size, learning_rate=args.learning_rate,
                            unrolled_steps=args.unrolled_steps, reg_weight=args.reg_weight, seed=args.seed,
                            window=training_window(plan, args.unrolled_steps))
    llm_cfg = describe_model(args.model).config
    if args.draft_vocab > llm_cfg.vocab_size:
        raise InputError(f"--draft-vocab {args.draft_vocab} exceeds the LLM's vocabulary ({llm_cfg.vocab_size})")
    cfg = FeatureConfig(llm_cfg, tuple(range(args.draft_vocab)))  # the real vocabulary comes from the corpus
    drafting = resolve_drafting(describe_model(args.model), args.init_from,
                                {k: getattr(args, k) for k in SHIPPED_DRAFTING})
    FeatureDrafter(cfg, **drafting)  # the shipped settings must make a valid drafter
    # --init-from exists and fits the LLM, --fused fits both: refused before any work
    args.fused_layers = resolve_fusion(describe_model(args.model), args.init_from, parse_fused(args.fused))
    args.drafter_layers = resolve_layers(describe_model(args.model), args.init_from, args.layers)
    args.train_group_names = check_train_groups(plan, () if args.train_groups is None else
                                                args.train_groups.split(","))
    held = [p for path in args.exclude_prompts
            for p in read_prompts_file(path, flag="--exclude-prompts", allow_token_ids=False, plain_lines=True)]
    # once each: a prompt repeated (in a file, or in two) was generated and weighed in the agreement as often
    evaluate = list(dict.fromkeys(
        p for path in args.eval_prompts
        for p in read_prompts_file(path, flag="--eval-prompts", allow_token_ids=False, plain_lines=True)))
    taken = set(held) | set(evaluate)
    written = 0
    for written_round in WRITTEN_ROUNDS.values():
        files = getattr(plan, written_round.files_field)
        if files:  # read (so checked) now; the corpus drops those held out or already in it
            round_prompts = written_prompts(files, taken, flag=written_round.flag)
            written += len(round_prompts)
            taken |= set(round_prompts)
    _check_plan_before_generating(plan, tc, held, written)
    _writable_dir(args.corpus, "--corpus")
    _writable_dir(args.out, "--out")
    _check_run_recipe(args.out, tc, args.teacher_dots)
    if args.export:
        for flag, other in (("--out", args.out), ("--corpus", args.corpus)):
            if os.path.abspath(args.export) == os.path.abspath(other):
                raise InputError(f"--export {args.export} is the {flag} directory: give the drafter a directory "
                                 f"of its own")
        if not unfinished_export_of(args.export, args.out):  # a resumed run replaces its own unfinished export
            check_destination(args.export)
    return plan, tc, drafting, held, evaluate


def _log(*parts) -> None:
    """Progress lines to stderr, beside the progress bars: stdout holds the closing line and the JSON summary
    alone (the log lines there broke a reader of the JSON)."""
    print(*parts, file=sys.stderr, flush=True)


@interruptible
def _cmd_feature_tune(args, out) -> int:
    plan, tc, drafting, held, evaluate = check_args(args)
    import jax

    from specjax.boost.feature_tune import BatchShapes, feature_tune
    from specjax.io.loader import load_model

    gpu = args.batch_shapes == "gpu" or (args.batch_shapes == "auto" and jax.default_backend() != "cpu")
    started = time.perf_counter()
    llm = load_model(args.model, progress=not args.no_progress)
    summary = feature_tune(llm, args.corpus, args.out, plan, tc, drafting, draft_vocab=args.draft_vocab,
                           held_out=args.held_out, max_eval=args.max_eval, exclude=held, export=args.export,
                           model_name=args.model, stop_after=args.stop_after, init_from=args.init_from,
                           eval_prompts=evaluate, progress=not args.no_progress,
                           time_budget=None if args.time_budget is None  # the model's loading counts too
                           else args.time_budget - (time.perf_counter() - started),
                           shapes=BatchShapes.gpu() if gpu else BatchShapes(), fused=args.fused_layers,
                           train_groups=args.train_group_names, teacher_dots=args.teacher_dots,
                           drafter_layers=args.drafter_layers, log=_log)
    depth = summary["held_out_agreement"]["all"]
    on_prompts = summary["eval_prompts_agreement"]
    history = summary["history_set_agreement"]
    first = next((row["held_out"] for row in summary["history"] if "held_out" in row), None)
    steps = summary["steps"]
    seconds = time.perf_counter() - started
    ended = (f"feature-tune done in {seconds:.0f} s (this run)" if steps["done"] >= steps["planned"]
             else f"feature-tune stopped after {steps['done']} of {steps['planned']} steps, {seconds:.0f} s this run "
                  f"(the same command continues it)")
    out.write(f"{ended}: held-out agreement by depth "
              f"{', '.join(f'{a:.3f}' for a in depth)} ({summary['sequences']['held_out']} sequences; on the "
              f"{history['sequences']} evaluated during training {', '.join(f'{a:.3f}' for a in history['all'])}"
              + (f", at the history's first evaluation {', '.join(f'{a:.3f}' for a in first['all'])}"
                 if first and first["positions"] == history["positions"] else "") + ")"
              + (f"; on the --eval-prompts {', '.join(f'{a:.3f}' for a in on_prompts['all'])}" if on_prompts else "")
              + (f"; drafter in {args.export}" if args.export else "") + "\n")
    out.write(json.dumps({k: v for k, v in summary.items() if k != "history"}, default=_plain) + "\n")
    return 0


def parse_fused(text: str | None) -> tuple[int, ...]:
    """``--fused 15,30`` -> (15, 30); None -> () (the final feature only)."""
    if text is None:
        return ()
    try:
        layers = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise InputError(f"--fused must be comma-separated LLM layer indices (e.g. 15,30), got {text!r}") from None
    if list(layers) != sorted(set(layers)):
        raise InputError(f"--fused must list distinct layers in increasing order, got {text!r}")
    return layers


def _plain(x):
    return float(x) if isinstance(x, float) and math.isfinite(x) else str(x)

