"""Helpers shared by the benchmark scripts: machine description, prompts, HF reference model."""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys

DEFAULT_PROMPTS = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "dev_prompts.jsonl")


def machine() -> str:
    import jax

    from specjax.speculation.cost import cpu_name

    cpu = cpu_name()
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            mem = f"{int(f.readline().split()[1]) / 2**20:.0f} GiB RAM"
    except OSError:
        pass
    dev = jax.devices()[0]
    accel = "" if dev.platform == "cpu" else f" ({dev.device_kind})"
    return (f"{cpu}, {os.cpu_count()} cores, {mem}; jax {jax.__version__} on {dev.platform}{accel}; "
            f"python {platform.python_version()}")


def require_plotting() -> None:
    """Exit with the fix before any benchmark work when matplotlib (the bench extra) is missing: the plot is
    drawn last, and a run of many minutes should not end in an ImportError."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        sys.exit(f"{os.path.basename(sys.argv[0])}: plotting needs matplotlib, from the bench extra: "
                 "pip install -e '.[bench]'")


def command() -> str:
    """The command line that ran this script, as printed in the header and stored in the JSON results."""
    return shlex.join([sys.executable.rsplit('/', 1)[-1]] + sys.argv)


def print_header(title: str) -> None:
    print(f"# {title}")
    print(f"# command: {command()}")
    print(f"# machine: {machine()}")


# argparse ``type=`` functions: a bad count or list is refused while parsing, naming the flag (argparse prefixes
# "argument --flag:"), not after minutes of model loading and generation.

def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def positive_int(text: str) -> int:
    """An integer >= 1 (a count, a stride, repetitions)."""
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def nonnegative_int(text: str) -> int:
    """An integer >= 0 (an index)."""
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def int_list(minimum: int = 1, sep: str = ","):
    """A ``sep``-separated list of integers, each >= ``minimum`` ("1,2,4")."""
    def parse(text: str) -> list[int]:
        values = [_integer(item.strip()) for item in text.split(sep)]
        low = [v for v in values if v < minimum]
        if low:
            raise argparse.ArgumentTypeError(f"{text!r}: every item must be an integer >= {minimum}, got {low}")
        return values
    return parse


def name_list(choices):
    """A comma-separated list of names, each one of ``choices`` (an unknown name is an error, not skipped)."""
    def parse(text: str) -> list[str]:
        names = [item.strip() for item in text.split(",") if item.strip()]
        unknown = [n for n in names if n not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"{text!r}: unknown {unknown or 'empty list'}; expected names from "
                                             f"{', '.join(choices)}")
        return names
    return parse


def existing_file(text: str) -> str:
    """A path to a file that exists (checked before any model is loaded)."""
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"no such file: {text!r}")
    return text


TASK_KINDS = os.path.join(os.path.dirname(__file__), "data", "task_kinds.jsonl")


def add_task_kind_args(ap) -> None:
    """The options of the scripts that run one prompt per task kind (``one_per_kind``) repeatedly."""
    ap.add_argument("--prompts-file", type=existing_file, default=TASK_KINDS)
    ap.add_argument("--which", type=nonnegative_int, default=1,
                    help="the K-th prompt of every task kind (0: the first)")
    ap.add_argument("--max-new-tokens", type=positive_int, default=128)
    ap.add_argument("--repetitions", type=positive_int, default=2)


def one_per_kind(path: str, which: int) -> tuple[list[dict], list[str]]:
    """The ``which``-th prompt record of every task kind (``category``) of a prompts file, kinds sorted,
    and every kind's name; exits naming the file when no kind has that many prompts."""
    import collections

    if which < 0:  # a negative index would count from each kind's end
        raise ValueError(f"which must be >= 0, got {which}")
    by_kind = collections.defaultdict(list)
    for r in load_prompts(path, None):
        by_kind[r.get("category", "?")].append(r)
    chosen = [v[which] for _, v in sorted(by_kind.items()) if len(v) > which]
    if not chosen:
        sys.exit(f"{path}: no task kind has a prompt number {which}")
    return chosen, sorted(by_kind)


def load_prompts(path: str, n: int | None, stride: int = 1) -> list[dict]:
    """The first ``n`` (None: all) of every ``stride``-th record of a prompts file (specjax's own reader: errors
    name file and line). Callers check their flags with ``positive_int``; this guards the slicing, where 0 would
    mean "all" and a negative count "all but the last"."""
    if (n is not None and n < 1) or stride < 1:
        raise ValueError(f"load_prompts({path!r}): n must be None or >= 1 and stride >= 1, got n={n}, stride={stride}")
    from specjax.errors import InputError
    from specjax.io.prompts import read_prompt_records

    try:
        records = read_prompt_records(path, flag="prompts file", allow_token_ids=False)[::stride]
    except InputError as e:
        sys.exit(f"{e} (pass --prompts-file)")
    return records if n is None else records[:n]


def load_hf_reference(path: str, dtype: str = "float32"):
    """transformers' own model for the same weights: a GGUF file or an HF directory (needs torch +
    accelerate)."""
    import torch
    from transformers import AutoModelForCausalLM

    kw = {} if os.path.isdir(path) else {"gguf_file": os.path.basename(path)}
    model = AutoModelForCausalLM.from_pretrained(path if os.path.isdir(path) else os.path.dirname(path),
                                                 dtype=getattr(torch, dtype), **kw)
    return model.eval()


def greedy_pair(model, hf, ids: list[int], max_new_tokens: int):
    """One prompt through specjax's incremental decoder and transformers' greedy ``generate``, back to
    back: (specjax tokens, seconds, transformers tokens, seconds)."""
    import time

    import torch

    import specjax

    t0 = time.perf_counter()
    ours = specjax.generate(model, [ids], max_new_tokens=max_new_tokens, mode="incremental").token_ids[0]
    ours_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids], device=hf.device), max_new_tokens=max_new_tokens, do_sample=False)
        if hf.device.type == "cuda":
            torch.cuda.synchronize()
    theirs_s = time.perf_counter() - t0
    return ours, ours_s, out[0, len(ids):].tolist(), theirs_s


def load_ssm(llm, spec: str):
    """--ssm: 'derived:K' (the LLM's first K layers), 'derived:i,j,..' (a layer list) or a model path."""
    import specjax
    from specjax.speculation.drafters.ssm import derive_ssm, parse_derived

    if spec.startswith("derived:"):
        return derive_ssm(llm, parse_derived(spec, llm.config))
    return specjax.load_model(spec, progress=False)
