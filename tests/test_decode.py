"""Incremental decoding is the ground truth for every later equivalence test: test it hard."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.api import plan_generation
from specjax.decoding.buckets import MIN_CACHE, MIN_OUTPUT, cache_bucket, output_bucket
from specjax.decoding.incremental import full_logits, generate_incremental_jit
from specjax.decoding.sampling import SamplingArrays, SamplingParams, warp_logits
from tests.conftest import random_ids


@pytest.fixture(scope="module", params=["llama", "opt"])
def model(request, tiny_llama_dir, tiny_opt_dir):
    path = tiny_llama_dir if request.param == "llama" else tiny_opt_dir
    return specjax.load_model(path, progress=False)


def test_cached_decoding_equals_full_recompute_argmax(model):
    rng = np.random.RandomState(0)
    prompt = random_ids(rng, model.config.vocab_size, 11)
    out = specjax.generate(model, [prompt], max_new_tokens=20, ignore_eos=True, mode="incremental").token_ids[0]
    seq = list(prompt)
    for step, tok in enumerate(out):
        full = specjax.logits(model, [seq])[0]
        assert int(np.argmax(full[-1])) == tok, f"step {step}: cached decode diverged from full recompute"
        seq.append(tok)


def test_batched_equals_one_at_a_time(model):
    rng = np.random.RandomState(1)
    prompts = [random_ids(rng, model.config.vocab_size, n) for n in (3, 17, 9, 30)]
    batched = specjax.generate(model, prompts, max_new_tokens=16, ignore_eos=True, mode="incremental").token_ids
    for p, b in zip(prompts, batched):
        assert specjax.generate(model, [p], max_new_tokens=16, ignore_eos=True, mode="incremental").token_ids[0] == b


def test_eos_stops_request_and_is_included(model):
    rng = np.random.RandomState(2)
    prompt = random_ids(rng, model.config.vocab_size, 7)
    free = specjax.generate(model, [prompt], max_new_tokens=12, ignore_eos=True, mode="incremental").token_ids[0]
    eos = free[4]  # declare the 5th generated token to be EOS: generation must stop right there
    cut = free.index(eos) + 1
    m = specjax.Model(model.config.__class__.from_dict({**model.config.to_dict(), "eos_token_ids": (eos,)}),
                      model.params, None)
    got = specjax.generate(m, [prompt, prompt[:3]], max_new_tokens=12, mode="incremental").token_ids
    assert got[0] == free[:cut]
    assert len(got[1]) <= 12 and (got[1][-1] == eos or len(got[1]) == 12)
    assert eos not in got[1][:-1]


@pytest.mark.parametrize("max_new", [1, 2, 13])
def test_max_new_tokens_is_exact(model, max_new):
    prompt = random_ids(np.random.RandomState(3), model.config.vocab_size, 5)
    res = specjax.generate(model, [prompt], max_new_tokens=max_new, ignore_eos=True, mode="incremental")
    assert len(res.token_ids[0]) == max_new
    assert res.stats["llm_passes"] == max_new  # prefill emits the first token, each pass one more


def test_prompt_lengths_in_one_bucket_do_not_recompile(model):
    """Every prompt that fits the first cache bucket (a one-token prompt and one of 900 tokens alike)
    runs the same compiled program: prefill reads only the chunks a prompt needs."""
    rng = np.random.RandomState(4)
    specjax.generate(model, [random_ids(rng, model.config.vocab_size, 20)], max_new_tokens=8, mode="incremental")
    before = generate_incremental_jit._cache_size()
    for n in (1, 17, 70, 300, 900):
        res = specjax.generate(model, [random_ids(rng, model.config.vocab_size, n)], max_new_tokens=8,
                               mode="incremental")
        assert res.stats["cache_len"] == MIN_CACHE
    assert generate_incremental_jit._cache_size() == before


def test_output_lengths_up_to_the_floor_do_not_recompile(model):
    """Asking for 6, 16, 64 or 128 new tokens runs one program: the output buffer has a floor
    (MIN_OUTPUT), and the stop is the traced max_new_tokens, so each request still stops where asked.
    The cache keeps the new tokens' own power of two (a 900-token prompt + 16 tokens fits 1024)."""
    rng = np.random.RandomState(7)
    prompt = random_ids(rng, model.config.vocab_size, 9)
    specjax.generate(model, [prompt], max_new_tokens=5, ignore_eos=True, mode="incremental")
    before = generate_incremental_jit._cache_size()
    for n in (6, 16, 64, MIN_OUTPUT):
        res = specjax.generate(model, [prompt], max_new_tokens=n, ignore_eos=True, mode="incremental")
        assert len(res.token_ids[0]) == n
    assert generate_incremental_jit._cache_size() == before
    assert output_bucket(MIN_OUTPUT + 1) == 2 * MIN_OUTPUT
    plan = plan_generation(model, [random_ids(rng, model.config.vocab_size, 900)], max_new_tokens=16,
                           chat_template=False, mode="incremental")
    assert (plan.max_out, plan.cache_len) == (MIN_OUTPUT, MIN_CACHE)


def test_cache_buckets_are_few_and_shrink_for_wide_batches():
    assert [cache_bucket(n) for n in (1, 1024, 1025, 4096, 4097, 8193)] == [1024, 1024, 4096, 4096, 8192, 16384]
    assert cache_bucket(200, batch=16) == 1024  # 16 x 768 padded slots: within MAX_PADDING_SLOTS
    assert cache_bucket(200, batch=64) == 256  # 64 x 768 would not be: the next power of two
    assert cache_bucket(3000, batch=64) == 4096  # nothing padded beyond the power of two anyway


def test_sampling_follows_the_positional_gumbel_definition(model):
    """Token t must be argmax(warp(logits) + Gumbel(fold_in(key(seed), t))), t = absolute position."""
    prompt = random_ids(np.random.RandomState(5), model.config.vocab_size, 6)
    sp = SamplingParams(temperature=0.9, top_k=20, top_p=0.8, seed=1234)
    out = specjax.generate(model, [prompt], max_new_tokens=10, sampling=sp, ignore_eos=True,
                           mode="incremental").token_ids[0]
    seq = list(prompt)
    arrays = SamplingArrays.from_params([sp])
    for tok in out:
        logits = specjax.logits(model, [seq])[0][-1]
        warped = np.asarray(warp_logits(jnp.asarray(logits)[None], arrays))[0]
        key = jax.random.fold_in(jax.random.key(1234), len(seq))
        noise = np.asarray(jax.random.gumbel(key, (logits.shape[-1],), jnp.float32))
        assert int(np.argmax(warped + noise)) == tok
        seq.append(tok)


def test_seeded_sampling_is_independent_of_batch_slot(model):
    rng = np.random.RandomState(6)
    a, b = (random_ids(rng, model.config.vocab_size, n) for n in (5, 12))
    sp_a, sp_b = SamplingParams(temperature=1.0, seed=7), SamplingParams(temperature=0.7, top_p=0.9, seed=8)
    ab = specjax.generate(model, [a, b], max_new_tokens=12, sampling=[sp_a, sp_b], ignore_eos=True,
                          mode="incremental").token_ids
    ba = specjax.generate(model, [b, a], max_new_tokens=12, sampling=[sp_b, sp_a], ignore_eos=True,
                          mode="incremental").token_ids
    assert ab == ba[::-1]
    other_seed = specjax.generate(model, [a], max_new_tokens=12, sampling=SamplingParams(temperature=1.0, seed=9),
                                  ignore_eos=True, mode="incremental").token_ids[0]
    assert other_seed != ab[0], "different seeds should give different samples on a random model"


def test_generate_core_is_callable_inside_user_jit(model):
    prompts = jnp.asarray([[3, 4, 5, 0], [7, 8, 9, 10]], jnp.int32)
    lens = jnp.asarray([3, 4], jnp.int32)
    sampling = SamplingArrays.from_params([SamplingParams()] * 2)

    @jax.jit
    def user_program(params):
        out = specjax.generate_incremental(params, prompts, lens, jnp.asarray([6, 6]), sampling,
                                           cfg=model.config, cache_len=16, max_out=8)
        return out.tokens[:, :6]

    got = np.asarray(user_program(model.params)).tolist()
    want = specjax.generate(model, [[3, 4, 5], [7, 8, 9, 10]], max_new_tokens=6, ignore_eos=True,
                            mode="incremental").token_ids
    assert got == want


def test_full_logits_ignore_right_padding(model):
    seq = random_ids(np.random.RandomState(7), model.config.vocab_size, 9)
    padded = jnp.asarray([seq + [0] * 7], jnp.int32)
    a = np.asarray(full_logits(model.params, padded, cfg=model.config))[0, :9]
    b = specjax.logits(model, [seq])[0]
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kind,lengths", [("llama", (589, 257)), ("opt", (589, 257)), ("llama", (900, 40))],
                         ids=["llama-tail-chunks", "opt-tail-chunks", "llama-every-size"])
def test_long_prompts_prefill_in_chunks_and_match_transformers(kind, lengths, tmp_path):
    """Prompts longer than a chunk (in one batch of different lengths) are read in chunks of
    PREFILL_CHUNKS = (512, 256, 64), the longest prompt of the batch setting every loop's trip count
    (589 and 257 tokens: one 512-token chunk and two 64-token ones; 900 and 40: one chunk of each
    size, then three of the smallest): the first token's logits match transformers' float64 ones as
    closely as transformers' float32 ones do, and the greedy continuation is transformers' float64
    argmax at every step."""
    import copy

    import torch

    from specjax.decoding.incremental import PREFILL_CHUNKS, prefill
    from specjax.models.cache import init_cache
    from tests import precision
    from tests.conftest import make_hf_model

    hf = make_hf_model(kind, str(tmp_path), max_position_embeddings=2048)
    model = specjax.load_model(str(tmp_path), progress=False)
    rng = np.random.RandomState(3)
    prompts = [random_ids(rng, model.config.vocab_size, n) for n in lengths]
    assert PREFILL_CHUNKS == (512, 256, 64), "the lengths above are chosen for these sizes"
    width = 2 * PREFILL_CHUNKS[0]
    padded = jnp.asarray([p + [0] * (width - len(p)) for p in prompts], jnp.int32)
    lens = jnp.asarray([len(p) for p in prompts], jnp.int32)
    logits, cache = jax.jit(prefill, static_argnames="cfg")(model.params, padded, lens,
                                                            init_cache(model.config, 2, width + 8), cfg=model.config)
    np.testing.assert_array_equal(np.asarray(cache.length), np.asarray(lens))
    hf64 = copy.deepcopy(hf).double()
    with torch.no_grad():
        for b, p in enumerate(prompts):
            ref = hf64(torch.tensor([p])).logits[0, -1].numpy()
            floor = precision.error(hf(torch.tensor([p])).logits[0, -1].numpy(), ref)
            precision.assert_within(np.asarray(logits)[b], ref, floor, what=f"{kind} prefill of {len(p)} tokens")
    # greedy continuation: each token is the argmax of transformers' float64 forward over everything
    # before it (transformers' own cached generate is not the oracle here: at this context it flips a
    # near tie of 1e-3 that both full forwards agree on)
    out = specjax.generate(model, prompts, max_new_tokens=6, ignore_eos=True, mode="incremental")
    with torch.no_grad():
        for p, got in zip(prompts, out.token_ids):
            want = hf64(torch.tensor([p + got])).logits[0, len(p) - 1:-1].numpy().argmax(-1).tolist()
            assert got == want
