"""Host-side API: load a model by name or path; generate from strings or token ids; score logits."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.decoding.buckets import cache_bucket, next_pow2, output_bucket
from specjax.decoding.contract import host_value
from specjax.decoding.host_step import MAX_CHUNK_STEPS, AheadCompile, run_host_loop, run_two_programs
from specjax.decoding.incremental import decode_host_step, decode_init_jit, finish_incremental, full_logits
from specjax.decoding.programs import step_drafter_params, step_matmuls, step_program
from specjax.decoding.sampling import SamplingArrays, SamplingParams
from specjax.errors import GenerationError, InputError, SpecjaxError
from specjax.io.prompts import normalize_prompts, prompt_labels
from specjax.io.special_tokens import check_policy, encode_chat, encode_text
from specjax.memory import check_cache_fits, local_devices_of
from specjax.speculation.choices import MODES
from specjax.speculation.cost import pass_head, with_costs
from specjax.speculation.drafters.ssm import SSMDrafter
from specjax.speculation.loop import finish_speculative, host_step, init_state_jit
from specjax.speculation.request import as_bound, check_positions, default_drafters, spec_config
from specjax.speculation.state import stop_rows
from specjax.types import Model
from specjax.x32 import in_32_bit


@dataclasses.dataclass
class GenerationResult:
    token_ids: list[list[int]]  # generated ids per prompt, prompt excluded
    texts: list[str | None]  # decoded text per prompt (None without a tokenizer)
    prompt_token_ids: list[list[int]]
    stats: dict  # batch: llm_passes, generated_tokens, seconds, tokens_per_s, ...; "requests": one dict each


def encode_prompts(model: Model, prompts, chat_template: bool = True, labels=None,
                   special_tokens: str = "parse") -> list[list[int]]:
    """Strings (chat template applied by default) or token-id lists -> list of token-id lists.
    ``labels``: what errors call each prompt (default "prompt i"). ``special_tokens``: what a special
    token's string inside a prompt's text becomes (``specjax.io.special_tokens``)."""
    check_policy(special_tokens)
    out = []
    vocab = model.config.vocab_size
    prompts = normalize_prompts(prompts, labels)
    for label, p in zip(prompt_labels(labels, len(prompts)), prompts):
        if isinstance(p, str):
            tok = model.tokenizer
            if tok is None:
                raise InputError(f"{label} is a string but the model has no tokenizer; pass token ids (a list of ints; "
                                 f"on the command line a --prompts-file line such as {{\"prompt\": [1, 2, 3]}})")
            if chat_template and getattr(tok, "chat_template", None):
                try:
                    ids = encode_chat(tok, [{"role": "user", "content": p}], special_tokens, label)
                except SpecjaxError:
                    raise
                except Exception as e:  # noqa: BLE001 - templates refuse in their own words (jinja raise_exception)
                    raise InputError(f"{label}: the model's chat template refused it: {type(e).__name__}: {e} "
                                     f"(chat_template=False / --no-chat-template tokenizes the text as it is)") from e
            else:
                ids = encode_text(tok, p, special_tokens, label)
        else:
            ids = p
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None and isinstance(p, str):  # a tokenizer with more (added) tokens than the embedding rows
            raise InputError(f"{label}: the tokenizer gives token id {bad}, outside the model's vocabulary "
                             f"[0, {vocab}) (the tokenizer has more tokens than the model's embedding)")
        if bad is not None:
            raise InputError(f"{label}: token id {bad} is not in [0, {vocab}) (the vocabulary)")
        if len(ids) == 0:
            raise InputError(f"{label} is empty")
        out.append([int(t) for t in ids])
    return out


def _sampling_list(sampling, n: int) -> list[SamplingParams]:
    if sampling is None:
        return [SamplingParams()] * n
    if isinstance(sampling, SamplingParams):
        return [sampling] * n
    if not isinstance(sampling, (list, tuple)) or len(sampling) != n or not all(
            isinstance(s, SamplingParams) for s in sampling):
        raise InputError(f"sampling must be a SamplingParams or a list of {n} of them (one per prompt)")
    return list(sampling)


def eos_ids_of(model: Model) -> tuple[int, ...]:
    """The tokens that end a request by default: the config's EOS ids and the tokenizer's."""
    ids = set(model.config.eos_token_ids)
    if model.tokenizer is not None and model.tokenizer.eos_token_id is not None:
        ids.add(int(model.tokenizer.eos_token_id))
    return tuple(sorted(ids))


def _check_max_new_tokens(max_new_tokens) -> int:
    max_new_tokens = host_value(max_new_tokens, "max_new_tokens")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    return int(max_new_tokens)


@dataclasses.dataclass(frozen=True)
class GenerationPlan:
    """Everything ``generate`` decided and checked before any device work: the tokenised, bucketed
    batch, the per-request settings and the static speculation setup (None = incremental)."""

    mode: str
    ids: list[list[int]]
    lens: np.ndarray  # [B] int32
    padded: np.ndarray  # [B, cache_len] int32, right-padded to the width of the cache bucket
    samplings: list[SamplingParams]
    max_new_tokens: int
    max_out: int
    cache_len: int
    eos_ids: tuple[int, ...]
    spec: Any = None  # speculation.loop.SpecConfig or None
    verifier: str | None = None
    draft: str | None = None


def plan_generation(model: Model, prompts, max_new_tokens: int = 128, sampling=None, chat_template: bool = True,
                    ignore_eos: bool = False, mode: str | None = None, ssms=(), expansion=None, impl: str = "auto",
                    verifier: str = "auto", draft: str = "auto", drafters=(), budget=None,
                    labels=None, special_tokens: str = "parse") -> GenerationPlan:
    """Validate a generation request and prepare it (see ``generate``). Reads only the configs and
    tokenizers of ``model`` and ``ssms`` (and the drafters' static parts), so it can run before their
    weights are loaded. Unlike ``generate``, it chooses no drafters: with no mode, SSMs or drafters the
    plan is incremental decoding (``generate`` passes the default drafters it chose). ``labels``: what
    errors call each prompt (default "prompt i"; the CLI passes a prompts file's ``path:line``)."""
    check_policy(special_tokens)
    mode = mode or ("tree" if ssms or drafters else "incremental")
    if mode not in MODES:
        raise InputError(f"mode must be one of {MODES}, got {mode!r}")
    max_new_tokens = _check_max_new_tokens(max_new_tokens)
    n = len(normalize_prompts(prompts, labels))
    samplings = _sampling_list(sampling, n)
    spec = verifier_name = draft_name = None
    extra_slots = 0
    if mode != "incremental":
        spec, verifier_name, draft_name = spec_config(model, list(ssms), list(drafters), mode, expansion, impl,
                                                       verifier, draft, any(not s.greedy for s in samplings), budget)
        extra_slots = spec.num_nodes  # tree scratch slots
    elif ssms or drafters:
        raise InputError(f"mode 'incremental' takes no SSMs or drafters, got {len(ssms) + len(drafters)}")
    elif budget is not None:
        raise InputError("mode 'incremental' drafts nothing, so it takes no tree budget")
    else:
        given = {k: v for k, v in (("verifier", verifier), ("draft", draft), ("expansion", expansion),
                                   ("impl", impl)) if v not in ("auto", None)}
        if given:  # they shape speculation only; taking them silently would hide a request that is not run
            raise InputError(f"mode 'incremental' neither drafts nor verifies, so it takes no "
                             f"{', '.join(f'{k}={v!r}' for k, v in given.items())}")
    ids = encode_prompts(model, prompts, chat_template, labels, special_tokens)
    limit = model.config.max_positions
    for label, p in zip(prompt_labels(labels, len(ids)), ids):
        if len(p) + max_new_tokens > limit:
            raise InputError(f"{label}: {len(p)} prompt tokens + max_new_tokens={max_new_tokens} = "
                             f"{len(p) + max_new_tokens} exceeds the context window of {limit}")
        if spec is not None:
            check_positions(spec, len(p) + max_new_tokens, f"{label}: prompt + max_new_tokens={max_new_tokens}")
    lens = np.array([len(p) for p in ids], np.int32)
    max_out = output_bucket(max_new_tokens)
    # The cache length comes from a few buckets, and prompts are padded to the cache's width: prefill
    # reads only the chunks a prompt needs, so every prompt that fits a bucket runs the same programs.
    # (It needs the new tokens' power of two, not the output buffer's floor: a 900-token prompt with
    # 16 new tokens stays in the first bucket.)
    cache_len = cache_bucket(int(lens.max()) + next_pow2(max_new_tokens) + extra_slots, len(ids))
    padded = np.zeros((len(ids), cache_len), np.int32)
    for i, p in enumerate(ids):
        padded[i, :len(p)] = p
    return GenerationPlan(mode=mode, ids=ids, lens=lens, padded=padded, samplings=samplings,
                          max_new_tokens=int(max_new_tokens), max_out=max_out, cache_len=cache_len,
                          eos_ids=() if ignore_eos else eos_ids_of(model), spec=spec, verifier=verifier_name,
                          draft=draft_name)


@in_32_bit
def generate(model: Model, prompts, max_new_tokens: int = 128, sampling=None, chat_template: bool = True,
             ignore_eos: bool = False, mode: str | None = None, ssms=(), expansion=None,
             impl: str = "auto", verifier: str = "auto", draft: str = "auto", parallel=None,
             on_tokens=None, drafters=(), budget=None, special_tokens: str = "parse") -> GenerationResult:
    """Generate for a batch of prompts (strings or token-id lists).

    mode: "incremental" (the reference decoder), "sequence" (one SSM drafts a chain of
    ``len(expansion)`` tokens) or "tree" (expansion-based with one SSM, merge-based with several).
    Default: "tree" when SSMs or drafters are given; with neither, the **default drafting**, the same as
    ``specjax generate``'s: the drafters ``registry.default_drafters`` names for this LLM (SmolLM2: the
    shipped feature drafter merged with the lookup drafter, or the corpus drafter where the feature
    drafter's files are missing; an LLM without either: the lookup drafter) under
    ``budget="auto"`` (``default_drafters``). ssms: Models sharing the LLM's
    tokenizer, each drafting an expansion tree. expansion: widths <k1, ..., km> (default
    ``registry.DEFAULT_EXPANSION``), or one per SSM. drafters: other drafters, as
    ``specjax.Bound(drafter, params)`` (``specjax.speculation.drafters``), merged with the SSMs.
    sampling: None (greedy), a SamplingParams for all prompts, or one per prompt (each carries its
    seed; a request's tokens depend only on its own seed and positions, not on its batch slot).
    verifier (speculative modes): "auto" = greedy for greedy requests, else "seeded" (the output
    equals incremental sampling with the same seed, token for token); "mss", "rrs", "naive" sample
    with the exact target distribution but other random numbers. draft: how SSMs draw children,
    "auto" = the verifier's natural drafting ("topk", "coupled", "iid" for mss, "wor" for rrs).
    A (draft, verifier) pair that would not be lossless is refused with an InputError.
    special_tokens: what a special token's string written inside a prompt's text (``<|im_end|>``)
    becomes: "parse" (the control token, as transformers and vLLM tokenize), "text" (ordinary text: a
    prompt cannot end its own turn; the chat template's control tokens stay) or "refuse" (an InputError
    naming it). Token-id prompts are taken as they are.
    budget (speculative modes): None verifies every proposal whole each step (the default drafting: None
    means "auto"); "auto" chooses per step
    how much of it to verify (none at all when drafts will not pay) from this machine's measured LLM
    pass costs by tree size at this batch size (measured once, cached; ``specjax tree-cost``) and the
    drafters' measured acceptance (``specjax.speculation.budget``); or a ``Budget`` with explicit levels
    and costs. Needs drafters that estimate their acceptance (the lookup drafter).
    parallel: a ``specjax.sharding.Parallel`` to run on its mesh (LLM under its rules, pipelined
    when pp > 1; SSMs under its ssm_rules). The batch is padded with inert requests to a multiple of
    dp x microbatches; the output is the same as on one device. A pipelined mesh of several CPU
    devices in one process runs one LLM pass per program call (``Parallel.one_pass_per_call``:
    XLA:CPU ran several in one program wrongly there).
    on_tokens: ``on_tokens(request_index, new_token_ids)`` is called once for every LLM pass that
    accepted tokens (several at once when speculation succeeds): the host calls the same loop in
    chunks of up to ``host_step.MAX_CHUNK_STEPS`` passes and hands over each pass's tokens as a chunk
    returns; each request's own finish time is reported. Either way
    ``stats`` has ``prefill_seconds`` (the time to the first tokens); ``stats["seconds"]`` (prefill +
    decoding) never includes compilation, which ``stats["compile_seconds"]`` reports apart.

    A request whose LLM logits turn non-finite (NaN weights, overflow) stops without emitting a
    token from that pass: ``GenerationError`` names it, with the whole result attached.
    """
    _check_on_host(model)
    check_policy(special_tokens)
    default = mode is None and not ssms and not drafters
    if default:
        if expansion is not None:
            raise InputError("expansion shapes SSM drafts, and the default drafters have none: pass ssms=[...] "
                             "with it, or drop it")
        budget = "auto" if budget is None else budget
        sampled = any(not s.greedy for s in _sampling_list(sampling, len(normalize_prompts(prompts))))
        drafters = default_drafters(model, sampled, verifier, draft, load=False)  # checked before weights load
    plan = plan_generation(model, prompts, max_new_tokens, sampling, chat_template, ignore_eos, mode, ssms,
                           expansion, impl, verifier, draft, drafters, budget, special_tokens=special_tokens)
    if default:
        drafters = default_drafters(model, sampled, verifier, draft)
    return run_plan(model, plan, list(ssms), parallel=parallel, on_tokens=on_tokens, drafters=drafters)


def _check_on_host(model: Model) -> None:
    """Weights traced by a caller's jit: refused before any work (the prefill ran, then a nested jit failed
    with a message about ``compiler_options``)."""
    traced = next((leaf for leaf in jax.tree.leaves(model.params) if isinstance(leaf, jax.core.Tracer)), None)
    if traced is not None:
        host_value(traced, "model.params")  # raises, naming the way to do it inside jit


def _check_run_args(parallel, on_tokens) -> None:
    """Before anything compiles: a wrong one would otherwise fail after it (``on_tokens`` at the first
    chunk's tokens)."""
    from specjax.sharding.parallel import Parallel

    if parallel is not None and not isinstance(parallel, Parallel):
        raise InputError(f"parallel must be a specjax.sharding.Parallel (or None), got {type(parallel).__name__} "
                         f"{parallel!r:.60}")
    if on_tokens is not None and not callable(on_tokens):
        raise InputError(f"on_tokens must be a callable on_tokens(request_index, new_token_ids) (or None), got "
                         f"{type(on_tokens).__name__}")


@in_32_bit
def run_plan(model: Model, plan: GenerationPlan, ssms=(), parallel=None, on_tokens=None,
             drafters=(), progress=None) -> GenerationResult:
    """Execute a validated plan (``plan_generation``) with loaded weights (the SSMs' and drafters'
    params in the plan's drafter order: SSMs first). ``progress``: called with each tree size the budget
    measures, if it measures (``measure_pass_costs``)."""
    _check_on_host(model)
    _check_run_args(parallel, on_tokens)
    n = len(plan.ids)
    check_cache_fits(model.config, n + (0 if parallel is None else parallel.padding_for(n)), plan.cache_len,
                     jax.tree.leaves(model.params)[0].dtype,
                     f"{n} prompt{'s' if n != 1 else ''} at max_new_tokens={plan.max_new_tokens}",
                     processes=jax.process_count() if parallel is not None else 1,
                     devices=local_devices_of(model.params, parallel.mesh if parallel is not None else None))
    drafter_params = tuple(s.params for s in ssms) + tuple(as_bound(d).params for d in drafters)
    params, drafter_params, inputs, host = _place(parallel, model, plan, drafter_params)
    if plan.spec is not None:  # the drafters' matmul weights packed for the CPU kernel, where it runs
        drafter_params = step_drafter_params(plan.spec.drafters, drafter_params, parallel)
    batch = inputs[0].shape[0]
    # XLA:CPU runs several pipelined passes in one program wrongly on an in-process mesh
    # (``Parallel.one_pass_per_call``): there the loop goes one pass per call, streamed or not.
    one_pass = parallel is not None and parallel.one_pass_per_call
    streamed = on_tokens is not None or one_pass
    started = []

    def beside():
        # The budget measures its pass costs (none of this batch size, head or mesh in the table yet): the
        # programs, which do not depend on the costs (an array argument), compile meanwhile (``AheadCompile``).
        costs = jax.ShapeDtypeStruct((len(plan.spec.budget.levels),), jnp.float32)
        init, finish_all, step = _programs(model, plan, plan.spec, costs, params, drafter_params, inputs, batch,
                                           parallel)
        started.append(AheadCompile(init, step, steps=np.int32(1)) if streamed else AheadCompile(init, finish_all))
        return started[0].result

    try:  # one device only (``AheadCompile``)
        plan = measured_budget(model, plan, params, batch, parallel, progress,
                               beside=beside if parallel is None else None)
    except BaseException as e:
        if not isinstance(e, KeyboardInterrupt):  # an interrupt does not wait for XLA
            for ahead in started:
                ahead.wait()  # a failed measurement leaves no compilation running behind its error
        raise
    ahead = started[0] if started else None
    loop_spec, pass_costs = (None, None) if plan.spec is None else plan.spec.costs_apart()
    init, finish_all, step = _programs(model, plan, loop_spec, pass_costs, params, drafter_params, inputs, batch,
                                       parallel)
    timing = {"step_matmuls": step_matmuls(params, batch, parallel)}
    if not streamed:
        out = run_two_programs(init, finish_all, host, timing, ahead=ahead)
        tokens = host(out.tokens)
        finish = None
    else:  # the loop in chunks of a few passes, each process fetching its reports
        out, finish = run_host_loop(init, step, host, n, on_tokens or _ignore_tokens, timing,
                                    1 if one_pass else MAX_CHUNK_STEPS, ahead=ahead)
        tokens = host(out.tokens)
    return _result(model, plan, out, tokens, host, n, timing, finish)


def _programs(model: Model, plan: GenerationPlan, loop_spec, pass_costs, params, drafter_params, inputs, batch: int,
              parallel):
    """(prefill, whole loop, chunk of the loop) as partially applied jitted functions. ``loop_spec``: the
    plan's spec with its budget's pass costs taken out (``SpecConfig.costs_apart``), ``pass_costs`` the
    [L] costs (an array; its ``jax.ShapeDtypeStruct`` compiles the same programs before they are measured).
    The prefill and the steps are separate programs: XLA:CPU's best matmul library differs between them
    (``specjax.decoding.programs``)."""
    cfg = model.config
    sizes = dict(cfg=cfg, cache_len=plan.cache_len, max_out=plan.max_out, parallel=parallel)
    if plan.spec is None:  # the reference decoder
        init = functools.partial(decode_init_jit, params, *inputs, eos_ids=plan.eos_ids, **sizes)
        per_step = dict(sampling=inputs[3], max_new_tokens=inputs[2], cfg=cfg, eos_ids=plan.eos_ids, parallel=parallel)
        statics = ("cfg", "eos_ids", "parallel")
        finish_all = step_program(finish_incremental, batch, statics).bind(params, **per_step)
        step = step_program(decode_host_step, batch, statics, ("state",)).bind(params, **per_step)
        return init, finish_all, step
    # the speculative loop: per-request settings live in its state
    n = len(plan.ids)
    stop_ids = stop_rows(plan.eos_ids, len(plan.lens) + (parallel.padding_for(n) if parallel else 0))
    if parallel is not None:
        stop_ids = parallel.put_batch(stop_ids)
    init = functools.partial(init_state_jit, params, drafter_params, *inputs, stop_ids, spec=loop_spec, **sizes)
    per_step = dict(cfg=cfg, spec=loop_spec, parallel=parallel)
    if pass_costs is not None:
        # The budget's pass costs go in as an array, not compiled in: a remeasured table reuses the programs.
        per_step["pass_costs"] = pass_costs if parallel is None else parallel.put(pass_costs, parallel.replicated())
    statics = ("cfg", "spec", "parallel")
    finish_all = step_program(finish_speculative, batch, statics).bind(params, drafter_params, **per_step)
    step = step_program(host_step, batch, statics, ("state",)).bind(params, drafter_params, **per_step)
    return init, finish_all, step


def _ignore_tokens(request: int, token_ids: list) -> None:
    """The host loop's ``on_tokens`` where the caller streams nothing."""


@in_32_bit
def measured_budget(model: Model, plan: GenerationPlan, params=None, batch: int | None = None, parallel=None,
                    progress=None, beside=None) -> GenerationPlan:
    """The plan with its tree budget's pass costs for this machine and batch size (measured once,
    then read from the cost table on disk). batch: the batch as run (mesh padding included);
    ``beside``: as in ``measure_pass_costs`` (called only when something is measured)."""
    if plan.spec is None or plan.spec.budget is None or plan.spec.budget.costs is not None:
        return plan
    params = model.params if params is None else params
    batch = len(plan.ids) + (parallel.padding_for(len(plan.ids)) if parallel is not None else 0) \
        if batch is None else batch
    budget = with_costs(plan.spec.budget, params, model.config, batch, plan.spec.impl, parallel, progress,
                        head=pass_head(plan.spec.verifier), beside=beside)
    return dataclasses.replace(plan, spec=dataclasses.replace(plan.spec, budget=budget))


def _result(model: Model, plan: GenerationPlan, out, tokens, host, n: int, timing: dict, finish) -> GenerationResult:
    counts = host(out.num_generated)[:n]
    failed = host(out.failed)[:n]
    token_ids = [tokens[i, :counts[i]].tolist() for i in range(n)]
    texts = [model.tokenizer.decode(t, skip_special_tokens=True) if model.tokenizer is not None else None
             for t in token_ids]
    seconds = timing["seconds"]
    total = int(counts.sum())
    stats = {"mode": plan.mode, "llm_passes": int(host(out.llm_passes)), "generated_tokens": total,
             "seconds": seconds, "tokens_per_s": total / seconds if seconds > 0 else float("inf"),
             "cache_len": plan.cache_len}
    for key in ("compile_seconds", "prefill_seconds", "step_matmuls"):
        if key in timing:
            stats[key] = timing[key]
    # Histograms count the loop's passes (tokens each emitted); the prefill pass, which emits the
    # first token of every request, is counted in llm_passes only.
    if plan.spec is None:
        hist = np.zeros((n, 3), np.int64)
        hist[:, 1] = np.maximum(counts - 1, 0)  # incremental decoding: one token per pass
        depth_acc = np.zeros((n, 1), np.int64)
    else:
        hist = host(out.tokens_per_pass)[:n].astype(np.int64)
        depth_acc = host(out.accepted_at_depth)[:n]
        stats.update({"tree_nodes": plan.spec.num_nodes, "drafters": [d.describe() for d in plan.spec.drafters],
                      "expansions": [d.expansion.widths for d in plan.spec.drafters if isinstance(d, SSMDrafter)],
                      "verifier": plan.verifier, "draft": plan.draft})
        at_level = host(out.level_passes)[:n].astype(np.int64)
        budget = plan.spec.budget
        if budget is not None:
            stats["budget"] = {"tree_nodes": [budget.node_count(lv) for lv in range(len(budget.levels))],
                               "seconds_per_pass": list(budget.costs), "costs_source": budget.source,
                               "goal": budget.goal, "passes_at_level": at_level.sum(0).tolist()}
    batch_hist = hist.sum(0)
    stats.update({"tokens_per_pass_histogram": batch_hist.tolist(),
                  "mean_tokens_per_pass": _mean(batch_hist),
                  "accepted_at_depth": depth_acc.sum(0).tolist()})
    requests = []
    for i in range(n):
        took = finish[i] if finish is not None and finish[i] is not None else seconds
        passes = 1 + int(hist[i].sum()) + int(failed[i] and counts[i] > 0)  # prefill + loop passes (+ failing one)
        requests.append({"generated_tokens": int(counts[i]), "llm_passes": passes,
                         "tokens_per_pass_histogram": hist[i].tolist(), "mean_tokens_per_pass": _mean(hist[i]),
                         "accepted_at_depth": depth_acc[i].tolist(), "seconds": took,
                         **({"passes_at_level": at_level[i].tolist()} if "budget" in stats else {}),
                         "tokens_per_s": int(counts[i]) / took if took > 0 else float("inf"),
                         "failed": bool(failed[i])})
    stats["requests"] = requests
    result = GenerationResult(token_ids=token_ids, texts=texts, prompt_token_ids=plan.ids, stats=stats)
    if failed.any():
        bad = np.flatnonzero(failed).tolist()
        raise GenerationError(f"requests {bad}: the LLM produced non-finite logits (NaN or inf; NaN weights or an "
                              f"overflow) or a distribution without probability mass; they stopped there and no "
                              f"token was invented", result=result, failed=bad)
    return result


def _mean(hist) -> float:
    hist = np.asarray(hist)
    passes = int(hist.sum())
    return float((hist * np.arange(len(hist))).sum() / passes) if passes else 0.0


def _place(parallel, model: Model, plan: GenerationPlan, drafter_params: tuple):
    """(LLM params, drafter params, per-request inputs, fetch-to-host function), on the mesh when given.

    On a mesh the batch is padded with inert copies of request 0 (budget of 1 token, dropped from the
    results) to a multiple of dp x microbatches, so any batch size runs."""
    n = len(plan.lens)
    padded, lens, samplings = plan.padded, plan.lens, plan.samplings
    if parallel is None:
        inputs = (jnp.asarray(padded), jnp.asarray(lens), jnp.full((n,), plan.max_new_tokens, jnp.int32),
                  SamplingArrays.from_params(samplings))
        return model.params, drafter_params, inputs, lambda x: np.asarray(jax.device_get(x))
    extra = parallel.padding_for(n)
    padded = np.concatenate([padded, np.repeat(padded[:1], extra, axis=0)])
    lens = np.concatenate([lens, np.repeat(lens[:1], extra)]).astype(np.int32)
    budget = np.array([plan.max_new_tokens] * n + [1] * extra, np.int32)
    parallel.validate(model.config, n + extra)
    drafters = plan.spec.drafters if plan.spec is not None else ()
    for d in drafters:
        d.check_mesh(parallel, n + extra)
    params = parallel.put_params(model.params, model.config)
    drafter_params = tuple(d.place(p, parallel) for d, p in zip(drafters, drafter_params))
    sampling = SamplingArrays.from_params(list(samplings) + [samplings[0]] * extra)
    inputs = parallel.put_batch((padded, lens, budget, sampling))
    return params, drafter_params, inputs, parallel.fetch


@in_32_bit
def logits(model: Model, token_ids) -> list[np.ndarray]:
    """Full-sequence logits for each token-id list: a list of float32 [len, V] arrays."""
    ids = encode_prompts(model, token_ids, chat_template=False)
    for i, p in enumerate(ids):
        if len(p) > model.config.max_positions:
            raise InputError(f"sequence {i} has {len(p)} tokens, beyond the context window "
                             f"{model.config.max_positions}")
    width = next_pow2(max(len(p) for p in ids))
    padded = np.zeros((len(ids), width), np.int32)
    for i, p in enumerate(ids):
        padded[i, :len(p)] = p
    out = np.asarray(full_logits(model.params, jnp.asarray(padded), cfg=model.config))
    return [out[i, :len(p)] for i, p in enumerate(ids)]
