"""The drafter interface: a drafter defined outside the package (here, in a test) speculates through
the same loop, merges with SSM drafters, is checked by its declared law, and a drafter that reads the
LLM's hidden states receives exactly the hidden states of the accepted nodes."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.attention.meta import causal_meta
from specjax.errors import InputError
from specjax.models import forward
from specjax.models.cache import init_cache
from specjax.speculation.drafters.base import Drafter, Proposal
from specjax.speculation.drafters.ssm import derive_ssm, ssm_drafters
from specjax.speculation.loop import SpecConfig, init_state_jit, step_jit
from specjax.speculation.state import stop_rows
from tests import precision
from tests.conftest import random_ids


@dataclasses.dataclass(frozen=True)
class RepeatDrafter(Drafter):
    """Proposes a chain repeating the root token (deterministic): right on repetitive text only."""

    depth: int = 2

    @property
    def law(self):
        return "onehot"

    @property
    def num_nodes(self):
        return self.depth

    @property
    def max_depth(self):
        return self.depth

    def static_parents(self):
        return tuple(range(-1, self.depth))

    def propose(self, params, state, ctx):
        root = jnp.take_along_axis(ctx.history, ctx.length[:, None], axis=1)
        batch = root.shape[0]
        tokens = jnp.broadcast_to(root, (batch, self.depth + 1)).astype(jnp.int32)
        parents = jnp.broadcast_to(jnp.arange(-1, self.depth, dtype=jnp.int32), (batch, self.depth + 1))
        return Proposal(tokens=tokens, parent=parents, ok=jnp.ones((batch, self.depth + 1), bool),
                        law_row=jnp.full((batch, self.depth + 1), -1, jnp.int32)), state


@dataclasses.dataclass(frozen=True)
class HiddenRecorder(RepeatDrafter):
    """Records the LLM's final hidden state at the last accepted node, and that node's position."""

    hidden_size: int = 0

    @property
    def hidden_layers(self):
        return (self.layers,)

    layers: int = 0

    def init(self, params, prompt_tokens, prompt_lens, *, cache_len, parallel=None, hidden=None, first=None):
        batch = prompt_tokens.shape[0]
        return (jnp.zeros((batch, self.hidden_size), jnp.float32), jnp.full((batch,), -1, jnp.int32))

    def commit(self, params, state, accepted):
        last = jnp.take_along_axis(accepted.hidden[:, :, 0], accepted.num_accepted[:, None, None], axis=1)[:, 0]
        chex.assert_shape(last, (accepted.length.shape[0], self.hidden_size))
        moved = accepted.num_emitted > 0
        return (jnp.where(moved[:, None], last, state[0]), jnp.where(moved, accepted.length - 1, state[1]))


def test_a_new_drafter_speculates_and_merges_losslessly(llama):
    rng = np.random.RandomState(5)
    prompts = [random_ids(rng, 128, n) for n in (5, 12)] + [[9, 9, 9, 9, 9, 9]]
    want = specjax.generate(llama, prompts, max_new_tokens=16, ignore_eos=True, mode="incremental")
    alone = specjax.generate(llama, prompts, max_new_tokens=16, ignore_eos=True, drafters=[(RepeatDrafter(), ())])
    assert alone.token_ids == want.token_ids
    assert alone.stats["drafters"] == ["RepeatDrafter"]
    ssm = derive_ssm(llama, 1)
    merged = specjax.generate(llama, prompts, max_new_tokens=16, ignore_eos=True, ssms=[ssm], expansion=(2, 1),
                              drafters=[specjax.Bound(RepeatDrafter(3))])
    assert merged.token_ids == want.token_ids
    assert merged.stats["tree_nodes"] == 1 + 4 + 3
    seeded = specjax.SamplingParams(temperature=0.9, seed=3)
    inc = specjax.generate(llama, prompts, max_new_tokens=16, ignore_eos=True, sampling=seeded, mode="incremental")
    spec = specjax.generate(llama, prompts, max_new_tokens=16, ignore_eos=True, sampling=seeded,
                            drafters=[(RepeatDrafter(), ())], verifier="seeded")
    assert spec.token_ids == inc.token_ids


def test_pairing_asks_the_declared_law(llama):
    @dataclasses.dataclass(frozen=True)
    class Iid(RepeatDrafter):
        @property
        def law(self):
            return "iid"

    SpecConfig((Iid(),), verifier="mss")  # i.i.d. entries: exact under MSS
    with pytest.raises(InputError, match=r"verifier 'rrs' is not lossless for drafter Iid .*lossless verifiers for "
                                         r"it: \['greedy', 'seeded', 'naive', 'mss'\]"):
        SpecConfig((Iid(),), verifier="rrs")
    ssm = derive_ssm(llama, 1)
    with pytest.raises(InputError, match="is not lossless for drafter ssm"):
        SpecConfig(ssm_drafters([ssm.config], [(2,)], "wor") + (RepeatDrafter(),), verifier="mss")
    with pytest.raises(InputError, match="must be a tuple of Drafter objects"):
        SpecConfig(drafters=(ssm.config,))


def test_a_drafter_declaring_one_hot_entries_is_verified_one_hot(llama):
    """check_pairing asks the declared law: a drafter that declares deterministic drafts but returns laws
    anyway must not have its entries verified against them (MSS against its q is the biased top-k rule)."""
    from specjax.speculation.loop import propose_all

    @dataclasses.dataclass(frozen=True)
    class ReturnsLaws(RepeatDrafter):
        def propose(self, params, state, ctx):
            proposal, state = super().propose(params, state, ctx)
            batch, vocab = proposal.tokens.shape[0], llama.config.vocab_size
            return proposal.replace(law_row=jnp.zeros_like(proposal.law_row),
                                    laws=jnp.full((batch, 1, vocab), -np.log(vocab), jnp.float32)), state

    sampling = specjax.SamplingArrays.from_params([specjax.SamplingParams(temperature=1.0, seed=1)])
    for fault, kept in ((None, False), ("allow_mss_on_topk", True)):  # the mutation test re-creates the rule
        spec = SpecConfig((ReturnsLaws(),), verifier="mss", impl="xla", fault=fault)
        state = init_state_jit(llama.params, ((),), jnp.asarray([[5, 6, 7, 0]], jnp.int32), jnp.asarray([3]),
                               jnp.asarray([4]), sampling, stop_rows((), 1), cfg=llama.config, spec=spec,
                               cache_len=16, max_out=8)
        (proposal,), _, _ = propose_all(((),), state, spec, sampling)
        assert (proposal.laws is not None) == kept
        assert (np.asarray(proposal.law_row) == (0 if kept else -1)).all()


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_hidden_state_drafter_receives_the_accepted_nodes_hidden_states(family, tiny_llama_dir, tiny_opt_dir):
    model = specjax.load_model(tiny_llama_dir if family == "llama" else tiny_opt_dir, progress=False)
    cfg = model.config
    drafter = HiddenRecorder(depth=2, hidden_size=cfg.hidden_size, layers=cfg.num_layers)
    spec = SpecConfig((drafter,), impl="xla")
    rng = np.random.RandomState(8)
    prompts = [random_ids(rng, cfg.vocab_size, 7), [3, 3, 3, 3, 3]]
    lens = jnp.asarray([len(p) for p in prompts], jnp.int32)
    padded = jnp.asarray([p + [0] * (16 - len(p)) for p in prompts], jnp.int32)
    max_new = jnp.full((2,), 12, jnp.int32)
    sampling = specjax.SamplingArrays.from_params([specjax.SamplingParams()] * 2)
    kw = dict(cfg=cfg, spec=spec)
    state = init_state_jit(model.params, ((),), padded, lens, max_new, sampling, stop_rows((), 2),
                           cache_len=16 + 16 + 3, max_out=16, **kw)

    @jax.jit
    def full(params, tokens):  # the final hidden states of a full causal recompute, every position
        meta = causal_meta(jnp.zeros((2,), jnp.int32))
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        cache = init_cache(cfg, 2, tokens.shape[1], jax.tree.leaves(params)[0].dtype)
        return forward(params, tokens, positions, cache, meta, cfg, hidden=(cfg.num_layers,)).hidden[:, :, 0]

    for _ in range(4):
        state = step_jit(model.params, ((),), state, **kw)
        recorded, position = (np.asarray(x) for x in state.drafter_states[0])
        assert (position >= 0).all()
        tokens = jnp.asarray(np.asarray(state.history)[:, :32])  # every committed position fits in 32
        with precision.float64():
            want = np.asarray(full(precision.params64(model.params), tokens))[np.arange(2), position]
        route32 = np.asarray(full(model.params, tokens))[np.arange(2), position]
        # the tree pass's states vs float64, within the float32 error of the causal recompute's
        precision.assert_within(recorded, want, precision.error(route32, want), what="hidden states handed over")
