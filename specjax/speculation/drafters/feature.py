"""The feature drafter: an EAGLE-style head that reads the LLM's own hidden states and drafts a
dynamic token tree (``specjax.models.feature`` holds the network).

**Keeping up with the LLM.** The drafter's cache holds one *pair* per committed position p,
(token_p, g_{p-1}) with g the LLM's post-norm final feature, so its length is the LLM's + 1 (the
root's pair included). ``init`` reads the prompt's features from the LLM's prefill; ``commit`` reads
the features of the root and the accepted nodes from the LLM's tree pass and feeds the new pairs
(node j's feature, the next emitted token), ending with the pair of the new root (the bonus token).
Its output there predicts the root's children.

**Dynamic tree (EAGLE-2).** Every step grows candidates by cumulative draft confidence under static
shapes: depth 1 takes the root's ``beam`` best children; at each further depth the ``beam`` best
candidates of the previous depth (by the product of draft probabilities along their path) are run
through the drafter (feeding its own features; tree attention over its cache and their ancestors)
and each proposes ``beam`` children. Of all ``beam + (depth - 1) * beam**2`` candidates the ``nodes``
best are kept, best first: a child never outranks its parent (probabilities are <= 1, ties broken
by depth), so every prefix of that order is a tree and the tree budget can cut it anywhere.

**Laws.** Children are deterministic functions of committed text and the request's seed: top-k of
the drafter's warped log-probabilities, or for sampled requests top-k of log q + G(seed, t), the
Gumbel noise seeded verification uses at the child's position t ("coupled"). Every entry is one-hot,
so greedy, seeded, naive, MSS and RRS verification stay exact (MSS/RRS treat the entries as delta).
Ranking reorders candidates by confidence, which is allowed for deterministic drafts only.

**Acceptance estimate** (tree budget): the expected accepted tokens of the best m nodes is the sum of
their path probabilities, scaled per request by a decayed ratio of tokens that matched to tokens the
estimate predicted, measured every step against what the LLM emitted.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax.attention.meta import AttentionMeta, causal_meta
from specjax.decoding import programs
from specjax.decoding.incremental import pad_for_chunks, run_chunks
from specjax.decoding.sampling import gumbel_noise, warp_logits
from specjax.errors import InputError
from specjax.models.cache import KVCache
from specjax.models.feature import FeatureConfig, feature_forward, init_feature_cache, llm_features, logits_of
from specjax.models.params import fuse_layer
from specjax.speculation.drafters.base import MAX_DRAFTED_NODES, Accepted, Bound, DraftContext, Drafter, Proposal
from specjax.speculation.drafters.merge import depths
from specjax.speculation.drafters.settings import parse_int_settings
from specjax.types import Model

DECAY = 0.9  # per step: the calibration follows the request's recent agreement
PRIOR = 2.0  # pseudo-tokens of (matched, predicted) before a request is observed: ratio 1
DEPTH_TIE = 1e-4  # a child ranks strictly below its parent even where its probability rounds to 1


@dataclasses.dataclass(frozen=True)
class FeatureDrafter(Drafter):
    """``nodes`` best of a ``beam``-wide, ``depth``-deep dynamic tree (module docstring)."""

    config: FeatureConfig
    depth: int = 6
    beam: int = 4
    nodes: int = 16
    ladder: tuple[int, ...] = (0, 1, 3, 6, 10, 16)

    def __post_init__(self):
        for name in ("depth", "beam", "nodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise InputError(f"feature drafter: {name} must be a positive int, got {value!r}")
        if self.beam > len(self.config.draft_vocab):
            raise InputError(f"feature drafter: beam {self.beam} exceeds the draft vocabulary "
                             f"({len(self.config.draft_vocab)} tokens)")
        if self.nodes > self.candidates:
            raise InputError(f"feature drafter: {self.nodes} nodes but beam {self.beam} x depth {self.depth} grows "
                             f"only {self.candidates} candidates")
        if self.nodes > MAX_DRAFTED_NODES:
            raise InputError(f"feature drafter: {self.nodes} nodes, beyond the tree limit of 64 (the root and "
                             f"{MAX_DRAFTED_NODES} drafted nodes)")
        if self.depth > self.nodes:  # a kept node's ancestors are kept: N nodes reach depth N at most
            raise InputError(f"feature drafter: depth {self.depth} exceeds nodes {self.nodes}; a tree of "
                             f"{self.nodes} nodes is at most {self.nodes} deep (each level more is one more drafter "
                             f"pass compiled and run for nothing)")
        rungs = tuple(self.ladder) if isinstance(self.ladder, (tuple, list)) else ()
        if not rungs or not all(isinstance(m, (int, np.integer)) and not isinstance(m, bool) for m in rungs) \
                or list(rungs) != sorted(set(rungs)) or rungs[0] < 0 or rungs[-1] > self.nodes:
            raise InputError(f"feature drafter: ladder must be increasing int node counts in [0, {self.nodes}], "
                             f"got {self.ladder!r}")
        object.__setattr__(self, "ladder", tuple(int(m) for m in rungs))  # hashable: part of the static spec

    @property
    def candidates(self) -> int:
        return self.beam + (self.depth - 1) * self.beam * self.beam

    @property
    def law(self) -> str:
        return "onehot"

    @property
    def num_nodes(self) -> int:
        return self.nodes

    @property
    def max_depth(self) -> int:
        return self.depth

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return self.config.hidden_layers

    def describe(self) -> str:
        layers = f"{self.config.layers} layers, " if self.config.layers > 1 else ""
        return f"feature({layers}depth {self.depth}, beam {self.beam}, nodes {self.nodes})"

    def budget_ladder(self) -> tuple[int, ...]:
        return tuple(self.ladder)

    def check_llm(self, config) -> None:
        _check_trained_for(self.config.llm, config, self.describe())

    def scratch(self) -> int:
        """Drafter cache slots past the committed pairs: the drafted frontiers, or a commit's pairs."""
        return max((self.depth - 1) * self.beam, 1)

    def step_params(self, params):
        """``fc``, the layer's matmul weights (fused and split as the LLM's are) and the [D, Vd] head,
        packed for the CPU matmul kernel as float16 panels (float32 products and sums). Under
        XLA:CPU's Eigen, which the step programs of small batches use, the drafter's 4-row matmuls cost
        49 ms of a 100 ms step (Xeon, 2 cores); with float32 panels its drafting still cost 5.8 ms a step
        at depth 6, mostly streaming the 8192-row head: float16 halves the bytes. Rounding the weights
        changes drafts only, which the LLM verifies: the output stays exact."""
        if params is None or params["fc"].dtype != jnp.float32 or isinstance(params["layers"], tuple):
            return params
        half = jnp.float16
        return {**params, "fc": programs.packed(params["fc"], half), "head": programs.packed(params["head"], half),
                "layers": programs.packed_layers(_step_layers(params), half)}

    # -- state ----------------------------------------------------------------------------------

    def init(self, params, prompt_tokens, prompt_lens, *, cache_len: int, parallel=None, hidden=None, first=None):
        """The pairs of the prompt and of its first generated token (the first root), from the LLM's
        prefill hidden states ``hidden`` [B, T, n, D] at ``config.hidden_layers`` (every prompt position)."""
        if hidden is None or first is None:
            raise InputError("the feature drafter needs the LLM's prefill hidden states and first token")
        batch, width = prompt_tokens.shape
        lens = prompt_lens.astype(jnp.int32)
        g = llm_features(params, hidden, self.config)
        prev = jnp.pad(g, ((0, 0), (1, 0), (0, 0)))  # [B, T + 1, D]: g_{p-1}, zero before position 0
        tokens = jnp.pad(prompt_tokens, ((0, 0), (0, 1))).at[jnp.arange(batch), lens].set(first)
        tokens, prev = pad_for_chunks(tokens), pad_for_chunks(prev)
        cache = init_feature_cache(self.config, batch, self._cache_len(cache_len), g.dtype)

        # In the LLM prefill's chunks: only the pairs the longest prompt has are computed, not the
        # padded width of the cache bucket (at 1k slots that cost 0.1 s a prompt, Xeon, 2 cores).
        def run_chunk(start, size, carry):
            cache, last = carry
            positions = jnp.broadcast_to(start + jnp.arange(size, dtype=jnp.int32), (batch, size))
            f, cache = feature_forward(params, jax.lax.dynamic_slice_in_dim(tokens, start, size, axis=1),
                                       jax.lax.dynamic_slice_in_dim(prev, start, size, axis=1), positions, cache,
                                       causal_meta(jnp.full((batch,), start, jnp.int32)), self.config)
            at = jnp.take_along_axis(f, jnp.clip(lens - start, 0, size - 1)[:, None, None], axis=1)[:, 0]
            here = (lens >= start) & (lens < start + size)  # this chunk holds the first root's pair
            return cache, jnp.where(here[:, None], at, last)

        cache, last = run_chunks(run_chunk, jnp.max(lens) + 1, width + 1,
                                 (cache, jnp.zeros((batch, g.shape[-1]), g.dtype)))
        state = self._state(cache.replace(length=lens + 1), last, params, batch)
        if parallel is not None:  # requests over dp, as every step leaves them, whatever the prompts' placement
            # (replicated prompts gave a replicated cache); the cache under the SSMs' rules (replicated weights)
            state = dict(parallel.constrain_batch({k: v for k, v in state.items() if k != "cache"}),
                         cache=parallel.constrain_cache(state["cache"], self.config.layer_config, parallel.ssm_rules))
        return state

    def _cache_len(self, cache_len: int) -> int:
        # the LLM's cache_len (its scratch included) + the root's pair + drafted frontiers, or the pairs of
        # one commit (at most the merged tree's depth + 1 <= 65: tree nodes are capped at 64)
        return cache_len + 1 + max(self.scratch(), 65)

    def _state(self, cache: KVCache, feat, params, batch: int) -> dict:
        n = self.nodes
        return {"cache": cache, "feat": feat, "logits": logits_of(params, feat),
                "tokens": jnp.zeros((batch, n + 1), jnp.int32), "parent": jnp.full((batch, n + 1), -1, jnp.int32),
                "score": jnp.full((batch, n), -jnp.inf, jnp.float32),
                "calib": jnp.zeros((batch, 2), jnp.float32)}

    # -- drafting -------------------------------------------------------------------------------

    def propose(self, params, state: dict, ctx: DraftContext) -> tuple[Proposal, dict]:
        tokens, parent, score, ok, cache, parent_laws = grow_tree(params, self.config, state, ctx, self.depth,
                                                                  self.beam, self.nodes, self.scratch())
        law_row, laws = jnp.full(tokens.shape, -1, jnp.int32), None
        if ctx.fault == "allow_mss_on_topk":  # the paper's rule: ranked entries declaring the drafter's q
            law_row, laws = laws_rows_of(parent_laws, self.config)
        proposal = Proposal(tokens=tokens, parent=parent, ok=ok, law_row=law_row, laws=laws)
        return proposal, dict(state, cache=cache, tokens=tokens, parent=parent, score=score)

    def commit(self, params, state: dict, accepted: Accepted) -> dict:
        """Feed the pairs (feature of path node j, emitted token j) for the root and every accepted node,
        update the calibration from this step's draft against the emitted tokens."""
        cache = state["cache"]
        batch, width = accepted.emitted.shape
        moved = accepted.num_emitted > 0
        g = llm_features(params, accepted.hidden, self.config)  # [B, D + 1, D]
        old = cache.length  # the old root's pair is committed: old = old root position + 1
        positions = old[:, None] + jnp.arange(width)[None, :]
        f, cache = feature_forward(params, accepted.emitted, g, positions, cache, causal_meta(old), self.config)
        last = jnp.take_along_axis(f, accepted.num_accepted[:, None, None], axis=1)[:, 0]
        new_length = jnp.where(moved, old + accepted.num_accepted + 1, old)
        feat = jnp.where(moved[:, None], last, state["feat"])
        matched, predicted = self._observe(state, accepted)
        calib = jnp.where(moved[:, None], state["calib"] * DECAY + jnp.stack([matched, predicted], -1), state["calib"])
        return dict(state, cache=cache.replace(length=new_length), feat=feat,
                    logits=jnp.where(moved[:, None], logits_of(params, feat), state["logits"]), calib=calib)

    def _observe(self, state: dict, accepted: Accepted):
        """(tokens of this step's draft that matched the emitted ones, tokens the estimate predicted within
        what was emitted). A node is observed when its depth <= tokens emitted (its path's truth is known)."""
        tokens, parent = state["tokens"], state["parent"]
        depth = node_depths(parent)
        seen = accepted.num_emitted[:, None]
        on = jnp.ones(tokens.shape, bool)  # node matches the emitted prefix down to it (root: yes)
        truth = jnp.take_along_axis(accepted.emitted, jnp.clip(depth - 1, 0, accepted.emitted.shape[1] - 1), axis=1)

        def node(i, on):  # parents come first: one pass settles every node (a loop: compiled once)
            up = jnp.take_along_axis(on, jnp.maximum(parent[:, i], 0)[:, None], axis=1)[:, 0]
            return on.at[:, i].set(up & (tokens[:, i] == truth[:, i]) & (depth[:, i] <= seen[:, 0]))

        on = jax.lax.fori_loop(1, tokens.shape[1], node, on)
        matched = jnp.max(jnp.where(on, depth, 0), axis=1).astype(jnp.float32)
        visible = (depth[:, 1:] <= seen) & jnp.isfinite(state["score"])
        predicted = jnp.sum(jnp.where(visible, jnp.exp(state["score"]), 0.0), axis=1)
        return matched, predicted

    def node_acceptance(self, params, state: dict) -> jax.Array:
        """Each node's path probability (best first), scaled by the request's calibration ratio."""
        ratio = (state["calib"][:, 0] + PRIOR) / (state["calib"][:, 1] + PRIOR)
        return ratio[:, None] * jnp.where(jnp.isfinite(state["score"]), jnp.exp(state["score"]), 0.0)


_PLAIN: dict[tuple, tuple] = {}  # ids of the source arrays -> (weakrefs to them, the derived arrays)


def _step_layers(params: dict) -> tuple:
    """The drafter's layers as split layers with fused weights, derived once while the arrays they come
    from live, so their packed copies (keyed by array) are made once too."""

    def make():
        count = {w.shape[0] for w in params["layers"].values()}.pop()
        return tuple(fuse_layer({n: w[i] for n, w in params["layers"].items()}) for i in range(count))

    return programs.while_alive(_PLAIN, tuple(jax.tree.leaves(params["layers"])), make)


node_depths = depths  # [B, N] depth of every node from parents stored before children (root 0)


def _draft_noise(cfg: FeatureConfig, sampling, root_pos, depth: int, shared=None):
    """G(seed, t) on the draft vocabulary [B, depth, Vd] at the children's positions t = root + 1 .. root +
    depth (the noise seeded verification uses there), zeros where no request samples: the seeded
    verifier's own rows where it shares them (``shared``, ``DraftContext.noise``), else drawn here in one
    call for every depth (on 2 AMD EPYC cores a [1, 49152] row costs 0.36 ms alone and 0.15 ms among 9)."""
    vocab = np.asarray(cfg.draft_vocab)
    if shared is not None:
        return shared[:, :depth][..., vocab]

    def noisy(_):
        positions = root_pos[:, None] + 1 + jnp.arange(depth, dtype=root_pos.dtype)[None, :]
        g = jax.vmap(lambda t: gumbel_noise(sampling.seed, t, cfg.llm.vocab_size), in_axes=1, out_axes=1)(positions)
        return g[..., vocab]

    zeros = jnp.zeros((root_pos.shape[0], depth, len(vocab)), jnp.float32)
    return jax.lax.cond(jnp.any(sampling.sampled), noisy, lambda _: zeros, None)


def _child_scores(logits, sampling, noise):
    """(ranking log-probabilities, selection scores) [B, F, Vd] of children whose position's draft-vocabulary
    noise is ``noise`` [B, Vd] (greedy requests: both the warped log-probabilities)."""
    logq = warp_logits(logits, sampling)
    select = jnp.where(sampling.sampled[:, None, None], logq + noise[:, None, :], logq)
    # confidence that a child is the coupled argmax: the softmax of the perturbed scores
    rank = jnp.where(sampling.sampled[:, None, None], jax.nn.log_softmax(select, axis=-1), logq)
    return rank, select


def grow_tree(params, cfg: FeatureConfig, state: dict, ctx: DraftContext, depth: int, beam: int, nodes: int,
              scratch: int):
    """The dynamic tree (module docstring). Returns (tokens [B, nodes + 1] with the root first, parents,
    cumulative log-confidence [B, nodes] best first, ok [B, nodes + 1], the drafter cache, and (each
    node's parent row, the drafter's warped q at the root and every expanded node [B, R, Vd]) for the
    mutation tests (unused otherwise, so compiled away))."""
    batch = ctx.length.shape[0]
    vocab = jnp.asarray(cfg.draft_vocab, jnp.int32)
    cache = state["cache"]
    root_pos = ctx.length
    cand_tok, cand_score, cand_parent, cand_law = [], [], [], []  # per depth: [B, n_d]
    # depth 1: children of the root
    noise = _draft_noise(cfg, ctx.sampling, root_pos, depth, ctx.noise)  # [B, depth, Vd]: depth d + 1's children read d
    rank, select = _child_scores(state["logits"][:, None, :], ctx.sampling, noise[:, 0])
    law_rows = [warp_logits(state["logits"][:, None, :], ctx.sampling)]  # the drafter's q at each parent
    sel_val, sel_idx = jax.lax.top_k(select[:, 0], beam)
    score = jnp.take_along_axis(rank[:, 0], sel_idx, axis=1) - DEPTH_TIE
    score = jnp.where(sel_val > -jnp.inf, score, -jnp.inf)
    cand_tok.append(vocab[sel_idx])
    cand_score.append(score)
    cand_parent.append(jnp.full((batch, beam), -1, jnp.int32))  # -1: the root
    cand_law.append(jnp.zeros((batch, beam), jnp.int32))
    frontier_ids = jnp.broadcast_to(jnp.arange(beam, dtype=jnp.int32), (batch, beam))  # candidate ids
    frontier_feat = jnp.broadcast_to(state["feat"][:, None, :], (batch, beam, state["feat"].shape[-1]))
    frontier_slot_parent = jnp.full((batch, beam), -1, jnp.int32)  # scratch slot of each frontier node's parent
    offset = beam
    words = -(-scratch // 32)
    bits_rows = jnp.zeros((batch, 0, scratch), bool)
    for d in range(1, depth):
        tok = jnp.take_along_axis(jnp.concatenate(cand_tok, 1), frontier_ids, axis=1)
        parent_score = jnp.take_along_axis(jnp.concatenate(cand_score, 1), frontier_ids, axis=1)
        # frontier nodes get scratch slots (d - 1) * beam + j; each sees its parent's ancestors and itself
        slots = (d - 1) * beam + jnp.arange(beam, dtype=jnp.int32)
        parent_bits = jnp.where(frontier_slot_parent[:, :, None] >= 0,
                                jnp.take_along_axis(bits_rows, jnp.maximum(frontier_slot_parent, 0)[:, :, None],
                                                    axis=1) if bits_rows.shape[1] else False, False)
        own = jnp.arange(scratch)[None, None, :] == slots[None, :, None]
        bits = parent_bits | own  # [B, beam, scratch]
        bits_rows = jnp.concatenate([bits_rows, bits], axis=1)
        meta = AttentionMeta(lengths=cache.length, ancestor=_pack(bits, words),
                             slots=jnp.broadcast_to(slots, (batch, beam)), region=scratch, impl=ctx.impl)
        positions = jnp.broadcast_to((root_pos + d)[:, None], (batch, beam))
        feat, cache = feature_forward(params, tok, frontier_feat, positions, cache, meta, cfg)
        logits = logits_of(params, feat)
        rank, select = _child_scores(logits, ctx.sampling, noise[:, d])
        law_rows.append(warp_logits(logits, ctx.sampling))
        sel_val, sel_idx = jax.lax.top_k(select, beam)  # [B, beam (frontier), beam (children)]
        child_score = parent_score[:, :, None] + jnp.take_along_axis(rank, sel_idx, axis=2) - DEPTH_TIE
        child_score = jnp.where((sel_val > -jnp.inf) & (parent_score[:, :, None] > -jnp.inf), child_score, -jnp.inf)
        n = beam * beam
        cand_tok.append(vocab[sel_idx].reshape(batch, n))
        cand_score.append(child_score.reshape(batch, n))
        cand_parent.append(jnp.broadcast_to(frontier_ids[:, :, None], (batch, beam, beam)).reshape(batch, n))
        cand_law.append(jnp.broadcast_to((1 + (d - 1) * beam + jnp.arange(beam, dtype=jnp.int32))[None, :, None],
                                         (batch, beam, beam)).reshape(batch, n))
        if d + 1 < depth:  # the next frontier: the best candidates of this depth
            _, best = jax.lax.top_k(child_score.reshape(batch, n), beam)
            frontier_feat = jnp.take_along_axis(feat, (best // beam)[:, :, None], axis=1)
            frontier_slot_parent = jnp.take_along_axis(jnp.broadcast_to(slots, (batch, beam)), best // beam, axis=1)
            frontier_ids = offset + best
        offset += n
    tok_all = jnp.concatenate(cand_tok, 1)
    score_all = jnp.concatenate(cand_score, 1)
    parent_all = jnp.concatenate(cand_parent, 1)
    keep_score, keep = jax.lax.top_k(score_all, nodes)  # best first; parents before children
    # position of each candidate in the kept order (0 = not kept), then parents as node indices
    where = jnp.zeros(score_all.shape, jnp.int32).at[jnp.arange(batch)[:, None], keep].set(
        jnp.arange(1, nodes + 1, dtype=jnp.int32)[None, :])
    kept_parent = jnp.take_along_axis(parent_all, keep, axis=1)
    parent_node = jnp.where(kept_parent < 0, 0,
                            jnp.take_along_axis(where, jnp.maximum(kept_parent, 0), axis=1))
    ok = (keep_score > -jnp.inf) & ((kept_parent < 0) | (parent_node > 0))
    parent_node = jnp.where(ok, parent_node, 0)
    root = jnp.take_along_axis(ctx.history, ctx.length[:, None], axis=1).astype(jnp.int32)
    tokens = jnp.concatenate([root, jnp.take_along_axis(tok_all, keep, axis=1)], axis=1)
    parent = jnp.concatenate([jnp.full((batch, 1), -1, jnp.int32), parent_node], axis=1)
    ok = jnp.concatenate([jnp.ones((batch, 1), bool), ok], axis=1)
    law_of = jnp.concatenate([jnp.full((batch, 1), -1, jnp.int32),
                              jnp.take_along_axis(jnp.concatenate(cand_law, 1), keep, axis=1)], axis=1)
    laws = (law_of, jnp.concatenate(law_rows, axis=1))
    return tokens, parent, jnp.where(ok[:, 1:], keep_score, -jnp.inf), ok, cache, laws


def laws_rows_of(laws, cfg: FeatureConfig):
    """(law_row [B, N + 1], laws [B, R, V]) declaring each node's parent distribution q over the full
    vocabulary (-inf outside the draft vocabulary): the fault "allow_mss_on_topk" only."""
    law_row, rows = laws
    full = jnp.full(rows.shape[:2] + (cfg.llm.vocab_size,), -jnp.inf, jnp.float32)
    return law_row, full.at[..., np.asarray(cfg.draft_vocab)].set(rows)


def _pack(bits: jax.Array, words: int) -> jax.Array:
    """[B, T, S] bool -> [B, T, words] uint32 ancestor words (bit j of word j // 32)."""
    pad = words * 32 - bits.shape[-1]
    b = jnp.pad(bits, ((0, 0), (0, 0), (0, pad))).reshape(bits.shape[:2] + (words, 32)).astype(jnp.uint32)
    return jnp.sum(b << jnp.arange(32, dtype=jnp.uint32), axis=-1).astype(jnp.uint32)


def feature_drafter_path(name_or_path: str) -> str:
    """The checkpoint directory of a registered feature drafter's name, or of a directory holding one."""
    from specjax.io import registry
    from specjax.io.feature_checkpoint import is_feature_checkpoint

    path = registry.resolve(name_or_path) if registry.is_feature_drafter(name_or_path) else name_or_path
    if not is_feature_checkpoint(path):
        raise InputError(f"feature drafter {name_or_path!r}: not a registered name "
                         f"({registry.feature_drafter_names()}) nor a directory with a feature_drafter.json")
    return path


# Token ids name which tokens end or pad a request; they change no hidden state, so the same weights
# loaded with another tokenizer config (a generation_config.json's extra eos ids) keep their drafter.
_NOT_ARCHITECTURE = ("bos_token_id", "eos_token_ids", "pad_token_id")


def _check_trained_for(trained, config, name: str) -> None:
    ours, theirs = config.to_dict(), trained.to_dict()
    diff = sorted(k for k in ours.keys() | theirs.keys()
                  if k not in _NOT_ARCHITECTURE and ours.get(k) != theirs.get(k))
    if diff:
        raise InputError(f"{name} was trained for another LLM (config differs in {diff})")


def load_feature_drafter(name_or_path: str, llm: Model, load: bool = True, **drafting) -> Bound:
    """A trained feature drafter (registered name or checkpoint directory) bound to ``llm``'s params.
    ``drafting`` overrides the shipped depth / beam / nodes / ladder. ``load=False``: the drafter only
    (params None), for checks before any weights load."""
    from specjax.io.feature_checkpoint import read_feature_meta, restore_feature_drafter
    from specjax.models.feature import bind

    path = feature_drafter_path(name_or_path)
    cfg, shipped, _ = read_feature_meta(path)
    _check_trained_for(cfg.llm, llm.config, f"feature drafter {name_or_path!r}")
    unknown = set(drafting) - set(shipped)
    if unknown:
        raise InputError(f"feature drafter settings: unknown {sorted(unknown)}; choose from {sorted(shipped)}")
    drafter = FeatureDrafter(cfg, **{**shipped, **drafting})
    if not load:
        return Bound(drafter, None)
    _, trained, _ = restore_feature_drafter(path)
    return Bound(drafter, bind(trained, llm.params, cfg))


def from_arg(arg: str, llm: Model, *, load: bool, expansion, draft: str) -> Bound:
    """``--drafter feature:auto`` (the registered drafter for the LLM), ``feature:NAME`` or ``feature:PATH``,
    optionally followed by ``,depth=D,beam=K,nodes=N``."""
    from specjax.io import registry

    name, *items = arg.split(",")
    settings = parse_int_settings(items, {k: k for k in ("depth", "beam", "nodes")}, f"--drafter feature:{arg}",
                                  "feature:NAME[,depth=D][,beam=K][,nodes=N]")
    if "nodes" in settings:  # a node budget of its own: the ladder spans it
        n = settings["nodes"]
        settings["ladder"] = tuple(sorted({0, 1, min(3, n), min(6, n), min(10, n), n}))
    if name == "auto":
        name = registry.default_feature_drafter(llm.config)
    return load_feature_drafter(name, llm, load=load, **settings)
