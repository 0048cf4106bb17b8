"""T4: the real multi-step speculative loop on toy LMs (vocabulary 8, warps on) samples exactly the
target law: chi-square of the first 4 tokens over 3e5 requests, a z-test of the accepted length of
the first step against its exact value, and mutation tests for the drafting-side pitfalls."""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
import pytest

from specjax.speculation.drafters.ssm import ssm_drafters
from specjax.speculation.loop import (
    SpecConfig,
    generate_speculative_jit,
    init_state_jit,
    step_jit,
)
from specjax.speculation.state import stop_rows
from tests import oracle
from tests.stats import assert_fits, fits
from tests.toy import (
    ContextLaw,
    exact_sequence_law,
    perturbed,
    sampling_arrays,
    toy_model,
)

VOCAB = 8
PROMPT = [1, 2, 3]
NUM_TOKENS = 4
N_SAMPLES = 300_000
N_MUTANT = 100_000  # fewer samples only make a mutant harder to catch
CHUNK = 100_000

# name: (draft, verifier, expansions, temperature, top_k, top_p, SSMs (0 = close to the LLM, 1 = far))
CONFIGS = {
    "mss-iid": ("iid", "mss", [(2, 1)], 1.0, 5, 1.0, (0,)),
    "rrs-wor": ("wor", "rrs", [(3, 1)], 0.7, 0, 0.9, (0,)),
    "rrs-wor-far": ("wor", "rrs", [(1,)], 1.0, 0, 1.0, (1,)),
    "naive-topk": ("topk", "naive", [(2, 2)], 1.0, 0, 0.8, (0,)),
    "mss-merged": ("iid", "mss", [(1, 1), (2,)], 1.0, 6, 1.0, (0, 1)),
    # SSM 2 has a draft vocabulary (a shrunk head): tokens 1, 4, 6 have q = 0, the LLM still emits them
    "mss-draft-vocab": ("iid", "mss", [(2, 1)], 1.0, 0, 1.0, (2,)),
}
DRAFT_VOCAB = (0, 2, 3, 5, 7)


@functools.lru_cache(maxsize=1)
def _models():
    cfg, params = toy_model(VOCAB, 0, sharpness=1.5)
    near = perturbed(params, 1, 0.5)
    rows = np.asarray(DRAFT_VOCAB)
    shrunk = dict(near, embed=jnp.concatenate([near["embed"][rows], near["embed"][:1]]),
                  lm_head=jnp.concatenate([near["lm_head"][:, rows], near["lm_head"][:, 1:2]], axis=1))
    return cfg, params, [near, perturbed(params, 2, 1.0), shrunk]


def _ssm_cfg(i):
    cfg = _models()[0]
    return dataclasses.replace(cfg, draft_vocab=DRAFT_VOCAB) if i == 2 else cfg


def _spec(name, fault=None):
    draft, verifier, widths, *_, ssm_ids = CONFIGS[name]
    return SpecConfig(ssm_drafters([_ssm_cfg(i) for i in ssm_ids], widths, draft), impl="xla", verifier=verifier,
                      fault=fault)


def _sample(name, n, seed0=0, prompts=(PROMPT,), fault=None):
    """First NUM_TOKENS tokens of n requests (seeds seed0...) through generate_speculative; request i
    gets prompts[i % len(prompts)] (prompts of different lengths share one batch)."""
    _, _, widths, temperature, top_k, top_p, ssm_ids = CONFIGS[name]
    cfg, params, ssms = _models()
    spec = _spec(name, fault)
    width = max(len(p) for p in prompts) + 1
    table = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        table[i, :len(p)] = p
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    out = []
    for start in range(0, n, CHUNK):
        b = min(CHUNK, n - start)
        which = (start + np.arange(b)) % len(prompts)
        res = generate_speculative_jit(params, tuple(ssms[i] for i in ssm_ids), jnp.asarray(table[which]),
                                       jnp.asarray(lengths[which]), jnp.full((b,), NUM_TOKENS, jnp.int32),
                                       sampling_arrays(b, temperature, top_k, top_p,
                                                       seeds=seed0 + start + np.arange(b)),
                                       cfg=cfg, spec=spec, cache_len=width + 8 + spec.num_nodes, max_out=NUM_TOKENS)
        assert not np.asarray(res.failed).any()
        out += list(map(tuple, np.asarray(res.tokens).tolist()))
    return out


def _exact(name, prompt=PROMPT):
    _, _, _, temperature, top_k, top_p, _ = CONFIGS[name]
    cfg, params, _ = _models()
    return exact_sequence_law(cfg, params, list(prompt), NUM_TOKENS, temperature, top_k, top_p)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_t4_multi_step_loop_samples_the_target_law(name):
    assert_fits(_sample(name, N_SAMPLES), _exact(name), name)


def test_t4_requests_with_different_prompts_in_one_batch():
    """Each request is verified against its own target and its own draft laws (pitfall 12): two
    prompts of different lengths alternate in one batch; each half fits its own exact law."""
    other = [6, 0, 2, 5, 7]
    samples = _sample("mss-merged", 100_000, seed0=3_000_000, prompts=(PROMPT, other))
    assert_fits(samples[0::2], _exact("mss-merged"), "prompt A")
    assert_fits(samples[1::2], _exact("mss-merged", other), "prompt B")


def test_t4_expected_accepted_length_matches_the_oracle():
    """z-test: tokens emitted by the first speculative step (accepted + 1) vs its exact expectation,
    computed by the float64 oracle from the same toy models' conditionals."""
    name = "mss-iid"
    _, _, widths, temperature, top_k, top_p, _ = CONFIGS[name]
    cfg, params, ssms = _models()
    spec = _spec(name)
    p0 = ContextLaw(cfg, params, PROMPT, temperature, top_k, top_p)
    exact = 0.0
    for y1 in range(VOCAB):  # the first token comes from prefill; the step's root is y1
        if p0(()) [y1] == 0:
            continue
        p = ContextLaw(cfg, params, PROMPT + [y1], temperature, top_k, top_p)
        q = ContextLaw(cfg, ssms[0], PROMPT + [y1], temperature, top_k, top_p)
        law = oracle.tree_law(p, [q], [q], widths, "iid", "mss")
        exact += p0(())[y1] * sum(pr * len(seq) for seq, pr in law.items())
    n = CHUNK
    prompts = jnp.asarray(np.tile(np.asarray(PROMPT + [0], np.int32), (n, 1)))
    s = sampling_arrays(n, temperature, top_k, top_p, seeds=7_000_000 + np.arange(n))
    max_new = jnp.full((n,), 16, jnp.int32)
    kw = dict(cfg=cfg, spec=spec)
    state = init_state_jit(params, (ssms[0],), prompts, jnp.full((n,), 3, jnp.int32), max_new, s, stop_rows((), n),
                           cache_len=24 + spec.num_nodes, max_out=16, **kw)
    state = step_jit(params, (ssms[0],), state, **kw)
    emitted = np.asarray(state.num_generated) - 1
    z = (emitted.mean() - exact) / (emitted.std() / np.sqrt(n))
    assert abs(z) < 4.9, f"mean tokens per step {emitted.mean():.4f} vs exact {exact:.4f} (z = {z:.1f})"
    assert 1.3 < exact < 2.9, f"uninformative configuration: exact mean {exact:.3f}"


DRAFT_MUTANTS = {  # mutation: (config, how the mutant is set up)
    "allow_mss_on_topk": "naive-topk",  # run with verifier mss on top-k drafts (the paper's rule)
    "greedy_first_token": "mss-iid",
    "law_wrong_temperature": "rrs-wor",
    "residual_draft_noise": "rrs-wor-far",
}


@pytest.mark.parametrize("mutation", list(DRAFT_MUTANTS))
def test_mutant_fails_t4(mutation):
    name = DRAFT_MUTANTS[mutation]
    exact = _exact(name)
    try:
        if mutation == "allow_mss_on_topk":
            CONFIGS["mss-on-topk"] = ("topk", "mss") + CONFIGS[name][2:]
            name = "mss-on-topk"
        samples = _sample(name, N_MUTANT, seed0=10_000_000, fault=mutation)
    finally:
        CONFIGS.pop("mss-on-topk", None)
    assert not fits(samples, exact), f"mutation {mutation} was not detected on {name}"
