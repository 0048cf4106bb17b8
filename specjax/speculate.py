"""Speculators: token trees drafted by small speculative models (SSMs).

* Expansion-based: one SSM, a static expansion configuration <k1, ..., km>; at depth i every
  frontier node gets k_i children. The topology is static, so its parent/depth/ancestor arrays are
  built once on the host; the SSM scores a whole frontier per forward pass with tree attention.
  How children are drawn (``DRAFTS``), each entry recording the law it was drawn from:
  ``topk`` the SSM's top-k (deterministic: law one-hot, -1); ``iid`` k samples with replacement
  from the SSM's warped distribution q; ``wor`` k samples without replacement (Gumbel-top-k, in
  perturbed-score order = draw order); ``coupled`` the top-k of log q + G(seed, t), the same Gumbel
  noise seeded verification uses at position t. Greedy requests (temperature 0) always draft top-k.
* Sequence-based: expansion <1, ..., 1>. Incremental decoding: the empty tree (root only).
* Merge-based: several SSMs each draft their own tree; ``merge_trees`` builds the tree that holds
  every proposed token sequence exactly once as a node, while each proposal stays its own child
  entry in draw order (paper Definition 3.2).

Keeping SSM caches in step with the LLM: each step an SSM re-reads a fixed chain of the last
``m + 1`` committed tokens ending at the root (m = its tree depth). A step commits at most m + 1
tokens, so this chain always covers every token the SSM has not processed (an accepted leaf at
maximum depth, the bonus token, or a merged path another SSM proposed) with static shapes; the
chain's logits at the root give the depth-1 children.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax import _mutation
from specjax.attention import AttentionMeta, causal_meta
from specjax.cache import KVCache
from specjax.config import ModelConfig
from specjax.errors import InputError
from specjax.keys import DRAFT, purpose_key
from specjax.models import forward
from specjax.sampling import SamplingArrays, gumbel_noise, warp_logits
from specjax.tree import TokenTree, ancestor_bits, from_parents

DRAFTS = ("topk", "iid", "wor", "coupled")
SAMPLED_DRAFTS = ("iid", "wor")  # drafts whose entries declare the SSM's law q (law_row >= 0)


@dataclasses.dataclass(frozen=True)
class Expansion:
    """Static expansion configuration <k1, ..., km> and its tree topology (BFS order)."""

    widths: tuple[int, ...]

    def __post_init__(self):
        if not self.widths:
            raise InputError("expansion config is empty; use mode 'incremental' for no speculation")
        if not isinstance(self.widths, tuple):
            raise InputError(f"expansion widths must be a tuple of positive ints, got {self.widths!r}")
        bad = [k for k in self.widths if isinstance(k, (bool, np.bool_)) or not isinstance(k, (int, np.integer))
               or k < 1]
        if bad:
            raise InputError(f"expansion widths must be positive ints, got {list(self.widths)}")

    @property
    def depth(self) -> int:
        return len(self.widths)

    @property
    def frontier_sizes(self) -> list[int]:
        sizes, f = [], 1
        for k in self.widths:
            f *= k
            sizes.append(f)
        return sizes

    @property
    def num_nodes(self) -> int:
        return 1 + sum(self.frontier_sizes)

    def topology(self) -> tuple[list[int], list[list[int]]]:
        """(parent per node, node ids per depth) with node 0 the root."""
        parents, levels = [-1], [[0]]
        for k in self.widths:
            level = []
            for p in levels[-1]:
                for _ in range(k):
                    level.append(len(parents))
                    parents.append(p)
            levels.append(level)
        return parents, levels

    @classmethod
    def parse(cls, text: str) -> Expansion:
        """``"1,1,3,1"``; every item a positive int (``"1,,2"`` is an error, not (1, 2))."""
        items = [x.strip() for x in text.split(",")]
        if not all(x.isascii() and x.isdigit() for x in items):
            raise InputError(f"expansion must be comma-separated positive ints like 1,1,3,1, got {text!r}")
        return cls(tuple(int(x) for x in items))


def static_tree(expansion: Expansion, batch: int, tokens: jax.Array, entry_ok: jax.Array | None = None,
                law_rows: jax.Array | None = None) -> TokenTree:
    """The expansion's static topology as a TokenTree carrying ``tokens`` [B, N].

    entry_ok [B, N]: False drops node i as an entry of its parent (a draw that does not exist, e.g.
    without replacement from a law with fewer than k tokens). law_rows [B]: True makes every entry
    of node u declare law row u (sampled drafts); otherwise entries are one-hot (-1)."""
    t = _topology_tree(expansion)
    rep = lambda x: jnp.broadcast_to(jnp.asarray(x), (batch,) + x.shape[1:])
    children = rep(t.children)
    if entry_ok is not None:
        ok = jnp.take_along_axis(entry_ok, jnp.maximum(children, 0).reshape(batch, -1), axis=1)
        children = jnp.where(ok.reshape(children.shape), children, -1)
    node = jnp.arange(children.shape[1], dtype=jnp.int32)[None, :, None]
    law_row = jnp.full(children.shape, -1, jnp.int32)
    if law_rows is not None:
        law_row = jnp.where(law_rows[:, None, None] & (children >= 0), node, -1)
    return TokenTree(tokens=tokens, parent=rep(t.parent), depth=rep(t.depth), valid=rep(t.valid),
                     ancestor=rep(t.ancestor), children=children, law_row=law_row)


@functools.lru_cache(maxsize=64)
def _topology_tree(expansion: Expansion) -> TokenTree:
    """The static topology as host (numpy) arrays, built and validated once per expansion."""
    parents, _ = expansion.topology()
    with jax.ensure_compile_time_eval():  # may first be called while tracing a jitted step
        t = from_parents([[0] * len(parents)], [parents], n_max=len(parents))
        return jax.tree.map(np.asarray, t)


def draft_slot(ssm_index: int, node, draw) -> jax.Array:
    """Slot of a drafting key: unique per (SSM, node, draw) within one step (node, draw < 2**10)."""
    return (ssm_index << 20) + (jnp.asarray(node, jnp.int32) << 10) + jnp.asarray(draw, jnp.int32)


def draw_children(logits: jax.Array, k: int, draft: str, sampling: SamplingArrays | None, length: jax.Array,
                  depth: int, nodes: np.ndarray, ssm_index: int):
    """Children of the frontier ``nodes`` (static ids) from SSM logits [B, F, V]; the children sit
    at position ``length + depth + 1``. Returns (tokens [B, F, k] in draw order, ok [B, F, k],
    declared law as warped log-probabilities [B, F, V] or None for one-hot entries)."""
    top = jax.lax.top_k(logits, k)[1].astype(jnp.int32)
    always = jnp.ones(top.shape, bool)
    if draft == "topk":
        if _mutation.active() == "allow_mss_on_topk":  # the paper's rule: entries declare softmax q
            return top, always, warp_logits(logits, sampling)
        return top, always, None
    batch, frontier, vocab = logits.shape
    logq = warp_logits(logits, sampling)
    seed = sampling.seed[:, None]
    node_ids = jnp.asarray(nodes, jnp.int32)[None, :]
    if draft == "iid":
        draws = jnp.arange(k, dtype=jnp.int32)
        slots = draft_slot(ssm_index, node_ids[:, :, None], draws[None, None, :])  # [1, F, k]

        def one(s, t, slot, lq):
            return jax.random.categorical(purpose_key(s, DRAFT, t, slot), lq).astype(jnp.int32)

        per_draw = jax.vmap(jax.vmap(jax.vmap(one, (None, None, 0, None)), (None, None, 0, 0)), (0, 0, None, 0))
        tokens = per_draw(seed[:, 0], length, slots[0], logq)
        ok = jnp.take_along_axis(logq, tokens, axis=-1) > -jnp.inf
    else:
        if draft == "wor":
            def one(s, t, node):
                return jax.random.gumbel(purpose_key(s, DRAFT, t, draft_slot(ssm_index, node, 0)), (vocab,))

            noise = jax.vmap(jax.vmap(one, (None, None, 0)), (0, 0, None))(seed[:, 0], length, node_ids[0])
        elif draft == "coupled":
            noise = gumbel_noise(sampling.seed, length + depth + 1, vocab)[:, None, :]
        else:
            raise InputError(f"unknown drafting mode {draft!r}; choose from {DRAFTS}")
        scores, tokens = jax.lax.top_k(logq + noise, k)  # perturbed-score order = sequential draw order
        tokens = tokens.astype(jnp.int32)
        ok = scores > -jnp.inf  # fewer than k tokens in q's support: the missing draws do not exist
    sampled = sampling.sampled[:, None, None]
    tokens = jnp.where(sampled, tokens, top)
    ok = jnp.where(sampled, ok, always)
    if _mutation.active() == "law_wrong_temperature":
        logq = warp_logits(logits, sampling.replace(temperature=jnp.ones_like(sampling.temperature)))
    return tokens, ok, logq


def chain_logits(params, cfg: ModelConfig, cache: KVCache, history: jax.Array, length: jax.Array,
                 chain: int) -> tuple[jax.Array, KVCache]:
    """Re-read the ``chain`` tokens ending at the root (position ``length``) and return the root's
    logits [B, V]. Writes their K/V at their positions; slots past the root get scratch values that
    the frontier passes overwrite before anything reads them."""
    start = jnp.maximum(length - chain + 1, 0)
    idx = start[:, None] + jnp.arange(chain)[None, :]
    tokens = jnp.take_along_axis(history, jnp.minimum(idx, history.shape[1] - 1), axis=1)
    logits, cache = forward(params, tokens, idx, cache, causal_meta(start), cfg,
                            logits_indices=(length - start)[:, None])
    return logits[:, 0], cache


def draft_expansion(params, cfg: ModelConfig, cache: KVCache, history: jax.Array, length: jax.Array,
                    expansion: Expansion, impl: str = "auto", draft: str = "topk",
                    sampling: SamplingArrays | None = None, ssm_index: int = 0):
    """Expansion drafting. Returns (tokens [B, N] (root = history[length]), entry_ok [B, N],
    laws [B, N, V] warped log q at each drafted-from node (None for top-k drafts), cache)."""
    batch = history.shape[0]
    parents, levels = expansion.topology()
    n = len(parents)
    tree = static_tree(expansion, batch, jnp.zeros((batch, n), jnp.int32))
    root = jnp.take_along_axis(history, length[:, None], axis=1)[:, 0]
    tokens = jnp.zeros((batch, n), jnp.int32).at[:, 0].set(root)
    entry_ok = jnp.ones((batch, n), bool)
    laws = None
    logits, cache = chain_logits(params, cfg, cache, history, length, expansion.depth + 1)
    frontier_logits = logits[:, None, :]  # [B, |frontier|, V]
    for depth, k in enumerate(expansion.widths):
        frontier = np.asarray(levels[depth])
        children = np.asarray(levels[depth + 1])  # static ids, grouped by parent in frontier order
        drawn, ok, logq = draw_children(frontier_logits, k, draft, sampling, length, depth, frontier, ssm_index)
        tokens = tokens.at[:, children].set(drawn.reshape(batch, -1))
        entry_ok = entry_ok.at[:, children].set(ok.reshape(batch, -1))
        if logq is not None:
            if laws is None:
                laws = jnp.full((batch, n, logq.shape[-1]), -jnp.inf, jnp.float32)
            laws = laws.at[:, frontier].set(logq)
        if depth + 1 == expansion.depth:
            break  # the deepest frontier needs no SSM pass: nothing is drafted below it
        meta = AttentionMeta(lengths=length, ancestor=tree.ancestor[:, children],
                             slots=jnp.broadcast_to(jnp.asarray(children, jnp.int32), (batch, len(children))),
                             region=n, impl=impl)
        positions = length[:, None] + depth + 1
        positions = jnp.broadcast_to(positions, (batch, len(children)))
        frontier_logits, cache = forward(params, tokens[:, children], positions, cache, meta, cfg)
    return tokens, entry_ok, laws, cache


def merge_trees(token_sets: list[jax.Array], expansions: list[Expansion], entry_oks: list | None = None,
                law_rows: list | None = None) -> TokenTree:
    """Merge several drafted trees (same root) into one: each distinct token sequence becomes exactly
    one node; every proposal remains a child entry (duplicates allowed) in draw order (SSM order,
    then node order). Jittable; node count padded to 1 + sum(N_s - 1).

    entry_oks[s] [B, N_s]: False = that draw does not exist (skipped). law_rows[s]: None (one-hot
    entries) or [B] bool; where True, an entry proposed by node i of set s under its parent p
    declares law row ``offset_s + p`` of the concatenated per-set law arrays (offset_s = sum of the
    earlier sets' N)."""
    max_nodes = 1 + sum(e.num_nodes - 1 for e in expansions)
    entry_oks = entry_oks or [None] * len(expansions)
    law_rows = law_rows or [None] * len(expansions)
    offsets = np.cumsum([0] + [e.num_nodes for e in expansions])[:-1]
    # Entry slots per node: all candidates in the worst case (sampled drafts may repeat a token among
    # one SSM's siblings, so several drafted nodes can merge and pool their children's entries).
    max_entries = max_nodes - 1
    # Candidates in depth-major order so every parent is merged before its children.
    cands = []  # (set index, node id, parent id, depth)
    for s, e in enumerate(expansions):
        parents, levels = e.topology()
        for d, level in enumerate(levels[1:], start=1):
            for node in level:
                cands.append((d, s, node, parents[node]))
    cands.sort()
    batch = token_sets[0].shape[0]
    root = token_sets[0][:, 0]
    oks = [jnp.ones(t.shape, bool) if o is None else o for t, o in zip(token_sets, entry_oks)]
    sampled = [jnp.zeros((batch,), bool) if r is None else r for r in law_rows]
    dedupe = _mutation.active() == "dedupe_merged"

    def merge_one(toks_per_set, ok_per_set, sampled_per_set, root_tok):
        tokens = jnp.zeros((max_nodes,), jnp.int32).at[0].set(root_tok)
        parent = jnp.full((max_nodes,), -1, jnp.int32)
        valid = jnp.zeros((max_nodes,), bool).at[0].set(True)
        children = jnp.full((max_nodes, max_entries), -1, jnp.int32)
        law_row = jnp.full((max_nodes, max_entries), -1, jnp.int32)
        num_entries = jnp.zeros((max_nodes,), jnp.int32)
        count = jnp.int32(1)
        own_to_merged = [jnp.zeros((e.num_nodes,), jnp.int32) for e in expansions]  # node 0 -> 0
        own_ok = [jnp.ones((e.num_nodes,), bool) for e in expansions]  # drafted node exists (and its parent)
        for _, s, node, par in cands:
            tok = toks_per_set[s][node]
            mp = own_to_merged[s][par]
            here = own_ok[s][par] & ok_per_set[s][node]
            same = valid & (parent == mp) & (tokens == tok)
            exists = jnp.any(same)
            new = here & ~exists
            m = jnp.where(exists, jnp.argmax(same), count)
            tokens = jnp.where(new, tokens.at[count].set(tok), tokens)
            parent = jnp.where(new, parent.at[count].set(mp), parent)
            valid = jnp.where(new, valid.at[count].set(True), valid)
            count = count + new.astype(jnp.int32)
            add = here & ~exists if dedupe else here  # one entry per proposal (the mutant: per distinct token)
            slot = jnp.where(add, num_entries[mp], max_entries)  # out of range -> dropped
            children = children.at[mp, slot].set(m, mode="drop")
            row = jnp.where(sampled_per_set[s], offsets[s] + par, -1)
            law_row = law_row.at[mp, slot].set(row, mode="drop")
            num_entries = num_entries.at[mp].add(add.astype(jnp.int32))
            own_to_merged[s] = own_to_merged[s].at[node].set(m)
            own_ok[s] = own_ok[s].at[node].set(here)
        return tokens, parent, valid, children, law_row

    tokens, parent, valid, children, law_row = jax.vmap(merge_one)(list(token_sets), oks, sampled, root)
    depth = _depths(parent)
    return TokenTree(tokens=tokens, parent=parent, depth=depth, valid=valid, ancestor=ancestor_bits(parent, valid),
                     children=children, law_row=law_row)


def _depths(parent: jax.Array) -> jax.Array:
    def one(par):
        def body(i, d):
            return d.at[i].set(jnp.where(par[i] >= 0, d[jnp.maximum(par[i], 0)] + 1, 0))

        return jax.lax.fori_loop(0, par.shape[0], body, jnp.zeros_like(par))

    return jax.vmap(one)(parent)
