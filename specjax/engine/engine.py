"""The engine: a fixed number of request slots stepping together, requests joining and leaving between
LLM passes (iteration-level scheduling, the paper's request manager).

The seams follow JetStream's engine API: ``prefill`` runs one request's prompt into a batch-1 state,
``insert`` writes it into a slot of the running batch, ``step`` advances every slot by one
speculative step (one LLM pass, the same jitted ``spec_step`` that ``generate_speculative`` loops
over), ``read`` fetches what each slot has emitted, ``release`` frees a slot. Every request keeps
its own sampling settings, budget, stop tokens and statistics in its row of the state, so its tokens
never depend on its slot, on its batch mates or on when it joined (position-keyed randomness). The
batch state is donated to ``step`` and ``insert``: the caches are updated in place.

Token ids in, token ids out: tokenisation, chat templates and scheduling policy live above.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax.attention import resolve_impl
from specjax.decoding.buckets import next_pow2
from specjax.decoding.programs import step_drafter_params, step_program
from specjax.decoding.sampling import SamplingArrays, SamplingParams
from specjax.errors import InputError
from specjax.memory import check_cache_fits, local_devices_of
from specjax.speculation.budget import Budget, default_levels
from specjax.speculation.cost import pass_head, with_costs
from specjax.speculation.drafters.base import Bound
from specjax.speculation.loop import init_state, init_state_jit, spec_step
from specjax.speculation.request import check_positions, check_spec
from specjax.speculation.spec import SpecConfig
from specjax.speculation.state import NO_STOP, SpecState, release_row, write_row
from specjax.types import Model
from specjax.x32 import in_32_bit


@dataclasses.dataclass(frozen=True)
class SlotView:
    """What the host sees of every slot after a step (numpy)."""

    tokens: np.ndarray  # [B, M] generated tokens (valid up to num_generated)
    num_generated: np.ndarray  # [B]
    done: np.ndarray  # [B] finished or free
    failed: np.ndarray  # [B]
    tokens_per_pass: np.ndarray  # [B, D + 2] histogram of tokens emitted per LLM pass (this request's passes)


class Engine:
    """Continuous batching over ``slots`` request slots.

    drafters: ``Bound(drafter, params)`` pairs (none = plain decoding through the same step).
    verifier: "seeded" (default) serves greedy requests exactly and sampled ones bit-identically to
    incremental sampling with their seed; "greedy", "naive", "mss" or "rrs" as in ``SpecConfig``.
    Sizes are fixed at construction so every step reuses one compiled program: a prompt may have up
    to ``max_prompt_tokens`` tokens (every prompt is padded to one width: one compiled prefill) and a
    request up to ``max_new_tokens`` new tokens and ``max_stop_tokens`` stop tokens. budget: None
    (verify whole proposals), "auto" (the tree budget with this machine's measured pass costs at
    ``slots`` requests and goal "rate": slots are refilled as requests end, so emitted tokens per
    second is what counts) or a ``Budget`` (``specjax.speculation.budget``; one without costs gets
    this machine's, as "auto" does). progress: called with a tree size before each pass-cost
    measurement (none when the table is cached).
    """

    @in_32_bit
    def __init__(self, model: Model, *, slots: int, max_prompt_tokens: int, max_new_tokens: int, drafters=(),
                 verifier: str = "seeded", impl: str = "auto", max_stop_tokens: int = 4, budget=None,
                 progress=None):
        for name, value in (("slots", slots), ("max_prompt_tokens", max_prompt_tokens),
                            ("max_new_tokens", max_new_tokens), ("max_stop_tokens", max_stop_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"{name} must be a positive int, got {value!r}")
        if max_prompt_tokens + max_new_tokens > model.config.max_positions:
            raise InputError(f"max_prompt_tokens + max_new_tokens = {max_prompt_tokens + max_new_tokens} exceeds the "
                             f"context window of {model.config.max_positions}")
        bound = [d if isinstance(d, Bound) else Bound(*d) for d in drafters]
        self.model = model
        self.slots = slots
        drafter_objs = tuple(b.drafter for b in bound)
        spec = SpecConfig(drafters=drafter_objs, impl=resolve_impl(impl), verifier=verifier)
        check_spec(model.config, spec)  # before the budget measures any pass cost
        check_positions(spec, max_prompt_tokens + max_new_tokens, "max_prompt_tokens + max_new_tokens")
        # the cache is at least the padded prompt and output widths (its tree slots come on top)
        check_cache_fits(model.config, slots, next_pow2(max_prompt_tokens) + next_pow2(max_new_tokens),
                         jax.tree.leaves(model.params)[0].dtype,
                         f"slots={slots} with max_prompt_tokens={max_prompt_tokens}, max_new_tokens={max_new_tokens}",
                         devices=local_devices_of(model.params))
        if budget is not None and budget != "auto" and not isinstance(budget, Budget):
            raise InputError(f"budget must be None, 'auto' or a Budget, got {budget!r}")
        if budget == "auto":
            # solo=False: the engine calls a step program per pass (see default_levels)
            budget = Budget(default_levels(drafter_objs, solo=False), goal="rate") if drafter_objs else None
        if budget is not None:  # a Budget without costs gets this machine's, as specjax.generate gives it
            budget = with_costs(budget, model.params, model.config, slots, resolve_impl(impl), progress=progress,
                                head=pass_head(verifier))
        self.spec = dataclasses.replace(spec, budget=budget)
        # the drafters' matmul weights packed for the CPU kernel, where it runs
        self.drafter_params = step_drafter_params(drafter_objs, tuple(b.params for b in bound))
        self.max_prompt_tokens = max_prompt_tokens
        self.max_new_tokens = max_new_tokens
        self.max_stop_tokens = max_stop_tokens
        self.max_out = next_pow2(max_new_tokens)
        # Every prompt is padded to one width: prefill reads only the chunks a prompt needs, so one
        # compiled prefill serves every prompt length.
        self.prompt_width = next_pow2(max_prompt_tokens)
        self.cache_len = self.prompt_width + self.max_out + self.spec.num_nodes
        # The budget's pass costs go to the step as an array (``SpecConfig.costs_apart``), not compiled in.
        loop_spec, pass_costs = self.spec.costs_apart()
        costs = {} if pass_costs is None else {"pass_costs": pass_costs}
        self._sizes = dict(cfg=model.config, spec=loop_spec, cache_len=self.cache_len, max_out=self.max_out)
        self._shapes: dict = {}  # rows -> the state's shapes (``_state_shapes``)
        # Compiled with the matmul library for this many slots (``specjax.decoding.programs``).
        self._step = step_program(spec_step, slots, ("cfg", "spec", "parallel"), ("state",)).bind(
            model.params, self.drafter_params, cfg=model.config, spec=loop_spec, **costs)

    # -- device work --------------------------------------------------------------------------

    def _state_shapes(self, rows: int):
        """The shapes and dtypes of a state of ``rows`` requests (``slots``: a batch state; 1: a prefilled row)."""
        if rows not in self._shapes:
            greedy = _sampling([SamplingParams()] * rows)
            self._shapes[rows] = jax.eval_shape(
                functools.partial(init_state, **self._sizes), self.model.params, self.drafter_params,
                jnp.zeros((rows, 1), jnp.int32), jnp.ones((rows,), jnp.int32), jnp.ones((rows,), jnp.int32), greedy,
                jnp.full((rows, self.max_stop_tokens), NO_STOP, jnp.int32))
        return self._shapes[rows]

    def _check_state(self, state, rows: int, what: str) -> None:
        """``state`` is one of this engine's, of ``rows`` requests: a row of another engine, or a whole batch
        state passed as a row, would be scattered partly or not at all, and the request lost silently."""
        deleted = [a for a in jax.tree.leaves(state) if isinstance(a, jax.Array) and a.is_deleted()]
        if deleted:  # XLA's own error named a buffer number and "deleted or donated", not the state or the fix
            raise InputError(f"{what} was donated to an earlier step() or insert() (its buffers are gone): pass on "
                             f"the state that call returned")
        want = self._state_shapes(rows)
        try:
            same = jax.tree.structure(state) == jax.tree.structure(want) and all(
                tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype
                for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(want)))
        except AttributeError:  # leaves without a shape
            same = False
        if not same:
            got = getattr(getattr(state, "tokens", None), "shape", type(state).__name__)
            source = "this engine's prefill()" if rows == 1 else "this engine's init(), insert() or step()"
            raise InputError(f"{what} is not a state of this engine's {rows} request(s) (its tokens: {got}, "
                             f"expected {tuple(want.tokens.shape)}); pass one from {source}")

    @in_32_bit
    def init(self) -> SpecState:
        """A batch state with every slot free."""
        greedy = _sampling([SamplingParams()] * self.slots)
        state = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self._state_shapes(self.slots))
        # Free slots still run through every step: give them valid (greedy) settings, not zeros
        return state.replace(done=jnp.ones((self.slots,), bool), sampling=greedy,
                             stop_ids=jnp.full((self.slots, self.max_stop_tokens), NO_STOP, jnp.int32))

    @in_32_bit
    def prefill(self, prompt: list[int], sampling: SamplingParams | None = None, max_new_tokens: int | None = None,
                stop_ids=()) -> SpecState:
        """One request's prompt through the LLM and the drafters: a batch-1 state holding its first token."""
        prompt, sampling, budget, stops = self._check(prompt, sampling, max_new_tokens, stop_ids)
        padded = jnp.asarray([prompt + [0] * (self.prompt_width - len(prompt))], jnp.int32)
        return init_state_jit(self.model.params, self.drafter_params, padded, jnp.asarray([len(prompt)], jnp.int32),
                              jnp.asarray([budget], jnp.int32), _sampling([sampling]), jnp.asarray([stops], jnp.int32),
                              **self._sizes)

    @in_32_bit
    def insert(self, state: SpecState, row: SpecState, slot: int) -> SpecState:
        """``state`` with ``row`` (from ``prefill``) in slot ``slot`` (whatever the slot held is dropped)."""
        self._check_slot(slot)
        self._check_state(state, self.slots, "state")
        self._check_state(row, 1, "row")
        return _insert_jit(state, row, jnp.int32(slot))

    @in_32_bit
    def step(self, state: SpecState) -> SpecState:
        """One speculative step (one LLM pass) of every slot; finished and free slots stay as they are."""
        self._check_state(state, self.slots, "state")
        return self._step(state)

    @in_32_bit
    def release(self, state: SpecState, slot: int) -> SpecState:
        """Free slot ``slot`` (a finished or cancelled request): later steps skip it."""
        self._check_slot(slot)
        self._check_state(state, self.slots, "state")  # a row, or another engine's: out-of-range writes are dropped
        return _release_jit(state, jnp.int32(slot))

    @staticmethod
    def read(state: SpecState) -> SlotView:
        return SlotView(tokens=np.asarray(state.tokens), num_generated=np.asarray(state.num_generated),
                        done=np.asarray(state.done), failed=np.asarray(state.failed),
                        tokens_per_pass=np.asarray(state.tokens_per_pass))

    # -- checks (before any device work) ------------------------------------------------------

    def _check(self, prompt, sampling, max_new_tokens, stop_ids):
        vocab = self.model.config.vocab_size
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise InputError("a prompt must be a non-empty list of token ids")
        if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab for t in prompt):
            raise InputError(f"prompt token ids must be ints in [0, {vocab})")
        if len(prompt) > self.max_prompt_tokens:
            raise InputError(f"the prompt has {len(prompt)} tokens; this engine takes at most {self.max_prompt_tokens}")
        sampling = SamplingParams() if sampling is None else sampling
        if not isinstance(sampling, SamplingParams):
            raise InputError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        if not sampling.greedy and self.spec.verifier == "greedy":
            raise InputError("this engine verifies greedily but the request has temperature > 0")
        budget = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or not 1 <= budget <= \
                self.max_new_tokens:
            raise InputError(f"max_new_tokens must be an int in [1, {self.max_new_tokens}], got {max_new_tokens!r}")
        if isinstance(stop_ids, (str, bytes)) or not isinstance(stop_ids, (list, tuple, np.ndarray)) or any(
                isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)) for t in stop_ids):
            raise InputError(f"stop_ids must be a list of int token ids, got {stop_ids!r:.80}")  # never rounded
        stops = [int(t) for t in stop_ids]
        if len(stops) > self.max_stop_tokens or any(not 0 <= t < vocab for t in stops):
            raise InputError(f"stop_ids: at most {self.max_stop_tokens} token ids in [0, {vocab}), got {stops}")
        return [int(t) for t in prompt], sampling, int(budget), stops + [NO_STOP] * (self.max_stop_tokens - len(stops))

    def _check_slot(self, slot) -> None:
        if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)) or not 0 <= slot < self.slots:
            raise InputError(f"slot must be an int in [0, {self.slots}), got {slot!r}")


def _sampling(params: list[SamplingParams]) -> SamplingArrays:
    return SamplingArrays.from_params(params)


_insert_jit = jax.jit(write_row, donate_argnums=0)
_release_jit = jax.jit(release_row, donate_argnums=0)
