"""The SSM drafter: a small speculative model (LLaMA/OPT) drafting an expansion tree, and SSM models
(derived from an LLM's layers, compatibility checks).

Expansion drafting (paper section 3): a static expansion <k1, ..., km>; at depth i every frontier
node gets k_i children, the SSM scoring a whole frontier per forward pass with tree attention. How
children are drawn (``DRAFTS``) decides the law the entries declare: ``topk`` the SSM's top-k and
``coupled`` the top-k of log q + G(seed, t) (the Gumbel noise seeded verification uses at position
t) are deterministic (one-hot); ``iid`` k samples with replacement from the SSM's warped q (law q);
``wor`` k samples without replacement (Gumbel-top-k in perturbed-score order = draw order; law q,
verified by RRS). Greedy requests (temperature 0) always draft top-k, one-hot.

Keeping the SSM cache in step with the LLM: each step the SSM re-reads a fixed chain of the last
``m + 1`` committed tokens ending at the root (m = its tree depth). A step commits at most m + 1
tokens, so this chain always covers every token the SSM has not processed (an accepted leaf at
maximum depth, the bonus token, or a merged path another drafter proposed) with static shapes; the
chain's logits at the root give the depth-1 children. ``commit`` therefore has nothing to do. Merged
with a deeper drafter (lookup chains), the chain is as long as the merged tree's depth + 1.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax.attention.meta import AttentionMeta, causal_meta
from specjax.config import ModelConfig
from specjax.decoding import programs
from specjax.decoding.incremental import prefill
from specjax.decoding.keys import DRAFT, purpose_key
from specjax.decoding.sampling import SamplingArrays, gumbel_noise, warp_logits
from specjax.errors import InputError
from specjax.io.loader import describe_model, load_model
from specjax.models import forward
from specjax.models.cache import KVCache, init_cache
from specjax.models.params import layers_split, stack_layers, take_layers
from specjax.speculation.drafters.base import Bound, DraftContext, Drafter, Proposal
from specjax.speculation.expansion import Expansion, static_tree
from specjax.types import Model

DRAFTS = ("topk", "iid", "wor", "coupled")
_LAW_OF_DRAFT = {"topk": "onehot", "coupled": "onehot", "iid": "iid", "wor": "wor"}
MAX_NODES = 1024  # drafting keys give node and draw 10 bits each (draft_slot)


@dataclasses.dataclass(frozen=True)
class SSMDrafter(Drafter):
    """An SSM (``config``; its params are passed apart) drafting ``expansion`` with rule ``mode``."""

    config: ModelConfig
    expansion: Expansion
    mode: str = "topk"

    def __post_init__(self):
        if self.mode not in DRAFTS:
            raise InputError(f"unknown drafting mode {self.mode!r}; choose from {DRAFTS}")
        if self.expansion.num_nodes > MAX_NODES:
            raise InputError(f"expansion {list(self.expansion.widths)} has {self.expansion.num_nodes} nodes, beyond "
                             f"{MAX_NODES} per SSM")

    @property
    def law(self) -> str:
        return _LAW_OF_DRAFT[self.mode]

    @property
    def num_nodes(self) -> int:
        return self.expansion.num_nodes - 1

    @property
    def max_depth(self) -> int:
        return self.expansion.depth

    def static_parents(self) -> tuple[int, ...]:
        return tuple(self.expansion.topology()[0])

    @property
    def position_limit(self) -> int | None:
        """An OPT SSM's learned position table: past its last row every position read that row (JAX clamps
        the index), so its drafts there were noise that still cost each step. RoPE (LLaMA) has no end."""
        return self.config.max_positions if self.config.family == "opt" else None

    def describe(self) -> str:
        return f"ssm(<{','.join(map(str, self.expansion.widths))}>, {self.mode})"

    def check_mesh(self, parallel, batch: int) -> None:
        parallel.param_shardings(self.config, parallel.ssm_rules)  # raises ShardingError naming the leaf

    def place(self, params, parallel):
        # an SSM loaded by name for one CPU device has split layers (load_model's default there); a mesh
        # shards stacked ones, and an SSM is small enough to restack here
        return parallel.put_params(stack_layers(params), self.config, parallel.ssm_rules)

    def step_params(self, params):
        """The SSM's matmul weights and head packed for the CPU kernel, as the LLM's are
        (``specjax.decoding.programs.step_params``: float32 split layers only)."""
        return programs.step_params(params)

    def init(self, params, prompt_tokens, prompt_lens, *, cache_len: int, parallel=None, hidden=None,
             first=None) -> KVCache:
        """The SSM's cache after the prompts (its own prefill)."""
        batch = prompt_tokens.shape[0]
        cache = init_cache(self.config, batch, cache_len, jax.tree.leaves(params)[0].dtype)
        if parallel is not None:
            cache = parallel.constrain_cache(cache, self.config, parallel.ssm_rules)
        _, cache = prefill(params, prompt_tokens, prompt_lens, cache, self.config)  # chunked when long
        return cache

    def propose(self, params, cache: KVCache, ctx: DraftContext) -> tuple[Proposal, KVCache]:
        tokens, ok, laws, cache = draft_expansion(params, self.config, cache, ctx.history, ctx.length, self.expansion,
                                                  ctx.impl, self.mode, ctx.sampling, ctx.index, ctx.fault,
                                                  commit_depth=ctx.max_depth)
        batch, n = tokens.shape
        parents = jnp.broadcast_to(jnp.asarray(self.static_parents(), jnp.int32), (batch, n))
        # Sampled modes declare row u (the node drafted from) of their stored laws for u's children;
        # greedy requests draft top-k whatever the mode, so their entries stay one-hot. The fault
        # "allow_mss_on_topk" re-creates the paper's rule: top-k entries declaring the SSM's q.
        declares = self.law != "onehot" or (ctx.fault == "allow_mss_on_topk" and self.mode == "topk")
        if declares and laws is not None:
            law_row = jnp.where(ctx.sampling.sampled[:, None] & (parents >= 0), parents, -1)
        else:
            law_row, laws = jnp.full((batch, n), -1, jnp.int32), None
        return Proposal(tokens=tokens, parent=parents, ok=ok, law_row=law_row, laws=laws), cache


def derived_layers(cfg, layers) -> list[int]:
    """The LLM layer indices of a derived SSM: an int K (the first K layers) or a layer list;
    checked against the LLM's layer count (a derived SSM must be smaller than the LLM)."""
    total = cfg.num_layers
    if isinstance(layers, (int, np.integer)) and not isinstance(layers, bool):
        if not 1 <= layers < total:
            raise InputError(f"a derived SSM takes the LLM's first K layers: K must be in [1, {total - 1}] for this "
                             f"{total}-layer LLM, got {layers}")
        return list(range(int(layers)))
    idx = list(layers) if isinstance(layers, (list, tuple)) else None
    if not idx or not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in idx) \
            or idx != sorted(set(idx)) or idx[0] < 0 or idx[-1] >= total or len(idx) >= total:
        raise InputError(f"a derived SSM needs strictly increasing layer indices in [0, {total - 1}], fewer than all "
                         f"{total}, got {layers!r}")
    return [int(i) for i in idx]


def parse_derived(text: str, cfg) -> list[int]:
    """``derived:auto`` (the first min(4, max(1, L // 4)) layers), ``derived:K`` or ``derived:i,j,..``."""
    body = text.split(":", 1)[1]
    if body == "auto":
        return derived_layers(cfg, min(4, max(1, cfg.num_layers // 4)))
    items = body.split(",")
    if not all(x.strip().isascii() and x.strip().isdigit() for x in items):
        raise InputError(f"--ssm {text!r}: expected derived:auto, derived:K or derived:i,j,... (non-negative ints)")
    values = [int(x) for x in items]
    return derived_layers(cfg, values[0] if len(values) == 1 else values)


def derive_ssm(llm: Model, layers) -> Model:
    """An SSM made of a subset of the LLM's layers (in order) plus its embedding, final norm and head.

    ``layers``: an int k (the first k layers) or a sequence of layer indices. Needs no training and
    shares the tokenizer, so the main job speculates out of the box; trained SSMs replace it later.
    With ``llm.params`` None (``specjax.describe_model``) the result has no params either.
    """
    cfg = llm.config
    idx = derived_layers(cfg, layers)
    config = dataclasses.replace(cfg, num_layers=len(idx))
    if llm.params is None:
        return Model(config, None, llm.tokenizer)
    params = dict(llm.params)
    if layers_split(llm.params):  # the LLM's own layout and buffers: nothing copied
        params["layers"] = tuple(llm.params["layers"][i] for i in idx)
    else:
        params["layers"] = take_layers(llm.params, idx)
    return Model(config, params, llm.tokenizer)


def check_compatible(llm: Model, ssm: Model, name: str = "SSM") -> None:
    """An SSM must share the LLM's vocabulary (and tokenizer, when both have one)."""
    if ssm.config.vocab_size != llm.config.vocab_size:
        raise InputError(f"{name} has vocab_size {ssm.config.vocab_size} but the LLM has {llm.config.vocab_size}; "
                         f"an SSM must share the LLM's tokenizer")
    if llm.tokenizer is not None and ssm.tokenizer is not None:
        if llm.tokenizer.get_vocab() != ssm.tokenizer.get_vocab():
            raise InputError(f"{name}'s tokenizer differs from the LLM's (different token-to-id maps)")


def draft_slot(ssm_index: int, node, draw) -> jax.Array:
    """Slot of a drafting key: unique per (SSM, node, draw) within one step (node, draw < 2**10)."""
    return (ssm_index << 20) + (jnp.asarray(node, jnp.int32) << 10) + jnp.asarray(draw, jnp.int32)


def draw_children(logits: jax.Array, k: int, draft: str, sampling: SamplingArrays | None, length: jax.Array,
                  depth: int, nodes: np.ndarray, ssm_index: int, fault: str | None = None):
    """Children of the frontier ``nodes`` (static ids) from SSM logits [B, F, V]; the children sit
    at position ``length + depth + 1``. Returns (tokens [B, F, k] in draw order, ok [B, F, k],
    declared law as warped log-probabilities [B, F, V] or None for one-hot entries)."""
    top = jax.lax.top_k(logits, k)[1].astype(jnp.int32)
    always = jnp.ones(top.shape, bool)
    if draft == "topk":
        if fault == "allow_mss_on_topk":  # the paper's rule: entries declare softmax q
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
    if fault == "law_wrong_temperature":
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
    logits, cache, _ = forward(params, tokens, idx, cache, causal_meta(start), cfg,
                            logits_indices=(length - start)[:, None])
    return logits[:, 0], cache


def draft_expansion(params, cfg: ModelConfig, cache: KVCache, history: jax.Array, length: jax.Array,
                    expansion: Expansion, impl: str = "auto", draft: str = "topk",
                    sampling: SamplingArrays | None = None, ssm_index: int = 0, fault: str | None = None,
                    commit_depth: int = 0):
    """Expansion drafting (``commit_depth``: the merged tree's depth when deeper than this expansion:
    the re-read chain then covers every token one step can commit). Returns (tokens [B, N] (root =
    history[length]), entry_ok [B, N], laws [B, N, V] warped log q at each drafted-from node (None for
    top-k drafts), cache)."""
    batch = history.shape[0]
    parents, levels = expansion.topology()
    n = len(parents)
    tree = static_tree(expansion, batch, jnp.zeros((batch, n), jnp.int32))
    root = jnp.take_along_axis(history, length[:, None], axis=1)[:, 0]
    tokens = jnp.zeros((batch, n), jnp.int32).at[:, 0].set(root)
    entry_ok = jnp.ones((batch, n), bool)
    laws = None
    logits, cache = chain_logits(params, cfg, cache, history, length, max(expansion.depth, commit_depth) + 1)
    frontier_logits = logits[:, None, :]  # [B, |frontier|, V]
    for depth, k in enumerate(expansion.widths):
        frontier = np.asarray(levels[depth])
        children = np.asarray(levels[depth + 1])  # static ids, grouped by parent in frontier order
        drawn, ok, logq = draw_children(frontier_logits, k, draft, sampling, length, depth, frontier, ssm_index, fault)
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
        frontier_logits, cache, _ = forward(params, tokens[:, children], positions, cache, meta, cfg)
    return tokens, entry_ok, laws, cache


def ssm_drafters(configs, expansions, draft: str = "topk") -> tuple[SSMDrafter, ...]:
    """One SSM drafter per (config, expansion), all drawing children with rule ``draft``."""
    configs, expansions = tuple(configs), tuple(expansions)
    if len(configs) != len(expansions):
        raise InputError(f"{len(configs)} SSMs but {len(expansions)} expansion configs")
    return tuple(SSMDrafter(c, e if isinstance(e, Expansion) else Expansion(tuple(e)), draft)
                 for c, e in zip(configs, expansions))


def from_arg(arg: str, llm: Model, *, load: bool, expansion: Expansion, draft: str) -> Bound:
    """``--drafter ssm:ARG``: ARG is a registered SSM name, a model path, or ``derived:K`` / ``derived:auto``
    / ``derived:i,j,..`` (the LLM's own layers). ``load=False`` describes it (config and tokenizer only)."""
    if arg.startswith("derived:"):
        model = derive_ssm(llm, parse_derived(arg, llm.config))
    else:
        model = load_model(arg, progress=False) if load else describe_model(arg)
    check_compatible(llm, model, name=f"SSM {arg!r}")
    return Bound(SSMDrafter(model.config, expansion, draft), model.params)
