"""Offline: how often a feature drafter's coupled drafts hold the LLM's seeded sample, by draft temperature.

Under seeded verification at temperature 1 the LLM emits argmax(log p + G), G the request's Gumbel noise at
that position, and the feature drafter proposes the top-k of log q + G over its draft vocabulary (the same
G: "coupled" drafts, ``specjax.speculation.drafters.feature``). This script measures, at depth 1 on the
greedy continuations of a prompts file (the contexts ``feature_agreement.py`` uses), the share of (position,
draw) pairs whose LLM sample is among the drafter's top 1 / 2 / 4 of log q / tau + G, for several tau (Monte
Carlo over G, the same draws for every tau), and the mean entropy and top probability of p and q: a trained
q flatter than p is what a tau below 1 would sharpen.

    python scripts/coupled_drafts.py --drafter feature:auto --prompts-file scripts/data/task_kinds.jsonl \
        --workdir bench_out/agreement-tk
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import _bench_common as common  # noqa: E402

TAUS = (0.5, 0.7, 0.85, 1.0, 1.2, 1.5)
TOPS = (1, 2, 4)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", default="feature:auto", help="feature:NAME or feature:PATH")
    ap.add_argument("--prompts-file", default=common.DEFAULT_PROMPTS, help="hand-written prompts (.jsonl)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--draws", type=int, default=16, help="Gumbel draws per position")
    ap.add_argument("--workdir", default="bench_out/agreement", help="where the continuations and features are kept")
    args = ap.parse_args(argv)
    if not args.drafter.startswith("feature:"):
        sys.exit(f"--drafter must be feature:NAME or feature:PATH, got {args.drafter!r}")
    if args.draws < 1:
        sys.exit(f"--draws must be >= 1, got {args.draws}")
    common.print_header("coupled feature drafts at temperature 1: the LLM's seeded sample among the drafter's top k")
    import jax
    import jax.numpy as jnp
    import numpy as np

    import specjax
    from specjax.boost.feature_corpus import CorpusPlan
    from specjax.boost.feature_train import make_batch, unrolled
    from specjax.boost.feature_tune import eval_prompt_set
    from specjax.models.common import head_logits
    from specjax.models.feature import logits_of
    from specjax.speculation.drafters.feature import from_arg

    records = common.load_prompts(args.prompts_file, None)
    llm = specjax.load_model("smollm2-135m-instruct", progress=False)
    bound = from_arg(args.drafter.split(":", 1)[1], llm, load=True, expansion=None, draft="topk")
    cfg, params = bound.drafter.config, bound.params
    plan = dataclasses.replace(CorpusPlan(), max_new_tokens=args.max_new_tokens)
    data = eval_prompt_set(llm, args.workdir, [r["prompt"] for r in records], plan,
                           categories=[str(r.get("category", "?")) for r in records], log=lambda *_: None,
                           layers=cfg.raw_layers)
    window = args.max_new_tokens + 9
    vocab = jnp.asarray(cfg.draft_vocab, jnp.int32)

    @jax.jit
    def batch_counts(params, llm_params, batch, key):  # weights as arguments: as constants XLA would fold them
        f1 = unrolled(params, batch, cfg, 1, window)[0]  # depth 1: the drafter fed the LLM's own features
        mask = batch["loss"][:, -window:] > 0
        logq = jax.nn.log_softmax(logits_of(params, f1), axis=-1)
        # p over the whole vocabulary: the LLM's own head on its features g
        logp = jax.nn.log_softmax(head_logits(batch["features"][:, -window:], llm_params, llm.config), axis=-1)

        def draw(hits, k):
            g = jax.random.gumbel(k, logp.shape)
            sample = jnp.argmax(logp + g, axis=-1)
            rows = []
            for tau in TAUS:
                top = vocab[jax.lax.top_k(logq / tau + g[..., vocab], max(TOPS))[1]]
                rows.append(jnp.stack([jnp.sum(jnp.any(top[..., :n] == sample[..., None], -1) * mask)
                                       for n in TOPS]))
            return hits + jnp.stack(rows), None

        hits, _ = jax.lax.scan(draw, jnp.zeros((len(TAUS), len(TOPS))), jax.random.split(key, args.draws))
        stats = jnp.stack([jnp.sum(jnp.exp(jnp.max(logp, -1)) * mask), jnp.sum(jnp.exp(jnp.max(logq, -1)) * mask),
                           jnp.sum(-jnp.sum(jnp.exp(logp) * logp, -1) * mask),
                           jnp.sum(-jnp.sum(jnp.exp(logq) * logq, -1) * mask)])
        return hits, jnp.sum(mask), stats

    hits, positions, stats = np.zeros((len(TAUS), len(TOPS))), 0.0, np.zeros(4)
    key = jax.random.key(0)
    for start in range(0, len(data), 4):
        batch = make_batch(data, np.arange(start, min(start + 4, len(data))), window)
        key, sub = jax.random.split(key)
        h, n, s = batch_counts(params, llm.params, {k: jnp.asarray(v) for k, v in batch.items()}, sub)
        hits, positions, stats = hits + np.asarray(h), positions + float(n), stats + np.asarray(s)
    print(f"# {args.drafter} on {len(data)} prompts of {args.prompts_file}: {int(positions)} positions x "
          f"{args.draws} draws")
    print(f"# mean top probability p {stats[0] / positions:.3f}, q {stats[1] / positions:.3f}; "
          f"entropy p {stats[2] / positions:.3f}, q {stats[3] / positions:.3f} nats")
    print("  tau " + "".join(f"   top{n}" for n in TOPS))
    for i, tau in enumerate(TAUS):
        print(f"{tau:5.2f} " + "".join(f"  {hits[i, j] / (positions * args.draws):.3f}" for j in range(len(TOPS))))


if __name__ == "__main__":
    main()
