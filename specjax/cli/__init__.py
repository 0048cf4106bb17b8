"""The ``specjax`` command: generate, serve, convert, launch, boost-tune, feature-tune, tree-cost.

Every argument is checked before any expensive work (model load, compilation, corpus generation);
a refused input prints ``specjax: error: ...`` and exits with status 2, never a traceback.
``generate`` streams text as the verifier accepts tokens, then prints one stats line per prompt.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import signal
import sys

from specjax.cli.generate import _cmd_generate
from specjax.cli.layers import add_layers_flag
from specjax.cli.serve import add_parser as add_serve
from specjax.cli.signals import interruptible
from specjax.cli.tree_cost import add_parser as add_tree_cost
from specjax.errors import SpecjaxError
from specjax.io import registry
from specjax.speculation.choices import DRAFT_CHOICES, MODES, VERIFIER_CHOICES

DESCRIPTION = ("specjax: tree-based speculative inference and verification for LLaMA- and OPT-family LLMs in JAX. "
               "Small drafters propose a token tree, the LLM scores it in one pass, a verifier keeps exactly "
               "what the LLM itself would have produced.")


def _default_compile_cache() -> str:
    from specjax.config import cache_root

    return os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(cache_root(), "xla")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every option's default, unless its help already says what the default is."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "(default" in text or action.default in (None, argparse.SUPPRESS) or not action.option_strings:
            return text
        return text + " (default: %(default)s)"


# -- small argument checks (no JAX, no model) -------------------------------------------------------


@interruptible
def _cmd_convert(args, out) -> int:
    import specjax
    from specjax.io.checkpoint import check_destination, save_checkpoint

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
    g.add_argument("--top-k", type=int, default=None,
                   help="sample among the k most likely tokens (default: 0 = off; needs --temperature > 0)")
    g.add_argument("--top-p", type=float, default=None,
                   help="nucleus sampling mass (default: 1 = off; needs --temperature > 0)")
    g.add_argument("--seed", type=int, default=None,
                   help="sampling seed: the same seed gives the same tokens (default: 0; at --temperature 0 it "
                        "only draws sampled SSM drafts)")
    g.add_argument("--mode", default="tree", choices=list(MODES),
                   help="tree/sequence speculation, or the incremental reference decoder")
    g.add_argument("--verifier", default="auto", choices=list(VERIFIER_CHOICES),
                   help="auto: greedy at temperature 0, else seeded (same tokens as --mode incremental with the "
                        "same --seed); mss/rrs/naive: exact sampling distribution, other random numbers")
    g.add_argument("--draft", default="auto", choices=list(DRAFT_CHOICES),
                   help="how SSMs draw tree children (auto: the verifier's natural choice; a pair that is not "
                        "lossless is refused)")
    g.add_argument("--ssm", action="append", default=None,
                   help="SSM: a registered name (smollm2-ssm-a, smollm2-ssm-b), 'derived:K' (the LLM's first K "
                        "layers), 'derived:i,j,..', 'derived:auto' or a model path; repeat for a merged pool "
                        f"(default: none, the default drafters speculate; --mode sequence: "
                        f"{','.join(registry.DEFAULT_SSMS)} for the default LLM, derived:auto for others)")
    g.add_argument("--drafter", action="append", default=None, metavar="NAME:ARG",
                   help="a registered drafter: feature:auto, feature:NAME or feature:PATH[,depth=D,beam=K,nodes=N] "
                        "(reads the LLM's hidden states, dynamic tree), lookup:auto, lookup:D or "
                        "lookup:depth=D,branches=K,ngram=N (copies continuations of the request's own text, no "
                        "weights), corpus:PATH[,depth=D,branches=K,ngram=N,min-ngram=M,corpus-ngram=N,"
                        "corpus-min-ngram=M,window=W] (lookup that also copies from the documents in PATH: a "
                        ".jsonl of {\"text\": ...} or {\"token_ids\": [...]}, "
                        "a text file or a directory; indexed once at start; corpus:auto or corpus:NAME: a "
                        f"shipped corpus of the LLM's own answers: {', '.join(registry.corpus_names())}), "
                        "ssm:derived:4 or ssm:PATH (drafts "
                        "--expansion); repeat to merge several (default "
                        f"when neither --ssm nor --drafter is given: {registry.describe_default_drafters()})")
    g.add_argument("--budget", default=None, choices=["auto", "off"],
                   help="auto: each step verifies as much of the drafted tree as pays, from this machine's measured "
                        "pass cost per tree size (measured once, cached; see `specjax tree-cost`) and the drafts' "
                        "measured acceptance, down to none; off: always the whole tree (default: auto when every "
                        "drafter estimates its acceptance (lookup, corpus, feature), else off)")
    g.add_argument("--expansion", default=None,
                   help="expansion widths k1,...,km (default: "
                        f"{','.join(map(str, registry.DEFAULT_EXPANSION))} for tree, the best measured on this CPU, "
                        f"as in the Python API; {','.join(map(str, registry.DEFAULT_SEQUENCE))} for sequence)")
    g.add_argument("--batch-size", type=int, default=1, help="prompts generated together")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weight dtype")
    add_layers_flag(g)
    g.add_argument("--no-chat-template", action="store_true", help="feed the prompt text without the chat template")
    g.add_argument("--special-tokens", default="parse", choices=["parse", "text", "refuse"],
                   help="what a special token's string written in a prompt (<|im_end|>) becomes: parse = the control "
                        "token (as transformers tokenizes), text = ordinary text (the chat template's own control "
                        "tokens stay), refuse = an error naming it (default: parse)")
    g.add_argument("--json", action="store_true", help="one JSON record per prompt on stdout instead of text")
    g.add_argument("--compile-cache", default=_default_compile_cache(),
                   help="directory of compiled programs reused by later runs ('none' = off; "
                        "$JAX_COMPILATION_CACHE_DIR or $SPECJAX_CACHE_DIR/xla)")
    g.set_defaults(func=_cmd_generate)
    m = g.add_argument_group("mesh and multi-host")
    m.add_argument("--mesh", help="device mesh using every device, e.g. 'tp=8', 'pp=2,tp=4', 'dp=2,tp=4' "
                                  "(default: one device)")
    m.add_argument("--microbatches", type=int, default=None,
                   help="pipeline request groups, at most --batch-size / dp (default: pp, or fewer when a dp "
                        "replica has fewer requests)")
    m.add_argument("--replicate-attention", action="store_true",
                   help="keep attention heads whole on every tensor shard (for head counts tp does not divide)")
    m.add_argument("--distributed", default="auto", choices=["auto", "slurm", "off"],
                   help="auto: join a cluster given by flags or SPECJAX_* variables (specjax launch); "
                        "slurm: also read SLURM's variables; off: refuse to join one")
    m.add_argument("--coordinator", help="HOST:PORT of process 0 (default: none, a single process)")
    m.add_argument("--num-processes", type=int, help="processes in the cluster (default: none, a single process)")
    m.add_argument("--process-id", type=int, help="this process's index (default: none, a single process)")
    m.add_argument("--init-timeout", type=float, default=60.0, help="seconds to wait for the coordinator and peers")

    la = sub.add_parser("launch", formatter_class=fmt,
                        help="run a command as N local processes forming one JAX cluster",
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
    from specjax.cli.boost import add_parser as add_boost_tune
    from specjax.cli.feature import add_parser as add_feature_tune

    add_boost_tune(sub, fmt)
    add_feature_tune(sub, fmt)
    add_tree_cost(sub, fmt)
    add_serve(sub, fmt, _default_compile_cache())
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
        try:
            out.flush()
        except BrokenPipeError:
            _drop_output(out)
        sys.stdout = previous
        out.close()
        os.dup2(saved, 1)
        os.close(saved)


def _drop_output(stream) -> None:
    """Point ``stream`` at /dev/null: its reader went away (``specjax generate ... | head``), and every
    later flush (the buffer's, at close) would raise BrokenPipeError again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, stream.fileno())
    except (OSError, ValueError, io.UnsupportedOperation):  # not a file descriptor: nothing more is written
        pass
    finally:
        os.close(devnull)


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
            return getattr(e, "exit_code", 2)  # 2: bad input; `launch` passes its process's status on
        except KeyboardInterrupt as e:
            print("specjax: interrupted", file=sys.stderr, flush=True)
            return 128 + getattr(e, "signum", signal.SIGINT)
        except BrokenPipeError:  # the reader of the output went away: a shell reports 128 + SIGPIPE
            _drop_output(out)
            return 128 + signal.SIGPIPE


INTERRUPTED = (128 + signal.SIGINT, 128 + signal.SIGTERM, 128 + signal.SIGHUP)


def entry() -> None:
    """The ``specjax`` command: ``main``'s status, leaving at once (``os._exit``) where the interpreter's
    normal exit would hang or crash. In a process of a JAX cluster that failed (its own bad input, or a
    peer that died), JAX's shutdown barrier waited 5 minutes for peers that would not come and then
    aborted (SIGABRT). After an interrupt, the interpreter's shutdown crashed when the Ctrl-C came during
    XLA compilation (SIGSEGV, JAX's own), so the status was -11 instead of 130. (``main`` itself only
    returns: it is also called in-process.)"""
    from specjax.sharding.distributed import joined_cluster

    try:
        code = main()
    except Exception as e:
        if not joined_cluster():
            raise
        import traceback

        import jax

        traceback.print_exc()
        print(f"specjax: error: process {jax.process_index()}: {type(e).__name__} (in a cluster of "
              f"{jax.process_count()} processes: a peer may have died or lost its connection)",
              file=sys.stderr, flush=True)
        code = 1
    if code in INTERRUPTED or (code != 0 and joined_cluster()):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
