"""Tree-speculative generation: prefill, then ONE ``lax.while_loop`` whose body is
speculate -> tree forward -> verify -> commit -> append / EOS / length bookkeeping.

Pure and jittable (call ``generate_speculative`` inside your own ``jax.jit``); ``specjax.api``
wraps it for strings. Incremental decoding (empty tree) and sequence speculation (expansion
<1, ..., 1>) run through the same code path.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.attention.meta import causal_meta
from specjax.config import ModelConfig
from specjax.decoding.incremental import PAD_TOKEN, is_eos, prefill
from specjax.decoding.sampling import SamplingArrays, finite_rows, sample_tokens
from specjax.errors import InputError
from specjax.models import forward
from specjax.models.cache import KVCache, init_cache
from specjax.speculation.faults import check_fault
from specjax.speculation.commit import commit_path, tree_forward
from specjax.speculation.drafters.merge import merge_trees
from specjax.speculation.drafters.ssm import DRAFTS, SAMPLED_DRAFTS, draft_expansion
from specjax.speculation.expansion import Expansion, static_tree
from specjax.speculation.tree import TokenTree
from specjax.speculation.verify.greedy import verify_greedy
from specjax.speculation.verify.sampled import verify_sampled
from specjax.speculation.verify.seeded import verify_seeded

VERIFIERS = ("greedy", "seeded", "mss", "rrs", "naive")
MAX_NODES_PER_SSM = 1024
# Which drafting modes each verifier is lossless for (docs/verification.md, "Which declared law").
LOSSLESS = {"greedy": DRAFTS, "seeded": DRAFTS, "naive": DRAFTS, "mss": ("iid",), "rrs": ("wor",)}
DEFAULT_DRAFT = {"greedy": "topk", "seeded": "coupled", "naive": "topk", "mss": "iid", "rrs": "wor"}


def check_combination(draft: str, verifier: str, fault: str | None = None) -> None:
    """Refuse a (drafting, verifier) pair that would not be lossless, naming the exact ones."""
    if verifier not in VERIFIERS:
        raise InputError(f"unknown verifier {verifier!r}; choose from {VERIFIERS}")
    if draft not in DRAFTS:
        raise InputError(f"unknown drafting mode {draft!r}; choose from {DRAFTS}")
    if draft in LOSSLESS[verifier] or (fault == "allow_mss_on_topk" and verifier == "mss"):
        return
    exact = [v for v in VERIFIERS if draft in LOSSLESS[v]]
    why = {"mss": "MSS needs entries drawn i.i.d. from the declared SSM law",
           "rrs": "RRS needs entries drawn without replacement (draft 'wor')"}[verifier]
    raise InputError(f"verifier {verifier!r} is not lossless for drafting mode {draft!r} ({why}); "
                     f"lossless verifiers for {draft!r}: {exact}")


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Static speculation setup: one expansion per SSM (none = incremental decoding)."""

    ssm_configs: tuple[ModelConfig, ...] = ()
    expansions: tuple[Expansion, ...] = ()
    impl: str = "auto"  # tree attention implementation
    verifier: str = "greedy"  # one of VERIFIERS; greedy ignores the sampling settings
    draft: str = "topk"  # how the SSMs draw children (speculate.DRAFTS)
    fault: str | None = None  # tests only: one of faults.FAULTS re-creates that pitfall (static, compiled apart)

    def __post_init__(self):
        if len(self.ssm_configs) != len(self.expansions):
            raise InputError(f"{len(self.ssm_configs)} SSMs but {len(self.expansions)} expansion configs")
        check_fault(self.fault)
        check_combination(self.draft, self.verifier, self.fault)
        too_big = [e.widths for e in self.expansions if e.num_nodes > MAX_NODES_PER_SSM]
        if too_big:  # drafting keys give node and draw 10 bits each (speculate.draft_slot)
            raise InputError(f"expansions {too_big} exceed {MAX_NODES_PER_SSM} nodes per SSM")

    @property
    def max_depth(self) -> int:
        return max((e.depth for e in self.expansions), default=0)

    @property
    def num_nodes(self) -> int:
        return 1 + sum(e.num_nodes - 1 for e in self.expansions)


@struct.dataclass
class SpecState:
    """Loop state (B requests, S cache slots, M output slots, D = max tree depth)."""

    llm_cache: KVCache  # committed LLM K/V; llm_cache.length[b] = position of request b's root
    ssm_caches: tuple  # one KVCache per SSM (kept in step by the re-read chain, see speculate.py)
    history: jax.Array  # [B, S] int32, prompt + generated tokens; history[b, length[b]] = the root
    tokens: jax.Array  # [B, M] int32, generated tokens, PAD_TOKEN beyond num_generated
    num_generated: jax.Array  # [B] int32
    done: jax.Array  # [B] bool
    llm_passes: jax.Array  # [] int32, LLM forward passes of the batch (prefill included)
    tokens_per_pass: jax.Array  # [B, D + 2] int32, per request: histogram over its passes of tokens emitted
    accepted_at_depth: jax.Array  # [B, max(D, 1)] int32, per request: accepted nodes at depth d + 1
    failed: jax.Array  # [B] bool, non-finite LLM logits or a residual without mass; the request stops


@struct.dataclass
class SpecOutput:
    tokens: jax.Array  # [B, M] int32
    num_generated: jax.Array  # [B] int32
    llm_passes: jax.Array  # [] int32
    tokens_per_pass: jax.Array  # [B, D + 2] int32 (sum over axis 0 for the batch's histogram)
    accepted_at_depth: jax.Array  # [B, max(D, 1)] int32
    failed: jax.Array  # [B] bool


def build_tree(ssm_params: tuple, state: SpecState, spec: SpecConfig, sampling: SamplingArrays):
    """Draft this step's token tree with every SSM (or the root-only tree with none).
    Returns (tree, declared laws [B, R, V] or None, SSM caches)."""
    history, length = state.history, state.llm_cache.length
    batch = history.shape[0]
    if not spec.expansions:
        root = jnp.take_along_axis(history, length[:, None], axis=1)
        return _root_only(root), None, ()
    drafted, oks, laws, caches = [], [], [], []
    for i, (params, cfg, expansion, cache) in enumerate(zip(ssm_params, spec.ssm_configs, spec.expansions,
                                                            state.ssm_caches)):
        tokens, ok, law, cache = draft_expansion(params, cfg, cache, history, length, expansion, spec.impl,
                                                 spec.draft, sampling, ssm_index=i, fault=spec.fault)
        drafted.append(tokens)
        oks.append(ok)
        laws.append(law)
        caches.append(cache)
    # Only i.i.d. and without-replacement entries declare the SSM's law; top-k and coupled entries are
    # one-hot (the mutant "allow_mss_on_topk" re-creates the paper's rule: top-k entries declaring q).
    declares_q = spec.draft in SAMPLED_DRAFTS or spec.fault == "allow_mss_on_topk"
    declares = sampling.sampled if declares_q else None
    laws = jnp.concatenate(laws, axis=1) if declares_q else None
    if len(drafted) == 1:
        tree = static_tree(spec.expansions[0], batch, drafted[0], entry_ok=oks[0], law_rows=declares)
    else:
        tree = merge_trees(drafted, list(spec.expansions), oks, [declares] * len(drafted), fault=spec.fault)
    return tree, laws, tuple(caches)


def _root_only(root: jax.Array) -> TokenTree:
    batch = root.shape[0]
    return TokenTree(tokens=root.astype(jnp.int32), parent=jnp.full((batch, 1), -1, jnp.int32),
                     depth=jnp.zeros((batch, 1), jnp.int32), valid=jnp.ones((batch, 1), bool),
                     ancestor=jnp.ones((batch, 1, 1), jnp.uint32), children=jnp.full((batch, 1, 1), -1, jnp.int32),
                     law_row=jnp.full((batch, 1, 1), -1, jnp.int32))


def verify(logits, tree: TokenTree, laws, sampling: SamplingArrays, length: jax.Array, spec: SpecConfig):
    if spec.verifier == "greedy":
        return verify_greedy(logits, tree, spec.max_depth)
    if spec.verifier == "seeded":
        return verify_seeded(logits, tree, sampling, length, spec.max_depth, fault=spec.fault)
    return verify_sampled(logits, tree, laws, sampling, length, spec.verifier, spec.max_depth, fault=spec.fault)


def spec_step(llm_params, ssm_params: tuple, state: SpecState, sampling: SamplingArrays, max_new_tokens: jax.Array,
              cfg: ModelConfig, spec: SpecConfig, eos_ids: tuple[int, ...], parallel=None) -> SpecState:
    """One speculative step for every request (finished requests are carried along unchanged)."""
    active = ~state.done
    depth = spec.max_depth
    length = state.llm_cache.length
    tree, laws, ssm_caches = build_tree(ssm_params, state, spec, sampling)
    logits, llm_cache, _ = tree_forward(llm_params, tree, state.llm_cache, cfg, spec.impl, parallel)
    verdict = verify(logits, tree, laws, sampling, length, spec)
    # Accepted token d + 1 was decided by the LLM's logits at path node d (the root is node 0); the bonus
    # by the last accepted node. If path node j has non-finite logits (NaN weights, overflow), the tokens
    # decided before it stand, exactly as incremental decoding emits them, and the request fails there.
    width = depth + 1
    j = jnp.arange(width)[None, :]
    on_path = j <= verdict.num_accepted[:, None]
    finite_at = jnp.take_along_axis(finite_rows(logits), jnp.maximum(verdict.path, 0), axis=1) | ~on_path
    first_bad = jnp.min(jnp.where(finite_at, width, j), axis=1)  # width = none
    ok = verdict.ok & (first_bad == width)  # verdict.ok: the final token's residual had mass
    n_legit = jnp.where(first_bad < width, first_bad, verdict.num_accepted + verdict.ok.astype(jnp.int32))

    # Tokens this step emits: accepted nodes then the bonus, cut after an EOS and at max_new_tokens.
    n_emit = n_legit
    eos_at = jnp.where(is_eos(verdict.emitted, eos_ids) & (j < n_emit[:, None]), j, width)
    first_eos = jnp.min(eos_at, axis=1)
    n_emit = jnp.minimum(n_emit, first_eos + 1)
    n_emit = jnp.minimum(n_emit, max_new_tokens - state.num_generated)
    n_emit = jnp.where(active, n_emit, 0)
    emit = j < n_emit[:, None]
    rows = jnp.arange(state.tokens.shape[0])[:, None]
    out_slot = jnp.where(emit, state.num_generated[:, None] + j, state.tokens.shape[1])
    tokens = state.tokens.at[rows, out_slot].set(verdict.emitted, mode="drop")
    hist_slot = jnp.where(emit, length[:, None] + 1 + j, state.history.shape[1])
    history = state.history.at[rows, hist_slot].set(verdict.emitted, mode="drop")
    num_generated = state.num_generated + n_emit
    finished = (first_eos < n_emit) | (num_generated >= max_new_tokens)  # EOS or budget before any failure
    failed = state.failed | (active & ~ok & ~finished)
    done = state.done | failed | (active & finished)

    keep = jnp.where(active, verdict.num_accepted + 1, 0)  # root + accepted nodes
    llm_cache = commit_path(llm_cache, verdict.path, keep)

    req = jnp.arange(state.tokens.shape[0])
    counted = active & ~failed  # a failing pass is not a speculative pass of the request's histogram
    hist = state.tokens_per_pass.at[req, n_emit].add(counted.astype(jnp.int32))
    acc = state.accepted_at_depth
    if depth:
        reached = (jnp.arange(depth)[None, :] < verdict.num_accepted[:, None]) & counted[:, None]
        acc = acc + reached.astype(jnp.int32)
    return SpecState(llm_cache=llm_cache, ssm_caches=ssm_caches, history=history, tokens=tokens,
                     num_generated=num_generated, done=done, llm_passes=state.llm_passes + 1,
                     tokens_per_pass=hist, accepted_at_depth=acc, failed=failed)


def init_state(llm_params, ssm_params: tuple, prompt_tokens, prompt_lens, max_new_tokens, sampling: SamplingArrays,
               *, cfg: ModelConfig, spec: SpecConfig, cache_len: int, max_out: int,
               eos_ids: tuple[int, ...], parallel=None) -> SpecState:
    """Prefill the LLM and every SSM; the LLM's token after the prompt (sampled exactly as incremental
    decoding samples it) becomes the first root. With ``parallel`` the LLM cache is pinned to the LLM's
    sharding (stage-local layers) and each SSM cache to the SSM rules (requests over dp)."""
    batch, width = prompt_tokens.shape
    dtype = jax.tree.leaves(llm_params)[0].dtype
    llm_cache = init_cache(cfg, batch, cache_len, dtype)
    if parallel is not None:
        llm_cache = parallel.constrain_cache(llm_cache, cfg)
    logits, llm_cache = prefill(llm_params, prompt_tokens, prompt_lens, llm_cache, cfg, parallel)
    ok = finite_rows(logits)
    first = sample_tokens(logits, sampling, positions=prompt_lens)
    if spec.verifier == "greedy" or spec.fault == "greedy_first_token":
        first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    history = jnp.zeros((batch, cache_len), jnp.int32).at[:, :width].set(prompt_tokens)
    history = history.at[jnp.arange(batch), prompt_lens].set(first)
    ssm_caches = []
    for params, scfg in zip(ssm_params, spec.ssm_configs):
        cache = init_cache(scfg, batch, cache_len, jax.tree.leaves(params)[0].dtype)
        if parallel is not None:
            cache = parallel.constrain_cache(cache, scfg, parallel.ssm_rules)
        positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
        _, cache, _ = forward(params, prompt_tokens, positions, cache, causal_meta(jnp.zeros((batch,), jnp.int32)),
                           scfg, logits_indices=jnp.zeros((batch, 1), jnp.int32))
        ssm_caches.append(cache.replace(length=prompt_lens.astype(jnp.int32)))
    depth = spec.max_depth
    return SpecState(llm_cache=llm_cache, ssm_caches=tuple(ssm_caches), history=history,
                     tokens=jnp.full((batch, max_out), PAD_TOKEN, jnp.int32).at[:, 0].set(
                         jnp.where(ok, first, PAD_TOKEN)),
                     num_generated=ok.astype(jnp.int32),
                     done=~ok | is_eos(first, eos_ids) | (max_new_tokens <= 1), llm_passes=jnp.ones((), jnp.int32),
                     tokens_per_pass=jnp.zeros((batch, depth + 2), jnp.int32),
                     accepted_at_depth=jnp.zeros((batch, max(depth, 1)), jnp.int32), failed=~ok)


def generate_speculative(llm_params, ssm_params: tuple, prompt_tokens: jax.Array, prompt_lens: jax.Array,
                         max_new_tokens: jax.Array, sampling: SamplingArrays | None = None, *, cfg: ModelConfig,
                         spec: SpecConfig, cache_len: int, max_out: int, eos_ids: tuple[int, ...] = (),
                         parallel=None) -> SpecOutput:
    """Tree-speculative generation of right-padded prompts [B, T]. Pure and jittable.

    sampling: per-request settings (None = greedy). ``spec.verifier`` "greedy" decodes greedily
    whatever the settings say (the host API refuses temperature > 0 with it); the others sample.
    cache_len must be >= T and >= max(prompt_len + max_new_tokens) + spec.num_nodes (tree scratch).
    parallel: a ``specjax.sharding.Parallel`` (static): the LLM runs under its rules (pp > 1 =
    pipelined layers), the SSMs under its ssm_rules; the whole loop stays one jitted program.
    """
    sampling = greedy_sampling(prompt_tokens.shape[0]) if sampling is None else sampling
    state = init_state(llm_params, ssm_params, prompt_tokens, prompt_lens, max_new_tokens, sampling, cfg=cfg,
                       spec=spec, cache_len=cache_len, max_out=max_out, eos_ids=eos_ids, parallel=parallel)

    def cond(state: SpecState):
        return jnp.any(~state.done)  # some request still needs tokens

    step = functools.partial(spec_step, llm_params, ssm_params, sampling=sampling, max_new_tokens=max_new_tokens,
                             cfg=cfg, spec=spec, eos_ids=eos_ids, parallel=parallel)
    state = jax.lax.while_loop(cond, step, state)
    return SpecOutput(tokens=state.tokens, num_generated=state.num_generated, llm_passes=state.llm_passes,
                      tokens_per_pass=state.tokens_per_pass, accepted_at_depth=state.accepted_at_depth,
                      failed=state.failed)


def greedy_sampling(batch: int) -> SamplingArrays:
    return SamplingArrays(temperature=jnp.zeros((batch,), jnp.float32), top_k=jnp.zeros((batch,), jnp.int32),
                          top_p=jnp.ones((batch,), jnp.float32), seed=jnp.zeros((batch,), jnp.int32))


generate_speculative_jit = jax.jit(generate_speculative,
                                   static_argnames=("cfg", "spec", "cache_len", "max_out", "eos_ids", "parallel"))
# The state is donated: caches and buffers are updated in place, never copied per step.
step_jit = jax.jit(spec_step, static_argnames=("cfg", "spec", "eos_ids", "parallel"), donate_argnames=("state",))


def generate_stream(llm_params, ssm_params: tuple, prompt_tokens, prompt_lens, max_new_tokens,
                    sampling: SamplingArrays | None = None, *, cfg: ModelConfig, spec: SpecConfig, cache_len: int,
                    max_out: int, eos_ids: tuple[int, ...] = (), parallel=None):
    """Host-loop twin of ``generate_speculative``: the same jitted step, one call per LLM pass,
    yielding each request's newly emitted tokens after every pass (for streaming and debugging)."""
    sampling = greedy_sampling(prompt_tokens.shape[0]) if sampling is None else sampling
    state = _init_state_jit(llm_params, ssm_params, prompt_tokens, prompt_lens, max_new_tokens, sampling, cfg=cfg,
                            spec=spec, cache_len=cache_len, max_out=max_out, eos_ids=eos_ids, parallel=parallel)
    shown = np.zeros(prompt_tokens.shape[0], np.int64)
    host = np.asarray if parallel is None else parallel.fetch  # fetch: arrays spanning several processes
    while True:
        counts = host(state.num_generated)
        tokens = host(state.tokens)
        yield [tokens[b, shown[b]:counts[b]].tolist() for b in range(len(counts))]
        shown = counts
        if bool(np.all(host(state.done))):
            return
        state = step_jit(llm_params, ssm_params, state, sampling, max_new_tokens, cfg=cfg, spec=spec, eos_ids=eos_ids,
                         parallel=parallel)


_init_state_jit = jax.jit(init_state, static_argnames=("cfg", "spec", "cache_len", "max_out", "eos_ids", "parallel"))
