"""Fixed drafted trees for the jitted verifier (T1/T2): numpy drafts from context-hashed laws,
turned into specjax TokenTrees with declared laws, plus their exact emitted laws from the oracle."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax.decoding.sampling import warp_logits
from specjax.speculation.drafters.base import Proposal
from specjax.speculation.drafters.merge import merge_proposals
from specjax.speculation.expansion import Expansion, static_tree
from specjax.speculation.verify.sampled import verify_sampled
from tests import oracle
from tests.toy import sampling_arrays

_warp_jit = jax.jit(warp_logits)


@dataclasses.dataclass
class Case:
    tree: object  # TokenTree, batch 1
    laws: jnp.ndarray  # [1, R, V] declared log-probabilities
    logits: jnp.ndarray  # [1, N, V]
    rule: str
    max_depth: int
    top_k: int = 0  # target warp

    def arrays(self):
        """numpy (tokens, children, law_row, target probs, law probs) exactly as the verifier sees them."""
        s = sampling_arrays(1, 1.0, self.top_k)
        target = np.exp(np.asarray(_warp_jit(self.logits, s)[0], np.float64))
        laws = np.exp(np.asarray(self.laws[0], np.float64))
        t = self.tree
        return (np.asarray(t.tokens[0]), np.asarray(t.children[0]), np.asarray(t.law_row[0]), target, laws)

    def exact_law(self) -> dict:
        tokens, children, law_row, target, laws = self.arrays()
        return oracle.fixed_tree_law(tokens, children, law_row, target, laws, self.rule)


def _draw(rng, q: np.ndarray, k: int, draft: str):
    if draft == "topk":
        return list(np.argsort(-q, kind="stable")[:k]), [True] * k
    if draft == "iid":
        return list(rng.choice(len(q), size=k, p=q)), [True] * k
    support = int((q > 0).sum())  # wor
    drawn = list(rng.choice(len(q), size=min(k, support), replace=False, p=q))
    return drawn + [0] * (k - len(drawn)), [True] * len(drawn) + [False] * (k - len(drawn))


def _log(x):
    with np.errstate(divide="ignore"):
        return np.log(x)


def _draft_static(rng, q, widths, draft, root_token):
    """One SSM's static tree: (tokens [N], entry_ok [N], contexts per node)."""
    parents, levels = Expansion(widths).topology()
    n = len(parents)
    tokens, ok, ctx = [root_token] + [0] * (n - 1), [True] * n, [()] * n
    for d, k in enumerate(widths):
        for f, u in enumerate(levels[d]):
            kids = levels[d + 1][f * k:(f + 1) * k]
            drawn, valid = _draw(rng, q(ctx[u]), k, draft)
            for c, x, v in zip(kids, drawn, valid):
                tokens[c], ok[c], ctx[c] = int(x), v, ctx[u] + (int(x),)
    return tokens, ok, ctx


def make_case(seed: int, vocab: int, widths_per_ssm, draft: str, rule: str, merged: bool = False,
              p_kw=None, q_kw=None, top_k: int = 0, same_q: bool = False, fault: str | None = None) -> Case:
    rng = np.random.default_rng(seed)
    p = oracle.RandomLaws(vocab, 10 * seed + 1, **(p_kw or {}))
    qs = [oracle.RandomLaws(vocab, 10 * seed + 2 + (0 if same_q else s), **(q_kw or {}))
          for s in range(len(widths_per_ssm))]
    declares = draft in ("iid", "wor")
    drafted = [_draft_static(rng, q, w, draft, 0) for q, w in zip(qs, widths_per_ssm)]
    exps = [Expansion(tuple(w)) for w in widths_per_ssm]
    parents = [e.topology()[0] for e in exps]
    # a sampled entry declares the row of the node it was drawn from (its parent); top-k entries one-hot
    law_rows = [jnp.asarray([[p if declares and p >= 0 else -1 for p in par]], jnp.int32) for par in parents]
    if not merged:
        tokens, ok, ctx = drafted[0]
        tree = static_tree(exps[0], 1, jnp.asarray([tokens], jnp.int32), jnp.asarray([ok]), law_rows[0])
        laws = np.stack([_log(qs[0](c)) for c in ctx])
    else:
        per_set = [np.stack([_log(q(c)) for c in ctx]) for q, (_, _, ctx) in zip(qs, drafted)]
        proposals = [Proposal(tokens=jnp.asarray([t], jnp.int32), parent=jnp.asarray([par], jnp.int32),
                              ok=jnp.asarray([o]), law_row=rows, laws=jnp.asarray(lw[None], jnp.float32))
                     for (t, o, _), par, rows, lw in zip(drafted, parents, law_rows, per_set)]
        tree = merge_proposals(proposals, [tuple(p) for p in parents], fault=fault)
        laws = np.concatenate(per_set)
    tok, par = np.asarray(tree.tokens[0]), np.asarray(tree.parent[0])
    node_ctx = [()] * len(tok)
    for i in range(1, len(tok)):
        if par[i] >= 0:
            node_ctx[i] = node_ctx[par[i]] + (int(tok[i]),)
    logits = np.stack([_log(p(c)) for c in node_ctx])
    depth = max(len(w) for w in widths_per_ssm)
    return Case(tree=tree, laws=jnp.asarray(laws[None], jnp.float32), logits=jnp.asarray(logits[None], jnp.float32),
                rule=rule, max_depth=depth, top_k=top_k)


def broadcast(tree, batch: int):
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (batch,) + x.shape[1:]), tree)


_verify_jit = jax.jit(verify_sampled, static_argnames=("rule", "max_depth", "fault"))


def run(case: Case, n: int, injected=None, seed0: int = 0, fault: str | None = None):
    """Verify the fixed tree for n requests (seeds seed0 .. seed0 + n - 1); ``fault`` re-creates a pitfall."""
    s = sampling_arrays(n, 1.0, case.top_k, seeds=seed0 + np.arange(n))
    return _verify_jit(jnp.broadcast_to(case.logits, (n,) + case.logits.shape[1:]), broadcast(case.tree, n),
                       jnp.broadcast_to(case.laws, (n,) + case.laws.shape[1:]), s, jnp.full((n,), 7, jnp.int32),
                       rule=case.rule, max_depth=case.max_depth, injected=injected, fault=fault)


def outcomes(verdict) -> list[tuple]:
    emitted = np.asarray(verdict.emitted)
    count = np.asarray(verdict.num_accepted) + 1
    return [tuple(row[:c].tolist()) for row, c in zip(emitted, count)]
