"""The whole feature-drafter recipe, each stage resumable (``specjax feature-tune`` runs it): corpus ->
LLM features -> draft vocabulary -> unrolled training -> held-out agreement by depth -> export."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time

import jax
import numpy as np

from specjax.boost.corpus import generate_corpus, read_shard
from specjax.boost.distill import batches_per_epoch
from specjax.boost.feature_corpus import (
    REQUEST_PARTS,
    REQUEST_ROUNDS,
    WRITTEN_PARTS,
    WRITTEN_ROUNDS,
    CorpusPlan,
    build_feature_corpus,
)
from specjax.boost.feature_data import (
    FeatureSet,
    check_dots,
    draft_vocabulary,
    feature_shards,
    held_out_indices,
    vocabulary_coverage,
)
from specjax.boost.feature_loading import load_feature_set, load_split
from specjax.boost.feature_train import (
    FeatureTrainConfig,
    depth_agreement,
    sequence_agreement,
    split_params,
    summarise_agreement,
    train_feature,
)
from specjax.errors import InputError
from specjax.models.feature import FeatureConfig, bind, deepen, init_trained, widen_fusion, with_fusion
from specjax.types import Model

EVAL_DEPTHS = 6


@dataclasses.dataclass(frozen=True)
class BatchShapes:
    """How the LLM's feature pass, the training and the evaluation pad their batches. The defaults suit a
    CPU (little padding); on a GPU compiling a shape costs more than computing padding (an H200: the
    two held-out evaluations of a stop-47 drafter took 220 s, nearly all compiling), so fewer, larger
    shapes (``gpu()``): widths a multiple of 256, feature batches of 32 rows, every batch full."""

    teacher_batch: int = 8
    width_multiple: int = 64
    full_batches: bool = False

    def __post_init__(self):
        if self.teacher_batch < 1 or self.width_multiple < 1:
            raise InputError(f"teacher_batch and width_multiple must be >= 1, got {self}")

    @classmethod
    def gpu(cls) -> "BatchShapes":
        return cls(teacher_batch=32, width_multiple=256, full_batches=True)

    def features(self, llm: Model, paths, out_dir: str, progress: bool, log, layers: tuple[int, ...] = (),
                 dots: str = "float32") -> list[str]:
        return feature_shards(llm, paths, out_dir, batch_size=self.teacher_batch, progress=progress, log=log,
                              width_multiple=self.width_multiple, full_batches=self.full_batches, layers=layers,
                              dots=dots)


_DOTS_SUFFIX = {"float32": "", "bfloat16": "-bf16dots"}  # one per feature_data.TEACHER_DOTS


def training_window(plan: CorpusPlan, unrolled_steps: int) -> int:
    """The right-most columns a training batch's loss covers (``FeatureTrainConfig.window``): the longest
    continuation the plan generates, the unrolled steps beyond it and a margin."""
    return max(plan.max_new_tokens, plan.passage_tokens) + unrolled_steps + 8


def features_dir(layers: tuple[int, ...], dots: str = "float32") -> str:
    """Where a corpus keeps its LLM features: ``features`` (g only), ``features-l15`` (layer 15's raw input
    beside g), ``features-l15-bf16dots`` (the same from bfloat16 dots, ``feature_data.TEACHER_DOTS``): each
    kind apart, so adding a fused drafter or switching the dots does not overwrite the others' data."""
    return "features" + "".join(f"-l{i}" for i in layers) + _DOTS_SUFFIX[check_dots(dots)]


def feature_tune(llm: Model, corpus_dir: str, run_dir: str, plan: CorpusPlan, tc: FeatureTrainConfig, drafting: dict,
                 *, draft_vocab: int, held_out: float, max_eval: int, exclude=(), export: str | None = None,
                 model_name: str = "", stop_after: int | None = None, init_from: str | None = None,
                 eval_prompts=(), progress: bool = True, log=print, time_budget: float | None = None,
                 shapes: BatchShapes | None = None, fused: tuple[int, ...] = (),
                 train_groups: tuple[str, ...] = (), teacher_dots: str = "float32",
                 drafter_layers: int | None = None) -> dict:
    """Run (or resume) every stage; returns the summary also written to ``run_dir/summary.json``.
    ``stop_after``: train at most this many steps in this run, then evaluate and export what there is
    (the summary says how many of the planned steps are done; running again resumes the training).
    ``init_from``: a trained feature drafter (registered name or directory) to continue from, its
    draft vocabulary kept (fine-tuning on a grown corpus) instead of a fresh start. ``eval_prompts``:
    prompts from outside the corpus's generator (hand-written; held out of training too) whose
    greedy continuations are a second held-out set, reported beside the split's: the split shares its
    training data's generator, so it flatters the drafter (``eval_prompt_set``). ``time_budget``: seconds
    from now after which no training step starts (the corpus, features and evaluations count; the last
    step is checkpointed, then the run evaluates and exports; running again resumes: ``train_feature``).
    ``shapes``: how batches are padded (``BatchShapes``). ``fused``: the LLM layers an EAGLE-3-style
    drafter reads (``FeatureConfig.fused``; the LLM's layer count names the final feature); a final-feature
    ``init_from`` then starts the fusion passing g through (``with_fusion``), so training starts from its
    drafts exactly. A fused ``init_from`` keeps its own layers (``fused`` () or the same) or adds layers
    (``widen_fusion``: the added ones' rows start at zero, so training starts from its features, to rounding).
    ``train_groups``: train on (and evaluate the held-out sequences of) these split groups only (``plan_groups``;
    default: all): the LLM's features are computed for their parts alone, so continuing a drafter on a new
    round costs that round's features, not the whole corpus's (7.4M tokens: 1-3.2 hours on 2 CPU cores in float32).
    ``teacher_dots``: how the LLM's pass over the corpus multiplies (``feature_data.TEACHER_DOTS``; "bfloat16"
    ran 2.8x faster on an Intel Xeon with AMX; part of the training run's recipe, so a run is not resumed on
    the other kind); the corpus split's held-out features come from the same pass,
    while the ``eval_prompts`` set is always the float32 LLM's, the features the drafter meets in the loop.
    ``drafter_layers``: the drafter's decoder layers (``FeatureConfig.layers``; default: 1, or ``init_from``'s); more
    than ``init_from`` has starts as exactly it (``deepen``: the added layers pass their input on)."""
    check_dots(teacher_dots)
    deadline = None if time_budget is None else time.monotonic() + time_budget
    shapes = shapes or BatchShapes()
    timing = {}
    started = time.perf_counter()
    exclude = list(dict.fromkeys([*exclude, *eval_prompts]))  # evaluation prompts are never training prompts
    fused = resolve_fusion(llm, init_from, tuple(fused))  # checked before the corpus: a bad request costs nothing
    drafter_layers = resolve_layers(llm, init_from, drafter_layers)
    train_groups = check_train_groups(plan, train_groups)
    layers = FeatureConfig(llm.config, (0,), fused).raw_layers
    train, held, groups = corpus_split(llm, corpus_dir, plan, exclude=exclude, held_out=held_out, seed=tc.seed,
                                       raw_layers=layers, teacher_dots=teacher_dots, train_groups=train_groups,
                                       shapes=shapes, progress=progress, log=log, timing=timing)
    start = None  # a fresh start is named by the recipe's seed; a continued one by its weights
    if init_from is None:
        vocab, coverage = draft_vocabulary(train, draft_vocab, llm.config.vocab_size)
        cfg = FeatureConfig(llm.config, vocab, fused, drafter_layers)
        params = bind(init_trained(llm.params, cfg, jax.random.key(tc.seed)), llm.params, cfg)
    else:
        cfg, params = start_from(init_from, llm, groups, tc.seed)
        if fused and not cfg.fused:  # a final-feature drafter, fused from here on
            final, cfg = cfg, dataclasses.replace(cfg, fused=fused)
            params = bind(with_fusion(split_params(params, final)[0], cfg), llm.params, cfg)
        elif fused != cfg.fused:  # a fusion that reads more layers from here on, starting as itself
            narrow, cfg = cfg, dataclasses.replace(cfg, fused=fused)
            params = bind(widen_fusion(split_params(params, narrow)[0], narrow, cfg), llm.params, cfg)
        cfg, params = deepen_bound(params, cfg, drafter_layers, llm)  # a deeper drafter from here on, as itself
        start = weights_digest(split_params(params, cfg)[0])
        coverage = vocabulary_coverage(train, cfg.draft_vocab)
    evaluated = evaluation_indices(len(held), max_eval)
    evaluation = held.subset(evaluated)
    prompt_set = (eval_prompt_set(llm, corpus_dir, list(eval_prompts), plan, progress, log, shapes=shapes,
                                  layers=layers) if eval_prompts else None)
    started = time.perf_counter()
    params, history = train_feature(params, train, cfg, tc, run_dir, held_out=evaluation, eval_prompts=prompt_set,
                                    start=start, eval_steps=EVAL_DEPTHS, progress=progress, log=log,
                                    stop_after=stop_after, deadline=deadline, teacher_dots=teacher_dots,
                                    width_multiple=shapes.width_multiple, full_batches=shapes.full_batches)
    timing["train_s_this_run"] = time.perf_counter() - started
    hits, counts = sequence_agreement(params, held, cfg, steps=EVAL_DEPTHS, window=tc.window,
                                      batch_size=tc.batch_size, width_multiple=shapes.width_multiple,
                                      full_batches=shapes.full_batches)
    final = summarise_agreement(hits, counts, held.parts, held.part_names)
    # the final weights on the sequences every history row evaluated, so step 0 and the end compare
    # ("all" over every held-out sequence may weigh parts the history's subset has fewer of)
    as_history = summarise_agreement(hits[evaluated], counts[evaluated], held.parts[evaluated], held.part_names)
    on_prompts = None if prompt_set is None else depth_agreement(params, prompt_set, cfg, steps=EVAL_DEPTHS,
                                                                 window=tc.window, batch_size=tc.batch_size,
                                                                 width_multiple=shapes.width_multiple,
                                                                 full_batches=shapes.full_batches)
    summary = {"model": model_name, "corpus": os.path.abspath(corpus_dir), "plan": dataclasses.asdict(plan),
               "train": dataclasses.asdict(tc), "drafting": {k: list(v) if isinstance(v, tuple) else v
                                                             for k, v in drafting.items()},
               "sequences": {"train": len(train), "held_out": len(held)},
               "tokens": {"train": int(train.lengths.sum()), "train_continuation": train.continuation_tokens(),
                          "held_out": int(held.lengths.sum())},
               "draft_vocab": {"size": len(cfg.draft_vocab), "continuation_coverage": coverage},
               "init_from": init_from, "fused": list(cfg.fused), "layers": cfg.layers,
               "train_groups": list(train_groups) or None, "teacher_dots": teacher_dots,
               "steps": {"done": _steps_done(run_dir),
                         "planned": math.ceil(tc.epochs * batches_per_epoch(len(train), tc.batch_size))},
               "held_out_agreement": final,
               "history_set_agreement": {"sequences": len(evaluated), **as_history},
               "eval_prompts_agreement": None if on_prompts is None else {"prompts": len(eval_prompts), **on_prompts},
               "timing": timing, "history": history}
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    if export:
        from specjax.io.feature_checkpoint import save_feature_drafter

        trained, _ = split_params(params, cfg)
        save_feature_drafter(export, cfg, trained, drafting, replace_unfinished_of=run_dir,
                             extra={"trained": {**{k: summary[k] for k in ("model", "plan", "train", "sequences",
                                                                           "tokens", "draft_vocab", "init_from",
                                                                           "fused", "train_groups", "teacher_dots",
                                                                           "steps", "held_out_agreement",
                                                                           "eval_prompts_agreement")},
                                                "run": os.path.abspath(run_dir)}})  # a resumed run replaces it
        log(f"exported the drafter to {export}")
    return summary


def evaluation_indices(count: int, max_eval: int) -> np.ndarray:
    """The held-out sequences evaluated during training: ``max_eval`` of ``count`` evenly spaced, so every
    corpus part (the held-out set is ordered part by part) keeps its share; the first ``max_eval`` would
    leave out the parts loaded last (stop 74: the newest written round, the drafter's weakest part)."""
    if count <= max_eval:
        return np.arange(count)
    # spacing (count - 1) / (max_eval - 1) >= 1, so the rounded positions are distinct
    return np.linspace(0, count - 1, max_eval).round().astype(np.int64)


def plan_groups(plan: CorpusPlan | dict) -> list[str]:
    """The split groups a corpus plan makes (``split_corpus``): the template parts together, then each round of
    requests and of written prompts it has. ``plan``: a CorpusPlan, or one as a trained drafter records it."""
    field = plan.get if isinstance(plan, dict) else lambda name: getattr(plan, name)
    return (["templates"] + [name for name, r in REQUEST_ROUNDS.items() if field(r.count_field)]
            + [name for name, r in WRITTEN_ROUNDS.items() if field(r.files_field)])


def check_train_groups(plan: CorpusPlan, train_groups) -> tuple[str, ...]:
    """``train_groups`` as a tuple, refused unless each names a distinct group of this plan (``plan_groups``)."""
    train_groups, known = tuple(train_groups), plan_groups(plan)
    unknown = [g for g in train_groups if g not in known]
    if unknown or len(set(train_groups)) != len(train_groups):
        raise InputError(f"--train-groups {','.join(train_groups)}: "
                         + (f"{', '.join(map(repr, unknown))} is not a split group of this corpus plan" if unknown else
                            "a group is named twice")
                         + f" (its groups: {', '.join(known)}; a round is a group once its flag is given)")
    return train_groups


def split_groups(names) -> dict[str, list[str]]:
    """Corpus part names by split group (``split_corpus``), in order: the template parts together (``templates``),
    each round of requests and of written prompts on its own; only the groups with a part among ``names``."""
    groups = {"templates": [n for n in names if n not in REQUEST_PARTS + WRITTEN_PARTS]}
    for round_name, request_round in REQUEST_ROUNDS.items():
        groups[round_name] = [n for n in names if n == request_round.answers]
    for round_name, written_round in WRITTEN_ROUNDS.items():
        groups[round_name] = [n for n in (written_round.greedy, written_round.sampled) if n in names]
    return {group: parts for group, parts in groups.items() if parts}


def corpus_split(llm: Model, corpus_dir: str, plan: CorpusPlan, *, exclude, held_out: float, seed: int,
                 raw_layers: tuple[int, ...] = (), teacher_dots: str = "float32", train_groups=(),
                 shapes: BatchShapes | None = None, progress: bool = True, log=print,
                 timing: dict | None = None) -> tuple[FeatureSet, FeatureSet, dict]:
    """The corpus of ``plan`` built (or resumed), the LLM's features of ``train_groups``' parts (default:
    every group) computed (or found), and split as a training run splits it (``split_corpus``): (train, held
    out, {group: counts}). ``timing`` (if given) gets the seconds of the corpus and of the features."""
    shapes = shapes or BatchShapes()
    started = time.perf_counter()
    shards = build_feature_corpus(llm, corpus_dir, plan, exclude=exclude, progress=progress, log=log)
    corpus_s, started = time.perf_counter() - started, time.perf_counter()
    trained_parts = {name for group, names in split_groups(list(shards)).items()
                     if not train_groups or group in train_groups for name in names}
    kept = os.path.join(corpus_dir, features_dir(raw_layers, teacher_dots))
    parts = {name: (paths, shapes.features(llm, paths, os.path.join(kept, name), progress, log, raw_layers,
                                           teacher_dots) if name in trained_parts else [])
             for name, paths in shards.items()}
    if timing is not None:
        timing.update(corpus_s=corpus_s, features_s=time.perf_counter() - started)
    return split_corpus(parts, held_out, seed, train_groups)


def split_corpus(parts: dict, fraction: float, seed: int, train_groups=()) -> tuple[FeatureSet, FeatureSet, dict]:
    """(train, held out, {group: {"train": n, "held_out": n}}). The template parts are split together and
    each round of requests or of written prompts on its own, so growing a corpus by a round leaves the
    other parts' split as it was: a drafter continued with ``init_from`` on the grown corpus is not
    evaluated on sequences it was trained on (``check_split``). ``train_groups`` (default: all): the
    groups loaded, whose parts need features; the others are only counted, from their shards, and split
    by the same rule, so every group's counts are the whole corpus's."""
    grouped = split_groups(list(parts))
    loaded = [group for group in grouped if not train_groups or group in train_groups]
    # the features copied once (feature_loading)
    train, held, counts = load_split([{name: parts[name] for name in grouped[g]} for g in loaded], fraction, seed=seed)
    split = {group: {"train": t, "held_out": h} for group, (t, h) in zip(loaded, counts)}
    for group in grouped:
        if group not in split:
            count = sum(len(read_shard(path)) for name in grouped[group] for path in parts[name][0])
            t, h = held_out_indices(count, fraction, seed)
            split[group] = {"train": len(t), "held_out": len(h)}
    return train, held, {group: split[group] for group in grouped}


def eval_prompt_set(llm: Model, corpus_dir: str, prompts: list[str], plan: CorpusPlan, progress: bool = True,
                    log=print, categories: list[str] | None = None, shapes: BatchShapes | None = None,
                    layers: tuple[int, ...] = ()) -> FeatureSet:
    """The LLM's greedy continuations of ``prompts`` (``plan.max_new_tokens``, chat template) with their
    features, made once under ``corpus_dir/eval-XXXXXXXXXXXX`` (named by the prompts' hash; never
    training data). ``categories``: one per prompt, the set's parts (default: one part). ``layers``: the raw
    LLM layers a fused drafter reads, stored beside g (``features_dir``)."""
    if categories is not None and len(categories) != len(prompts):
        raise InputError(f"eval prompts: {len(categories)} categories for {len(prompts)} prompts")
    # named by what the continuations depend on: the prompts, their length, the seed and the LLM
    digest = hashlib.sha256(json.dumps([prompts, plan.max_new_tokens, plan.seed,
                                        llm.config.to_dict()]).encode()).hexdigest()[:12]
    out = os.path.join(corpus_dir, f"eval-{digest}")
    shards = generate_corpus(llm, prompts, os.path.join(out, "continuations"), max_new_tokens=plan.max_new_tokens,
                             batch_size=plan.batch_size, temperatures=(0.0,), seed=plan.seed, progress=progress,
                             recipe={"part": "eval prompts"})
    features = (shapes or BatchShapes()).features(llm, shards, os.path.join(out, features_dir(layers)), progress, log,
                                                  layers)
    data = load_feature_set({"eval prompts": (shards, features)})  # the prompts' order
    if categories is not None:
        names = tuple(sorted(set(categories)))
        data = dataclasses.replace(data, parts=np.asarray([names.index(c) for c in categories], np.int32),
                                   part_names=names)
    return data


def resolve_fusion(llm, init_from: str | None, fused: tuple[int, ...]) -> tuple[int, ...]:
    """The fused layers of the drafter to train (``llm``: a Model or ``describe_model``'s description):
    ``fused``, or a fused ``init_from``'s own (refused if they differ); checked against the LLM, as is
    ``init_from`` (it must exist and have been trained for this LLM)."""
    if init_from is not None:
        from specjax.speculation.drafters.feature import load_feature_drafter

        own = load_feature_drafter(init_from, llm, load=False).drafter.config.fused
        if own and fused and own != fused:
            final = llm.config.num_layers
            if not set(own) < set(fused) or (final in own) != (final in fused):
                raise InputError(f"--init-from {init_from} reads LLM layers {list(own)}; --fused asks "
                                 f"{list(fused)}: a trained fusion can only add layers (keeping its final "
                                 f"feature {final} or its lack), not drop or change them")
            FeatureConfig(llm.config, (0,), fused)  # refuses layers outside the LLM
            return fused
        if own:
            return own
        if fused and llm.config.num_layers not in fused:
            raise InputError(f"--fused {list(fused)} with --init-from {init_from} (a final-feature drafter) must "
                             f"include {llm.config.num_layers}, the final feature, so training starts from its drafts")
    FeatureConfig(llm.config, (0,), fused)  # refuses layers outside the LLM
    return fused


def resolve_layers(llm, init_from: str | None, layers: int | None) -> int:
    """The decoder layers of the drafter to train: ``layers``, or 1 / ``init_from``'s own where None; an
    ``init_from`` can be deepened, not made shallower (checked before any work)."""
    own = 1
    if init_from is not None:
        from specjax.speculation.drafters.feature import load_feature_drafter

        own = load_feature_drafter(init_from, llm, load=False).drafter.config.layers
    if layers is None:
        return own
    if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= llm.config.num_layers:
        raise InputError(f"--layers must be an integer in [1, {llm.config.num_layers}] (the LLM's layers), "
                         f"got {layers!r}")
    if layers < own:
        raise InputError(f"--init-from {init_from} has {own} decoder layers; --layers {layers} would drop some: a "
                         f"trained drafter can only be deepened")
    return layers


def deepen_bound(params: dict, cfg: FeatureConfig, layers: int, llm: Model) -> tuple[FeatureConfig, dict]:
    """(config, bound params) of the bound drafter ``params`` with ``layers`` decoder layers, starting as
    exactly itself (``deepen``); unchanged where it has as many already."""
    if layers == cfg.layers:
        return cfg, params
    deeper = dataclasses.replace(cfg, layers=layers)
    return deeper, bind(deepen(split_params(params, cfg)[0], cfg, deeper), llm.params, deeper)


def start_from(name_or_path: str, llm: Model, groups: dict, seed: int):
    """(config, bound params) of a trained drafter for ``llm``, to continue training it on this corpus."""
    from specjax.io.feature_checkpoint import read_feature_meta
    from specjax.speculation.drafters.feature import feature_drafter_path, load_feature_drafter

    bound = load_feature_drafter(name_or_path, llm)  # checks that it was trained for this LLM
    check_split(name_or_path, read_feature_meta(feature_drafter_path(name_or_path))[2].get("trained"), groups, seed)
    params = jax.tree.map(lambda a: a.astype(llm.params["embed"].dtype), bound.params)
    return bound.drafter.config, params


def check_split(name: str, trained: dict | None, groups: dict, seed: int) -> None:
    """Refuse to continue a drafter whose training run split its sequences otherwise than this run does
    (another seed, --held-out or corpus): its training sequences could be held out here and flatter it.
    Its run covered its ``train_groups``, or (without them) the template parts and each round of requests and of
    written prompts its plan had."""
    if not trained or not {"plan", "train", "sequences"} <= set(trained):
        raise InputError(f"--init-from {name}: its metadata does not record its training run (plan, seed, split), "
                         f"so its held-out split cannot be checked against this run's")
    covered = trained.get("train_groups") or plan_groups(trained["plan"])
    if any(g not in groups for g in covered):
        raise InputError(f"--init-from {name}: it was trained with a requests or written part this corpus plan does "
                         f"not have")
    here = {k: sum(groups[g][k] for g in covered) for k in ("train", "held_out")}
    if trained["train"].get("seed") != seed or trained["sequences"] != here:
        raise InputError(f"--init-from {name}: trained with seed {trained['train'].get('seed')} on "
                         f"{trained['sequences']} sequences, but this run splits the same parts into {here} with "
                         f"seed {seed}: use its corpus, --seed and --held-out, or its held-out sequences may be in "
                         f"this run's training set")


def weights_digest(trained: dict) -> str:
    """A short sha256 of a drafter's trained weights (leaves in tree order, float32 bytes)."""
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(trained):
        digest.update(np.asarray(leaf, np.float32).tobytes())
    return digest.hexdigest()[:16]


def _steps_done(run_dir: str) -> int:
    """The newest checkpointed training step (orbax names each step's directory by its number)."""
    steps = os.path.join(run_dir, "steps")
    return max((int(d) for d in os.listdir(steps) if d.isdigit()), default=0) if os.path.isdir(steps) else 0
