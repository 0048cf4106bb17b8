"""Greedy tree speculation produces exactly the incremental tokens, with any SSM; merge; one jit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import specjax
from specjax.errors import InputError
from specjax.io.hf_export import export_hf
from specjax.models import init_params
from specjax.speculation.drafters.base import Proposal
from specjax.speculation.drafters.merge import merge_proposals
from specjax.speculation.drafters.ssm import SSMDrafter, derive_ssm, ssm_drafters
from specjax.speculation.expansion import Expansion
from specjax.speculation.loop import (
    SpecConfig,
    generate_speculative_jit,
    generate_stream,
)
from specjax.speculation.tree import root_path
from tests import precision
from tests.conftest import random_ids


@pytest.fixture(scope="module")
def opt(tiny_opt_dir):
    return specjax.load_model(tiny_opt_dir, progress=False)


def _random_ssm(like, family="llama", seed=0):
    """A deliberately useless SSM: a random model sharing only the vocabulary."""
    import dataclasses

    cfg = dataclasses.replace(like.config, family=family, num_layers=1, hidden_size=32, intermediate_size=48,
                              num_heads=2, num_kv_heads=2 if family == "opt" else 1, head_dim=16,
                              word_embed_proj_dim=None, tie_word_embeddings=True, rope_scaling=None)
    return specjax.Model(cfg, init_params(cfg, jax.random.key(seed), scale=0.5), like.tokenizer)


PROMPT_LENS = (5, 13, 1, 30)  # a mixed-length batch of 4


@pytest.mark.parametrize("family", ["llama", "opt"])
@pytest.mark.parametrize("setup", ["tree-derived", "tree-random-crossfamily", "sequence", "wide", "merge2", "merge3"])
def test_speculative_equals_incremental(request, family, setup):
    llm = request.getfixturevalue(family)
    rng = np.random.RandomState(hash((family, setup)) % 2**31)
    prompts = [random_ids(rng, llm.config.vocab_size, n) for n in PROMPT_LENS]
    derived = derive_ssm(llm, 1)
    other = "opt" if family == "llama" else "llama"
    kw = {
        "tree-derived": dict(mode="tree", ssms=[derived]),
        "tree-random-crossfamily": dict(mode="tree", ssms=[_random_ssm(llm, other)]),
        "sequence": dict(mode="sequence", ssms=[derived], expansion=(1, 1, 1, 1, 1)),
        "wide": dict(mode="tree", ssms=[llm], expansion=(4, 2, 1)),
        "merge2": dict(mode="tree", ssms=[derived, _random_ssm(llm, family)], expansion=[(1, 1, 3, 1), (2, 2)]),
        "merge3": dict(mode="tree", ssms=[derived, llm, _random_ssm(llm, other, 1)], expansion=(1, 2, 1)),
    }[setup]
    for ignore_eos in (True, False):  # the tiny models declare EOS = 5; both paths must cut identically
        want = specjax.generate(llm, prompts, max_new_tokens=37, ignore_eos=ignore_eos, mode="incremental").token_ids
        got = specjax.generate(llm, prompts, max_new_tokens=37, ignore_eos=ignore_eos, **kw)
        assert got.token_ids == want, f"{setup}: speculative output differs from incremental"
    for p, w in zip(prompts[:2], want[:2]):  # batch 1 as well (one prompt bucket: one compile)
        assert specjax.generate(llm, [p], max_new_tokens=37, **kw).token_ids[0] == w
    jax.clear_caches()  # each setup compiles new programs; see conftest._release_compiled_executables


def test_perfect_ssm_accepts_every_drafted_token(llama):
    prompts = [random_ids(np.random.RandomState(1), 128, 9)]
    res = specjax.generate(llama, prompts, max_new_tokens=41, ignore_eos=True, mode="sequence", ssms=[llama],
                           expansion=(1, 1, 1, 1))
    hist = res.stats["tokens_per_pass_histogram"]
    # 40 tokens after the prefill token, 5 per pass: 8 passes, every one full.
    assert hist == [0, 0, 0, 0, 0, 8] and res.stats["llm_passes"] == 9


def test_empty_tree_loop_equals_reference_decoder(llama):
    prompts = [random_ids(np.random.RandomState(2), 128, n) for n in (4, 17)]
    want = specjax.generate(llama, prompts, max_new_tokens=20, ignore_eos=True, mode="incremental").token_ids
    width, max_out = 32, 32
    padded = np.zeros((2, width), np.int32)
    for i, p in enumerate(prompts):
        padded[i, :len(p)] = p
    out = generate_speculative_jit(llama.params, (), jnp.asarray(padded), jnp.asarray([4, 17]),
                                   jnp.asarray([20, 20]), cfg=llama.config, spec=SpecConfig(), cache_len=80,
                                   max_out=max_out)
    got = [np.asarray(out.tokens[i, :20]).tolist() for i in range(2)]
    assert got == want and int(out.llm_passes) == 20


def _raw_args(model, prompts, width=32, max_new=24):
    padded = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        padded[i, :len(p)] = p
    return (jnp.asarray(padded), jnp.asarray([len(p) for p in prompts], jnp.int32),
            jnp.full((len(prompts),), max_new, jnp.int32))


def test_compiles_once_per_bucket_and_no_transfers_inside_the_loop(llama):
    ssm = derive_ssm(llama, 1)
    spec = SpecConfig(ssm_drafters([ssm.config], [(1, 2, 1)]), impl="xla")
    rng = np.random.RandomState(3)
    kw = dict(cfg=llama.config, spec=spec, cache_len=32 + 32 + spec.num_nodes, max_out=32)
    args = _raw_args(llama, [random_ids(rng, 128, 20)])
    jax.block_until_ready(generate_speculative_jit(llama.params, (ssm.params,), *args, **kw))
    before = generate_speculative_jit._cache_size()
    for n in (17, 25, 32):
        args = jax.device_put(_raw_args(llama, [random_ids(rng, 128, n)]))
        params = jax.device_put((llama.params, (ssm.params,)))
        with jax.transfer_guard("disallow"):  # the whole loop runs on device: no host round trip
            out = generate_speculative_jit(params[0], params[1], *args, **kw)
            jax.block_until_ready(out)
    assert generate_speculative_jit._cache_size() == before, "a new prompt in the same bucket recompiled"


def test_callable_inside_user_jit_and_streaming_twin_agrees(llama):
    ssm = derive_ssm(llama, 1)
    spec = SpecConfig(ssm_drafters([ssm.config], [(2, 1, 1)]), impl="xla")
    prompts = [random_ids(np.random.RandomState(4), 128, n) for n in (6, 11)]
    args = _raw_args(llama, prompts)
    kw = dict(cfg=llama.config, spec=spec, cache_len=32 + 32 + spec.num_nodes, max_out=32)

    @jax.jit
    def user_program(llm_params, ssm_params, *args):
        from specjax.speculation.loop import generate_speculative

        return generate_speculative(llm_params, ssm_params, *args, **kw).tokens

    tokens = np.asarray(user_program(llama.params, (ssm.params,), *args))
    streamed = [[], []]
    for chunk in generate_stream(llama.params, (ssm.params,), *args, **kw):
        for b, toks in enumerate(chunk):
            streamed[b] += toks
    want = specjax.generate(llama, prompts, max_new_tokens=24, ignore_eos=True, mode="incremental").token_ids
    assert streamed == want
    assert [tokens[b, :24].tolist() for b in range(2)] == want


def test_the_jittable_cores_refuse_inputs_that_are_not_one_batch(llama):
    """Inside a caller's jit these silently gave other tokens (a narrow cache), a vmap error naming no argument
    (a sampling batch of 1 for 2 prompts) or more generated tokens than the output holds."""
    from specjax.decoding.incremental import generate_incremental
    from specjax.speculation.loop import generate_speculative

    prompts = jnp.asarray([[1, 2, 3, 0], [4, 5, 0, 0]], jnp.int32)
    lens, budget = jnp.asarray([3, 2], jnp.int32), jnp.full((2,), 6, jnp.int32)
    sampling = specjax.SamplingArrays.from_params([specjax.SamplingParams()] * 2)
    ssm = derive_ssm(llama, 1)
    spec = SpecConfig(ssm_drafters([ssm.config], [(2, 1)]), impl="xla")
    cases = [
        (dict(sampling=specjax.SamplingArrays.from_params([specjax.SamplingParams()])),
         r"sampling.temperature must have shape \(2,\), one entry per prompt"),
        (dict(max_new=jnp.int32(6)), r"max_new_tokens must have shape \(2,\)"),
        (dict(cache_len=2), "cache_len=2 is narrower than the prompts' width T=4"),
        (dict(max_new=jnp.full((2,), 12, jnp.int32)), r"max_new_tokens must be in \[1, max_out=8\], got \[12, 12\]"),
        (dict(lens=jnp.asarray([0, 2], jnp.int32)), r"prompt_lens must be in \[1, 4\]"),
        # PRNG keys failed deep inside sampling ("key accepts a scalar seed"); seeds past 2**31 passed
        (dict(sampling=sampling.replace(seed=jax.random.split(jax.random.key(0), 2))),
         r"sampling.seed must be \[B\] int32 seeds in \[0, 2\*\*31\), one per request \(not PRNG keys\)"),
        (dict(sampling=sampling.replace(seed=jnp.asarray([1, 2**31 + 5], jnp.uint32))),
         r"sampling.seed must be in \[0, 2\*\*31\), got \[1, 2147483653\]"),
    ]
    # the tree's scratch slots after a request's tokens: a cache without them failed requests near their end
    # on the Pallas path (the tree's keys and values written past the end were dropped)
    with pytest.raises(InputError, match=rf"generate_speculative: prompt_lens \+ max_new_tokens \+ {spec.num_nodes} "
                                         rf"tree slots \[{9 + spec.num_nodes}, {8 + spec.num_nodes}\] exceed"):
        generate_speculative(llama.params, (ssm.params,), prompts, lens, budget, sampling, cfg=llama.config,
                             spec=spec, cache_len=9 + spec.num_nodes - 1, max_out=8)
    for change, message in cases:
        a = {**dict(lens=lens, max_new=budget, sampling=sampling, cache_len=32, max_out=8), **change}
        with pytest.raises(InputError, match="generate_incremental: " + message):
            jax.jit(lambda p, t: generate_incremental(p, t, a["lens"], a["max_new"], a["sampling"], cfg=llama.config,
                                                      cache_len=a["cache_len"], max_out=a["max_out"]))(
                llama.params, prompts)
        with pytest.raises(InputError, match="generate_speculative: " + message):
            generate_speculative(llama.params, (ssm.params,), prompts, a["lens"], a["max_new"], a["sampling"],
                                 cfg=llama.config, spec=spec, cache_len=a["cache_len"], max_out=a["max_out"])


def test_64_bit_types_switched_on_change_nothing(llama):
    """``jax_enable_x64`` (a global switch of much scientific JAX code) made every loop carry int64 and
    every speculative run a carry-type TypeError; the entry points now run in JAX's 32-bit types."""
    ssm = derive_ssm(llama, 1)
    prompts = [random_ids(np.random.RandomState(5), 128, n) for n in (6, 11)]
    seeded = specjax.SamplingParams(temperature=0.9, seed=3)
    want = [specjax.generate(llama, prompts, 8, ssms=[ssm], sampling=s, ignore_eos=True).token_ids
            for s in (None, seeded)]
    spec = SpecConfig(ssm_drafters([ssm.config], [(2, 1, 1)]), impl="xla")
    kw = dict(cfg=llama.config, spec=spec, cache_len=32 + 32 + spec.num_nodes, max_out=32)
    with jax.enable_x64(True):
        got = [specjax.generate(llama, prompts, 8, ssms=[ssm], sampling=s, ignore_eos=True).token_ids
               for s in (None, seeded)]
        padded = jnp.asarray([p + [0] * (32 - len(p)) for p in prompts])  # int64 under x64, as a user makes them
        assert padded.dtype == jnp.int64

        @jax.jit
        def user_program(llm_params, ssm_params, tokens, lens, max_new):
            from specjax.speculation.loop import generate_speculative

            return generate_speculative(llm_params, ssm_params, tokens, lens, max_new, **kw).tokens

        tokens = np.asarray(user_program(llama.params, (ssm.params,), padded, jnp.asarray([6, 11]),
                                         jnp.asarray([8, 8])))
    assert got == want
    assert [tokens[b, :8].tolist() for b in range(2)] == want[0]


# 12 random pool shapes (each new shape costs ~3 s of op compilation in eager mode) + the fixed cases below
@settings(max_examples=12, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(1, 3), min_size=1, max_size=3), st.integers(0, 2**31 - 1)),
                min_size=2, max_size=3), st.integers(2, 4))
def test_merge_holds_every_proposed_sequence_exactly_once(drafts, vocab):
    expansions = [Expansion(tuple(w)) for w, _ in drafts]
    token_sets = []
    for e, (_, seed) in zip(expansions, drafts):
        t = np.random.RandomState(seed).randint(0, vocab, (1, e.num_nodes)).astype(np.int32)  # small vocab: collisions
        t[:, 0] = 7
        token_sets.append(jnp.asarray(t))
    props = _proposals(expansions, token_sets)
    merged = merge_proposals(props, [tuple(e.topology()[0]) for e in expansions])
    proposals = []
    for e, toks in zip(expansions, token_sets):
        parents, _ = e.topology()
        for node in range(1, e.num_nodes):
            path = [node]
            while parents[path[-1]] > 0:
                path.append(parents[path[-1]])
            proposals.append(tuple(int(toks[0, j]) for j in reversed(path)))
    valid = np.asarray(merged.valid[0])
    seqs = [tuple(int(merged.tokens[0, j]) for j in root_path(merged, 0, i)[1:]) for i in range(valid.size) if valid[i]]
    assert sorted(seqs) == sorted(set(proposals) | {()}), "merged tree != set of proposed sequences"
    assert len(seqs) == len(set(seqs)), "a sequence appears twice"
    entries = np.asarray(merged.children[0])
    assert (entries >= 0).sum() == len(proposals), "every proposal must stay its own child entry"
    parent = np.asarray(merged.parent[0])
    for u, row in enumerate(entries):
        for c in row[row >= 0]:
            assert parent[c] == u


_merge_jit = jax.jit(merge_proposals, static_argnums=1)


def _proposals(expansions, token_sets):
    return [Proposal(tokens=toks, parent=jnp.asarray([e.topology()[0]], jnp.int32), ok=jnp.ones(toks.shape, bool),
                     law_row=jnp.full(toks.shape, -1, jnp.int32)) for e, toks in zip(expansions, token_sets)]


@pytest.mark.parametrize("widths", [[(2, 1), (1, 2)], [(3,), (1, 1, 1), (2,)]])
def test_dynamic_parents_merge_like_static_ones(widths):
    """Parents read as arrays (dynamic trees) merge exactly as static topologies (expansion drafters)."""
    expansions = [Expansion(w) for w in widths]
    rng = np.random.RandomState(len(widths))
    token_sets = [jnp.asarray(rng.randint(0, 3, (1, e.num_nodes)), jnp.int32).at[:, 0].set(7) for e in expansions]
    props = _proposals(expansions, token_sets)
    static = _merge_jit(props, tuple(tuple(e.topology()[0]) for e in expansions))
    dynamic = _merge_jit(props, None)
    for a, b in zip(jax.tree.leaves(static), jax.tree.leaves(dynamic)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bad_speculation_configs(llama):
    ssm = derive_ssm(llama, 1)
    p = [[1, 2, 3]]
    with pytest.raises(InputError, match="expansion must be a non-empty tuple of widths"):
        specjax.generate(llama, p, max_new_tokens=4, ssms=[ssm], expansion=())
    with pytest.raises(InputError, match="expansion config is empty"):
        Expansion(())
    with pytest.raises(InputError, match="positive ints"):
        specjax.generate(llama, p, max_new_tokens=4, ssms=[ssm], expansion=(1, 0, 2))
    with pytest.raises(InputError, match=r"makes a token tree of 85 nodes; the limit is 64 \(N_max\)"):
        specjax.generate(llama, p, max_new_tokens=4, ssms=[ssm], expansion=(4, 4, 4))
    with pytest.raises(InputError, match="needs at least one SSM"):
        specjax.generate(llama, p, max_new_tokens=4, mode="tree")
    with pytest.raises(InputError, match="widths must all be 1"):
        specjax.generate(llama, p, max_new_tokens=4, mode="sequence", ssms=[ssm], expansion=(1, 2))
    hot = specjax.SamplingParams(temperature=1.0)
    with pytest.raises(InputError, match="verifier 'greedy' decodes greedily but a request has temperature > 0"):
        specjax.generate(llama, p, max_new_tokens=4, ssms=[ssm], sampling=hot, verifier="greedy")
    # The pairing check asks each drafter's declared law: deterministic (top-k) entries are exact under
    # every verifier (MSS then treats them as one-hot); i.i.d. entries need MSS, without-replacement RRS.
    assert SSMDrafter(ssm.config, Expansion((2,)), "topk").law == "onehot"
    SpecConfig(ssm_drafters([ssm.config], [(2,)], "topk"), verifier="mss")
    with pytest.raises(InputError, match=r"verifier 'rrs' is not lossless for drafter ssm\(<1,1,3,1,1,1,1,1>, iid\) "
                                         r"\(entries drawn i.i.d. .*\['greedy', 'seeded', 'naive', 'mss'\]"):
        specjax.generate(llama, p, max_new_tokens=4, ssms=[ssm], sampling=hot, verifier="rrs", draft="iid",
                         expansion=(1, 1, 3, 1, 1, 1, 1, 1))
    with pytest.raises(InputError, match=r"verifier 'mss' is not lossless for drafter ssm\(.*, wor\)"):
        specjax.generate(llama, p, max_new_tokens=4, ssms=[ssm], sampling=hot, verifier="mss", draft="wor")
    with pytest.raises(InputError, match=r"has 1057 nodes, beyond 1024 per SSM"):
        SSMDrafter(ssm.config, Expansion((32, 32)))
    with pytest.raises(InputError, match="unknown fault 'nope'"):
        SpecConfig(fault="nope")
    with pytest.raises(InputError, match="verifier must be one of"):
        specjax.generate(llama, p, max_new_tokens=4, ssms=[ssm], sampling=hot, verifier="typo")
    import dataclasses

    wrong_vocab = specjax.Model(dataclasses.replace(ssm.config, vocab_size=100), ssm.params, None)
    with pytest.raises(InputError, match="SSM 0 has vocab_size 100 but the LLM has 128"):
        specjax.generate(llama, p, max_new_tokens=4, ssms=[wrong_vocab])


def test_an_opt_ssm_is_refused_past_its_position_table(llama):
    """Past an OPT SSM's last learned position every position read that row (JAX clamps the index): its
    drafts there were noise, each step, and nothing said so. RoPE SSMs read any position."""
    import dataclasses

    from specjax.config import ModelConfig
    from specjax.engine import Engine

    cfg = ModelConfig(family="opt", vocab_size=llama.config.vocab_size, hidden_size=16, intermediate_size=32,
                      num_layers=1, num_heads=2, num_kv_heads=2, head_dim=8, max_position_embeddings=16)
    opt = specjax.Model(cfg, init_params(cfg, jax.random.key(0)), None)
    prompt = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
    with pytest.raises(InputError, match=r"prompt 0: prompt \+ max_new_tokens=7: 17 tokens, more than the 16 "
                                         r"positions of ssm\(<1,1,1>, topk\)'s position table"):
        specjax.generate(llama, prompt, max_new_tokens=7, ssms=[opt], expansion=(1, 1, 1))
    # to the table's end: the drafts that read past it are of tokens past the request's last (never committed)
    # (the same SSM with a longer table drafts the same committed tokens: the same passes)
    longer_cfg = dataclasses.replace(cfg, max_position_embeddings=64)
    table = opt.params["pos_embed"]
    longer = specjax.Model(longer_cfg, {**opt.params, "pos_embed": jnp.concatenate(
        [table, jnp.ones((48, table.shape[1]), table.dtype)])}, None)
    runs = [specjax.generate(llama, prompt, max_new_tokens=6, ssms=[s], expansion=(1, 1, 1), ignore_eos=True)
            for s in (opt, longer)]
    assert runs[0].token_ids == runs[1].token_ids == specjax.generate(
        llama, prompt, max_new_tokens=6, mode="incremental", ignore_eos=True).token_ids
    assert runs[0].stats["llm_passes"] == runs[1].stats["llm_passes"]
    with pytest.raises(InputError, match="max_prompt_tokens \\+ max_new_tokens: 17 tokens, more than the 16"):
        Engine(llama, slots=1, max_prompt_tokens=13, max_new_tokens=4, budget=None,
               drafters=[(SSMDrafter(cfg, Expansion((1, 1, 1))), opt.params)])
    rope = dataclasses.replace(llama.config, max_position_embeddings=16)
    assert SSMDrafter(rope, Expansion((1, 1, 1))).position_limit is None


def test_tokenizer_mismatch_is_refused(llama):
    from specjax.speculation.drafters.ssm import check_compatible

    class Tok:
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return self.vocab

    a = specjax.Model(llama.config, llama.params, Tok({"a": 0, "b": 1}))
    b = specjax.Model(llama.config, llama.params, Tok({"a": 1, "b": 0}))
    with pytest.raises(InputError, match="tokenizer differs"):
        check_compatible(a, b)


def test_hf_export_round_trip(llama, tmp_path):
    import torch
    import transformers

    ssm = derive_ssm(llama, [1])  # the second layer alone: exercises layer selection too
    export_hf(ssm, str(tmp_path / "ssm"))
    back = specjax.load_model(str(tmp_path / "ssm"), progress=False)
    seq = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]]
    np.testing.assert_array_equal(specjax.logits(back, seq)[0], specjax.logits(ssm, seq)[0])  # same weights
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "ssm"), dtype=torch.float32)
    with torch.no_grad():
        hf32 = hf(torch.tensor(seq)).logits[0].numpy()
        ref = hf.double()(torch.tensor(seq)).logits[0].numpy()
    precision.assert_within(specjax.logits(ssm, seq)[0], ref, precision.error(hf32, ref), what="exported SSM")


def test_hf_export_is_the_loaders_table_inverted(tmp_path):
    """Biased projections too: export(load(x)) writes back exactly the tensors of x, key for key."""
    from safetensors.numpy import load_file

    from tests.conftest import make_hf_model

    src = str(tmp_path / "src")
    make_hf_model("llama", src, attention_bias=True, mlp_bias=True, tie_word_embeddings=True)
    model = specjax.load_model(src, progress=False)
    export_hf(model, str(tmp_path / "out"))
    original, exported = load_file(f"{src}/model.safetensors"), load_file(str(tmp_path / "out/model.safetensors"))
    original.pop("lm_head.weight", None)  # tied: the loader accepts a duplicate of the embedding, export omits it
    assert sorted(exported) == sorted(original)
    for key, value in original.items():
        np.testing.assert_array_equal(exported[key], value.astype(np.float32), err_msg=key)
    back = specjax.load_model(str(tmp_path / "out"), progress=False)
    for a, b in zip(jax.tree.leaves(back.params), jax.tree.leaves(model.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
