"""The ``specjax`` command: generate, convert, launch, boost-tune.

Every argument is checked before any expensive work (model load, compilation, corpus generation);
a refused input prints ``specjax: error: ...`` and exits with status 2, never a traceback.
``generate`` streams text as the verifier accepts tokens, then prints one stats line per prompt.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import time

from specjax import registry
from specjax.errors import GenerationError, InputError, SpecjaxError

DESCRIPTION = ("specjax: tree-based speculative inference and verification for LLaMA- and OPT-family LLMs in JAX. "
               "Small drafters propose a token tree, the LLM scores it in one pass, a verifier keeps exactly "
               "what the LLM itself would have produced.")


def _default_compile_cache() -> str:
    from specjax.tokenizer import cache_dir

    return os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(cache_dir(), "xla")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every option's default, unless its help already says what the default is."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "(default" in text or action.default in (None, argparse.SUPPRESS) or not action.option_strings:
            return text
        return text + " (default: %(default)s)"


# -- small argument checks (no JAX, no model) -------------------------------------------------------

def _positive(name: str, value, allow_none: bool = False):
    if value is None and allow_none:
        return
    if value is None or value < 1:
        raise InputError(f"{name} must be >= 1, got {value}")


def _read_prompts(args) -> list:
    from specjax.prompts import check_text, read_prompts_file

    if args.prompt is not None and args.prompts_file is not None:
        raise InputError("give either --prompt or --prompts-file, not both")
    if args.prompt is not None:
        if not args.prompt:
            raise InputError("--prompt is empty")
        return [check_text(args.prompt, "--prompt")]
    if args.prompts_file is None:
        raise InputError("give --prompt TEXT or --prompts-file FILE.jsonl")
    return read_prompts_file(args.prompts_file, flag="--prompts-file")


def _check_generate_args(args) -> None:
    """Everything about ``generate``'s flags that needs neither JAX nor the model."""
    from specjax.sampling import SamplingParams
    from specjax.speculate import Expansion

    _positive("--max-new-tokens", args.max_new_tokens)
    _positive("--batch-size", args.batch_size)
    _positive("--microbatches", args.microbatches, allow_none=True)
    SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    if args.expansion is not None:
        Expansion.parse(args.expansion)
    if args.mode == "incremental" and (args.ssm or args.expansion):
        raise InputError("--mode incremental drafts nothing: drop --ssm / --expansion, or choose --mode tree")
    if args.microbatches is not None:
        if args.mesh is None:
            raise InputError("--microbatches needs --mesh with pp > 1 (pipeline request groups)")
        if args.microbatches > args.batch_size:
            raise InputError(f"--microbatches {args.microbatches} exceeds --batch-size {args.batch_size}: the extra "
                             f"pipeline groups would hold nothing but padding")
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


def _ssm_specs(args) -> tuple[list[str], str | None]:
    """(--ssm entries, --expansion) after the defaults: the shipped SSM in its best measured shape for
    the default LLM, otherwise the LLM's first layers (derived:auto)."""
    if args.mode == "incremental":
        return [], None
    if not args.ssm and args.model == registry.DEFAULT_MODEL:
        expansion = args.expansion
        if expansion is None and args.mode == "tree":
            expansion = ",".join(map(str, registry.DEFAULT_EXPANSION))
        return list(registry.DEFAULT_SSMS), expansion
    return args.ssm or ["derived:auto"], args.expansion


def _ssm(spec: str, llm, load: bool):
    """One --ssm entry: described (config only) or loaded."""
    import specjax
    from specjax.ssm import derive_ssm, parse_derived

    if spec.startswith("derived:"):
        return derive_ssm(llm, parse_derived(spec, llm.config))
    return specjax.load_model(spec, progress=False) if load else specjax.describe_model(spec)


class _TextStream:
    """Incremental detokenisation: the new text since the last call, holding back an incomplete
    UTF-8 sequence (a token may end in the middle of a character)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.shown = tokenizer, [], 0

    def feed(self, ids) -> str:
        if self.tokenizer is None:  # token ids, space-separated
            new = " ".join(map(str, ids))
            new, self.ids = (" " + new if self.ids else new), self.ids + list(ids)
            return new
        self.ids += list(ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        new, self.shown = text[self.shown:], len(text)
        return new

    def finish(self) -> str:
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        return text[self.shown:]


def _stats_line(req: dict, load_s: float, compile_s: float, batch: int, description: str) -> str:
    return (f"# {req['generated_tokens']} tokens in {req['seconds']:.2f} s = {req['tokens_per_s']:.1f} tokens/s | "
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
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def _cmd_generate(args, out) -> int:
    _check_generate_args(args)
    prompts = _read_prompts(args)
    parallel = _parallel(args)  # joins the cluster: must precede any other JAX use
    _compile_cache(args.compile_cache)
    import jax

    import specjax
    from specjax.api import plan_generation, run_plan

    printing = jax.process_index() == 0  # every process computes; process 0 reports
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if printing else (lambda *a: None)
    sampling = specjax.SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                      seed=args.seed)
    ssm_specs, expansion = _ssm_specs(args)
    # Check the whole request against the configs and tokenizer before the weights load.
    light = specjax.describe_model(args.model)
    light_ssms = [_ssm(s, light, load=False) for s in ssm_specs]
    batches = [prompts[i:i + args.batch_size] for i in range(0, len(prompts), args.batch_size)]
    kw = dict(max_new_tokens=args.max_new_tokens, sampling=sampling, chat_template=not args.no_chat_template,
              mode=args.mode, expansion=expansion, verifier=args.verifier, draft=args.draft)
    plans = [plan_generation(light, batch, ssms=light_ssms, **kw) for batch in batches]
    if parallel is not None:
        for batch in batches:
            extra = parallel.padding_for(len(batch))
            parallel.validate(light.config, len(batch) + extra, [s.config for s in light_ssms])
    t0 = time.perf_counter()
    # With a mesh the LLM goes straight to its sharding (a model larger than one device never sits on one).
    model = specjax.load_model(args.model, dtype=args.dtype, progress=not args.json and printing, parallel=parallel)
    ssms = [_ssm(s, model, load=True) for s in ssm_specs]
    if parallel is not None:  # place once; generation then finds everything where it belongs
        ssms = [s._replace(params=parallel.put_params(s.params, s.config, parallel.ssm_rules)) for s in ssms]
    load_s = time.perf_counter() - t0
    description = args.mode + (f", SSMs {','.join(ssm_specs)}, expansion "
                               + ";".join(",".join(map(str, e.widths)) for e in plans[0].spec.expansions)
                               if ssm_specs else "")
    failures = []
    headers = len(prompts) > 1 and not args.json  # "### prompt i" before each text
    for number, (batch, plan) in enumerate(zip(batches, plans)):
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
            result = run_plan(model, plan, ssms, parallel=parallel, on_tokens=on_tokens)
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
                                      "llm_passes": req["llm_passes"],
                                      "mean_accepted_tokens_per_pass": round(req["mean_tokens_per_pass"], 4),
                                      "tokens_per_pass_histogram": req["tokens_per_pass_histogram"],
                                      "tokens_per_s": round(req["tokens_per_s"], 3)}) + "\n")
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
                log(_stats_line(req, load_s, st.get("compile_seconds", 0.0), len(batch), description))
    if failures:
        for message in failures:
            log(f"specjax: error: {message}")
        return 2
    return 0


def _cmd_convert(args, out) -> int:
    import specjax
    from specjax.checkpoint import check_destination, save_checkpoint

    check_destination(args.dst)  # before the model loads
    model = specjax.load_model(args.src, dtype=args.dtype)
    save_checkpoint(args.dst, model.config, model.params, model.tokenizer)
    out.write(f"saved {args.src} -> {args.dst}\n")
    return 0


def _cmd_launch(args, out) -> int:
    from specjax.sharding.launch import launch

    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    return launch(cmd, args.num_processes, cpu_devices=args.cpu_devices, port=args.port, timeout_s=args.timeout)


def build_parser() -> argparse.ArgumentParser:
    fmt = _HelpFormatter
    p = argparse.ArgumentParser(prog="specjax", description=DESCRIPTION, formatter_class=fmt)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    g = sub.add_parser("generate", formatter_class=fmt,
                       help="generate text, speculating with small drafters (lossless: the LLM's own output)",
                       description="Generate text for one prompt or a JSONL file of prompts. By default the LLM "
                                   "speculates with a shipped drafter and a verifier keeps exactly the tokens the LLM "
                                   "itself produces; --mode incremental runs the reference decoder instead.")
    g.add_argument("--model", default=registry.DEFAULT_MODEL,
                   help=f"registered name {registry.registered_names()}, HF directory, .gguf file or specjax "
                        f"checkpoint")
    g.add_argument("--prompt", help="the prompt text (default: none; give --prompt or --prompts-file)")
    g.add_argument("--prompts-file", help='JSONL file, one {"prompt": TEXT} or {"prompt": [token ids]} per line '
                                          "(default: none; give --prompt or --prompts-file)")
    g.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate per prompt")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 samples")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed (the same seed gives the same tokens)")
    g.add_argument("--mode", default="tree", choices=["tree", "sequence", "incremental"],
                   help="tree/sequence speculation, or the incremental reference decoder")
    g.add_argument("--verifier", default="auto", choices=["auto", "greedy", "seeded", "mss", "rrs", "naive"],
                   help="auto: greedy at temperature 0, else seeded (same tokens as --mode incremental with the "
                        "same --seed); mss/rrs/naive: exact sampling distribution, other random numbers")
    g.add_argument("--draft", default="auto", choices=["auto", "topk", "iid", "wor", "coupled"],
                   help="how SSMs draw tree children (auto: the verifier's natural choice; a pair that is not "
                        "lossless is refused)")
    g.add_argument("--ssm", action="append", default=None,
                   help="SSM: a registered name (smollm2-ssm-a, smollm2-ssm-b), 'derived:K' (the LLM's first K "
                        "layers), 'derived:i,j,..', 'derived:auto' or a model path; repeat for a merged pool "
                        f"(default: {','.join(registry.DEFAULT_SSMS)} for the default LLM, its best measured "
                        f"configuration; derived:auto for other LLMs)")
    g.add_argument("--expansion", default=None,
                   help="expansion widths k1,...,km (default: "
                        f"{','.join(map(str, registry.DEFAULT_EXPANSION))} with the default SSM, else 1,1,3,1,1,1,1,1 "
                        f"for tree and 1,1,1,1,1,1,1,1 for sequence)")
    g.add_argument("--batch-size", type=int, default=1, help="prompts generated together")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weight dtype")
    g.add_argument("--no-chat-template", action="store_true", help="feed the prompt text without the chat template")
    g.add_argument("--json", action="store_true", help="one JSON record per prompt on stdout instead of text")
    g.add_argument("--compile-cache", default=_default_compile_cache(),
                   help="directory of compiled programs reused by later runs ('none' = off; "
                        "$JAX_COMPILATION_CACHE_DIR or $SPECJAX_CACHE_DIR/xla)")
    g.set_defaults(func=_cmd_generate)
    m = g.add_argument_group("mesh and multi-host")
    m.add_argument("--mesh", help="device mesh using every device, e.g. 'tp=8', 'pp=2,tp=4', 'dp=2,tp=4' "
                                  "(default: one device)")
    m.add_argument("--microbatches", type=int, default=None,
                   help="pipeline request groups, at most --batch-size (default: pp)")
    m.add_argument("--replicate-attention", action="store_true",
                   help="keep attention heads whole on every tensor shard (for head counts tp does not divide)")
    m.add_argument("--distributed", default="auto", choices=["auto", "slurm", "off"],
                   help="auto: join a cluster given by flags or SPECJAX_* variables (specjax launch); "
                        "slurm: also read SLURM's variables; off: refuse to join one")
    m.add_argument("--coordinator", help="HOST:PORT of process 0 (default: none, a single process)")
    m.add_argument("--num-processes", type=int, help="processes in the cluster (default: none, a single process)")
    m.add_argument("--process-id", type=int, help="this process's index (default: none, a single process)")
    m.add_argument("--init-timeout", type=float, default=60.0, help="seconds to wait for the coordinator and peers")

    la = sub.add_parser("launch", formatter_class=fmt, help="run a command as N local processes forming one JAX cluster",
                        description="Start N local processes of one command as a JAX cluster (coordinator on "
                                    "127.0.0.1), stop all of them when one fails or the time limit passes.")
    la.add_argument("-n", "--num-processes", type=int, required=True, help="number of processes (required)")
    la.add_argument("--cpu-devices", type=int, default=None,
                    help="simulated CPU devices per process (default: the platform's own devices)")
    la.add_argument("--port", type=int, default=None, help="coordinator port on 127.0.0.1 (default: a free one)")
    la.add_argument("--timeout", type=float, default=600.0, help="stop everything after this many seconds")
    la.add_argument("cmd", nargs=argparse.REMAINDER, help="-- COMMAND ARGS... (e.g. -- specjax generate --mesh ...)")
    la.set_defaults(func=_cmd_launch)

    c = sub.add_parser("convert", formatter_class=fmt,
                       help="convert a model (name, HF dir, .gguf) to a specjax orbax checkpoint",
                       description="Convert a model to a specjax orbax checkpoint (+ tokenizer), restorable into "
                                   "any mesh.")
    c.add_argument("src", help="registered name, HF directory or .gguf file")
    c.add_argument("dst", help="new (or empty) checkpoint directory")
    c.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="stored dtype")
    c.set_defaults(func=_cmd_convert)
    from specjax.boost_cli import add_parser as add_boost_tune

    add_boost_tune(sub, fmt)
    return p


@contextlib.contextmanager
def _clean_stdout():
    """Yield a stream on the real standard output and point file descriptor 1 at standard error for
    the duration: what C++ libraries write there (gloo's connection lines under ``specjax launch``)
    can then never corrupt the command's output (e.g. --json lines)."""
    sys.stdout.flush()
    try:
        real = sys.stdout.fileno() == 1
        saved = os.dup(1) if real else None
    except (OSError, ValueError, io.UnsupportedOperation):  # stdout replaced in Python (capture, notebooks)
        real = False
    if not real:  # output goes where the caller put sys.stdout; fd 1 is not ours to move
        yield sys.stdout
        return
    os.dup2(2, 1)
    out = os.fdopen(os.dup(saved), "w", buffering=1, encoding="utf-8", errors="replace")
    previous = sys.stdout
    sys.stdout = out  # Python-level prints (argparse's --help) still reach the real stdout
    try:
        yield out
    finally:
        out.flush()
        sys.stdout = previous
        out.close()
        os.dup2(saved, 1)
        os.close(saved)


def main(argv=None) -> int:
    # transformers prints an advisory ("PyTorch was not found ...") when imported without torch.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    with _clean_stdout() as out:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as e:
            return e.code if isinstance(e.code, int) else 2
        try:
            return args.func(args, out)
        except SpecjaxError as e:
            print(f"specjax: error: {e}", file=sys.stderr, flush=True)
            return 2
        except KeyboardInterrupt:
            print("specjax: interrupted", file=sys.stderr, flush=True)
            return 130


if __name__ == "__main__":
    sys.exit(main())
