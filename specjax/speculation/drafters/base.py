"""The drafter interface: what every drafter declares and the three calls the loop makes.

A drafter proposes part of each step's token tree for every request in the batch. It has params
(a pytree, possibly empty) and a state (a pytree, possibly empty) that lives in the loop state, one
row per request slot. The loop calls, all inside the one jitted ``lax.while_loop``:

* ``init(params, prompt, ...)`` once per request batch (prefill): the state after the prompt (with the
  LLM's prefill hidden states and first token for drafters that read hidden states);
* ``propose(params, state, ctx)`` once per step: a ``Proposal`` (its nodes below the root, with
  their parents and the law each was drawn from) and the updated state;
* ``commit(params, state, accepted)`` after verification: the accepted path, the emitted tokens
  and, when ``hidden_layers`` asks for them, the LLM's hidden states at the accepted nodes.

**Declared laws** decide which verifier is lossless (docs/verification.md). Every child entry of a
proposal was drawn from one of: a deterministic rule (``"onehot"``: top-k, lookup, greedy chains,
reranked trees; exact under every verifier, which then treats the entry as delta(x)); i.i.d. from a
stored distribution (``"iid"``: exact under MSS); without replacement from a stored distribution in
draw order (``"wor"``: exact under RRS). ``check_pairing`` asks each drafter's ``law`` instead of a
table of drafting-mode names. Greedy, seeded and naive verification ignore the stored laws and are
exact for any drafter.

**State rows.** The engine inserts a request into a running batch by writing its row of every
state leaf: state leaves are batch-major ([B, ...]) or ``KVCache`` (batch on axis 1).

Adding a drafter: subclass ``Drafter`` in a module of this package and register a factory for it in
``specjax/speculation/drafters/__init__.py`` (one line); nothing outside the package changes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.decoding.sampling import SamplingArrays
from specjax.errors import InputError

LAWS = ("onehot", "iid", "wor")
# The laws each verifier is exact for. greedy, seeded and naive never read a stored law.
VERIFIER_LAWS = {"greedy": LAWS, "seeded": LAWS, "naive": LAWS, "mss": ("onehot", "iid"), "rrs": ("onehot", "wor")}
_WHY = {"mss": "MSS needs entries drawn i.i.d. from their declared law (or deterministic ones)",
        "rrs": "RRS needs entries drawn without replacement from their declared law (or deterministic ones)"}


MAX_DRAFTED_NODES = 63  # a drafter's nodes below the root: the token tree's limit of 64 counts the root

@struct.dataclass
class Proposal:
    """One drafter's nodes for this step, node 0 = the root (the last committed token).

    Parents are stored before children. ``ok[b, i]`` False means node i was not drawn (a draw that
    does not exist, e.g. without replacement from a law with fewer tokens than asked): it is not an
    entry of its parent and none of its descendants are either. ``law_row[b, i]`` is the row of
    ``laws`` that node i's token was drawn from as a child of its parent (-1: one-hot).
    """

    tokens: jax.Array  # [B, N] int32
    parent: jax.Array  # [B, N] int32, -1 for the root
    ok: jax.Array  # [B, N] bool
    law_row: jax.Array  # [B, N] int32
    laws: jax.Array | None = None  # [B, R, V] float32 warped log-probabilities; None = every entry one-hot


@struct.dataclass
class DraftContext:
    """What a drafter may read when it proposes: the committed history of every request."""

    history: jax.Array  # [B, S] int32, prompt + generated tokens; history[b, length[b]] = the root
    length: jax.Array  # [B] int32, position of the root (committed K/V of the LLM end before it)
    sampling: SamplingArrays  # [B] per-request settings (drafting noise is keyed by seed and position)
    index: int = struct.field(pytree_node=False, default=0)  # the drafter's place in the spec (key slots)
    impl: str = struct.field(pytree_node=False, default="xla")  # tree attention implementation
    fault: str | None = struct.field(pytree_node=False, default=None)  # tests only (faults.FAULTS)
    # The deepest tree of the merged pool: a step may commit up to max_depth + 1 tokens, also ones
    # another drafter proposed (a drafter that re-reads recent tokens must cover that many).
    max_depth: int = struct.field(pytree_node=False, default=0)
    # Under the seeded verifier, the noise it adds this step, G(seed, length + 1 + d) [B, max_depth + 1, V]
    # (zeros where no request samples; ``specjax.speculation.verify.seeded.seeded_noise``): a drafter
    # coupling its drafts to it reads these rows instead of drawing them again. None otherwise.
    noise: jax.Array | None = None


@struct.dataclass
class Accepted:
    """What verification decided this step, for ``Drafter.commit``."""

    path: jax.Array  # [B, D + 1] node ids of the merged tree, path[:, 0] = 0, -1 padding
    num_accepted: jax.Array  # [B] accepted nodes below the root
    emitted: jax.Array  # [B, D + 1] accepted tokens then the LLM's own next token
    num_emitted: jax.Array  # [B] tokens appended to the history (0 for finished requests)
    length: jax.Array  # [B] the new root position
    hidden: jax.Array | None = None  # [B, D + 1, len(hidden_layers), H] LLM hidden states at path nodes


@dataclasses.dataclass(frozen=True)
class Drafter:
    """Base class of drafters: frozen (hashable, a static part of ``SpecConfig``)."""

    @property
    def law(self) -> str:
        """How this drafter's entries are drawn: one of LAWS."""
        raise NotImplementedError

    @property
    def num_nodes(self) -> int:
        """Nodes it proposes below the root (static)."""
        raise NotImplementedError

    @property
    def max_depth(self) -> int:
        raise NotImplementedError

    @property
    def hidden_layers(self) -> tuple[int, ...] | None:
        """LLM layers whose input hidden states ``commit`` receives (L = the final hidden state)."""
        return None

    def static_parents(self) -> tuple[int, ...] | None:
        """The proposal's parent array when it never changes (expansion trees), else None."""
        return None

    def check_llm(self, config) -> None:
        """Refuse an LLM (its ModelConfig) this drafter was not made for, before any work (default: any fits)."""

    @property
    def position_limit(self) -> int | None:
        """Positions this drafter can read: a request (prompt and new tokens) must fit in them; None where
        every position can be read."""
        return None

    def init(self, params, prompt_tokens: jax.Array, prompt_lens: jax.Array, *, cache_len: int, parallel=None,
             hidden: jax.Array | None = None, first: jax.Array | None = None):
        """The drafter's state after the right-padded prompts [B, T] (lengths [B]). A drafter with
        ``hidden_layers`` also gets the LLM's hidden states at every prompt position, ``hidden`` [B, T,
        len(hidden_layers), H], and the LLM's first generated token ``first`` [B] (the first root). With
        ``parallel``, per-request arrays belong over dp (``parallel.constrain_batch``), as the steps leave
        them: an array created replicated (zeros) makes the streamed loop compile a second time."""
        return ()

    def propose(self, params, state, ctx: DraftContext) -> tuple[Proposal, object]:
        raise NotImplementedError

    def commit(self, params, state, accepted: Accepted):
        return state

    def describe(self) -> str:
        return type(self).__name__

    def budget_ladder(self) -> tuple[int, ...]:
        """Node counts below the root (prefixes of the proposal, parents before children) that the
        tree budget may cut this drafter's proposal to: by default none or all of it."""
        return (0, self.num_nodes)

    def node_acceptance(self, params, state):
        """[B, num_nodes] float32: the estimated probability that each proposed node below the root
        (proposal order) is accepted, from the state ``propose`` just returned; None when the drafter
        does not estimate (the tree budget then cannot be used with it). Accepted tokens are the
        accepted nodes, so a tree's expected accepted tokens is the sum over its distinct nodes."""
        return None

    def expected_accepted(self, params, state, node_counts: tuple[int, ...]):
        """[B, len(node_counts)] float32: expected accepted tokens if the tree kept this drafter's first
        m nodes (the sum of their ``node_acceptance``); None when the drafter does not estimate."""
        p = self.node_acceptance(params, state)
        if p is None:
            return None
        cum = jnp.concatenate([jnp.zeros_like(p[:, :1]), jnp.cumsum(p, axis=1)], axis=1)
        return cum[:, jnp.asarray(node_counts)]

    def check_mesh(self, parallel, batch: int) -> None:
        """Refuse a mesh this drafter cannot run on (before any weights move)."""

    def step_params(self, params):
        """The params as a step program multiplies by them on one CPU device with specjax's kernels on
        (``specjax.decoding.programs.step_drafter_params``): a drafter with matmul weights returns them
        packed for the CPU matmul kernel; the default changes nothing."""
        return params

    def place(self, params, parallel):
        """The params placed for ``parallel`` (default: replicated on every device)."""
        return parallel.put(params, jax.tree.map(lambda _: parallel.replicated(), params))


def estimates_acceptance(drafter: Drafter) -> bool:
    """Whether the drafter estimates its nodes' acceptance (what the tree budget needs)."""
    return type(drafter).node_acceptance is not Drafter.node_acceptance


class Bound(NamedTuple):
    """A drafter with its params, as the host API takes it."""

    drafter: Drafter
    params: Any = ()


def check_pairing(drafters, verifier: str) -> None:
    """Refuse a verifier that is not lossless for some drafter's declared law, naming the exact ones."""
    if verifier not in VERIFIER_LAWS:
        raise InputError(f"unknown verifier {verifier!r}; choose from {tuple(VERIFIER_LAWS)}")
    for d in drafters:
        if d.law not in LAWS:
            raise InputError(f"drafter {d.describe()} declares law {d.law!r}; choose from {LAWS}")
        if d.law not in VERIFIER_LAWS[verifier]:
            exact = [v for v, laws in VERIFIER_LAWS.items() if d.law in laws]
            raise InputError(f"verifier {verifier!r} is not lossless for drafter {d.describe()} (entries drawn "
                             f"{_LAW_WORDS[d.law]}; {_WHY[verifier]}); lossless verifiers for it: {exact}")


_LAW_WORDS = {"onehot": "deterministically", "iid": "i.i.d. from a stored law",
              "wor": "without replacement from a stored law"}


def static_proposal_parents(parents: tuple[int, ...], batch: int) -> jax.Array:
    return np.broadcast_to(np.asarray(parents, np.int32), (batch, len(parents)))
