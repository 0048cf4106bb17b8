"""The lookup drafter: model-free drafts copied from the request's own text (prompt lookup, on device).

Where the output repeats its input (summarise this, answer from this passage, rewrite this code) the
next tokens are often a continuation the request has already seen. Each step, for every request:

1. the *key* is its last tokens ending at the root; at every earlier position p the match length is
   the number of consecutive tokens (up to ``max_ngram``) ending at p that equal the key's;
2. candidates are positions with a match of at least ``min_ngram`` tokens, ranked longest match
   first, then by how much of their continuation is committed (up to ``depth``), then most recent;
   ``branches`` of them are taken, each with a first continuation token
   different from those already taken (a second match with the same next token would duplicate a
   branch);
3. each candidate's continuation ``history[p + 1 : p + 1 + depth]`` becomes one chain below the
   root; tokens not yet committed (past the root) are not drafted (``ok`` False).

The rule reads only committed tokens, so every entry is deterministic (law ``"onehot"``): greedy,
seeded, naive, MSS and RRS verification stay exact. Everything is [B, S] array work inside the
jitted loop: no host round trip, static shapes, any batch.

**Measured acceptance** (for the tree budget, ``specjax.speculation.budget``): after every step each
chain is compared with the tokens the LLM actually emitted, as far as they are known, whether or not
the chain was in the verified tree. Per request and per match length n the drafter keeps decayed
counts of continuation tokens that were right and of first wrong ones; their ratio (with a weak
prior) is the per-token acceptance rate alpha_n its estimate of accepted tokens uses.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax.errors import InputError
from specjax.speculation.drafters.base import MAX_DRAFTED_NODES, Accepted, Bound, DraftContext, Drafter, Proposal
from specjax.speculation.drafters.settings import parse_int_settings

MAX_NGRAM = 32  # the longest match a lookup searches for (its search unrolls once per length)

DECAY = 0.95  # per update: recent agreement counts more (text switches between copying and writing)
PRIOR = (1.0, 1.0)  # pseudo-counts (right, wrong) before a request has been observed: alpha = 0.5


def default_note(drafter, *names: str) -> str:
    """For a check between settings, name those the user left at their defaults: "min_ngram 2 exceeds
    max_ngram 1" alone blames a setting that was never given."""
    defaults = {f.name: f.default for f in dataclasses.fields(drafter)}
    unset = [f"{n} defaults to {defaults[n]}" for n in names if getattr(drafter, n) == defaults[n]]
    return f" ({'; '.join(unset)})" if 0 < len(unset) < len(names) else ""


@dataclasses.dataclass(frozen=True)
class LookupDrafter(Drafter):
    """``branches`` chains of ``depth`` tokens copied from the request's prompt and generated text."""

    depth: int = 8
    branches: int = 2
    max_ngram: int = 3
    min_ngram: int = 1
    _what = "lookup drafter"  # errors name the drafter the user asked for (the corpus drafter checks these too)

    def __post_init__(self):
        for name in ("depth", "branches", "max_ngram", "min_ngram"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise InputError(f"{self._what}: {name} must be a positive int, got {value!r}")
        if self.min_ngram > self.max_ngram:
            raise InputError(f"{self._what}: min_ngram {self.min_ngram} exceeds max_ngram {self.max_ngram}"
                             f"{default_note(self, 'min_ngram', 'max_ngram')}")
        if self.max_ngram > MAX_NGRAM:  # one block of ops per n-gram length: 300 took 27 s to compile
            raise InputError(f"{self._what}: max_ngram {self.max_ngram} exceeds {MAX_NGRAM}")
        if self.depth * self.branches > MAX_DRAFTED_NODES:
            raise InputError(f"{self._what}: {self.branches} branches x depth {self.depth} = "
                             f"{self.branches * self.depth} nodes, beyond the tree limit of 64 (the root and "
                             f"{MAX_DRAFTED_NODES} drafted nodes)")

    @property
    def law(self) -> str:
        return "onehot"

    @property
    def num_nodes(self) -> int:
        return self.depth * self.branches

    @property
    def max_depth(self) -> int:
        return self.depth

    def static_parents(self) -> tuple[int, ...]:
        """Chain-major: chain c's nodes are 1 + c * depth ... (c + 1) * depth, each under the previous."""
        parents = [-1]
        for c in range(self.branches):
            first = 1 + c * self.depth
            parents += [0] + list(range(first, first + self.depth - 1))
        return tuple(parents)

    def budget_ladder(self) -> tuple[int, ...]:
        """Node counts (below the root) worth compiling a pass for: none, the best chain's first two
        tokens, its first four, all of it, then every chain (chain-major order keeps each a prefix). Each
        level is one more compiled pass (~2-3 s of compilation each for SmolLM2 on a CPU), so the ladder
        is short. Most passes verify one to three drafted tokens, where rungs are cheapest; with the step
        programs' matmuls in Eigen (``specjax.decoding.programs``) SmolLM2's 3-node pass costs what its
        2-node one does on 2 Xeon cores (34.7 vs 34.6 ms, 1 node 27.9, 5 nodes 41.4), so the rungs are 3
        and 5 nodes rather than 2 and 3. Replayed with the budget on greedy outputs
        (``scripts/offline_acceptance.py --costs``, that cost table): grounded dev prompts 1.32-1.82x ->
        1.32-1.82x modelled speed over incremental decoding by kind (summarisation 1.55 -> 1.57x, RAG-QA
        1.62 -> 1.70x, code edits 1.75 -> 1.82x), the other task kinds -1% to +3%; with YNNPACK's costs
        (bigger batches) -4% to +3% by kind. A sixth rung (2 nodes) changed nothing in either replay."""
        ladder = [0, min(2, self.depth), min(4, self.depth), self.depth, self.num_nodes]
        return tuple(sorted(set(ladder)))

    def describe(self) -> str:
        return f"lookup(depth {self.depth}, branches {self.branches}, n-grams {self.max_ngram}..{self.min_ngram})"

    @property
    def stat_rows(self) -> int:
        """Rows of the acceptance statistics ``counts``: one per match length 0..max_ngram. The state's
        ``ngram`` is each chain's row (0 = no chain), so a subclass with more kinds of match maps them
        to more rows."""
        return self.max_ngram + 1

    def init(self, params, prompt_tokens, prompt_lens, *, cache_len: int, parallel=None, hidden=None,
             first=None) -> dict:
        batch = prompt_tokens.shape[0]
        k, d = self.branches, self.depth
        state = {"chains": jnp.zeros((batch, k, d), jnp.int32), "known": jnp.zeros((batch, k), jnp.int32),
                 "ngram": jnp.zeros((batch, k), jnp.int32),
                 "counts": jnp.zeros((batch, self.stat_rows, 2), jnp.float32)}
        return state if parallel is None else parallel.constrain_batch(state)  # per request: over dp, as steps leave it

    def propose(self, params, state: dict, ctx: DraftContext) -> tuple[Proposal, dict]:
        chains, known, ngram = find_chains(ctx.history, ctx.length, self.depth, self.branches, self.max_ngram,
                                           self.min_ngram)
        return self.chain_proposal(ctx, chains, known), dict(state, chains=chains, known=known, ngram=ngram)

    def chain_proposal(self, ctx: DraftContext, chains: jax.Array, known: jax.Array) -> Proposal:
        """The proposal of ``branches`` chains [B, K, D] below the root, chain k's first ``known[:, k]``
        tokens drafted (chain-major, ``static_parents``), every entry one-hot."""
        batch = chains.shape[0]
        root = jnp.take_along_axis(ctx.history, ctx.length[:, None], axis=1)
        tokens = jnp.concatenate([root, chains.reshape(batch, -1)], axis=1).astype(jnp.int32)
        drafted = jnp.arange(self.depth)[None, None, :] < known[:, :, None]  # [B, K, D]
        ok = jnp.concatenate([jnp.ones((batch, 1), bool), drafted.reshape(batch, -1)], axis=1)
        parents = jnp.broadcast_to(jnp.asarray(self.static_parents(), jnp.int32), tokens.shape)
        return Proposal(tokens=tokens, parent=parents, ok=ok, law_row=jnp.full(tokens.shape, -1, jnp.int32))

    def commit(self, params, state: dict, accepted: Accepted) -> dict:
        """Score this step's chains against the tokens the LLM emitted (as far as they go)."""
        emitted, n_emit = accepted.emitted, accepted.num_emitted
        width = min(self.depth, emitted.shape[1])
        chains, known = state["chains"][:, :, :width], jnp.minimum(state["known"], width)
        seen = jnp.minimum(known, n_emit[:, None])  # [B, K] chain tokens whose true value is known
        d = jnp.arange(width)[None, None, :]
        same = (chains == emitted[:, None, :width]) & (d < seen[:, :, None])
        right = jnp.sum(jnp.cumprod(same, axis=2), axis=2)  # leading agreement
        wrong = (right < seen).astype(jnp.float32)
        observed = (seen > 0) & (state["ngram"] > 0)
        rows = jnp.where(observed, state["ngram"], 0)  # row 0 collects nothing that is read
        update = jnp.stack([jnp.where(observed, right, 0).astype(jnp.float32), jnp.where(observed, wrong, 0)], -1)
        moved = (n_emit > 0)[:, None, None]
        counts = jnp.where(moved, state["counts"] * DECAY, state["counts"])
        counts = counts.at[jnp.arange(counts.shape[0])[:, None], rows].add(update)
        return dict(state, counts=counts)

    def node_acceptance(self, params, state: dict) -> jax.Array:
        """[B, K * D] (chain-major): node d of chain c (match length n_c, known_c drafted tokens,
        acceptance alpha_c) is accepted with P(no earlier chain's first token was right) * alpha_c^d,
        d <= known_c (chains start with different tokens, so at most one can be accepted)."""
        counts = state["counts"]
        right = jnp.take_along_axis(counts[..., 0], state["ngram"], axis=1) + PRIOR[0]
        wrong = jnp.take_along_axis(counts[..., 1], state["ngram"], axis=1) + PRIOR[1]
        alpha = jnp.where(state["ngram"] > 0, right / (right + wrong), 0.0)  # [B, K]
        d = jnp.arange(1, self.depth + 1, dtype=jnp.float32)
        powers = alpha[:, :, None] ** d[None, None, :]  # [B, K, D]
        drafted = d[None, None, :] <= state["known"][:, :, None]
        first_wrong = jnp.cumprod(jnp.concatenate([jnp.ones_like(alpha[:, :1]), 1 - alpha[:, :-1]], 1), axis=1)
        per_node = first_wrong[:, :, None] * jnp.where(drafted, powers, 0.0)
        return per_node.reshape(per_node.shape[0], -1)


def find_chains(history: jax.Array, length: jax.Array, depth: int, branches: int, max_ngram: int,
                min_ngram: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The lookup rule (module docstring). history [B, S] with history[b, length[b]] = the root.
    Returns (chains [B, K, D] int32, known [B, K] drafted tokens per chain (0 = no match), ngram [B, K]
    the match length of each chain (0 = none))."""
    batch, size = history.shape
    pos = jnp.arange(size)[None, :]
    run = jnp.zeros((batch, size), jnp.int32)
    alive = jnp.ones((batch, size), bool)
    for k in range(max_ngram):  # match length ending at p: consecutive equal tokens going back
        key = jnp.take_along_axis(history, jnp.maximum(length - k, 0)[:, None], axis=1)  # [B, 1]
        back = jnp.roll(history, k, axis=1)  # back[:, p] = history[:, p - k]
        alive = alive & (pos - k >= 0) & (length[:, None] - k >= 0) & (back == key)
        run = run + alive.astype(jnp.int32)
    candidate = (pos < length[:, None]) & (run >= min_ngram)
    # Longest match first, then the most committed continuation (up to ``depth`` tokens: a match just
    # behind the root has seen only a token or two of what follows it), then the most recent.
    known = jnp.clip(length[:, None] - pos, 0, depth)
    score = jnp.where(candidate, (run * (depth + 1) + known) * size + pos, -1)
    nxt = jnp.roll(history, -1, axis=1)  # nxt[:, p] = history[:, p + 1]
    rows = jnp.arange(batch)[:, None]
    chains, known, ngram = [], [], []
    for _ in range(branches):
        best = jnp.argmax(score, axis=1)
        found = jnp.max(score, axis=1) >= 0
        start = best + 1  # the continuation begins after the match
        idx = jnp.minimum(start[:, None] + jnp.arange(depth)[None, :], size - 1)
        chains.append(history[rows, idx])
        known.append(jnp.where(found, jnp.clip(length - start + 1, 0, depth), 0))
        ngram.append(jnp.where(found, run[jnp.arange(batch), best], 0))
        first = history[jnp.arange(batch), jnp.minimum(start, size - 1)]
        score = jnp.where(nxt == first[:, None], -1, score)  # the next branch starts differently
    return jnp.stack(chains, 1).astype(jnp.int32), jnp.stack(known, 1), jnp.stack(ngram, 1)


def parse_arg(arg: str) -> LookupDrafter:
    """``lookup:D`` (depth D) or ``lookup:depth=D,branches=K,ngram=N`` (ngram = the longest key);
    ``lookup:auto`` = the defaults."""
    if arg == "auto":
        return LookupDrafter()
    if arg.isascii() and arg.isdigit():
        return LookupDrafter(depth=int(arg))
    names = {"depth": "depth", "branches": "branches", "ngram": "max_ngram", "min-ngram": "min_ngram"}
    return LookupDrafter(**parse_int_settings(arg.split(","), names, f"--drafter lookup:{arg}",
                                              f"lookup:auto, lookup:D or comma-separated {'/'.join(names)}=N items"))


def from_arg(arg: str, llm, *, load: bool, expansion, draft: str) -> Bound:
    """``--drafter lookup:ARG`` (see ``parse_arg``); it has no params and ignores the SSM flags."""
    return Bound(parse_arg(arg), ())
