"""`specjax serve`: an OpenAI-compatible HTTP server (completions, chat completions, streaming) over the
continuous-batching engine, speculating per request like `specjax generate`.

Every flag is checked before the model loads; the server listens only once the model is loaded and
its programs are compiled (GET /health answers 200 from then on).
"""

from __future__ import annotations

import math
import socket
import sys

from specjax.cli.layers import add_layers_flag, split_layers_arg
from specjax.errors import InputError
from specjax.io import registry

NO_SPECULATION = "none"


def _check(args) -> None:
    for flag, value in (("--slots", args.slots), ("--max-queue", args.max_queue), ("--max-tokens", args.max_tokens),
                        ("--max-prompt-tokens", args.max_prompt_tokens),
                        ("--max-request-bytes", args.max_request_bytes)):
        if value is not None and value < 1:
            raise InputError(f"{flag} must be >= 1, got {value}")
    if not 0 < args.port < 65536:
        raise InputError(f"--port must be in [1, 65535], got {args.port}")
    if not (math.isfinite(args.shutdown_grace) and args.shutdown_grace >= 0):  # nan or inf broke the shutdown timer
        raise InputError(f"--shutdown-grace must be a finite number of seconds >= 0, got {args.shutdown_grace}")
    drafters = args.drafter or list(registry.DEFAULT_DRAFTERS)
    if NO_SPECULATION in drafters and len(drafters) > 1:
        raise InputError(f"--drafter {NO_SPECULATION} turns speculation off; it takes no other --drafter")
    if args.budget is not None and drafters == [NO_SPECULATION]:
        raise InputError(f"--drafter {NO_SPECULATION} drafts nothing, so it takes no --budget")
    from specjax.sharding import distributed

    if distributed.detect_cluster() is not None:
        raise InputError("specjax serve runs as one process (multi-host serving is not implemented yet; see the "
                         "README's Serving section)")


DEFAULT_MAX_PROMPT_TOKENS, DEFAULT_MAX_TOKENS = 2048, 512


def _lengths(args, context: int) -> None:
    """Defaults that fit the model: a short context window shrinks them (max tokens to at most half of
    it, the prompt to the rest); given values are kept and checked against the window."""
    if args.max_tokens is None:
        args.max_tokens = min(DEFAULT_MAX_TOKENS, max(1, context // 2),
                              max(1, context - (args.max_prompt_tokens or 1)))
    if args.max_prompt_tokens is None:
        args.max_prompt_tokens = max(1, min(DEFAULT_MAX_PROMPT_TOKENS, context - args.max_tokens))


def _drafters(args, llm, load: bool) -> list:
    from specjax.speculation.drafters import build
    from specjax.speculation.expansion import Expansion
    from specjax.speculation.request import resolve_verifier

    specs = args.drafter or list(registry.default_drafters(llm.config))
    if specs == [NO_SPECULATION]:
        return []
    _, draft = resolve_verifier("seeded", "auto", True)
    widths = Expansion.parse(args.expansion) if args.expansion else Expansion(registry.DEFAULT_EXPANSION)
    return [build(t, llm, load=load, expansion=widths, draft=draft) for t in specs]


def _spec(args, light, bound: list):
    """The drafters' tree as the Engine will check it (node limit, the LLM each was made for), checked now;
    --expansion only shapes SSM drafts, so without one it is refused rather than ignored."""
    from specjax.speculation.drafters.ssm import SSMDrafter
    from specjax.speculation.request import check_spec
    from specjax.speculation.spec import SpecConfig

    drafters = tuple(b.drafter for b in bound)
    if args.expansion is not None and not any(isinstance(d, SSMDrafter) for d in drafters):
        raise InputError("--expansion shapes SSM drafts, but no --drafter ssm:ARG is given; drop it")
    spec = SpecConfig(drafters=drafters, impl="xla", verifier="seeded")
    check_spec(light.config, spec)
    return spec


def _listen_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound (not yet listening: clients are refused until the programs are compiled)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a restart reuses the port
        sock.bind(address)
    except OSError as e:
        raise InputError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def _budget(args, bound: list) -> str | None:
    """auto when every drafter estimates its acceptance (the default drafter does), else the whole tree."""
    from specjax.speculation.drafters.base import estimates_acceptance

    if not bound or args.budget == "off":
        return None
    blind = [b.drafter.describe() for b in bound if not estimates_acceptance(b.drafter)]
    if blind and args.budget == "auto":
        raise InputError(f"--budget auto needs drafters that estimate their acceptance; {', '.join(blind)} do not "
                         f"(use --budget off, or the lookup drafter alone)")
    return None if blind else "auto"


def _cmd_serve(args, out) -> int:
    _check(args)
    import specjax
    from specjax.cli.generate import _compile_cache
    from specjax.serving.server import build_state, run, warm_up
    from specjax.speculation.request import check_positions

    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    light = specjax.describe_model(args.model)
    if light.tokenizer is None:
        raise InputError(f"serving needs a tokenizer (text in, text out); {args.model} has none")
    light_bound = _drafters(args, light, load=False)  # every flag checked before the weights load
    budget = _budget(args, light_bound)
    spec = _spec(args, light, light_bound)
    limits = [d.position_limit for d in spec.drafters if d.position_limit is not None]
    _lengths(args, min([light.config.max_positions, *limits]))
    if args.max_prompt_tokens + args.max_tokens > light.config.max_positions:
        raise InputError(f"--max-prompt-tokens {args.max_prompt_tokens} + --max-tokens {args.max_tokens} exceeds the "
                         f"context window of {light.config.max_positions}")
    check_positions(spec, args.max_prompt_tokens + args.max_tokens,
                    f"--max-prompt-tokens {args.max_prompt_tokens} + --max-tokens {args.max_tokens}")
    from specjax.decoding.buckets import next_pow2
    from specjax.memory import check_cache_fits

    check_cache_fits(light.config, args.slots, next_pow2(args.max_prompt_tokens) + next_pow2(args.max_tokens),
                     args.dtype, f"--slots {args.slots} with --max-prompt-tokens {args.max_prompt_tokens} and "
                     f"--max-tokens {args.max_tokens}")
    sock = _listen_socket(args.host, args.port)  # an address in use is found now, not after loading and compiling
    _compile_cache(args.compile_cache)
    model = specjax.load_model(args.model, dtype=args.dtype, progress=True, split_layers=split_layers_arg(args))
    bound = _drafters(args, model, load=True)
    state = build_state(model, model_name=args.served_model_name or args.model, slots=args.slots,
                        max_prompt_tokens=args.max_prompt_tokens, max_tokens=args.max_tokens,
                        max_queue=args.max_queue, drafters=bound, budget=budget, log=log,
                        special_tokens=args.special_tokens,
                        **({} if args.max_request_bytes is None else {"max_request_bytes": args.max_request_bytes}))
    warm_up(state.scheduler.engine, log=log)  # the prefill and the step compile before the server listens
    run(state, host=args.host, port=args.port, shutdown_grace=args.shutdown_grace, log=log, sock=sock)
    return 1 if state.scheduler.failure is not None else 0  # the engine failed: a supervisor should restart it


def add_parser(sub, fmt, compile_cache_default: str) -> None:
    s = sub.add_parser("serve", formatter_class=fmt,
                       help="serve the LLM over an OpenAI-compatible HTTP API (continuous batching, speculation)",
                       description="OpenAI-compatible server: POST /v1/completions and /v1/chat/completions "
                                   "(streaming or not), GET /v1/models, /health, /metrics (Prometheus). Requests join "
                                   "and leave the batch between LLM passes; each speculates with its own token tree "
                                   "and is verified losslessly: greedy and seeded requests get exactly the tokens of "
                                   "offline `specjax generate`. SIGTERM stops admitting, lets running requests finish "
                                   "for --shutdown-grace seconds, then fails the rest with an error.")
    s.add_argument("--model", default=registry.DEFAULT_MODEL,
                   help=f"registered name {registry.registered_names()}, HF directory, .gguf file or specjax "
                        f"checkpoint")
    s.add_argument("--served-model-name", default=None,
                   help="the name clients send as 'model' (default: the --model argument)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=int, default=8000, help="port to listen on")
    s.add_argument("--slots", type=int, default=8, help="requests generated together (the batch size)")
    s.add_argument("--max-queue", type=int, default=256,
                   help="requests waiting for a slot; beyond it requests are refused with HTTP 429")
    s.add_argument("--max-prompt-tokens", type=int, default=None,
                   help=f"longest prompt accepted, in tokens (default: {DEFAULT_MAX_PROMPT_TOKENS}, less where the "
                        f"model's context window is shorter than that plus --max-tokens)")
    s.add_argument("--max-tokens", type=int, default=None,
                   help=f"most tokens one request may generate; the default max_tokens of chat requests "
                        f"(completions: 16, as OpenAI's) (default: {DEFAULT_MAX_TOKENS}, at most half the model's "
                        f"context window)")
    s.add_argument("--max-request-bytes", type=int, default=None,  # default: the protocol's (not imported here:
                   # it would load FastAPI for every specjax command)
                   help="largest request body accepted, in bytes; a larger one is refused unread with HTTP 413 "
                        "(default: 16 MiB)")
    s.add_argument("--drafter", action="append", default=None, metavar="NAME:ARG",
                   help="as in `specjax generate` (corpus:auto, feature:auto, lookup:auto, lookup:D, ssm:PATH, ...; "
                        f"repeat to merge), or '{NO_SPECULATION}' for plain decoding (default: "
                        f"{registry.describe_default_drafters()})")
    s.add_argument("--expansion", default=None, help="expansion widths of SSM drafters, as in generate (default: "
                        f"{','.join(map(str, registry.DEFAULT_EXPANSION))})")
    s.add_argument("--budget", default=None, choices=["auto", "off"],
                   help="auto: each step verifies as much of each request's tree as pays, from measured pass costs "
                        "at --slots requests and measured acceptance; off: whole trees (default: auto when every "
                        "drafter estimates its acceptance, else off)")
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weight dtype")
    s.add_argument("--special-tokens", default="parse", choices=["parse", "text", "refuse"],
                   help="what a special token's string written in a prompt or message (<|im_end|>) becomes: parse = "
                        "the control token (as transformers and vLLM tokenize), text = ordinary text, so a message "
                        "cannot end its turn or open another (the chat template's own control tokens stay), "
                        "refuse = a 400 naming it (default: parse)")
    add_layers_flag(s)
    s.add_argument("--shutdown-grace", type=float, default=10.0,
                   help="seconds running requests may finish after SIGTERM before they fail")
    s.add_argument("--compile-cache", default=compile_cache_default,
                   help="directory of compiled programs reused by later runs ('none' = off)")
    s.set_defaults(func=_cmd_serve)
