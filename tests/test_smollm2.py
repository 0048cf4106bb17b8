"""The embedded default model: loads torch-free, and greedy generation equals transformers'."""

from __future__ import annotations

import os
import site
import subprocess
import sys

import numpy as np
import pytest

import specjax
from tests import precision
from tests.conftest import dev_prompts, requires_smollm2

pytestmark = [requires_smollm2, pytest.mark.slow]

# Every 7th dev prompt: covers all categories of the set (generic, knowledge, roleplay, common-sense,
# fermi, counterfactual, coding, math, writing) inside the CI budget. scripts/check_smollm2_vs_hf.py
# runs all 78.
PROMPT_STRIDE = 7


def test_loads_and_generates_without_torch_installed(tmp_path):
    """A site-packages view without torch: find_spec('torch') is None, as on a torch-free machine."""
    view = tmp_path / "site"
    view.mkdir()
    for sd in site.getsitepackages():
        if not os.path.isdir(sd):
            continue
        for name in os.listdir(sd):
            if name.split("-")[0].split(".")[0] in ("torch", "torchgen", "functorch"):
                continue
            if not (view / name).exists():
                os.symlink(os.path.join(sd, name), view / name)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = (f"import site, sys; site.addsitedir({str(view)!r}); sys.path.insert(0, {repo!r})\n"
            "import importlib.util; assert importlib.util.find_spec('torch') is None\n"
            "import specjax\n"
            "m = specjax.load_model('smollm2-135m-instruct', progress=False)\n"
            "r = specjax.generate(m, ['Name a colour.'], max_new_tokens=8)\n"
            "assert 'torch' not in sys.modules\n"
            "print('TOKENS', r.token_ids[0])\n")
    env = {**os.environ, "SPECJAX_CACHE_DIR": str(tmp_path / "cache")}  # also exercise a cold tokenizer
    r = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "TOKENS [" in r.stdout


def test_the_gguf_tokenizer_loads_without_importing_an_installed_torch(tmp_path):
    """Every ``specjax`` command reads the tokenizer first; with torch installed (the test extra, most
    users' machines) it must not import it (1.5 s of start-up), converting or reading the cached conversion."""
    pytest.importorskip("torch")
    code = ("import sys, specjax\n"
            "m = specjax.describe_model('smollm2-135m-instruct')\n"
            "assert m.tokenizer('Name a colour.')['input_ids'], 'the tokenizer encodes'\n"
            "print('TORCH', 'torch' in sys.modules)\n")
    env = {**os.environ, "SPECJAX_CACHE_DIR": str(tmp_path / "cache")}
    for attempt in ("converted", "read from the cache"):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "TORCH False" in r.stdout, f"the tokenizer {attempt} imported torch"
    assert os.listdir(tmp_path / "cache" / "tokenizers"), "the conversion was cached"


@pytest.fixture(scope="module")
def hf_smollm2():
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from specjax.io.registry import resolve

    path = resolve("smollm2-135m-instruct")
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32)
    return model.eval()


def test_gguf_tokenizer_keeps_the_gguf_special_tokens_over_the_converters(monkeypatch):
    """Some transformers versions' GGUF converter (5.17) also returns bos/eos/unk, SmolLM2's eos wrongly
    as <|im_start|>: the GGUF's own metadata must win, and the overlap must not raise (it did on the
    GPU machine's transformers 5.17: "got multiple values for keyword argument 'unk_token'")."""
    import importlib

    from specjax._compat import gguf_tokenizer_from_fields
    from specjax.io.registry import resolve
    from specjax.io.tokenizer import _gguf_tokenizer_fields

    arch, fields, config = _gguf_tokenizer_fields(resolve("smollm2-135m-instruct"))
    assert config["eos_token"] == "<|im_end|>"
    try:
        gguf = importlib.import_module("transformers.integrations.gguf")
        convert = gguf.convert_gguf_tokenizer
    except (ImportError, AttributeError):
        gguf = importlib.import_module("transformers.integrations.ggml")
        convert = gguf.convert_gguf_tokenizer

    def with_guesses(architecture, tokenizer_dict):
        backend, extra = convert(architecture, tokenizer_dict)
        return backend, {**extra, "unk_token": "<|endoftext|>", "eos_token": "<|im_start|>",
                         "bos_token": "<|im_start|>"}

    monkeypatch.setattr(gguf, "convert_gguf_tokenizer", with_guesses)
    tok = gguf_tokenizer_from_fields(arch, fields, config)
    assert (tok.eos_token, tok.bos_token, tok.unk_token) == (config["eos_token"], config["bos_token"],
                                                             config["unk_token"])


def test_greedy_64_tokens_equal_transformers_on_dev_prompts(smollm2, hf_smollm2):
    import torch

    prompts = dev_prompts()[::PROMPT_STRIDE]
    ours = specjax.generate(smollm2, prompts, max_new_tokens=64, mode="incremental")  # one mixed-length batch
    for prompt, ids, got in zip(prompts, ours.prompt_token_ids, ours.token_ids):
        with torch.no_grad():
            out = hf_smollm2.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False)
        want = out[0, len(ids):].tolist()
        assert got == want, f"prompt {prompt!r}: specjax and transformers diverge"


def test_batched_equals_single_on_smollm2(smollm2):
    prompts = dev_prompts()[1::PROMPT_STRIDE * 2][:4]
    batched = specjax.generate(smollm2, prompts, max_new_tokens=32, mode="incremental").token_ids
    for p, b in zip(prompts, batched):
        assert specjax.generate(smollm2, [p], max_new_tokens=32, mode="incremental").token_ids[0] == b


def test_logits_match_transformers(smollm2, hf_smollm2):
    """Against transformers in float64 (the exact math of the reference implementation), specjax's
    float32 logits are as accurate as transformers' own float32 ones (the floor, measured here)."""
    import copy

    import torch

    ids = smollm2.tokenizer("The quick brown fox jumps over the lazy dog. " * 12)["input_ids"]
    ours = specjax.logits(smollm2, [ids])[0]
    with torch.no_grad():
        hf32 = hf_smollm2(torch.tensor([ids])).logits[0].numpy()
        ref = copy.deepcopy(hf_smollm2).double()(torch.tensor([ids])).logits[0].numpy()
    floor = precision.error(hf32, ref)
    precision.assert_within(ours, ref, floor, what="specjax float32 vs transformers float64")
    # the bound has power: a one-position shift of the input (pitfall 11's cousin) is far outside it
    assert precision.error(specjax.logits(smollm2, [ids[1:]])[0], ref[1:]) > 100 * precision.bound(ref, floor)


def test_real_tree_logits_equal_incremental_decoding(smollm2):
    """A 15-node tree of real continuations (greedy path + top-3 alternatives at 4 depths).

    Bound (tests/precision.py): every route is compared with specjax's float64 logits of the node's
    root path; the floor is the float32 error of two other routes to the same logits, measured here
    (incremental decoding and full recompute; ~1e-4 with logits up to ~37 on a 30-layer model, more or
    less on other CPUs). The tree must stay within the bound and pick the same argmax at every node; a
    position off by one exceeds it by orders of magnitude (checked, so the bound has power).
    """
    import jax
    import jax.numpy as jnp

    from specjax.attention.meta import causal_meta
    from specjax.decoding.incremental import prefill
    from specjax.models import forward
    from specjax.models.cache import init_cache
    from specjax.speculation.commit import tree_forward
    from specjax.speculation.tree import from_paths, root_path

    m = smollm2
    ids = specjax.api.encode_prompts(m, ["What is the capital of France?"])[0]
    committed = len(ids) - 1  # the last prompt token is the root of the tree
    cont = specjax.generate(m, [ids], max_new_tokens=8, mode="incremental").token_ids[0]
    full = specjax.logits(m, [ids + cont])[0]
    paths = [cont[:6]] + [cont[:d] + [int(t)] for d in range(4)
                          for t in np.argsort(-full[len(ids) - 1 + d])[1:3]]
    tree = from_paths([ids[-1]], [paths], n_max=32)
    n = int(tree.valid.sum())
    assert n == 15
    cache = init_cache(m.config, 1, 128)
    prompt = jnp.asarray([ids[:-1] + [0] * (64 - committed)])
    _, cache = jax.jit(prefill, static_argnames="cfg")(m.params, prompt, jnp.asarray([committed]), cache,
                                                       cfg=m.config)
    # the weights as an argument: captured, they become constants XLA folds for minutes (130 s here)
    step = jax.jit(lambda p, c, t: forward(p, t[:, None], c.length[:, None], c, causal_meta(c.length),
                                           m.config)[:2])
    incremental, recompute, seqs = [], [], []
    for i in range(n):
        path = [int(tree.tokens[0, j]) for j in root_path(tree, 0, i)]
        c = cache
        for t in path:
            out, c = step(m.params, c, jnp.asarray([t], jnp.int32))
            c = c.replace(length=c.length + 1)
        incremental.append(np.asarray(out)[0, 0])
        recompute.append(specjax.logits(m, [ids[:-1] + path])[0][-1])
        seqs.append(ids[:-1] + path)
    ref = np.stack([row[-1] for row in precision.logits64(m, seqs)])
    incremental, recompute = np.stack(incremental), np.stack(recompute)
    floors = precision.error(incremental, ref), precision.error(recompute, ref)
    for impl in ("xla", "pallas"):
        logits, _, _ = jax.jit(tree_forward, static_argnames=("cfg", "impl"))(m.params, tree, cache, cfg=m.config,
                                                                          impl=impl)
        got = np.asarray(logits)[0, :n]
        precision.assert_within(got, ref, *floors, what=f"{impl} tree")
        np.testing.assert_array_equal(got.argmax(-1), incremental.argmax(-1))
    # The bound has power: a position off by one (pitfall 11) lands far outside it.
    shifted, _, _ = jax.jit(tree_forward, static_argnames=("cfg", "impl"))(
        m.params, tree.replace(depth=tree.depth + 1), cache, cfg=m.config, impl="xla")
    assert precision.error(np.asarray(shifted)[0, :n], ref) > 100 * precision.bound(ref, *floors)


def _useless_ssm(llm):
    import dataclasses

    import jax

    from specjax.models import init_params

    cfg = dataclasses.replace(llm.config, num_layers=1, hidden_size=64, intermediate_size=96, num_heads=2,
                              num_kv_heads=1, head_dim=32)
    return specjax.Model(cfg, init_params(cfg, jax.random.key(0), scale=0.3), llm.tokenizer)


def test_speculative_greedy_equals_incremental_on_smollm2(smollm2):
    """Tree (expansion and merge) and sequence speculation with the shipped boost-tuned pool, a
    derived SSM, a useless random SSM and a perfect one (the LLM itself): a mixed-length batch of 4
    dev prompts (batch 1
    is covered by the perfect-SSM check below and batch-slot invariance by the toy tests)."""
    import jax

    from specjax.speculation.drafters.ssm import derive_ssm

    every = dev_prompts()
    prompts = (every[3::19] if len(every) >= 60 else every)[:4]
    want = specjax.generate(smollm2, prompts, max_new_tokens=24, mode="incremental").token_ids
    derived, useless = derive_ssm(smollm2, 8), _useless_ssm(smollm2)
    shipped = [specjax.load_model(name, progress=False) for name in ("smollm2-ssm-a", "smollm2-ssm-b")]
    setups = [dict(mode="tree", ssms=shipped, expansion=[(1, 1, 3, 1, 1), (2, 1, 1)]),
              dict(mode="tree", ssms=[useless], expansion=(2, 2, 1)),
              dict(mode="tree", ssms=[derived, useless], expansion=[(1, 1, 3, 1), (2, 1)]),
              dict(mode="sequence", ssms=[smollm2], expansion=(1, 1, 1, 1))]
    for kw in setups:
        got = specjax.generate(smollm2, prompts, max_new_tokens=24, **kw)
        assert got.token_ids == want, f"{kw['mode']} with {len(kw['ssms'])} SSMs differs from incremental"
        jax.clear_caches()
    perfect = specjax.generate(smollm2, prompts[:1], max_new_tokens=24, mode="sequence", ssms=[smollm2],
                               expansion=(1, 1, 1, 1))
    assert perfect.stats["mean_tokens_per_pass"] >= 4.0  # a perfect drafter is accepted almost always


def test_seeded_speculative_equals_seeded_incremental_on_smollm2(smollm2):
    """T6: seeded tree speculation (coupled drafts from a merged pool of a derived and a useless SSM)
    reproduces incremental seeded sampling token for token; one seed per prompt, warps on; RRS runs
    and stays inside the warped support."""
    import jax

    from specjax.speculation.drafters.ssm import derive_ssm

    every = dev_prompts()
    prompts = (every[5::13] if len(every) >= 44 else every)[:4]  # 4 prompts with or without shared/
    sampling = [specjax.SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=100 + i) for i in range(4)]
    want = specjax.generate(smollm2, prompts, max_new_tokens=24, sampling=sampling, mode="incremental").token_ids
    greedy = specjax.generate(smollm2, prompts, max_new_tokens=24, mode="incremental").token_ids
    assert want != greedy, "the sampled reference must actually sample"
    derived, useless = derive_ssm(smollm2, 8), _useless_ssm(smollm2)
    got = specjax.generate(smollm2, prompts, max_new_tokens=24, sampling=sampling, ssms=[derived, useless],
                           expansion=[(1, 1, 3, 1), (2, 1)], draft="coupled")  # verifier auto -> seeded
    assert got.token_ids == want, "seeded speculation differs from incremental sampling"
    assert got.stats["verifier"] == "seeded"
    jax.clear_caches()
    # RRS (MSS runs through the README's `--verifier mss` command, tests/test_readme.py): sampled, so only
    # the support can be checked here
    got = specjax.generate(smollm2, prompts[:2], max_new_tokens=16, sampling=sampling[:2], ssms=[derived],
                           verifier="rrs")
    assert got.stats["draft"] == "wor" and all(len(t) == 16 for t in got.token_ids)
    for ids, toks in zip(got.prompt_token_ids, got.token_ids):  # every token inside the top-40 support
        logits = specjax.logits(smollm2, [ids + toks])[0][len(ids) - 1:-1]
        kth = np.sort(logits, axis=-1)[:, -40]
        assert (logits[np.arange(len(toks)), toks] >= kth).all(), "RRS emitted a token outside the top-k"
    jax.clear_caches()


def test_pp2_tp4_mesh_logits_are_as_close_to_float64_as_one_devices(smollm2):
    """SmolLM2 (9 heads / 3 KV heads: tp never divides them, so attention is replicated and the MLP
    and vocabulary are split) as PP=2 x TP=4 on 8 simulated devices: logits as close to the float64
    reference as one device's (the floor, measured here), with the same argmax everywhere. (Its
    tokens: the API test below, and the README's mesh commands through ``specjax generate --mesh``
    and ``specjax launch``, tests/test_readme.py.)"""
    import jax.numpy as jnp

    from specjax.decoding.incremental import full_logits
    from specjax.models.params import stack_layers
    from specjax.sharding import Parallel, ShardingRules

    every = dev_prompts()  # 78 with ../shared, 4 built-in ones in a bare clone
    prompt = every[5 % len(every)]
    want = specjax.generate(smollm2, [prompt], max_new_tokens=16, mode="incremental").token_ids[0]

    parallel = Parallel.create("pp=2,tp=4", rules=ShardingRules(heads=None, kv_heads=None))
    ids = jnp.asarray([specjax.api.encode_prompts(smollm2, [prompt])[0] + want] * 2)
    one = np.asarray(full_logits(smollm2.params, ids, cfg=smollm2.config))
    stacked = stack_layers(smollm2.params)  # a mesh takes stacked layer weights (one device gets split ones)
    mesh = np.asarray(full_logits(parallel.put_params(stacked, smollm2.config), parallel.put_batch(ids),
                                  cfg=smollm2.config, parallel=parallel))
    ref = np.stack(precision.logits64(smollm2, np.asarray(ids).tolist()))
    precision.assert_within(mesh, ref, precision.error(one, ref), what="pp=2,tp=4 mesh")
    np.testing.assert_array_equal(mesh.argmax(-1), one.argmax(-1))


def test_api_on_a_pipeline_mesh_equals_one_device_streamed_or_not(smollm2, recwarn):
    """``specjax.generate`` on an in-process PP=2 x TP=4 mesh, tree-speculative with SmolLM2's first
    8 layers as the SSM: the same tokens as one device's incremental decoding whether it streams or
    not. Before ``Parallel.one_pass_per_call`` the unstreamed call ran the whole loop as one program
    and emitted 4749 for 253 at the 6th token (a race of XLA:CPU's in-process execution of several
    pipelined passes in one program); now neither call traces a whole loop there (no warning)."""
    from specjax.sharding import Parallel, ShardingRules
    from specjax.speculation.drafters.ssm import derive_ssm

    every = dev_prompts()
    prompt = every[5 % len(every)]
    want = specjax.generate(smollm2, [prompt], max_new_tokens=16, mode="incremental").token_ids[0]
    parallel = Parallel.create("pp=2,tp=4", rules=ShardingRules(heads=None, kv_heads=None))
    assert parallel.one_pass_per_call
    model = specjax.load_model("smollm2-135m-instruct", parallel=parallel, progress=False)
    ssm = derive_ssm(model, 8)
    whole = specjax.generate(model, [prompt], ssms=[ssm], expansion=(1, 2, 1), parallel=parallel, max_new_tokens=16)
    shown = []
    streamed = specjax.generate(model, [prompt], ssms=[ssm], expansion=(1, 2, 1), parallel=parallel,
                                max_new_tokens=16, on_tokens=lambda i, ids: shown.extend(ids))
    assert whole.token_ids[0] == want
    assert streamed.token_ids[0] == want and shown == want
    assert whole.stats["llm_passes"] == streamed.stats["llm_passes"]
    assert not [w for w in recwarn if "pipelined LLM passes" in str(w.message)]
