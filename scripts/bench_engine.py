"""Benchmark: the base engine against PyTorch, side by side in one run (float32, batch 1, warm).

* prefill tokens/s at each prompt length (specjax: the jitted prefill + first token; torch: one
  forward with a KV cache), with the cache buffer the API would allocate and with one 4x larger
  (the cost must not depend on unused slots);
* decode ms/token at each context length (the next ``--decode-steps`` tokens);
* the tree pass: one LLM forward over a token tree of N nodes at a fixed context, relative to N = 1;
* end to end (``--e2e``): ``specjax.generate`` incremental vs transformers' greedy ``generate`` over
  prompts of several task kinds, interleaved per prompt.

    python scripts/bench_engine.py --lengths 64,256,1024,2048,4096 --e2e scripts/data/task_kinds.jsonl

On a GPU (jax's default backend) torch runs on CUDA beside it, both in strict float32 by default
(``--matmul-precision highest``: no TF32 on either side) or both in ``--dtype bfloat16``; the tree
pass is timed through the XLA path and the Pallas kernel. Where the weights cannot travel, an HF
directory of the same architecture with random weights (``scripts/random_weights_model.py``) times
the same: a dense forward costs what its shapes cost.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import _bench_common as common  # noqa: E402


def _median(fn, repeats: int) -> float:
    fn()  # warm up (compilation)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main() -> None:
    from specjax.cli.layers import add_layers_flag, split_layers_arg

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a registered name or an HF directory")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="both sides")
    ap.add_argument("--matmul-precision", default="highest", choices=("highest", "tf32"),
                    help="float32 matmuls on a GPU, both sides: highest (true float32) or tf32")
    add_layers_flag(ap)
    ap.add_argument("--lengths", type=common.int_list(), default=[64, 256, 1024, 2048, 4096], help="comma-separated")
    ap.add_argument("--decode-steps", type=common.positive_int, default=16)
    ap.add_argument("--tree-nodes", type=common.int_list(), default=[1, 16, 64], help="comma-separated")
    ap.add_argument("--tree-context", type=common.positive_int, default=256)
    ap.add_argument("--repeats", type=common.positive_int, default=3)
    ap.add_argument("--max-new-tokens", type=common.positive_int, default=128,
                    help="output buffer of the API-sized cache")
    ap.add_argument("--e2e", type=common.existing_file,
                    help="prompts file for the end-to-end comparison (without the flag: no end-to-end section)")
    ap.add_argument("--e2e-tokens", type=common.positive_int, default=128)
    ap.add_argument("--json-out", default="bench_out/engine.json")
    ap.add_argument("--plot", default="bench_out/engine.png")
    args = ap.parse_args()
    common.require_plotting()
    e2e_records = common.load_prompts(args.e2e, None) if args.e2e else None  # a bad file fails before the benchmark

    import jax
    import jax.numpy as jnp
    import torch

    import specjax
    from specjax.decoding.buckets import next_pow2
    from specjax.decoding.incremental import decode_init_jit, decode_step
    from specjax.decoding.incremental import prefill as prefill_fn
    from specjax.decoding.programs import step_library, step_program
    from specjax.decoding.sampling import SamplingArrays, SamplingParams
    from specjax.io.loader import resolve_model_path
    from specjax.models.cache import init_cache
    from specjax.speculation.commit import tree_forward
    from specjax.speculation.tree import from_parents

    gpu = jax.default_backend() == "gpu"
    if gpu and not torch.cuda.is_available():
        sys.exit("jax runs on a GPU but torch sees no CUDA device: the comparison would not be side by side")
    device = torch.device("cuda" if gpu else "cpu")
    if gpu and args.dtype == "float32":
        jax.config.update("jax_default_matmul_precision", "highest" if args.matmul_precision == "highest"
                          else "tensorfloat32")
        torch.backends.cuda.matmul.allow_tf32 = args.matmul_precision == "tf32"
        torch.backends.cudnn.allow_tf32 = args.matmul_precision == "tf32"
    common.print_header(f"base engine: specjax vs torch ({args.dtype}, batch 1)")
    # Decode steps and tree passes compiled as specjax.generate compiles its steps.
    decode_step_jit = step_program(decode_step, 1, ("cfg", "eos_ids", "parallel"), ("state",))
    if gpu:
        print(f"# GPU: jax matmul precision {jax.config.jax_default_matmul_precision}, torch allow_tf32 "
              f"{torch.backends.cuda.matmul.allow_tf32} (float32 only)")
    else:
        print(f"# specjax step programs: XLA:CPU matmul library {step_library(1)} (SPECJAX_CPU_DOTS)")
    print(f"# torch {torch.__version__} on {device} ({torch.get_num_threads()} CPU threads)")
    model = specjax.load_model(args.model, dtype=args.dtype, progress=False, split_layers=split_layers_arg(args))
    cfg = model.config
    hf = common.load_hf_reference(resolve_model_path(args.model), dtype=args.dtype).to(device)

    def sync():
        if gpu:
            torch.cuda.synchronize()
    rng = np.random.RandomState(0)
    greedy = SamplingArrays.from_params([SamplingParams()])
    results = {"prefill": [], "decode": [], "tree": [], "e2e": None}

    def save():  # after every section: a run stopped by a time limit keeps what it measured
        os.makedirs(os.path.dirname(args.json_out) or ".", exist_ok=True)
        with open(args.json_out, "w") as f:
            json.dump({"machine": common.machine(), "command": " ".join(sys.argv), **results}, f, indent=1)

    print(f"{'tokens':>6} {'sj prefill tok/s':>16} {'4x buffer':>10} {'torch tok/s':>11} {'sj decode ms':>12} "
          f"{'torch decode ms':>15}")
    for length in args.lengths:
        ids = rng.randint(0, cfg.vocab_size, length).tolist()
        width = next_pow2(length)
        prompt = jnp.asarray([ids + [0] * (width - length)], jnp.int32)
        lens = jnp.asarray([length], jnp.int32)
        budget = jnp.asarray([args.decode_steps + 1], jnp.int32)
        row = {"tokens": length}
        for name, cache_len in (("api", width + next_pow2(args.max_new_tokens)),
                                ("4x", 4 * (width + next_pow2(args.max_new_tokens)))):
            statics = dict(cfg=cfg, cache_len=cache_len, max_out=next_pow2(args.decode_steps + 1))

            def prefill(statics=statics):
                return jax.block_until_ready(decode_init_jit(model.params, prompt, lens, budget, greedy, **statics))

            row[f"prefill_s_{name}"] = _median(prefill, args.repeats)
            if name == "api":
                state = prefill()
                decode_step_jit(model.params, jax.tree.map(jnp.copy, state), greedy, budget, cfg=cfg, eos_ids=())

                def decode(state=state):
                    s = jax.tree.map(jnp.copy, state)
                    for _ in range(args.decode_steps):
                        s = decode_step_jit(model.params, s, greedy, budget, cfg=cfg, eos_ids=())
                    jax.block_until_ready(s.tokens)

                row["decode_ms"] = 1e3 * _median(decode, args.repeats) / args.decode_steps
        with torch.no_grad():
            tids = torch.tensor([ids], device=device)

            # The last position's logits only, as transformers' generate asks for them (logits_to_keep=1)
            # and as specjax's prefill computes them: the full [T, vocab] head would be ~20% of the pass.
            def torch_prefill():
                out = hf(tids, use_cache=True, logits_to_keep=1)
                sync()
                return out

            row["torch_prefill_s"] = _median(torch_prefill, args.repeats)
            past = torch_prefill().past_key_values

            def torch_decode():
                import copy

                cache = copy.deepcopy(past)
                tok = torch.tensor([[ids[-1]]], device=device)
                for _ in range(args.decode_steps):
                    out = hf(tok, past_key_values=cache, use_cache=True)
                    cache = out.past_key_values
                    tok = out.logits[:, -1:].argmax(-1)
                sync()

            row["torch_decode_ms"] = 1e3 * _median(torch_decode, args.repeats) / args.decode_steps
        results["prefill"].append(row)
        print(f"{length:>6} {length / row['prefill_s_api']:>16.0f} {length / row['prefill_s_4x']:>10.0f} "
              f"{length / row['torch_prefill_s']:>11.0f} {row['decode_ms']:>12.1f} {row['torch_decode_ms']:>15.1f}",
              flush=True)

    save()
    # The tree pass: a bushy tree (node i under node (i - 1) // 2) over a committed prefix.
    context = args.tree_context
    cache = init_cache(cfg, 1, next_pow2(context) + 128, model.params["embed"].dtype)
    ids = rng.randint(0, cfg.vocab_size, context).tolist()
    _, cache = jax.jit(prefill_fn, static_argnames="cfg")(
        model.params, jnp.asarray([ids + [0] * (next_pow2(context) - context)]), jnp.asarray([context]), cache,
        cfg=cfg)
    fwd = step_program(tree_forward, 1, ("cfg", "impl"))
    print(f"# tree pass at a {context}-token context")
    for impl in ("xla", "pallas") if gpu else ("xla",):
        base = None
        for n in args.tree_nodes:
            parents = [-1] + [(i - 1) // 2 for i in range(1, n)]
            tree = from_parents([rng.randint(0, cfg.vocab_size, n).tolist()], [parents], n_max=n)
            t = _median(lambda tree=tree, impl=impl: jax.block_until_ready(
                fwd(model.params, tree, cache, cfg=cfg, impl=impl)), args.repeats)
            base = base or t
            results["tree"].append({"impl": impl, "nodes": n, "ms": 1e3 * t, "relative": t / base})
            print(f"  {impl:>6} {n:>3} nodes: {1e3 * t:7.2f} ms = {t / base:.2f}x one node", flush=True)

    save()
    if e2e_records is not None:
        records = e2e_records
        prompts = specjax.api.encode_prompts(model, [r["prompt"] for r in records])
        specjax.generate(model, [prompts[0]], max_new_tokens=args.e2e_tokens, mode="incremental")  # warm up
        with torch.no_grad():
            hf.generate(torch.tensor([prompts[0]], device=device), max_new_tokens=8, do_sample=False)
        rows = []
        for rec, ids in zip(records, prompts):
            ours, sj, theirs, th = common.greedy_pair(model, hf, ids, args.e2e_tokens)
            rows.append({"id": rec.get("id"), "category": rec.get("category"), "prompt_tokens": len(ids),
                         "specjax_tokens": len(ours), "specjax_s": sj, "torch_tokens": len(theirs), "torch_s": th,
                         "identical": ours == theirs})
            print(f"  {rec.get('id', ''):>8} {rec.get('category', ''):>14} {len(ids):>5} tokens: specjax "
                  f"{len(ours) / sj:6.1f} tok/s, transformers {len(theirs) / th:6.1f} tok/s, same {ours == theirs}",
                  flush=True)
        sj_tps = sum(r["specjax_tokens"] for r in rows) / sum(r["specjax_s"] for r in rows)
        th_tps = sum(r["torch_tokens"] for r in rows) / sum(r["torch_s"] for r in rows)
        results["e2e"] = {"rows": rows, "specjax_tok_s": sj_tps, "torch_tok_s": th_tps}
        print(f"# end to end over {len(rows)} prompts: specjax {sj_tps:.2f} tok/s, transformers {th_tps:.2f} tok/s, "
              f"ratio {sj_tps / th_tps:.2f}x; identical outputs {sum(r['identical'] for r in rows)}/{len(rows)}")

    save()
    _plot(results, args.plot)


def _plot(results, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["prefill"]
    lengths = [r["tokens"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(lengths, [r["tokens"] / r["prefill_s_api"] for r in rows], "o-", label="specjax")
    a.plot(lengths, [r["tokens"] / r["prefill_s_4x"] for r in rows], "o--", label="specjax, 4x cache buffer")
    a.plot(lengths, [r["tokens"] / r["torch_prefill_s"] for r in rows], "s-", label="torch")
    a.set(xscale="log", xlabel="prompt tokens", ylabel="prefill tokens/s", title="prefill")
    b.plot(lengths, [r["decode_ms"] for r in rows], "o-", label="specjax")
    b.plot(lengths, [r["torch_decode_ms"] for r in rows], "s-", label="torch")
    b.set(xscale="log", xlabel="context tokens", ylabel="ms per token", title="decode")
    for ax in (a, b):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
