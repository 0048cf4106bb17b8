"""Why a pool member does or does not add accepted tokens, teacher-forced on the corpus hold-out
(every 20th corpus sequence, the same split ``specjax boost-tune`` evaluates on):

* first member's own top-1..5 on the held-out positions where its top-1 misses (its top-2 there is
  what the single-member tree <2,1,...> already proposes), and each later candidate's top-1..5 on
  the same positions: a pool beats the first member at depth 1 only if the candidate's top-1 beats
  the first member's top-2 there;
* per-token MSS acceptance E[sum_v min(p(v), q_tau(v))] of the first member for draft temperatures
  tau (p: the LLM at T = 1), i.e. whether sharpening or flattening the drafts would help.

    python scripts/pool_diagnostics.py --corpus boost-corpus/smollm2-v1 --first smollm2-ssm-a \\
        --candidate smollm2-ssm-b --alpha-sequences 64
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import _bench_common as common  # noqa: E402


def mss_acceptance(llm, ssm, sequences, taus, batch_size=8):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from specjax.boost.distill import Examples
    from specjax.decoding.incremental import full_logits

    @jax.jit
    def summed(llm_logits, ssm_logits, weights):
        p = jax.nn.softmax(llm_logits, axis=-1)
        per_tau = lambda tau: jnp.sum(jnp.minimum(p, jax.nn.softmax(ssm_logits / tau, axis=-1)), axis=-1)  # noqa: E731
        return jax.vmap(lambda tau: jnp.sum(per_tau(tau) * weights))(jnp.asarray(taus, jnp.float32))

    total, count = np.zeros(len(taus)), 0.0
    for start in range(0, len(sequences), batch_size):
        batch = Examples.build(sequences[start:start + batch_size])
        tokens = jnp.asarray(batch.tokens)
        total += np.asarray(summed(full_logits(llm.params, tokens, cfg=llm.config),
                                   full_logits(ssm.params, tokens, cfg=ssm.config), jnp.asarray(batch.weights)))
        count += float(batch.weights.sum())
    return total / count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", required=True, help="corpus directory written by specjax boost-tune")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--first", required=True, help="first pool member (name or path)")
    ap.add_argument("--candidate", action="append", default=[], help="later member (name or path); repeatable")
    ap.add_argument("--alpha-sequences", type=int, default=64, help="hold-out sequences for MSS acceptance; 0: skip")
    ap.add_argument("--taus", default="0.5,0.7,0.85,1,1.2,1.5")
    args = ap.parse_args()
    common.print_header("Pool diagnostics on the corpus hold-out (teacher-forced)")

    from specjax import load_model
    from specjax.boost.distill import Examples, evaluate, predicted_mask
    from specjax.boost.pool import EVAL_EVERY_NTH, read_corpus, restricted

    held_seqs = [s for i, s in enumerate(read_corpus(args.corpus)) if i % EVAL_EVERY_NTH == 0]
    held = Examples.build(held_seqs)
    first = load_model(args.first, progress=False)
    missed = restricted(held, (held.weights > 0) & ~predicted_mask(first.params, first.config, held))
    share = float(missed.weights.sum() / held.weights.sum())
    print(f"{len(held_seqs)} held-out sequences, {int(held.weights.sum())} positions; {args.first} misses {share:.3f}")
    print(f"{'member':<48} {'top-1 (all)':>11}  top-1..5 where the first member misses")
    for name in [args.first] + args.candidate:
        ssm = first if name == args.first else load_model(name, progress=False)
        on_missed = evaluate(ssm.params, ssm.config, missed)
        print(f"{name:<48} {evaluate(ssm.params, ssm.config, held)[0]:>11.3f}  "
              + " ".join(f"{x:.3f}" for x in on_missed), flush=True)
    if args.alpha_sequences:
        taus = [float(t) for t in args.taus.split(",")]
        llm = load_model(args.model, progress=False)
        alpha = mss_acceptance(llm, first, held_seqs[:args.alpha_sequences], taus)
        print(f"\nMSS acceptance of {args.first} per token, {min(args.alpha_sequences, len(held_seqs))} sequences:")
        for tau, a in zip(taus, alpha):
            print(f"  draft temperature {tau:<5} E[sum min(p, q)] = {a:.3f}")


if __name__ == "__main__":
    main()
