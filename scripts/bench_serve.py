"""Load benchmark of `specjax serve`: throughput and time to first token / time per output token (p50,
p99) vs concurrency, speculation on (the server's default drafters, ``registry.default_drafters``: for
SmolLM2 the shipped feature drafter merged with lookup drafting, under the tree budget) vs off
(`--drafter none`), through the real `openai` client, streaming chat completions, greedy.

For each setting a server is started on 127.0.0.1 (model load and compilation are not timed), then
for each concurrency C, C client threads send requests back to back until ``--requests-per-client``
each have finished (prompts drawn in turn from the prompts file). Throughput = tokens served / wall
time of that concurrency level. TTFT is measured from sending the request to its first content
chunk, TPOT = (last chunk - first chunk) / (tokens - 1) per request.

    python scripts/bench_serve.py --concurrency 1,4,16,64 --slots 8 --max-tokens 64 --out bench_out/serve.png
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
import _bench_common as common  # noqa: E402

TASKS = os.path.join(os.path.dirname(__file__), "data", "task_kinds.jsonl")
SETTINGS = {"speculation": [], "no-speculation": ["--drafter", "none"]}  # --settings name -> extra serve flags


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args, extra: list[str], log_path: str):
    import httpx2 as httpx

    port = _free_port()
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "specjax", "serve", "--model", args.model, "--port", str(port),
                             "--slots", str(args.slots), "--max-tokens", str(args.max_tokens),
                             "--max-prompt-tokens", str(args.max_prompt_tokens), *extra],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 1800
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the server exited; see {log_path}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    sys.exit(f"the server did not come up in 30 minutes; see {log_path}")


def _one(client, model: str, prompt: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=max_tokens, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].delta.content:
            last = time.perf_counter()
            first = first or last
    ttft = (first or time.perf_counter()) - t0
    tpot = (last - first) / (tokens - 1) if first is not None and tokens > 1 else None
    return {"ttft": ttft, "tpot": tpot, "tokens": tokens}


def _level(url: str, model: str, prompts: list[str], concurrency: int, per_client: int, max_tokens: int) -> dict:
    import numpy as np
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
    lock, counter, results = threading.Lock(), [0], []

    def worker():
        for _ in range(per_client):
            with lock:
                prompt = prompts[counter[0] % len(prompts)]
                counter[0] += 1
            r = _one(client, model, prompt, max_tokens)
            with lock:
                results.append(r)

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(worker) for _ in range(concurrency)]:
            f.result()
    wall = time.perf_counter() - t0
    ttft = np.array([r["ttft"] for r in results])
    tpot = np.array([r["tpot"] for r in results if r["tpot"] is not None])
    tokens = sum(r["tokens"] for r in results)
    return {"concurrency": concurrency, "requests": len(results), "tokens": tokens, "seconds": wall,
            "tokens_per_s": tokens / wall, "ttft_p50": float(np.percentile(ttft, 50)),
            "ttft_p99": float(np.percentile(ttft, 99)), "tpot_p50": float(np.percentile(tpot, 50)),
            "tpot_p99": float(np.percentile(tpot, 99))}


def _plot(rows: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, levels in rows.items():
        c = [r["concurrency"] for r in levels]
        axes[0].plot(c, [r["tokens_per_s"] for r in levels], "o-", label=name)
        axes[1].plot(c, [r["ttft_p50"] for r in levels], "o-", label=f"{name} p50")
        axes[1].plot(c, [r["ttft_p99"] for r in levels], "x--", label=f"{name} p99")
        axes[2].plot(c, [r["tpot_p50"] * 1e3 for r in levels], "o-", label=f"{name} p50")
        axes[2].plot(c, [r["tpot_p99"] * 1e3 for r in levels], "x--", label=f"{name} p99")
    for ax, ylabel in zip(axes, ("tokens/s (all clients)", "time to first token (s)", "time per output token (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts-file", type=common.existing_file, default=TASKS)
    ap.add_argument("--concurrency", type=common.int_list(), default=[1, 4, 16, 64], help="comma-separated")
    ap.add_argument("--requests-per-client", type=common.positive_int, default=2,
                    help="requests each client sends (at least 8 in all per level: low levels send more)")
    ap.add_argument("--slots", type=common.positive_int, default=8)
    ap.add_argument("--max-tokens", type=common.positive_int, default=64)
    ap.add_argument("--max-prompt-tokens", type=common.positive_int, default=1024)
    ap.add_argument("--settings", type=common.name_list(tuple(SETTINGS)), default=list(SETTINGS),
                    help=f"comma-separated, from {', '.join(SETTINGS)}")
    ap.add_argument("--out", default="bench_out/serve.png")
    args = ap.parse_args()
    common.require_plotting()
    common.print_header("specjax serve load benchmark")
    prompts = [r["prompt"] for r in common.load_prompts(args.prompts_file, None)]
    levels = args.concurrency
    rows = {}
    tmp = tempfile.mkdtemp(prefix="bench-serve-")
    for name in args.settings:
        proc, url = _start(args, SETTINGS[name], os.path.join(tmp, f"{name}.log"))
        try:
            rows[name] = []
            _level(url, args.model, prompts[:2], 2, 1, 8)  # warm the prompt buckets' first use
            for c in levels:
                per_client = max(args.requests_per_client, -(-8 // c))
                row = _level(url, args.model, prompts, c, per_client, args.max_tokens)
                rows[name].append(row)
                print(f"{name:>15} concurrency {c:>3}: {row['requests']:>3} requests, {row['tokens']:>5} tokens in "
                      f"{row['seconds']:6.1f} s = {row['tokens_per_s']:6.1f} tok/s | TTFT p50 {row['ttft_p50']:.2f} "
                      f"p99 {row['ttft_p99']:.2f} s | TPOT p50 {row['tpot_p50'] * 1e3:.0f} p99 "
                      f"{row['tpot_p99'] * 1e3:.0f} ms", flush=True)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    if len(rows) == 2:
        for a, b in zip(rows["speculation"], rows["no-speculation"]):
            print(f"# concurrency {a['concurrency']:>3}: speculation / none = "
                  f"{a['tokens_per_s'] / b['tokens_per_s']:.2f}x throughput")
    title = (f"specjax serve, {args.model}, {args.slots} slots, {args.max_tokens} tokens/request, greedy, "
             f"float32; {common.machine()}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:  # before plotting: the numbers survive a plot failure
        json.dump({"command": sys.argv, "machine": common.machine(), "rows": rows}, f, indent=1)
    _plot(rows, args.out, title)
    print(f"# plot: {args.out}")


if __name__ == "__main__":
    main()
