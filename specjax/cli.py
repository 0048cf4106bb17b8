"""The ``specjax`` command: generate, convert, launch, boost-tune."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from specjax import registry
from specjax.errors import SpecjaxError


def _read_prompts(args) -> list[str]:
    if args.prompt is not None and args.prompts_file is not None:
        raise SpecjaxError("give either --prompt or --prompts-file, not both")
    if args.prompt is not None:
        return [args.prompt]
    if args.prompts_file is None:
        raise SpecjaxError("give --prompt TEXT or --prompts-file FILE.jsonl")
    prompts = []
    try:
        with open(args.prompts_file) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    prompts.append(str(record["prompt"]))
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise SpecjaxError(f"{args.prompts_file}:{n}: expected a JSON object with a 'prompt' key") from None
    except FileNotFoundError:
        raise SpecjaxError(f"{args.prompts_file}: prompts file not found") from None
    if not prompts:
        raise SpecjaxError(f"{args.prompts_file}: no prompts")
    return prompts


def _parallel(args):
    """Join the cluster (when there is one) and build the mesh from --mesh; None without --mesh."""
    from specjax.sharding import Parallel, ShardingRules, distributed

    cluster = distributed.detect_cluster(args.coordinator, args.num_processes, args.process_id,
                                         slurm=args.distributed == "slurm")
    if cluster is not None and args.distributed == "off":
        raise SpecjaxError(f"--distributed off, but a cluster is configured ({cluster.source})")
    distributed.initialize(cluster, timeout_s=args.init_timeout)
    if args.mesh is None:
        if cluster is not None and cluster.num_processes > 1:
            raise SpecjaxError("several processes need a --mesh that spans them (e.g. --mesh pp=2,tp=4)")
        return None
    rules = ShardingRules(heads=None, kv_heads=None) if args.replicate_attention else ShardingRules()
    return Parallel.create(args.mesh, rules=rules, microbatches=args.microbatches)


def _cmd_generate(args) -> int:
    import specjax

    parallel = _parallel(args)
    import jax

    printing = jax.process_index() == 0  # every process computes; process 0 reports
    prompts = _read_prompts(args)
    if not args.ssm and args.model == registry.DEFAULT_MODEL:  # the shipped boost-tuned SSMs, best config
        args.ssm = list(registry.DEFAULT_SSMS)
        if args.expansion is None and args.mode == "tree":
            args.expansion = ",".join(map(str, registry.DEFAULT_EXPANSION))
    args.ssm = args.ssm or ["derived:auto"]
    sampling = specjax.SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                      seed=args.seed)
    if args.max_new_tokens < 1:
        raise SpecjaxError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    t0 = time.perf_counter()
    # With a mesh the LLM goes straight to its sharding (a model larger than one device never sits on one).
    model = specjax.load_model(args.model, dtype=args.dtype, progress=not args.json and printing, parallel=parallel)
    ssms = _load_ssms(args, model) if args.mode != "incremental" else []
    if parallel is not None:  # place once; generate() then finds everything where it belongs
        ssms = [s._replace(params=parallel.put_params(s.params, s.config, parallel.ssm_rules)) for s in ssms]
    load_s = time.perf_counter() - t0
    if not printing:
        args.json, sys.stdout = True, open(os.devnull, "w")
    if not args.json:
        print(f"# model {args.model} loaded in {load_s:.1f}s; mode {args.mode}"
              + (f", SSMs {args.ssm}, expansion {args.expansion or 'default'}" if ssms else ""), file=sys.stderr)
    for i in range(0, len(prompts), args.batch_size):
        batch = prompts[i:i + args.batch_size]
        result = specjax.generate(model, batch, max_new_tokens=args.max_new_tokens, sampling=sampling,
                                  chat_template=not args.no_chat_template, mode=args.mode, ssms=ssms,
                                  expansion=args.expansion, verifier=args.verifier, draft=args.draft,
                                  parallel=parallel)
        st = result.stats
        mean = st.get("mean_tokens_per_pass", 1.0)
        for prompt, ids, text in zip(batch, result.token_ids, result.texts):
            if args.json:
                print(json.dumps({"prompt": prompt, "token_ids": ids, "text": text, "mode": st["mode"],
                                  "llm_passes": st["llm_passes"], "mean_accepted_tokens_per_pass": round(mean, 4),
                                  "tokens_per_pass_histogram": st.get("tokens_per_pass_histogram"),
                                  "tokens_per_s": round(st["tokens_per_s"], 3)}), flush=True)
            else:
                print(text)
                print(f"# {len(ids)} tokens, {st['tokens_per_s']:.1f} tokens/s (batch of {len(batch)}, first call "
                      f"includes compilation), {st['llm_passes']} LLM passes, {mean:.2f} tokens per pass",
                      file=sys.stderr)
    return 0


def _load_ssms(args, llm):
    """--ssm entries: 'derived:auto' (the first min(4, max(1, L // 4)) of the LLM's L layers),
    'derived:K' (first K layers), 'derived:0,1,...' (layer list), or a model path."""
    import specjax
    from specjax.ssm import derive_ssm

    ssms = []
    for spec in args.ssm:
        if spec == "derived:auto":
            ssms.append(derive_ssm(llm, min(4, max(1, llm.config.num_layers // 4))))
        elif spec.startswith("derived:"):
            body = spec.split(":", 1)[1]
            try:
                layers = [int(x) for x in body.split(",")]
            except ValueError:
                raise SpecjaxError(f"--ssm {spec!r}: expected derived:K or derived:i,j,k") from None
            ssms.append(derive_ssm(llm, layers[0] if len(layers) == 1 else layers))
        else:
            ssms.append(specjax.load_model(spec, progress=False))
    return ssms


def _cmd_convert(args) -> int:
    import specjax
    from specjax.checkpoint import save_checkpoint

    model = specjax.load_model(args.src, dtype=args.dtype)
    save_checkpoint(args.dst, model.config, model.params, model.tokenizer)
    print(f"saved {args.src} -> {args.dst}")
    return 0


def _cmd_launch(args) -> int:
    from specjax.sharding.launch import launch

    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    return launch(cmd, args.num_processes, cpu_devices=args.cpu_devices, port=args.port, timeout_s=args.timeout)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specjax", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text (incremental decoding)")
    g.add_argument("--model", default=registry.DEFAULT_MODEL,
                   help=f"registered name {registry.registered_names()}, HF directory, .gguf file or "
                        f"specjax checkpoint (default: %(default)s)")
    g.add_argument("--prompt")
    g.add_argument("--prompts-file", help='JSONL file, one {"prompt": ...} per line')
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--mode", default="tree", choices=["tree", "sequence", "incremental"],
                   help="tree/sequence speculation or the incremental reference decoder (default: %(default)s)")
    g.add_argument("--verifier", default="auto", choices=["auto", "greedy", "seeded", "mss", "rrs", "naive"],
                   help="auto: greedy at temperature 0, else seeded (same tokens as --mode incremental with the "
                        "same --seed); mss/rrs/naive: exact sampling distribution, other random numbers")
    g.add_argument("--draft", default="auto", choices=["auto", "topk", "iid", "wor", "coupled"],
                   help="how SSMs draw tree children (auto: the verifier's natural choice; a pair that is not "
                        "lossless is refused)")
    g.add_argument("--ssm", action="append", default=None,
                   help="SSM: a registered name (smollm2-ssm-a, smollm2-ssm-b), 'derived:K' (the LLM's first K "
                        "layers), 'derived:i,j,..' or a model path; repeat for a merged pool (default for the "
                        "default LLM: the shipped boost-tuned SSMs in their best measured configuration; "
                        "otherwise derived:auto)")
    g.add_argument("--expansion", default=None,
                   help="expansion widths k1,...,km (default: the shipped SSMs' best measured shape for the default "
                        "LLM, else 1,1,3,1,1,1,1,1 for tree; 1,1,1,1,1,1,1,1 for sequence)")
    g.add_argument("--batch-size", type=int, default=1)
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    g.add_argument("--no-chat-template", action="store_true")
    g.add_argument("--json", action="store_true", help="one JSON record per prompt on stdout")
    g.set_defaults(func=_cmd_generate)
    m = g.add_argument_group("mesh and multi-host")
    m.add_argument("--mesh", help="device mesh, e.g. 'tp=8', 'pp=2,tp=4', 'dp=2,tp=4' (default: one device)")
    m.add_argument("--microbatches", type=int, default=None, help="pipeline request groups (default: pp)")
    m.add_argument("--replicate-attention", action="store_true",
                   help="keep attention heads whole on every tensor shard (for head counts tp does not divide)")
    m.add_argument("--distributed", default="auto", choices=["auto", "slurm", "off"],
                   help="auto: join a cluster given by flags or SPECJAX_* variables (specjax launch); "
                        "slurm: also read SLURM's variables")
    m.add_argument("--coordinator", help="HOST:PORT of process 0")
    m.add_argument("--num-processes", type=int)
    m.add_argument("--process-id", type=int)
    m.add_argument("--init-timeout", type=float, default=60.0, help="seconds to wait for the coordinator and peers")

    la = sub.add_parser("launch", help="run a command as N local processes forming one JAX cluster")
    la.add_argument("-n", "--num-processes", type=int, required=True)
    la.add_argument("--cpu-devices", type=int, default=None, help="simulated CPU devices per process")
    la.add_argument("--port", type=int, default=None, help="coordinator port on 127.0.0.1 (default: a free one)")
    la.add_argument("--timeout", type=float, default=600.0, help="stop everything after this many seconds")
    la.add_argument("cmd", nargs=argparse.REMAINDER, help="-- COMMAND ARGS... (e.g. -- specjax generate --mesh ...)")
    la.set_defaults(func=_cmd_launch)

    c = sub.add_parser("convert", help="convert a model (name, HF dir, .gguf) to a specjax orbax checkpoint")
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    c.set_defaults(func=_cmd_convert)
    from specjax.boost_cli import add_parser as add_boost_tune

    add_boost_tune(sub)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SpecjaxError as e:
        print(f"specjax: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
