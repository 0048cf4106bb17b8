"""Helpers shared by the benchmark scripts: machine description, prompts, HF reference model."""

from __future__ import annotations

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


def print_header(title: str) -> None:
    print(f"# {title}")
    print(f"# command: {shlex.join([sys.executable.rsplit('/', 1)[-1]] + sys.argv)}")
    print(f"# machine: {machine()}")


TASK_KINDS = os.path.join(os.path.dirname(__file__), "data", "task_kinds.jsonl")


def add_task_kind_args(ap) -> None:
    """The options of the scripts that run one prompt per task kind (``one_per_kind``) repeatedly."""
    ap.add_argument("--prompts-file", default=TASK_KINDS)
    ap.add_argument("--which", type=int, default=1, help="the K-th prompt of every task kind")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repetitions", type=int, default=2)


def one_per_kind(path: str, which: int) -> tuple[list[dict], list[str]]:
    """The ``which``-th prompt record of every task kind (``category``) of a prompts file, kinds sorted,
    and every kind's name; exits naming the file when no kind has that many prompts."""
    import collections

    by_kind = collections.defaultdict(list)
    for r in load_prompts(path, None):
        by_kind[r.get("category", "?")].append(r)
    chosen = [v[which] for _, v in sorted(by_kind.items()) if len(v) > which]
    if not chosen:
        sys.exit(f"{path}: no task kind has a prompt number {which}")
    return chosen, sorted(by_kind)


def load_prompts(path: str, n: int | None, stride: int = 1) -> list[dict]:
    """Every ``stride``-th record of a prompts file (specjax's own reader: errors name file and line)."""
    from specjax.errors import InputError
    from specjax.io.prompts import read_prompt_records

    try:
        records = read_prompt_records(path, flag="prompts file", allow_token_ids=False)[::stride]
    except InputError as e:
        sys.exit(f"{e} (pass --prompts-file)")
    return records[:n] if n else records


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
