"""Mesh check + step times: one model on several meshes of simulated CPU devices, side by side.

For each mesh (and one device): logits of the prompt batch vs one device (max |diff|), greedy
incremental and tree-speculative tokens vs one device (must be identical: the script exits 1 naming
the meshes that differ), warm wall time per LLM pass for both. Attention is replicated automatically
when tp does not divide the head count (SmolLM2: 9 heads / 3 KV heads), so only MLP and vocabulary are
split there.

    JAX_NUM_CPU_DEVICES=8 python scripts/bench_mesh.py --meshes one tp=8 pp=2,tp=4 dp=2,tp=4
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
sys.path.insert(0, os.path.dirname(__file__))
import _bench_common as common  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--meshes", nargs="+", default=["one", "tp=8", "pp=2,tp=4", "dp=2,tp=4"])
    ap.add_argument("--batch", type=common.positive_int, default=4)
    ap.add_argument("--max-new-tokens", type=common.positive_int, default=32)
    ap.add_argument("--ssm", default="derived:4")
    ap.add_argument("--expansion", default="1,1,3,1")
    ap.add_argument("--prompts-file", type=common.existing_file, default=common.DEFAULT_PROMPTS)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    jax.config.update("jax_default_matmul_precision", "highest")
    import specjax
    from specjax.decoding.incremental import full_logits
    from specjax.sharding import Parallel, ShardingRules
    from specjax.speculation.expansion import Expansion

    common.print_header("specjax on simulated CPU meshes vs one device (float32, greedy)")
    prompts = [r["prompt"] for r in common.load_prompts(args.prompts_file, args.batch, stride=11)]  # before the model
    model = specjax.load_model(args.model, progress=False)
    cfg = model.config
    ssm = common.load_ssm(model, args.ssm)
    ids = specjax.api.encode_prompts(model, prompts)
    width = max(len(p) for p in ids)
    batch_ids = np.zeros((len(ids), width), np.int32)
    for i, p in enumerate(ids):
        batch_ids[i, :len(p)] = p
    valid = np.arange(width)[None, :] < np.array([len(p) for p in ids])[:, None]
    expansion = Expansion.parse(args.expansion).widths
    print(f"# {args.model}: {cfg.num_layers} layers, {cfg.num_heads} heads / {cfg.num_kv_heads} KV heads, "
          f"batch {len(ids)}, {args.max_new_tokens} new tokens, SSM {args.ssm}, expansion {expansion}")
    print(f"{'mesh':>14} {'attention':>10} {'logits diff':>11} {'incr ==':>7} {'tree ==':>7} "
          f"{'incr ms/pass':>12} {'tree ms/pass':>12} {'tree passes':>11} {'compile s':>9}")
    reference = None
    differ = []  # meshes whose greedy tokens differ from one device's
    for shape in args.meshes:
        parallel, attention = None, "-"
        if shape != "one":
            rules = ShardingRules()
            tp = Parallel.create(shape).shape.tp
            if cfg.num_heads % tp:
                rules, attention = ShardingRules(heads=None, kv_heads=None), "replicated"
            else:
                attention = "split"
            parallel = Parallel.create(shape, rules=rules)
        llm = model if parallel is None else model._replace(params=parallel.put_params(model.params, cfg))
        draft = ssm if parallel is None else ssm._replace(
            params=parallel.put_params(ssm.params, ssm.config, parallel.ssm_rules))
        tokens_in = jnp.asarray(batch_ids) if parallel is None else parallel.put_batch(jnp.asarray(batch_ids))
        logits = np.asarray(full_logits(llm.params, tokens_in, cfg=cfg, parallel=parallel))
        kw = dict(max_new_tokens=args.max_new_tokens, ignore_eos=True, parallel=parallel)
        t0 = time.perf_counter()
        specjax.generate(llm, prompts, mode="incremental", **kw)
        specjax.generate(llm, prompts, mode="tree", ssms=[draft], expansion=expansion, **kw)
        compile_s = time.perf_counter() - t0
        inc = specjax.generate(llm, prompts, mode="incremental", **kw)
        tree = specjax.generate(llm, prompts, mode="tree", ssms=[draft], expansion=expansion, **kw)
        compile_s -= inc.stats["seconds"] + tree.stats["seconds"]
        if reference is None:
            reference = (logits, inc.token_ids)
        diff = float(np.abs(logits - reference[0])[valid].max())
        inc_ms = 1e3 * inc.stats["seconds"] / inc.stats["llm_passes"]
        tree_ms = 1e3 * tree.stats["seconds"] / tree.stats["llm_passes"]
        print(f"{shape:>14} {attention:>10} {diff:11.2e} {str(inc.token_ids == reference[1]):>7} "
              f"{str(tree.token_ids == reference[1]):>7} {inc_ms:12.1f} {tree_ms:12.1f} "
              f"{tree.stats['llm_passes']:11d} {compile_s:9.1f}", flush=True)
        if inc.token_ids != reference[1] or tree.token_ids != reference[1]:
            differ.append(shape)
    if differ:
        sys.exit(f"bench_mesh: greedy tokens differ from one device's on the meshes {differ} (must be identical)")


if __name__ == "__main__":
    main()
