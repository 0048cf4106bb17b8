"""`specjax generate`: every flag checked before the model loads, text streamed, one stats line per prompt."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

from specjax.cli.layers import split_layers_arg
from specjax.errors import GenerationError, InputError
from specjax.io import registry
from specjax.io.detokenize import IncrementalText
from specjax.speculation.drafters.base import estimates_acceptance


def _positive(name: str, value, allow_none: bool = False):
    if value is None and allow_none:
        return
    if value is None or value < 1:
        raise InputError(f"{name} must be >= 1, got {value}")


def _read_prompts(args) -> tuple[list, list[str]]:
    """(prompts, labels): each label names the prompt in errors (``--prompt``, or the file's ``path:line``)."""
    from specjax.io.prompts import check_text, read_labelled_prompts

    if args.prompt is not None and args.prompts_file is not None:
        raise InputError("give either --prompt or --prompts-file, not both")
    if args.prompt is not None:
        if not args.prompt:
            raise InputError("--prompt is empty")
        return [check_text(args.prompt, "--prompt")], ["--prompt"]
    if args.prompts_file is None:
        raise InputError("give --prompt TEXT or --prompts-file FILE.jsonl")
    return read_labelled_prompts(args.prompts_file, flag="--prompts-file")


def _sampling_kw(args) -> dict:
    """SamplingParams' arguments from the flags (unset ones at their defaults: off, and seed 0)."""
    return dict(temperature=args.temperature, top_k=args.top_k or 0, top_p=1.0 if args.top_p is None else args.top_p,
                seed=args.seed or 0)


def _has_ssm_drafts(args) -> bool:
    """An SSM drafts here: --mode sequence (the default SSM), --ssm, or --drafter ssm:ARG."""
    return args.mode != "incremental" and bool(args.mode == "sequence" or args.ssm or any(
        t.startswith("ssm:") for t in args.drafter or ()))


def _unused_sampling_flags(args) -> list[str]:
    """Sampling flags given for greedy decoding, where they change nothing: reported, not refused (a sweep
    over temperatures may pass them throughout)."""
    from specjax.speculation.request import resolve_verifier

    if args.temperature > 0:
        return []
    unused = [flag for flag, v in (("--top-k", args.top_k), ("--top-p", args.top_p)) if v is not None]
    sampled_drafts = _has_ssm_drafts(args) and resolve_verifier(args.verifier, args.draft, False)[1] != "topk"
    if args.seed is not None and not sampled_drafts:
        unused.append("--seed")
    return unused


def _check_generate_args(args) -> None:
    """Everything about ``generate``'s flags that needs neither JAX nor the model."""
    from specjax.decoding.sampling import SamplingParams
    from specjax.speculation.expansion import Expansion

    _positive("--max-new-tokens", args.max_new_tokens)
    _positive("--batch-size", args.batch_size)
    _positive("--microbatches", args.microbatches, allow_none=True)
    SamplingParams(**_sampling_kw(args))
    if args.expansion is not None:
        Expansion.parse(args.expansion)
    if args.mode == "incremental" and (args.ssm or args.expansion or args.drafter):
        raise InputError("--mode incremental drafts nothing: drop --ssm / --drafter / --expansion, or choose --mode "
                         "tree")
    if args.mode == "incremental" and args.budget is not None:
        raise InputError("--mode incremental drafts nothing, so it takes no --budget")
    if args.mode == "incremental" and (args.verifier != "auto" or args.draft != "auto"):
        raise InputError("--mode incremental neither drafts nor verifies: drop --verifier / --draft, or choose "
                         "--mode tree")
    from specjax.speculation.drafters import parse_spec

    for text in args.drafter or ():
        parse_spec(text)
    for flag, given in (("--expansion", args.expansion is not None), ("--draft", args.draft != "auto")):
        if given and args.mode == "tree" and not _has_ssm_drafts(args):
            raise InputError(f"{flag} shapes SSM drafts, but no SSM drafts here (nor in the default drafters); "
                             f"add --ssm NAME or --drafter ssm:ARG, or drop {flag}")
    if args.layers == "split" and args.mesh is not None:
        raise InputError("--layers split keeps the weights on one device; a --mesh shards stacked layers: drop one")
    if args.mesh is not None:
        from specjax.sharding.mesh import MeshShape

        mesh = MeshShape.parse(args.mesh)  # a ShardingError naming the bad part, before anything loads
    if args.microbatches is not None:
        if args.mesh is None or mesh.pp == 1:
            raise InputError(f"--microbatches needs --mesh with pp > 1 (pipeline request groups), got "
                             f"{'no --mesh' if args.mesh is None else '--mesh ' + args.mesh}")
        if args.microbatches > args.batch_size:
            raise InputError(f"--microbatches {args.microbatches} exceeds --batch-size {args.batch_size}: the extra "
                             f"pipeline groups would hold nothing but padding")
    if args.replicate_attention and args.mesh is None:
        raise InputError("--replicate-attention shapes how a --mesh splits attention; without --mesh it does nothing")
    if args.init_timeout <= 0:
        raise InputError(f"--init-timeout must be > 0 seconds, got {args.init_timeout}")


def _parallel(args):
    """Join the cluster (when there is one) and build the mesh from --mesh; None without --mesh."""
    from specjax.sharding import Parallel, ShardingRules, distributed

    cluster = distributed.detect_cluster(args.coordinator, args.num_processes, args.process_id,
                                         slurm=args.distributed == "slurm")
    if cluster is not None and args.distributed == "off":
        raise InputError(f"--distributed off, but a cluster is configured ({cluster.source})")
    distributed.initialize(cluster, timeout_s=args.init_timeout)
    if args.mesh is None:
        if cluster is not None and cluster.num_processes > 1:
            raise InputError("several processes need a --mesh that spans them (e.g. --mesh pp=2,tp=4)")
        return None
    rules = ShardingRules(heads=None, kv_heads=None) if args.replicate_attention else ShardingRules()
    return Parallel.create(args.mesh, rules=rules, microbatches=args.microbatches)


def _drafters(args, llm, load: bool, verifier: str, draft: str) -> list:
    """The --drafter entries built by their registered factories (``Bound`` each)."""
    from specjax.speculation.drafters import build
    from specjax.speculation.expansion import Expansion
    from specjax.speculation.request import resolve_verifier

    _, draft = resolve_verifier(verifier, draft, args.temperature > 0)
    widths = Expansion.parse(args.expansion) if args.expansion else Expansion(registry.DEFAULT_EXPANSION)
    return [build(t, llm, load=load, expansion=widths, draft=draft) for t in _drafter_specs(args, llm.config)]


def _ssm_specs(args) -> tuple[list[str], str | None]:
    """(--ssm entries, --expansion for them): what --ssm names; --mode sequence without one drafts with
    the shipped SSM for the default LLM, else the LLM's first layers (derived:auto). Without SSMs the
    expansion is None: it shaped the --drafter ssm:ARG entries when they were built."""
    if args.mode == "incremental":
        return [], None
    if args.mode == "sequence" and not args.ssm:
        return (list(registry.DEFAULT_SSMS) if args.model == registry.DEFAULT_MODEL else ["derived:auto"]), \
            args.expansion
    ssms = list(args.ssm or ())
    return ssms, args.expansion if ssms else None  # expansion None: the API's default (one place)


def _drafter_specs(args, llm_config) -> list[str]:
    """--drafter entries after the default (``registry.default_drafters``) when neither --ssm nor
    --drafter is given (tree mode); --mode sequence takes an SSM, so it gets the default SSM instead."""
    if args.mode == "incremental" or args.ssm or args.drafter:
        return list(args.drafter or ())
    return [] if args.mode == "sequence" else list(registry.default_drafters(llm_config))


def _budget(args, ssm_specs, drafter_objs) -> str | None:
    """--budget: auto (the default) adapts the tree to measured costs and acceptance when every drafter
    estimates its acceptance (lookup); with an SSM in the pool the default is the whole tree, and an
    explicit --budget auto is refused (SSMs do not estimate acceptance)."""
    if args.mode == "incremental" or args.budget == "off":
        return None
    # ssm_specs, not args.ssm: --mode sequence without --ssm drafts with the default SSM.
    blind = [f"SSM {s}" for s in ssm_specs]
    blind += [d.describe() for d in drafter_objs if not estimates_acceptance(d)]
    if not blind:
        return "auto"
    if args.budget == "auto":
        names = blind
        raise InputError(f"--budget auto needs drafters that estimate their acceptance; {', '.join(names)} do not "
                         f"(use --budget off, or the lookup drafter alone)")
    return None


def _ssm(spec: str, llm, load: bool):
    """One --ssm entry: described (config only) or loaded."""
    import specjax
    from specjax.speculation.drafters.ssm import derive_ssm, parse_derived

    if spec.startswith("derived:"):
        return derive_ssm(llm, parse_derived(spec, llm.config))
    return specjax.load_model(spec, progress=False) if load else specjax.describe_model(spec)


class _TextStream:
    """The new text since the last call (``specjax.io.detokenize``: a few tokens decoded per token, an
    unfinished UTF-8 character held back); token ids space-separated without a tokenizer. No prompt
    context: the stream shows what the result's text will be, the generated tokens decoded alone."""

    def __init__(self, tokenizer):
        self.tokenizer, self.count = tokenizer, 0
        self.decoder = IncrementalText(tokenizer) if tokenizer is not None else None

    def feed(self, ids) -> str:
        if self.decoder is None:
            new = " ".join(map(str, ids))
            new, self.count = (" " + new if self.count else new), self.count + len(ids)
            return new
        return "".join(self.decoder.add(t) for t in ids)

    def finish(self) -> str:
        return self.decoder.flush() if self.decoder is not None else ""


def _budget_record(stats: dict, req: dict) -> dict:
    """The tree budget's cost table and this request's passes at each level, for --json."""
    if "budget" not in stats:
        return {}
    b = stats["budget"]
    return {"tree_budget": {"tree_nodes": b["tree_nodes"], "ms_per_pass": [round(c * 1e3, 2) for c in
                                                                          b["seconds_per_pass"]],
                            "costs_source": b["costs_source"], "passes_at_level": req["passes_at_level"]}}


def _stats_line(req: dict, load_s: float, compile_s: float, prefill_s: float, batch: int, description: str) -> str:
    return (f"# {req['generated_tokens']} tokens in {req['seconds']:.2f} s (first token after {prefill_s:.2f} s) = "
            f"{req['tokens_per_s']:.1f} tokens/s | "
            f"load {load_s:.1f} s, compile {compile_s:.1f} s | {req['llm_passes']} LLM passes, "
            f"{req['mean_tokens_per_pass']:.2f} tokens per pass | {description}"
            + (f", batch of {batch}" if batch > 1 else ""))


def _compile_cache(directory: str) -> None:
    """Keep compiled programs on disk: a second run with the same shapes skips most compilation."""
    if directory == "none":
        return
    import jax

    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise InputError(f"--compile-cache {directory}: cannot create it ({e.strerror or e}); use 'none' to turn the "
                         f"cache off") from None
    jax.config.update("jax_compilation_cache_dir", directory)
    # Every program: the run's set is fixed by its shapes, and its dozens of small ones (weight packing,
    # casts, 30-70 ms each) had compiled afresh on every start under a 0.5 s floor. Measured on 2 AMD
    # EPYC cores, `--mode incremental` on SmolLM2 run again: 8.2-8.3 s with the floor, 7.2-7.5 s without.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def _batch_parallel(parallel, requests: int):
    """The mesh for a batch of ``requests``: ``--microbatches`` lowered to the requests each dp replica gets
    when a short last batch has fewer (the flag is checked against --batch-size, which full batches have)."""
    if parallel is None or parallel.microbatches is None:
        return parallel
    return dataclasses.replace(parallel, microbatches=min(parallel.microbatches, parallel.per_replica(requests)))


def _cmd_generate(args, out) -> int:
    _check_generate_args(args)
    prompts, labels = _read_prompts(args)
    parallel = _parallel(args)  # joins the cluster: must precede any other JAX use
    _compile_cache(args.compile_cache)
    import jax

    import specjax
    from specjax.api import plan_generation, run_plan
    from specjax.models.params import stack_layers

    printing = jax.process_index() == 0  # every process computes; process 0 reports
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if printing else (lambda *a: None)
    sampling = specjax.SamplingParams(**_sampling_kw(args))
    unused = _unused_sampling_flags(args)
    if unused:
        log(f"# note: {', '.join(unused)} change{'s' if len(unused) == 1 else ''} nothing at --temperature 0 "
            f"(greedy decoding)")
    ssm_specs, expansion = _ssm_specs(args)
    # Check the whole request against the configs and tokenizer before the weights load.
    light = specjax.describe_model(args.model)
    if (not args.no_chat_template and any(isinstance(p, str) for p in prompts) and light.tokenizer is not None
            and not getattr(light.tokenizer, "chat_template", None)):
        # Said, not silent: a base model's prompt goes in as written, where a chat model's gets its turn markers.
        log(f"# note: {args.model} has no chat template: prompts are tokenized as written "
            f"(--no-chat-template says so and silences this note)")
    light_ssms = [_ssm(s, light, load=False) for s in ssm_specs]
    light_drafters = _drafters(args, light, False, args.verifier, args.draft)
    batches = [prompts[i:i + args.batch_size] for i in range(0, len(prompts), args.batch_size)]
    batch_labels = [labels[i:i + args.batch_size] for i in range(0, len(prompts), args.batch_size)]
    kw = dict(max_new_tokens=args.max_new_tokens, sampling=sampling, chat_template=not args.no_chat_template,
              special_tokens=args.special_tokens,
              mode=args.mode, expansion=expansion, verifier=args.verifier, draft=args.draft,
              budget=_budget(args, ssm_specs, [b.drafter for b in light_drafters]))
    plans = [plan_generation(light, batch, ssms=light_ssms, drafters=light_drafters, labels=names, **kw)
             for batch, names in zip(batches, batch_labels)]
    # What every process of a cluster must agree on: the request as tokenized, the models' configs, the
    # drafters' settings and the flags that are not about this host (paths, --ssm's and --drafter's too,
    # may differ between hosts: what they hold is compared, as far as it is known before loading).
    from specjax.sharding.distributed import check_agreement

    own = {"process_id", "coordinator", "num_processes", "distributed", "init_timeout", "compile_cache", "model",
           "prompts_file", "ssm", "drafter", "func"}
    check_agreement("arguments, prompts or models", (
        [p.ids for p in plans], light.config, [s.config for s in light_ssms], [b.drafter for b in light_drafters],
        sorted((k, v) for k, v in vars(args).items() if k not in own)))
    meshes = [_batch_parallel(parallel, len(batch)) for batch in batches]
    from specjax.memory import check_cache_fits

    for batch, batch_mesh, plan in zip(batches, meshes, plans):
        rows = len(batch) + (batch_mesh.padding_for(len(batch)) if batch_mesh is not None else 0)
        if batch_mesh is not None:
            batch_mesh.validate(light.config, rows, [s.config for s in light_ssms])
        check_cache_fits(light.config, rows, plan.cache_len, args.dtype,
                         f"--batch-size {args.batch_size} at --max-new-tokens {args.max_new_tokens}",
                         processes=jax.process_count())
    t0 = time.perf_counter()
    # With a mesh the LLM goes straight to its sharding (a model larger than one device never sits on one).
    model = specjax.load_model(args.model, dtype=args.dtype, progress=not args.json and printing, parallel=parallel,
                               split_layers=split_layers_arg(args))
    ssms = [_ssm(s, model, load=True) for s in ssm_specs]
    drafters = _drafters(args, model, True, args.verifier, args.draft)
    if parallel is not None:  # place once; generation then finds everything where it belongs
        # an SSM loaded by name has split layers on one CPU device (load_model's default there): restacked
        ssms = [s._replace(params=parallel.put_params(stack_layers(s.params), s.config, parallel.ssm_rules))
                for s in ssms]
    load_s = time.perf_counter() - t0
    from specjax.speculation.cost import cache_path

    def measuring(nodes, batch):
        log(f"# measuring the LLM pass time of a {nodes}-node tree at batch {batch} (once per machine; cached in "
            f"{cache_path()})")

    names = ssm_specs + _drafter_specs(args, model.config)
    description = args.mode + (f", {', '.join(names)}: " + "; ".join(d.describe() for d in plans[0].spec.drafters)
                               if names else "")
    failures = []
    headers = len(prompts) > 1 and not args.json  # "### prompt i" before each text
    for number, (batch, plan, batch_mesh) in enumerate(zip(batches, plans, meshes)):
        first = number * args.batch_size
        streams = [_TextStream(model.tokenizer) for _ in batch]
        stream_live = printing and not args.json and len(batch) == 1
        if stream_live and headers:
            out.write(f"### prompt {first}\n")

        def on_tokens(i, ids, streams=streams, stream_live=stream_live):
            text = streams[i].feed(ids)
            if stream_live and text:
                out.write(text)
                out.flush()

        try:
            # the budget measures its costs here, on one device while the programs compile (``run_plan``)
            result = run_plan(model, plan, ssms, parallel=batch_mesh, on_tokens=on_tokens, drafters=drafters,
                              progress=lambda n, b=len(plan.ids): measuring(n, b))
            failed = set()
        except GenerationError as e:
            result, failed = e.result, set(e.failed)
            failures.append(str(e))
        st = result.stats
        for i, (prompt, ids) in enumerate(zip(batch, result.token_ids)):
            req = st["requests"][i]
            if not printing:
                continue
            if args.json:
                if i in failed:
                    continue
                out.write(json.dumps({"prompt": prompt, "token_ids": ids, "text": result.texts[i], "mode": st["mode"],
                                      "speculation": description,
                                      "llm_passes": req["llm_passes"],
                                      "mean_accepted_tokens_per_pass": round(req["mean_tokens_per_pass"], 4),
                                      "tokens_per_pass_histogram": req["tokens_per_pass_histogram"],
                                      "tokens_per_s": round(req["tokens_per_s"], 3),
                                      "prefill_seconds": round(st["prefill_seconds"], 4),
                                      "step_matmuls": st["step_matmuls"], **_budget_record(st, req)})
                          + "\n")
                out.flush()
                continue
            if stream_live:
                out.write(streams[i].finish() + "\n")
            else:
                if headers:
                    out.write(f"### prompt {first + i}\n")
                out.write((result.texts[i] if result.texts[i] is not None else " ".join(map(str, ids))) + "\n")
            out.flush()
            if i not in failed:
                log(_stats_line(req, load_s, st["compile_seconds"], st["prefill_seconds"], len(batch), description))
    if failures:
        for message in failures:
            log(f"specjax: error: {message}")
        return 2
    return 0
