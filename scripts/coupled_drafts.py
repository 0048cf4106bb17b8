"""Offline: how often a feature drafter's coupled drafts hold the LLM's seeded sample, by draft temperature.

Under seeded verification at temperature 1 the LLM emits argmax(log p + G), G the request's Gumbel noise at
that position, and the feature drafter proposes the top-k of log q + G over its draft vocabulary (the same
G: "coupled" drafts, ``specjax.speculation.drafters.feature``). This script measures, at depth 1 on the
greedy continuations of a prompts file (the contexts ``feature_agreement.py`` uses), the share of (position,
draw) pairs whose LLM sample is among the drafter's top 1 / 2 / 4 of log q / tau + G, for several tau (Monte
Carlo over G, the same draws for every tau), and the mean entropy and top probability of p and q: a trained
q flatter than p is what a tau below 1 would sharpen.

The second table is the alternative to coupling: *sampled* drafts, k children drawn without replacement from
q_tau = softmax(log q / tau) with the drafter's own noise (independent of the LLM's), declared as their law
and verified by recursive rejection sampling (``verify_sampled`` rule "rrs", lossless in distribution, not
seeded). Its cells are the exact probability that one of the k children is accepted given the drawn
children, averaged over positions and draws (k = 1 is the overlap sum(min(p, q_tau))).

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
RRS_TAUS = (0.5, 0.7, 0.85, 1.0)


def rrs_accept(logp, logq_tau, vocab, noise, k):
    """P(one of k children is accepted) under RRS: children = top-k of log q_tau + noise over the draft
    vocabulary (draws without replacement); the j-th is accepted with min(1, r(x) / lam_j(x)), lam_j = q_tau
    without the earlier children, renormalised; after a rejection r <- norm(max(0, r - lam_j)). Returns
    [..., k]: the acceptance probability after 1..k children."""
    import jax
    import jax.numpy as jnp

    children = jax.lax.top_k(logq_tau + noise, k)[1]  # [..., k] indices into the draft vocabulary
    r = jnp.exp(logp)  # [..., V]
    lam_d = jnp.exp(logq_tau)  # [..., Vd]
    reject, out = jnp.ones(logp.shape[:-1]), []
    for j in range(k):
        x_d = children[..., j]
        lam_x = jnp.take_along_axis(lam_d, x_d[..., None], -1)[..., 0]
        r_x = jnp.take_along_axis(r, vocab[x_d][..., None], -1)[..., 0]
        a = jnp.where(lam_x > 0, jnp.minimum(1.0, r_x / jnp.maximum(lam_x, 1e-30)), 0.0)
        reject = reject * (1.0 - a)
        out.append(1.0 - reject)
        lam_full = jnp.zeros_like(r).at[..., vocab].set(lam_d)
        left = jnp.maximum(r - lam_full, 0.0)
        mass = jnp.sum(left, -1, keepdims=True)
        r = jnp.where(mass > 0, left / jnp.maximum(mass, 1e-30), r)
        lam_d = lam_d * (1.0 - jax.nn.one_hot(x_d, lam_d.shape[-1]))
        lam_d = lam_d / jnp.maximum(jnp.sum(lam_d, -1, keepdims=True), 1e-30)
    return jnp.stack(out, -1)


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
            noise = jax.random.gumbel(jax.random.fold_in(k, 1), logq.shape)  # the drafter's own, independent
            rrs = jnp.stack([jnp.sum(rrs_accept(logp, jax.nn.log_softmax(logq / tau, -1), vocab, noise, max(TOPS))
                                     [..., [n - 1 for n in TOPS]] * mask[..., None], axis=(0, 1))
                             for tau in RRS_TAUS])
            return (hits[0] + jnp.stack(rows), hits[1] + rrs), None

        (hits, rrs), _ = jax.lax.scan(draw, (jnp.zeros((len(TAUS), len(TOPS))), jnp.zeros((len(RRS_TAUS), len(TOPS)))),
                                      jax.random.split(key, args.draws))
        stats = jnp.stack([jnp.sum(jnp.exp(jnp.max(logp, -1)) * mask), jnp.sum(jnp.exp(jnp.max(logq, -1)) * mask),
                           jnp.sum(-jnp.sum(jnp.exp(logp) * logp, -1) * mask),
                           jnp.sum(-jnp.sum(jnp.exp(logq) * logq, -1) * mask)])
        return hits, rrs, jnp.sum(mask), stats

    hits, rrs = np.zeros((len(TAUS), len(TOPS))), np.zeros((len(RRS_TAUS), len(TOPS)))
    positions, stats = 0.0, np.zeros(4)
    key = jax.random.key(0)
    for start in range(0, len(data), 4):
        batch = make_batch(data, np.arange(start, min(start + 4, len(data))), window)
        key, sub = jax.random.split(key)
        h, a, n, s = batch_counts(params, llm.params, {k: jnp.asarray(v) for k, v in batch.items()}, sub)
        hits, rrs = hits + np.asarray(h), rrs + np.asarray(a)
        positions, stats = positions + float(n), stats + np.asarray(s)
    print(f"# {args.drafter} on {len(data)} prompts of {args.prompts_file}: {int(positions)} positions x "
          f"{args.draws} draws")
    print(f"# mean top probability p {stats[0] / positions:.3f}, q {stats[1] / positions:.3f}; "
          f"entropy p {stats[2] / positions:.3f}, q {stats[3] / positions:.3f} nats")
    print("  tau " + "".join(f"   top{n}" for n in TOPS))
    for i, tau in enumerate(TAUS):
        print(f"{tau:5.2f} " + "".join(f"  {hits[i, j] / (positions * args.draws):.3f}" for j in range(len(TOPS))))
    print("# sampled drafts from q_tau verified by RRS: P(one of the top k children accepted)")
    print("  tau " + "".join(f"   top{n}" for n in TOPS))
    for i, tau in enumerate(RRS_TAUS):
        print(f"{tau:5.2f} " + "".join(f"  {rrs[i, j] / (positions * args.draws):.3f}" for j in range(len(TOPS))))


if __name__ == "__main__":
    main()
