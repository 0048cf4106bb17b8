"""Tree-speculative generation: prefill, then ONE ``lax.while_loop`` whose body is
speculate -> tree forward -> verify -> commit -> append / EOS / length bookkeeping.

Pure and jittable (call ``generate_speculative`` inside your own ``jax.jit``); ``specjax.api``
wraps it for strings. Incremental decoding (empty tree) and sequence speculation (expansion
<1, ..., 1>) run through the same code path.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig
from specjax.decoding.contract import check_batch
from specjax.decoding.host_step import steps_while_active
from specjax.decoding.incremental import PAD_TOKEN, prefill
from specjax.decoding.sampling import SamplingArrays, finite_rows, first_argmax, sample_tokens
from specjax.models.cache import init_cache
from specjax.models.output import ForwardOutput, TokenOutput
from specjax.speculation.budget import choose_level, expected_by_level
from specjax.speculation.commit import commit_rows, tree_forward
from specjax.speculation.drafters.base import Accepted, DraftContext
from specjax.speculation.drafters.merge import concat_laws, merge_proposals
from specjax.speculation.expansion import static_tree
from specjax.speculation.spec import DEFAULT_DRAFT, VERIFIERS, SpecConfig
from specjax.speculation.state import SpecOutput, SpecState, greedy_sampling, stop_hit, stop_rows
from specjax.speculation.tree import TokenTree
from specjax.speculation.verify.greedy import verify_greedy
from specjax.speculation.verify.sampled import verify_sampled
from specjax.speculation.verify.seeded import seeded_head, seeded_noise, verify_seeded
from specjax.x32 import in_32_bit

__all__ = ["SpecConfig", "SpecState", "SpecOutput", "VERIFIERS", "DEFAULT_DRAFT", "spec_step", "init_state",
           "generate_speculative", "generate_speculative_jit", "generate_stream", "step_jit", "init_state_jit",
           "host_step_jit"]


def propose_all(drafter_params: tuple, state: SpecState, spec: SpecConfig, sampling: SamplingArrays, noise=None):
    """Every drafter's proposal for this step (root token set), the drafters' new states and the root [B, 1].
    ``noise``: the seeded verifier's rows of noise this step (``DraftContext.noise``)."""
    history, length = state.history, state.llm_cache.length
    root = jnp.take_along_axis(history, length[:, None], axis=1)
    proposals, states = [], []
    for i, (drafter, params, dstate) in enumerate(zip(spec.drafters, drafter_params, state.drafter_states)):
        ctx = DraftContext(history=history, length=length, sampling=sampling, index=i, impl=spec.impl,
                           fault=spec.fault, max_depth=spec.max_depth, noise=noise)
        proposal, dstate = drafter.propose(params, dstate, ctx)
        proposal = proposal.replace(tokens=proposal.tokens.at[:, 0].set(root[:, 0]))
        if drafter.law == "onehot" and proposal.laws is not None and spec.fault != "allow_mss_on_topk":
            # the declared law is the one the verifier was checked against (check_pairing): a drafter
            # declaring deterministic drafts is verified one-hot, never against laws it returns anyway (MSS
            # against its q is the paper's biased top-k rule, which that mutation test re-creates). Without
            # laws every entry is one-hot already (``verify_sampled``), and the step program stays as it was
            proposal = proposal.replace(laws=None, law_row=jnp.full_like(proposal.law_row, -1))
        proposals.append(proposal)
        states.append(dstate)
    return proposals, tuple(states), root


def build_tree(proposals: list, root: jax.Array, spec: SpecConfig, counts: tuple[int, ...]):
    """This step's token tree: each proposal cut to its first ``counts[s]`` nodes below the root,
    merged (the root-only tree when nothing is kept). Returns (tree, stored laws [B, R, V] or None,
    static bound on the tree depth)."""
    keep = [s for s, m in enumerate(counts) if m > 0]
    if not keep:
        return _root_only(root), None, 0
    kept = [proposals[s].replace(tokens=proposals[s].tokens[:, :counts[s] + 1],
                                 parent=proposals[s].parent[:, :counts[s] + 1], ok=proposals[s].ok[:, :counts[s] + 1],
                                 law_row=proposals[s].law_row[:, :counts[s] + 1]) for s in keep]
    parents = []
    for s in keep:
        full = spec.drafters[s].static_parents()
        parents.append(None if full is None else tuple(full[:counts[s] + 1]))
    depth = max(spec.drafters[s].max_depth if par is None else _static_depth(par) for s, par in zip(keep, parents))
    laws = concat_laws(proposals)  # every proposal's rows: the offsets do not depend on the cut
    if len(proposals) == 1 and parents[0] is not None:
        p = kept[0]
        tree = static_tree(parents[0], p.tokens.shape[0], p.tokens, entry_ok=p.ok, law_row=p.law_row)
    else:
        offsets = _law_offsets(proposals)
        tree = merge_proposals(kept, parents, fault=spec.fault, law_offsets=[offsets[s] for s in keep])
    return tree, laws, depth


def _static_depth(parents: tuple[int, ...]) -> int:
    depth = [0] * len(parents)
    for i, p in enumerate(parents):
        depth[i] = depth[p] + 1 if p >= 0 else 0
    return max(depth)


def _law_offsets(proposals: list) -> list[int]:
    """Each proposal's first row in ``concat_laws(proposals)``."""
    rows = [0 if p.laws is None else p.laws.shape[1] for p in proposals]
    return [int(o) for o in np.cumsum([0] + rows)[:-1]]


def _root_only(root: jax.Array) -> TokenTree:
    """The one-node tree (incremental decoding through the speculative loop)."""
    batch = root.shape[0]
    return TokenTree(tokens=root.astype(jnp.int32), parent=jnp.full((batch, 1), -1, jnp.int32),
                     depth=jnp.zeros((batch, 1), jnp.int32), valid=jnp.ones((batch, 1), bool),
                     ancestor=jnp.ones((batch, 1, 1), jnp.uint32), children=jnp.full((batch, 1, 1), -1, jnp.int32),
                     law_row=jnp.full((batch, 1, 1), -1, jnp.int32))


def verify(out: ForwardOutput | TokenOutput, tree: TokenTree, laws, sampling: SamplingArrays, length: jax.Array,
           spec: SpecConfig, depth: int | None = None):
    """The verdict on the tree pass ``out`` (a ``TokenOutput`` for the greedy and seeded verifiers, else its
    logits)."""
    depth = spec.max_depth if depth is None else depth
    if spec.verifier == "greedy":
        return verify_greedy(out.token, tree, depth)
    if spec.verifier == "seeded":
        return verify_seeded(out.token, tree, depth)
    return verify_sampled(out.logits, tree, laws, sampling, length, spec.verifier, depth, fault=spec.fault)


def _scored_pass(llm_params, proposals, root, state: SpecState, cfg, spec: SpecConfig, parallel, counts, noise=None):
    """One branch of the budget switch: the tree at these node counts through the LLM, verified.
    Returns (verdict, K/V [L, B, D + 1, KVH, Dh], finite logits and hidden states, each at the path's
    nodes), padded to the spec's full depth so every branch has one shape. The pass only reads the
    cache (``block_only``) and the accepted path is committed after the switch: it never copies the cache.
    ``noise``: the seeded verifier's rows of noise (``seeded_noise``)."""
    tree, laws, depth = build_tree(proposals, root, spec, counts)
    # The greedy and seeded verifiers read only each node's token (and finiteness): cheaper to get
    greedy = spec.verifier == "greedy"
    seeded = seeded_head(state.sampling, noise, tree) if spec.verifier == "seeded" else None
    out = tree_forward(llm_params, tree, state.llm_cache, cfg, spec.impl, parallel, hidden=spec.hidden_layers,
                       block_only=True, greedy=greedy, seeded=seeded)
    verdict = verify(out, tree, laws, state.sampling, state.llm_cache.length, spec, depth)
    pad = spec.max_depth - depth
    if pad:
        verdict = verdict.replace(path=jnp.pad(verdict.path, ((0, 0), (0, pad)), constant_values=-1),
                                  emitted=jnp.pad(verdict.emitted, ((0, 0), (0, pad))))
    at_path = jnp.maximum(verdict.path, 0)
    finite = jnp.take_along_axis(out.finite if isinstance(out, TokenOutput) else finite_rows(out.logits), at_path,
                                 axis=1)
    hidden = None
    if out.hidden is not None:
        hidden = jnp.take_along_axis(out.hidden, at_path[:, :, None, None], axis=1)
    rows = jnp.arange(at_path.shape[0])[:, None]
    path_kv = (out.cache.k[:, rows, at_path], out.cache.v[:, rows, at_path])
    return verdict, path_kv, finite, hidden


@in_32_bit
def spec_step(llm_params, drafter_params: tuple, state: SpecState, cfg: ModelConfig, spec: SpecConfig,
              parallel=None, pass_costs=None) -> SpecState:
    """One speculative step for every slot; finished and free slots are carried along unchanged.
    Each request's sampling settings, budget and stop tokens are its own rows of the state. With a
    tree budget, the level (how much of each proposal is verified) is chosen per step for the batch,
    with ``pass_costs`` [L] (seconds per pass at each level, an array argument, so new costs reuse the
    compiled step) or, without it, the budget's own costs (``SpecConfig.costs_apart``)."""
    active = ~state.done
    left = state.max_new_tokens - state.num_generated  # tokens each request may still emit
    depth = spec.max_depth
    length = state.llm_cache.length
    sampling = state.sampling
    noise = None
    if spec.verifier == "seeded":  # made once: every branch's verification and the drafters' coupled drafts
        noise = seeded_noise(sampling, length, depth + 1, cfg.vocab_size, fault=spec.fault)
    proposals, drafter_states, root = propose_all(drafter_params, state, spec, sampling, noise)
    levels = spec.levels
    branches = [functools.partial(_scored_pass, llm_params, proposals, root, state, cfg, spec, parallel, counts,
                                  noise) for counts in levels]
    if spec.budget is None:
        level = jnp.int32(0)
        verdict, path_kv, finite_on_path, hidden = branches[0]()
    else:
        expected = expected_by_level(spec.drafters, drafter_params, drafter_states, proposals, spec.budget)
        level = choose_level(spec.budget, expected, active, left, pass_costs)
        verdict, path_kv, finite_on_path, hidden = jax.lax.switch(level, branches)
    # Accepted token d + 1 was decided by the LLM's logits at path node d (the root is node 0); the bonus
    # by the last accepted node. If path node j has non-finite logits (NaN weights, overflow), the tokens
    # decided before it stand, exactly as incremental decoding emits them, and the request fails there.
    width = depth + 1
    j = jnp.arange(width)[None, :]
    on_path = j <= verdict.num_accepted[:, None]
    finite_at = finite_on_path | ~on_path
    first_bad = jnp.min(jnp.where(finite_at, width, j), axis=1)  # width = none
    ok = verdict.ok & (first_bad == width)  # verdict.ok: the final token's residual had mass
    n_legit = jnp.where(first_bad < width, first_bad, verdict.num_accepted + verdict.ok.astype(jnp.int32))

    # Tokens this step emits: accepted nodes then the bonus, cut after a stop token and at the budget.
    n_emit = n_legit
    stop_at = jnp.where(stop_hit(verdict.emitted, state.stop_ids) & (j < n_emit[:, None]), j, width)
    first_stop = jnp.min(stop_at, axis=1)
    n_emit = jnp.minimum(n_emit, first_stop + 1)
    n_emit = jnp.minimum(n_emit, left)
    n_emit = jnp.where(active, n_emit, 0)
    emit = j < n_emit[:, None]
    rows = jnp.arange(state.tokens.shape[0])[:, None]
    out_slot = jnp.where(emit, state.num_generated[:, None] + j, state.tokens.shape[1])
    tokens = state.tokens.at[rows, out_slot].set(verdict.emitted, mode="drop")
    hist_slot = jnp.where(emit, length[:, None] + 1 + j, state.history.shape[1])
    history = state.history.at[rows, hist_slot].set(verdict.emitted, mode="drop")
    num_generated = state.num_generated + n_emit
    finished = (first_stop < n_emit) | (num_generated >= state.max_new_tokens)  # before any failure
    failed = state.failed | (active & ~ok & ~finished)
    done = state.done | failed | (active & finished)

    keep = jnp.where(active, verdict.num_accepted + 1, 0)  # root + accepted nodes
    llm_cache = commit_rows(state.llm_cache, *path_kv, keep)
    drafter_states = _commit_drafters(drafter_params, drafter_states, spec, verdict, n_emit, llm_cache.length,
                                      hidden)

    req = jnp.arange(state.tokens.shape[0])
    counted = active & ~failed  # a failing pass is not a speculative pass of the request's histogram
    hist = state.tokens_per_pass.at[req, n_emit].add(counted.astype(jnp.int32))
    acc = state.accepted_at_depth
    if depth:
        reached = (jnp.arange(depth)[None, :] < verdict.num_accepted[:, None]) & counted[:, None]
        acc = acc + reached.astype(jnp.int32)
    at_level = state.level_passes.at[req, level].add(counted.astype(jnp.int32))
    return state.replace(llm_cache=llm_cache, drafter_states=drafter_states, history=history, tokens=tokens,
                         num_generated=num_generated, done=done, failed=failed, tokens_per_pass=hist,
                         accepted_at_depth=acc, level_passes=at_level, llm_passes=state.llm_passes + 1)


def _commit_drafters(drafter_params, drafter_states, spec: SpecConfig, verdict, n_emit, new_length, hidden):
    """Tell every drafter what was accepted; a drafter that reads hidden states gets the LLM's at the
    accepted path's nodes (``hidden``: [B, D + 1, len(spec.hidden_layers), H] gathered at the path),
    for the layers it asked (a subset of ``spec.hidden_layers``)."""
    out = []
    for drafter, params, dstate in zip(spec.drafters, drafter_params, drafter_states):
        at_path = None
        if drafter.hidden_layers:
            cols = [spec.hidden_layers.index(i) for i in drafter.hidden_layers]
            at_path = hidden[:, :, cols]
        accepted = Accepted(path=verdict.path, num_accepted=verdict.num_accepted, emitted=verdict.emitted,
                            num_emitted=n_emit, length=new_length, hidden=at_path)
        out.append(drafter.commit(params, dstate, accepted))
    return tuple(out)


@in_32_bit
def init_state(llm_params, drafter_params: tuple, prompt_tokens, prompt_lens, max_new_tokens,
               sampling: SamplingArrays, stop_ids: jax.Array, *, cfg: ModelConfig, spec: SpecConfig, cache_len: int,
               max_out: int, parallel=None) -> SpecState:
    """Prefill the LLM and every drafter; the LLM's token after the prompt (sampled exactly as incremental
    decoding samples it) becomes the first root. With ``parallel`` the LLM cache is pinned to the LLM's
    sharding (stage-local layers); drafters place their own state (SSM caches under the SSM rules).

    prompt_tokens [B, T] right-padded, prompt_lens / max_new_tokens [B], sampling [B], stop_ids [B, E]
    (shapes checked at trace time, values where concrete: ``specjax.decoding.contract``)."""
    check_batch(prompt_tokens, prompt_lens, max_new_tokens, sampling, cache_len=cache_len, max_out=max_out,
                stop_ids=stop_ids, where="generate_speculative", tree_slots=spec.num_nodes)
    batch, width = prompt_tokens.shape
    dtype = jax.tree.leaves(llm_params)[0].dtype
    llm_cache = init_cache(cfg, batch, cache_len, dtype)
    if parallel is not None:
        llm_cache = parallel.constrain_cache(llm_cache, cfg)
    logits, llm_cache, *states = prefill(llm_params, prompt_tokens, prompt_lens, llm_cache, cfg, parallel,
                                         hidden=spec.hidden_layers)
    ok = finite_rows(logits)
    first = sample_tokens(logits, sampling, positions=prompt_lens)
    if spec.verifier == "greedy" or spec.fault == "greedy_first_token":
        first = first_argmax(logits)
    history = jnp.zeros((batch, cache_len), jnp.int32).at[:, :width].set(prompt_tokens)
    history = history.at[jnp.arange(batch), prompt_lens].set(first)
    drafter_states = []
    for d, p in zip(spec.drafters, drafter_params):
        extra = {}
        if d.hidden_layers:  # the prompt's hidden states for the layers this drafter reads, and the first root
            extra = {"hidden": states[0][:, :, [spec.hidden_layers.index(i) for i in d.hidden_layers]], "first": first}
        drafter_states.append(d.init(p, prompt_tokens, prompt_lens, cache_len=cache_len, parallel=parallel, **extra))
    drafter_states = tuple(drafter_states)
    depth = spec.max_depth
    max_new_tokens = jnp.asarray(max_new_tokens, jnp.int32)
    per_request = dict(history=history,
                       tokens=jnp.full((batch, max_out), PAD_TOKEN, jnp.int32).at[:, 0].set(
                           jnp.where(ok, first, PAD_TOKEN)),
                       num_generated=ok.astype(jnp.int32),
                       done=~ok | stop_hit(first, stop_ids) | (max_new_tokens <= 1), failed=~ok,
                       sampling=sampling, max_new_tokens=max_new_tokens, stop_ids=jnp.asarray(stop_ids, jnp.int32),
                       tokens_per_pass=jnp.zeros((batch, depth + 2), jnp.int32),
                       accepted_at_depth=jnp.zeros((batch, max(depth, 1)), jnp.int32),
                       level_passes=jnp.zeros((batch, len(spec.levels)), jnp.int32))
    if parallel is not None:  # over dp, as every step leaves them (see ``Parallel.constrain_batch``)
        per_request = parallel.constrain_batch(per_request)
    return SpecState(llm_cache=llm_cache, drafter_states=drafter_states, llm_passes=jnp.ones((), jnp.int32),
                     **per_request)


@in_32_bit
def generate_speculative(llm_params, drafter_params: tuple, prompt_tokens: jax.Array, prompt_lens: jax.Array,
                         max_new_tokens: jax.Array, sampling: SamplingArrays | None = None,
                         stop_ids: jax.Array | None = None, *, cfg: ModelConfig, spec: SpecConfig, cache_len: int,
                         max_out: int, eos_ids: tuple[int, ...] = (), parallel=None, pass_costs=None) -> SpecOutput:
    """Tree-speculative generation of right-padded prompts [B, T]. Pure and jittable.

    drafter_params: one params pytree per ``spec.drafters`` entry (an SSM's weights; () for a
    drafter without params). sampling: per-request settings (None = greedy). stop_ids [B, E]: each
    request's stop tokens, -1 padded (None = ``eos_ids`` for every request). ``spec.verifier``
    "greedy" decodes greedily whatever the settings say (the host API refuses temperature > 0 with
    it); the others sample. cache_len must be >= T and >= max(prompt_len + max_new_tokens) +
    spec.num_nodes (tree scratch). parallel: a ``specjax.sharding.Parallel`` (static): the LLM runs
    under its rules (pp > 1 = pipelined layers), SSM drafters under its ssm_rules; the whole loop
    stays one jitted program (warned against on a pipelined mesh of several CPU devices in one
    process: ``Parallel.one_pass_per_call``). pass_costs [L]: the tree budget's seconds per pass at each
    level, traced (``spec_step``); None: the budget's own costs, compiled in.
    """
    batch = prompt_tokens.shape[0]
    sampling = greedy_sampling(batch) if sampling is None else sampling
    stop_ids = stop_rows(eos_ids, batch) if stop_ids is None else stop_ids
    state = init_state(llm_params, drafter_params, prompt_tokens, prompt_lens, max_new_tokens, sampling, stop_ids,
                       cfg=cfg, spec=spec, cache_len=cache_len, max_out=max_out, parallel=parallel)
    return finish_speculative(llm_params, drafter_params, state, cfg=cfg, spec=spec, parallel=parallel,
                              pass_costs=pass_costs)


@in_32_bit
def finish_speculative(llm_params, drafter_params: tuple, state: SpecState, cfg: ModelConfig, spec: SpecConfig,
                       parallel=None, pass_costs=None) -> SpecOutput:
    """The loop of ``generate_speculative`` after ``init_state``: steps until every request is done.
    Its own program in ``specjax.generate``, so the prefill and the steps can be compiled with
    different options (``specjax.decoding.programs``)."""
    if parallel is not None:
        parallel.warn_multi_pass("a whole speculative decoding loop")

    def cond(state: SpecState):
        return jnp.any(~state.done)  # some request still needs tokens

    step = functools.partial(spec_step, llm_params, drafter_params, cfg=cfg, spec=spec, parallel=parallel,
                             pass_costs=pass_costs)
    state = jax.lax.while_loop(cond, step, state)
    return SpecOutput(tokens=state.tokens, num_generated=state.num_generated, llm_passes=state.llm_passes,
                      tokens_per_pass=state.tokens_per_pass, accepted_at_depth=state.accepted_at_depth,
                      level_passes=state.level_passes, failed=state.failed)


generate_speculative_jit = jax.jit(generate_speculative,
                                   static_argnames=("cfg", "spec", "cache_len", "max_out", "eos_ids", "parallel"))
init_state_jit = jax.jit(init_state, static_argnames=("cfg", "spec", "cache_len", "max_out", "parallel"))
# The state is donated: caches and buffers are updated in place, never copied per step.
step_jit = jax.jit(spec_step, static_argnames=("cfg", "spec", "parallel"), donate_argnames=("state",))


@in_32_bit
def host_step(llm_params, drafter_params: tuple, state: SpecState, cfg: ModelConfig, spec: SpecConfig,
              parallel=None, steps=1, pass_costs=None):
    """``spec_step`` as the streaming host loop calls it: up to ``steps`` (int32 operand) passes while
    some request is not done, returning (state, ``ChunkReport``) (``specjax.decoding.host_step``)."""
    step = functools.partial(spec_step, llm_params, drafter_params, cfg=cfg, spec=spec, parallel=parallel,
                             pass_costs=pass_costs)
    return steps_while_active(step, state, steps)


host_step_jit = jax.jit(host_step, static_argnames=("cfg", "spec", "parallel"), donate_argnames=("state",))


@in_32_bit
def generate_stream(llm_params, drafter_params: tuple, prompt_tokens, prompt_lens, max_new_tokens,
                    sampling: SamplingArrays | None = None, stop_ids: jax.Array | None = None, *, cfg: ModelConfig,
                    spec: SpecConfig, cache_len: int, max_out: int, eos_ids: tuple[int, ...] = (), parallel=None,
                    pass_costs=None):
    """Host-loop twin of ``generate_speculative``: the same jitted step, one call per LLM pass,
    yielding each request's newly emitted tokens after every pass (for streaming and debugging)."""
    batch = prompt_tokens.shape[0]
    sampling = greedy_sampling(batch) if sampling is None else sampling
    stop_ids = stop_rows(eos_ids, batch) if stop_ids is None else stop_ids
    state = init_state_jit(llm_params, drafter_params, prompt_tokens, prompt_lens, max_new_tokens, sampling, stop_ids,
                           cfg=cfg, spec=spec, cache_len=cache_len, max_out=max_out, parallel=parallel)
    shown = np.zeros(batch, np.int64)
    host = np.asarray if parallel is None else parallel.fetch  # fetch: arrays spanning several processes
    while True:
        counts = host(state.num_generated)
        tokens = host(state.tokens)
        yield [tokens[b, shown[b]:counts[b]].tolist() for b in range(len(counts))]
        shown = counts
        if bool(np.all(host(state.done))):
            return
        state = step_jit(llm_params, drafter_params, state, cfg=cfg, spec=spec, parallel=parallel,
                         pass_costs=pass_costs)
