"""The ``specjax`` command: generate, convert."""

from __future__ import annotations

import argparse
import json
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


def _cmd_generate(args) -> int:
    import specjax

    prompts = _read_prompts(args)
    sampling = specjax.SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                      seed=args.seed)
    if args.max_new_tokens < 1:
        raise SpecjaxError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    t0 = time.perf_counter()
    model = specjax.load_model(args.model, dtype=args.dtype, progress=not args.json)
    load_s = time.perf_counter() - t0
    if not args.json:
        print(f"# model {args.model} loaded in {load_s:.1f}s", file=sys.stderr)
    for i in range(0, len(prompts), args.batch_size):
        batch = prompts[i:i + args.batch_size]
        result = specjax.generate(model, batch, max_new_tokens=args.max_new_tokens, sampling=sampling,
                                  chat_template=not args.no_chat_template)
        st = result.stats
        for prompt, ids, text in zip(batch, result.token_ids, result.texts):
            if args.json:
                print(json.dumps({"prompt": prompt, "token_ids": ids, "text": text,
                                  "llm_passes": st["llm_passes"], "tokens_per_s": round(st["tokens_per_s"], 3),
                                  "mode": "incremental"}), flush=True)
            else:
                print(text)
                print(f"# {len(ids)} tokens, {st['tokens_per_s']:.1f} tokens/s (batch of {len(batch)}, "
                      f"first call includes compilation), {st['llm_passes']} LLM passes", file=sys.stderr)
    return 0


def _cmd_convert(args) -> int:
    import specjax
    from specjax.checkpoint import save_checkpoint

    model = specjax.load_model(args.src, dtype=args.dtype)
    save_checkpoint(args.dst, model.config, model.params, model.tokenizer)
    print(f"saved {args.src} -> {args.dst}")
    return 0


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
    g.add_argument("--batch-size", type=int, default=1)
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    g.add_argument("--no-chat-template", action="store_true")
    g.add_argument("--json", action="store_true", help="one JSON record per prompt on stdout")
    g.set_defaults(func=_cmd_generate)
    c = sub.add_parser("convert", help="convert a model (name, HF dir, .gguf) to a specjax orbax checkpoint")
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    c.set_defaults(func=_cmd_convert)
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
