"""Exact float64 oracle for tree verification (test layer T0 of docs' verification.md).

Independent of specjax: plain numpy, written from the rules, not from the jitted code. It computes
the exact law of what a verifier emits (accepted tokens, then the final token), integrating over
its coins analytically and over the drafts by enumeration, for tiny vocabularies.

Distributions are functions of the context (tuple of tokens below the root): ``p(ctx)`` is the
warped target; ``q[s](ctx)`` SSM s's law that drafts are drawn from; ``declared[s](ctx)`` the law
the entries declare (normally q; a pitfall variant declares another one).
"""

from __future__ import annotations

import itertools
from collections import defaultdict

import numpy as np

VARIANTS = ("correct", "reorder", "not_cumulative", "target_after_rejection", "residual_carried", "dedupe")


def draws(q: np.ndarray, k: int, mode: str):
    """All outcomes of drawing k children from q: list of (tokens tuple, probability)."""
    v = len(q)
    if mode == "topk":
        order = np.argsort(-q, kind="stable")[:k]
        return [(tuple(int(x) for x in order), 1.0)]
    if mode == "iid":
        return [(c, float(np.prod([q[x] for x in c]))) for c in itertools.product(range(v), repeat=k)
                if all(q[x] > 0 for x in c)]
    if mode == "wor":  # sequential without replacement; draws that cannot exist (support < k) are absent
        out = []

        def rec(prefix, prob, left):
            mass = sum(q[x] for x in range(v) if x not in prefix)
            if left == 0 or mass <= 0:
                out.append((prefix, prob))
                return
            for x in range(v):
                if x not in prefix and q[x] > 0:
                    rec(prefix + (x,), prob * q[x] / mass, left - 1)

        rec((), 1.0, k)
        return out
    raise ValueError(mode)


def entry_law(rule: str, declared: np.ndarray, x: int, earlier_same_group: list[int]) -> np.ndarray:
    v = len(declared)
    if rule == "naive":
        lam = np.zeros(v)
        lam[x] = 1.0
        return lam
    lam = declared.copy()
    if rule == "rrs":
        lam[list(earlier_same_group)] = 0.0
        lam = lam / lam.sum() if lam.sum() > 0 else lam
    return lam


def accept_probability(r_x: float, lam_x: float) -> float:
    """P(xi * lam(x) < r(x)) for xi ~ U[0, 1)."""
    if lam_x <= 0:
        return 1.0 if r_x > 0 else 0.0
    return min(1.0, r_x / lam_x)


def residual(r: np.ndarray, lam: np.ndarray) -> np.ndarray:
    out = np.maximum(r - lam, 0.0)
    s = out.sum()
    return out / s if s > 0 else r


def verify_node(p_u: np.ndarray, entries, variant: str = "correct", r_start=None) -> dict:
    """Exact emitted law at one node given its entries [(x, lam, child_law_fn)] in draw order;
    child_law_fn(r_at_acceptance) -> dict of emitted suffixes of the child. Returns {seq: prob}."""
    if variant == "reorder":
        entries = sorted(entries, key=lambda e: e[0])
    r = p_u.copy() if r_start is None else r_start.copy()
    reach = 1.0
    out = defaultdict(float)
    for x, lam, child in entries:
        a = accept_probability(r[x], lam[x])
        if a > 0:
            for seq, pr in child(r).items():
                out[(x,) + seq] += reach * a * pr
        reach *= 1.0 - a
        base = p_u if variant == "not_cumulative" else r
        r = residual(base, lam)
        if reach == 0.0:
            break
    final = p_u if variant == "target_after_rejection" else r
    for y in range(len(final)):
        if final[y] > 0:
            out[(y,)] += reach * final[y]
    return dict(out)


def tree_law(p, q, declared, widths, draft: str, rule: str, variant: str = "correct", merged: bool = False):
    """Exact emitted law of one speculative step at the root (context ()).

    widths: one expansion <k1..km> per SSM. Single SSM without ``merged``: a static tree (equal-token
    siblings stay separate nodes, each with its own subtree). ``merged``: duplicate proposals merge
    into one node whose entries pool every proposal's children (specjax's merge_trees)."""
    if not merged:
        assert len(widths) == 1
        return _static(p, q[0], declared[0], tuple(widths[0]), draft, rule, variant, (), 0, None, {})
    return _merged(p, q, declared, widths, draft, rule, variant, (), 0, tuple(1 for _ in widths), None)


def _static(p, q, declared, widths, draft, rule, variant, ctx, level, r_start, memo):
    key = (ctx, level)
    if r_start is None and key in memo:
        return memo[key]
    p_u = p(ctx)
    if level == len(widths):
        law = verify_node(p_u, [], variant, r_start)
    else:
        law = defaultdict(float)
        for tokens, prob in draws(q(ctx), widths[level], draft):
            entries = []
            for j, x in enumerate(tokens):
                lam = entry_law(rule, declared(ctx), x, list(tokens[:j]))
                child = _child_fn(lambda r, c=ctx + (x,): _static(p, q, declared, widths, draft, rule, variant, c,
                                                                  level + 1, r, memo), variant)
                entries.append((x, lam, child))
            for seq, pr in verify_node(p_u, entries, variant, r_start).items():
                law[seq] += prob * pr
        law = dict(law)
    if r_start is None:
        memo[key] = law
    return law


def _child_fn(fn, variant):
    if variant == "residual_carried":
        return fn  # the child starts from the parent's residual at acceptance
    return lambda r: fn(None)


def _merged(p, q, declared, widths, draft, rule, variant, ctx, level, counts, r_start):
    p_u = p(ctx)
    groups = []  # (ssm, proposal index): one draw group per merged proposal
    for s, n in enumerate(counts):
        if level < len(widths[s]):
            groups += [s] * n
    if not groups:
        return verify_node(p_u, [], variant, r_start)
    law = defaultdict(float)
    outcomes = [draws(q[s](ctx), widths[s][level], draft) for s in groups]
    for combo in itertools.product(*outcomes):
        prob = float(np.prod([pr for _, pr in combo]))
        child_counts = defaultdict(lambda: [0] * len(counts))
        for s, (tokens, _) in zip(groups, combo):
            for x in tokens:
                child_counts[x][s] += 1
        entries, seen = [], set()
        for s, (tokens, _) in zip(groups, combo):
            for j, x in enumerate(tokens):
                if variant == "dedupe" and x in seen:
                    continue
                seen.add(x)
                lam = entry_law(rule, declared[s](ctx), x, list(tokens[:j]))
                cc = tuple(child_counts[x])
                child = _child_fn(lambda r, c=ctx + (x,), cc=cc: _merged(p, q, declared, widths, draft, rule, variant,
                                                                         c, level + 1, cc, r), variant)
                entries.append((x, lam, child))
        for seq, pr in verify_node(p_u, entries, variant, r_start).items():
            law[seq] += prob * pr
    return dict(law)


def complete(law: dict, p, length: int) -> dict:
    """Extend every emitted sequence to ``length`` tokens by exact sampling from the target p."""
    out = defaultdict(float)
    stack = list(law.items())
    while stack:
        seq, pr = stack.pop()
        if len(seq) == length:
            out[seq] += pr
            continue
        dist = p(seq)
        for y in range(len(dist)):
            if dist[y] > 0:
                stack.append((seq + (y,), pr * dist[y]))
    return dict(out)


def target_law(p, length: int) -> dict:
    return complete({(): 1.0}, p, length)


def max_abs_diff(a: dict, b: dict) -> float:
    return max(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


def total_variation(a: dict, b: dict) -> float:
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


class RandomLaws:
    """Context-hashed random distributions with zeros (top-k / top-p style) and edge cases."""

    def __init__(self, vocab: int, seed: int, kind: str = "random", top_k: int = 0, top_p: float = 1.0,
                 scale: float = 2.0, temperature: float = 1.0):
        self.vocab, self.seed, self.kind = vocab, seed, kind
        self.top_k, self.top_p, self.scale, self.temperature = top_k, top_p, scale, temperature
        self._cache = {}

    def logits(self, ctx):
        rng = np.random.default_rng([self.seed, len(ctx), *ctx])
        return rng.normal(0.0, self.scale, self.vocab)

    def __call__(self, ctx):
        if ctx not in self._cache:
            self._cache[ctx] = self._law(ctx)
        return self._cache[ctx]

    def _law(self, ctx):
        v = self.vocab
        if self.kind == "one_hot":
            out = np.zeros(v)
            out[int(np.argmax(self.logits(ctx)))] = 1.0
            return out
        if self.kind == "support":  # a fixed half of the vocabulary (disjoint supports when paired)
            out = np.zeros(v)
            idx = np.arange(v)[(np.arange(v) % 2) == (self.seed % 2)]
            out[idx] = np.exp(self.logits(ctx)[idx])
            return out / out.sum()
        x = self.logits(ctx) / self.temperature
        if self.top_k:
            kth = np.sort(x)[::-1][min(self.top_k, v) - 1]
            x = np.where(x < kth, -np.inf, x)
        probs = np.exp(x - x.max())
        probs /= probs.sum()
        if self.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            before = np.cumsum(probs[order]) - probs[order]
            keep = np.zeros(v, bool)
            keep[order[before < self.top_p]] = True
            probs = np.where(keep, probs, 0.0)
            probs /= probs.sum()
        return probs


def fixed_entries(children, law_row, tokens, laws, u, rule):
    """Entries of node u of a fixed tree in draw order: [(child, x, lam)] (padding skipped)."""
    out, seen = [], []
    for j in range(children.shape[1]):
        c = int(children[u, j])
        if c < 0:
            continue
        x, row = int(tokens[c]), int(law_row[u, j])
        declared = laws[row] if row >= 0 else None
        if rule == "naive" or declared is None:
            lam = np.zeros(laws.shape[-1])
            lam[x] = 1.0
        else:
            earlier = [t for t, r in seen if r == row] if rule == "rrs" else []
            lam = entry_law("mss", declared, x, [])
            if earlier:
                lam[earlier] = 0.0
                lam = lam / lam.sum() if lam.sum() > 0 else lam
        seen.append((x, row))
        out.append((c, x, lam))
    return out


def fixed_tree_law(tokens, children, law_row, target, laws, rule, u=0) -> dict:
    """Exact emitted law of verifying ONE fixed tree (only the coins and the final draw random).
    target [N, V] and laws [R, V] are probabilities (float64)."""
    entries = [(x, lam, lambda r, c=c: fixed_tree_law(tokens, children, law_row, target, laws, rule, c))
               for c, x, lam in fixed_entries(children, law_row, tokens, laws, u, rule)]
    return verify_node(target[u], entries)


def simulate(tokens, children, law_row, target, laws, rule, coin_policy):
    """Step-by-step run of the rule on a fixed tree. coin_policy(depth, entry, threshold) -> xi.
    Returns (accepted nodes, coins used {(depth, entry): xi}, final law, thresholds seen)."""
    u, depth, path, used = 0, 0, [], {}
    while True:
        r = target[u].copy()
        accepted = False
        for j, (c, x, lam) in enumerate(fixed_entries(children, law_row, tokens, laws, u, rule)):
            threshold = r[x] / lam[x] if lam[x] > 0 else (np.inf if r[x] > 0 else 0.0)
            xi = coin_policy(depth, j, threshold, r[x])
            used[(depth, j)] = xi
            if xi * lam[x] < r[x]:
                path.append(c)
                u, depth, accepted = c, depth + 1, True
                break
            r = residual(r, lam)
        if not accepted:
            return path, used, r
