"""Verifiers: walk the tree from the root and accept the path the LLM itself would produce.

* ``verify_greedy``: follow the child whose token is the LLM's argmax; that argmax is the bonus.
* ``verify_seeded``: the LLM's token at node u is argmax(score(logits[u]) + G(seed, t)) with t the
  ABSOLUTE position of the next token (``specjax.decoding.sampling``), exactly the incremental sampler's
  definition, so the output equals incremental seeded sampling token for token for any tree
  (drafter-invariant); the tree pass decides it per node (``SeededHead``).
* ``verify_sampled``: multi-step speculative sampling over the entries of every node, in draw order
  (docs/verification.md): r <- p~[u]; entry j with token x and declared law lam is accepted iff
  xi_j * lam(x) < r(x) (strict, no division); else r <- norm(max(0, r - lam)) (kept when the mass
  is 0). ``rule``: "mss" (lam = the entry's stored SSM law), "rrs" (that law with the tokens of
  earlier entries of the same law removed, renormalised: exact for draws without replacement),
  "naive" (lam = one-hot; exact for any drafter). No entry accepted: emit y ~ r. A leaf reached by
  acceptance emits its bonus token y ~ p~[leaf]. Greedy requests get a one-hot target, which makes
  every rule the greedy walk.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specjax.decoding.keys import (
    COIN,
    DRAFT,
    RESIDUAL,
    categorical_from_probs,
    purpose_key,
    uniform_coin,
)
from specjax.decoding.sampling import SamplingArrays, warp_logits
from specjax.speculation.tree import TokenTree
from specjax.speculation.verify.base import Verdict

RULES = ("mss", "rrs", "naive")


@struct.dataclass
class _Walk:
    node: jax.Array  # current node (accepted so far)
    entry: jax.Array  # next entry index at node
    depth: jax.Array
    r: jax.Array  # [V] residual target at node
    path: jax.Array  # [D + 1]
    emitted: jax.Array  # [D + 1] accepted tokens so far
    done: jax.Array


def verify_sampled(logits: jax.Array, tree: TokenTree, laws: jax.Array | None, sampling: SamplingArrays,
                   length: jax.Array, rule: str, max_depth: int, injected=None, fault: str | None = None) -> Verdict:
    """Multi-step speculative sampling over the tree (see the module docstring); one
    ``lax.while_loop`` per request, one entry per iteration. laws [B, R, V]: declared drafting laws
    as warped log-probabilities, indexed by ``tree.law_row`` (-1 = one-hot).

    injected (white-box tests only): (coins [B, D + 1, K] used as xi at (depth, entry), Gumbel noise
    [B, D + 1, V] for the final token at each depth) instead of the keyed random numbers.
    fault (mutation tests only): one of ``faults.FAULTS`` re-creates that verifier pitfall."""
    if rule not in RULES:
        raise ValueError(f"unknown verification rule {rule!r}; choose from {RULES}")
    mutation = fault
    batch, n, vocab = logits.shape
    warp_with = sampling
    if mutation == "target_unwarped":
        warp_with = sampling.replace(top_k=jnp.zeros_like(sampling.top_k), top_p=jnp.ones_like(sampling.top_p))
    probs = jnp.exp(warp_logits(logits, warp_with))
    one_hot_argmax = jax.nn.one_hot(jnp.argmax(logits, axis=-1), vocab, dtype=jnp.float32)
    target = jnp.where(sampling.sampled[:, None, None], probs, one_hot_argmax)  # [B, N, V]
    children, law_row = _entries_in_draw_order(tree, mutation)
    if laws is None:  # no stored laws: every entry is one-hot (as ``Proposal`` documents), whatever its law_row
        laws = jnp.full((batch, 1, vocab), -jnp.inf, jnp.float32)
        law_row = jnp.full_like(law_row, -1)
    num_entries = children.shape[-1]

    if injected is None:
        injected = (jnp.zeros((batch, 1, 1), jnp.float32), jnp.zeros((batch, 1, 1), jnp.float32))
        use_injected = False
    else:
        use_injected = True

    def one(target_b, tokens_b, children_b, law_row_b, laws_b, seed, length_b, coins_b, gumbel_b):
        def body(w: _Walk) -> _Walk:
            t = length_b + w.depth + 1  # absolute position of the token decided at this node
            j = jnp.minimum(w.entry, num_entries - 1)
            c = jnp.where(w.entry < num_entries, children_b[w.node, j], -1)
            # a tree deeper than max_depth (a drafter deeper than it declares) is cut at the bound, which
            # stays exact; walking on would accept more tokens than ``emitted`` holds
            has = (c >= 0) & (w.depth < max_depth)
            x = tokens_b[jnp.maximum(c, 0)]
            lam = _entry_law(x, w.node, w.entry, tokens_b, children_b, law_row_b, laws_b, rule, mutation)
            coin_slot = 0 if mutation == "shared_coins" else w.entry
            xi = coins_b[w.depth, coin_slot] if use_injected else uniform_coin(purpose_key(seed, COIN, t, coin_slot))
            accept = has & ((xi * lam[x] <= w.r[x]) if mutation == "coin_le" else (xi * lam[x] < w.r[x]))
            base = target_b[w.node] if mutation == "residual_not_cumulative" else w.r
            residual = jnp.maximum(base - lam, 0.0)
            mass = jnp.sum(residual)
            residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), w.r)  # null event: keep r
            child = jnp.maximum(c, 0)
            next_r = w.r if mutation == "residual_carried" else target_b[child]
            return _Walk(node=jnp.where(accept, child, w.node),
                         entry=jnp.where(accept, 0, w.entry + 1),
                         depth=w.depth + accept.astype(jnp.int32),
                         r=jnp.where(accept, next_r, jnp.where(has, residual, w.r)),
                         path=jnp.where(accept, w.path.at[w.depth + 1].set(child), w.path),
                         emitted=jnp.where(accept, w.emitted.at[w.depth].set(x), w.emitted), done=~has)

        start = _Walk(node=jnp.int32(0), entry=jnp.int32(0), depth=jnp.int32(0), r=target_b[0],
                      path=jnp.full((max_depth + 1,), -1, jnp.int32).at[0].set(0),
                      emitted=jnp.zeros((max_depth + 1,), jnp.int32), done=jnp.bool_(False))
        w = jax.lax.while_loop(lambda w: ~w.done, body, start)
        # Entries exhausted (or a leaf reached): the final token, drawn once, after the walk.
        final_law = target_b[w.node] if mutation == "target_after_rejection" else w.r
        final_key = purpose_key(seed, RESIDUAL, length_b + w.depth + 1)
        if mutation == "residual_draft_noise":  # the key the wor drafter used for this node's children
            final_key = purpose_key(seed, DRAFT, length_b, (w.node << 10))
        y, ok = categorical_from_probs(final_key, final_law, gumbel_b[w.depth] if use_injected else None)
        return w.path, w.depth, y, w.emitted.at[w.depth].set(y), ok, final_law

    path, depth, bonus, emitted, ok, final = jax.vmap(one)(target, tree.tokens, children, law_row, laws,
                                                           sampling.seed, length, *injected)
    return Verdict(path=path, num_accepted=depth, bonus=bonus, emitted=emitted, ok=ok, residual=final)


def _entries_in_draw_order(tree: TokenTree, fault: str | None):
    """(children, law_row) [B, N, K] with padding entries (-1) moved behind the real ones, draw order kept
    (the fault "reorder_by_token" visits them in token-id order instead)."""
    order = jnp.argsort(tree.children < 0, axis=-1, stable=True)
    children = jnp.take_along_axis(tree.children, order, axis=-1)
    law_row = jnp.take_along_axis(tree.law_row, order, axis=-1)
    if fault == "reorder_by_token":
        tok = jax.vmap(lambda t, c: jnp.where(c >= 0, t[jnp.maximum(c, 0)], 2**30))(tree.tokens, children)
        order = jnp.argsort(tok, axis=-1, stable=True)
        children = jnp.take_along_axis(children, order, axis=-1)
        law_row = jnp.take_along_axis(law_row, order, axis=-1)
    return children, law_row


def _entry_law(x, node, entry, tokens_b, children_b, law_row_b, laws_b, rule: str, fault: str | None) -> jax.Array:
    """lambda [V]: the law entry ``entry`` of ``node`` (token x) is verified against. Its declared
    stored law (one-hot when it declares none); naive: always one-hot; RRS: the stored law without the
    tokens of earlier entries drawn from the same law, renormalised (draws without replacement)."""
    vocab = laws_b.shape[-1]
    row = law_row_b[node, entry]
    one_hot = jax.nn.one_hot(x, vocab, dtype=jnp.float32)
    if rule == "naive":
        return one_hot
    lam = jnp.where(row >= 0, jnp.exp(laws_b[jnp.maximum(row, 0)]), one_hot)
    if rule == "rrs" and fault != "mss_on_wor":
        kids = children_b[node]
        slots = jnp.arange(kids.shape[0])
        earlier = (slots < entry) & (kids >= 0) & (law_row_b[node] == row) & (row >= 0)
        drawn = jnp.zeros((vocab,), jnp.int32).at[tokens_b[jnp.maximum(kids, 0)]].max(earlier.astype(jnp.int32))
        lam = jnp.where(drawn > 0, 0.0, lam)
        lam = lam / jnp.maximum(jnp.sum(lam), jnp.finfo(jnp.float32).tiny)
    return lam
