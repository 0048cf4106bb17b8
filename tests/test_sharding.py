"""Meshes on 8 simulated CPU devices: TP=8, PP=2 x TP=4, PP=4 x TP=2, DP=2 x TP=4 (and PP x DP x TP)
give the single-device logits (as close to the float64 reference as one device's, tests/precision.py)
and exactly its greedy tokens, incremental and tree-speculative,
for tiny LLaMA (GQA 8/2, so KV heads are replicated at tp >= 4) and OPT models; the pipeline equals
its sequential reference; misconfigurations fail with errors naming the leaf."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.config import ModelConfig
from specjax.decoding.incremental import full_logits, prefill
from specjax.errors import ShardingError
from specjax.models.cache import init_cache
from specjax.sharding import MeshShape, Parallel, ShardingRules, make_mesh
from specjax.speculation.commit import tree_forward
from specjax.speculation.drafters.ssm import derive_ssm
from specjax.speculation.tree import from_parents
from tests import precision
from tests.toy import mesh_model, mesh_prompts

MESHES = ("tp=8", "pp=2,tp=4", "pp=4,tp=2", "dp=2,tp=4")
pytestmark = pytest.mark.skipif(jax.device_count() != 8 or jax.devices()[0].platform != "cpu",
                                reason="needs the 8 simulated CPU devices of tests/conftest.py (JAX_PLATFORMS=cpu)")


tiny = mesh_model


@pytest.fixture(scope="module", params=["llama", "opt"])
def model(request):
    return tiny(request.param)


GEN = dict(max_new_tokens=12, ignore_eos=True)
INCREMENTAL = dict(GEN, mode="incremental")


@pytest.fixture(scope="module")
def reference(model):
    """One-device greedy tokens: incremental, and tree-speculative with a derived SSM (equal to it)."""
    prompts = _prompts(model.config)
    spec_kw = dict(mode="tree", ssms=[derive_ssm(model, 2)], expansion=(1, 2, 1))
    incremental = specjax.generate(model, prompts, **INCREMENTAL).token_ids
    tree = specjax.generate(model, prompts, **GEN, **spec_kw)
    assert tree.token_ids == incremental  # (established elsewhere; the anchor of these tests)
    return prompts, spec_kw, incremental, tree.stats["llm_passes"]


def _prompts(cfg):
    return mesh_prompts(cfg.vocab_size)


@functools.partial(jax.jit, static_argnames=("cfg", "parallel"))
def _tree_logits(params, prefix, lens, tree, cfg, parallel=None):
    """Prefill a prefix, then score a token tree on top of it: the verification pass."""
    cache = init_cache(cfg, prefix.shape[0], 64, jax.tree.leaves(params)[0].dtype)
    if parallel is not None:
        cache = parallel.constrain_cache(cache, cfg)
    _, cache = prefill(params, prefix, lens, cache, cfg, parallel)
    logits, _, _ = tree_forward(params, tree, cache, cfg, "xla", parallel)
    return logits


def _float64(fn, params, *args, **kw) -> np.ndarray:
    """``fn`` on one device in float64: the reference the mesh and the one-device float32 runs meet."""
    with precision.float64():
        return np.asarray(fn(precision.params64(params), *args, **kw))


def _inputs(cfg):
    rng = np.random.RandomState(1)
    prefix = rng.randint(0, cfg.vocab_size, (4, 16)).astype(np.int32)
    lens = np.array([16, 3, 9, 1], np.int32)
    parents = [[-1, 0, 0, 1, 1, 2, 5], [-1, 0, 1, 2], [-1, 0, 0, 0, 0], [-1]]
    tokens = [rng.randint(0, cfg.vocab_size, len(p)).tolist() for p in parents]
    return prefix, lens, from_parents(tokens, parents, n_max=8)


@pytest.mark.parametrize("shape", MESHES)
def test_logits_match_one_device(model, shape):
    cfg, params = model.config, model.params
    parallel = Parallel.create(shape)
    prefix, lens, tree = _inputs(cfg)
    ref_full = full_logits(params, jnp.asarray(prefix), cfg=cfg)
    ref_tree = _tree_logits(params, jnp.asarray(prefix), jnp.asarray(lens), tree, cfg)
    sharded = parallel.put_params(params, cfg)
    full = full_logits(sharded, parallel.put_batch(jnp.asarray(prefix)), cfg=cfg, parallel=parallel)
    tree_logits = _tree_logits(sharded, *parallel.put_batch((prefix, lens, tree)), cfg=cfg, parallel=parallel)
    full64 = _float64(full_logits, params, jnp.asarray(prefix), cfg=cfg)
    precision.assert_within(full, full64, precision.error(ref_full, full64), what=f"{shape} full logits")
    valid = np.asarray(tree.valid)
    tree64 = _float64(_tree_logits, params, jnp.asarray(prefix), jnp.asarray(lens), tree, cfg)[valid]
    floor = precision.error(np.asarray(ref_tree)[valid], tree64)
    precision.assert_within(np.asarray(tree_logits)[valid], tree64, floor, what=f"{shape} tree logits")
    assert sharded["layers"]["wq"].sharding.spec == parallel.param_shardings(cfg)["layers"]["wq"].spec


@pytest.mark.parametrize("shape", MESHES)
def test_greedy_tokens_match_one_device(model, reference, shape):
    prompts, spec_kw, incremental, tree_passes = reference
    parallel = Parallel.create(shape)
    assert specjax.generate(model, prompts, **INCREMENTAL, parallel=parallel).token_ids == incremental
    tree = specjax.generate(model, prompts, **GEN, **spec_kw, parallel=parallel)
    assert tree.token_ids == incremental
    assert tree.stats["llm_passes"] == tree_passes


@pytest.mark.parametrize("shape", MESHES)
def test_streamed_tokens_match_one_device_in_chunks(model, reference, shape, monkeypatch):
    """Streaming on a mesh: the same tokens, handed over as they come, and the same passes as one
    device; the host loop runs chunks of up to MAX_CHUNK_STEPS passes except on an in-process CPU
    pipeline, one pass per call there (``Parallel.one_pass_per_call``)."""
    from specjax import api
    from specjax.decoding.host_step import MAX_CHUNK_STEPS

    prompts, spec_kw, incremental, tree_passes = reference
    parallel = Parallel.create(shape)
    most, real = [], api.run_host_loop
    monkeypatch.setattr(api, "run_host_loop", lambda *args, **kw: most.append(args[-1]) or real(*args, **kw))
    shown = [[] for _ in prompts]
    tree = specjax.generate(model, prompts, **GEN, **spec_kw, parallel=parallel,
                            on_tokens=lambda i, ids: shown[i].extend(ids))
    assert tree.token_ids == shown == incremental
    assert tree.stats["llm_passes"] == tree_passes
    assert most == [1 if shape.startswith("pp=") else MAX_CHUNK_STEPS]


def test_pipeline_with_dp_and_odd_batch_pads_requests():
    """PP x DP x TP at once, a batch of 3 (padded to dp x microbatches = 4 inside, 3 returned): tokens,
    LLM passes and acceptance statistics equal one device's, so the padding requests leak nowhere."""
    model = tiny("llama")
    parallel = Parallel.create("pp=2,dp=2,tp=2")
    prompts = _prompts(model.config)[:3]
    spec_kw = dict(mode="tree", ssms=[derive_ssm(model, 1)], expansion=(2, 1))
    ref = specjax.generate(model, prompts, max_new_tokens=8, ignore_eos=True, **spec_kw)
    out = specjax.generate(model, prompts, max_new_tokens=8, ignore_eos=True, parallel=parallel, **spec_kw)
    inc = specjax.generate(model, prompts, max_new_tokens=8, ignore_eos=True, parallel=parallel, mode="incremental")
    assert out.token_ids == inc.token_ids == ref.token_ids
    assert out.stats["generated_tokens"] == inc.stats["generated_tokens"] == 24
    for key in ("llm_passes", "tokens_per_pass_histogram", "accepted_at_depth", "mean_tokens_per_pass"):
        assert out.stats[key] == ref.stats[key], key
    prefix, lens, tree = _inputs(model.config)
    got = _tree_logits(parallel.put_params(model.params, model.config), *parallel.put_batch((prefix, lens, tree)),
                       cfg=model.config, parallel=parallel)
    want = _tree_logits(model.params, jnp.asarray(prefix), jnp.asarray(lens), tree, model.config)
    valid = np.asarray(tree.valid)
    ref = _float64(_tree_logits, model.params, jnp.asarray(prefix), jnp.asarray(lens), tree, model.config)[valid]
    precision.assert_within(np.asarray(got)[valid], ref, precision.error(np.asarray(want)[valid], ref))


def test_an_ssm_with_split_layers_runs_on_a_mesh():
    """An SSM loaded by name on one CPU device has split layers (load_model's default there): the CLI's
    ``--ssm NAME --mesh ...`` was always refused for it. A mesh now restacks it."""
    from specjax.models.params import layers_split, split_layers

    model = tiny("llama")
    ssm = derive_ssm(model, 1)
    ssm = ssm._replace(params=split_layers(ssm.params))
    assert layers_split(ssm.params)
    prompts = _prompts(model.config)[:2]
    kw = dict(max_new_tokens=6, ignore_eos=True, ssms=[ssm], expansion=(2, 1))
    want = specjax.generate(model, prompts, max_new_tokens=6, ignore_eos=True, mode="incremental").token_ids
    assert specjax.generate(model, prompts, parallel=Parallel.create("dp=2,tp=4"), **kw).token_ids == want


def test_the_tree_cost_table_keys_what_changes_a_meshs_pass_time():
    """Costs measured with replicated attention, another schedule or other request groups steered the budget
    of a run without them (the key held the mesh's shape alone)."""
    from specjax.speculation.cost import table_key

    cfg = tiny("llama").config
    variants = [Parallel.create("pp=2,tp=4"), Parallel.create("pp=2,tp=4", microbatches=1),
                Parallel.create("pp=2,tp=4", rules=ShardingRules(heads=None, kv_heads=None)),
                Parallel(make_mesh("pp=2,tp=4"), schedule="sequential")]
    keys = {table_key(cfg, jnp.float32, 4, "xla", parallel=p) for p in variants}
    assert len(keys) == len(variants)
    assert table_key(cfg, jnp.float32, 4, "xla", parallel=variants[0]) == table_key(
        cfg, jnp.float32, 4, "xla", parallel=Parallel.create("pp=2,tp=4"))


def test_pipeline_equals_sequential_reference():
    """The shard_map pipeline vs one scan over the same pp-split weights (PP=4 x TP=2, 2 microbatches)."""
    model = tiny("opt")
    cfg = model.config
    prefix, lens, tree = _inputs(cfg)
    piped = Parallel.create("pp=4,tp=2", microbatches=2)
    sequential = Parallel(piped.mesh, schedule="sequential")
    assert piped.pipelined and not sequential.pipelined and piped.num_microbatches(4) == 2
    params = piped.put_params(model.params, cfg)
    inputs = piped.put_batch((prefix, lens, tree))
    a = _tree_logits(params, *inputs, cfg=cfg, parallel=piped)
    b = _tree_logits(params, *inputs, cfg=cfg, parallel=sequential)
    ref = _float64(_tree_logits, model.params, jnp.asarray(prefix), jnp.asarray(lens), tree, cfg)
    valid = np.asarray(tree.valid)
    precision.assert_within(np.asarray(a)[valid], ref[valid], precision.error(np.asarray(b)[valid], ref[valid]),
                            what="pipeline vs its sequential reference")

    def program(parallel):
        return _tree_logits.lower(params, *inputs, cfg=cfg, parallel=parallel).as_text()

    # The pipelined program hands activations over with ppermute; the sequential one has none.
    assert "collective_permute" in program(piped) and "collective_permute" not in program(sequential)


def test_bfloat16_weights_run_on_a_pipeline():
    """XLA:CPU aborted the whole process compiling the pipeline's bfloat16 output broadcast (a psum over
    "pp"); the broadcast now sums in float32, exact since the other stages hold zeros. The logits are as
    close to the float64 reference of the same bfloat16 weights as one device's."""
    model = tiny("llama")
    cfg = model.config
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), model.params)
    prefix, lens, tree = _inputs(cfg)
    piped = Parallel.create("pp=2,tp=4")
    got = _tree_logits(piped.put_params(params, cfg), *piped.put_batch((prefix, lens, tree)), cfg=cfg, parallel=piped)
    want = _tree_logits(params, jnp.asarray(prefix), jnp.asarray(lens), tree, cfg)
    valid = np.asarray(tree.valid)
    ref = _float64(_tree_logits, params, jnp.asarray(prefix), jnp.asarray(lens), tree, cfg)[valid]
    precision.assert_within(np.asarray(got, np.float32)[valid], ref,
                            precision.error(np.asarray(want, np.float32)[valid], ref), what="bfloat16 pipeline")


def test_one_pass_per_call_only_for_an_in_process_cpu_pipeline(recwarn):
    """A pipelined mesh of several CPU devices in this process steps one pass per call (XLA:CPU ran
    several pipelined passes in one program wrongly there, tests/test_smollm2.py); tp / dp meshes and
    the sequential schedule do not, and only the first warns when a whole loop is traced on it."""
    piped = Parallel.create("pp=2,tp=4")
    assert piped.one_pass_per_call
    assert Parallel.create("pp=2,dp=4").one_pass_per_call
    for other in (Parallel.create("tp=8"), Parallel.create("dp=2,tp=4"), Parallel(piped.mesh, schedule="sequential")):
        assert not other.one_pass_per_call
        other.warn_multi_pass("a whole loop")
    assert not [w for w in recwarn if "pipelined LLM passes" in str(w.message)]
    with pytest.warns(RuntimeWarning, match="a whole loop runs several pipelined LLM passes in one program"):
        piped.warn_multi_pass("a whole loop")


def test_constrain_batch_puts_requests_over_dp_and_replicates_scalars():
    """Inside jit, per-request arrays come out split over dp (as the decoding step leaves them) and a
    scalar (one max_new_tokens for every request) replicated, not refused for lacking a batch axis."""
    parallel = Parallel.create("dp=2,tp=4")
    state = {"tokens": jnp.arange(12, dtype=jnp.int32).reshape(4, 3), "done": jnp.zeros((4,), bool),
             "max_new_tokens": jnp.int32(7)}
    out = jax.jit(parallel.constrain_batch)(state)
    assert out["tokens"].sharding.is_equivalent_to(parallel.batch_sharding((4, 3)), 2)
    assert out["done"].sharding.is_equivalent_to(parallel.batch_sharding((4,)), 1)
    assert len({str(s.index) for s in out["tokens"].addressable_shards}) == 2  # two dp halves, not one copy
    assert out["max_new_tokens"].sharding.is_fully_replicated
    np.testing.assert_array_equal(out["tokens"], state["tokens"])
    assert int(out["max_new_tokens"]) == 7


def test_a_mesh_that_cannot_split_the_weights_is_refused_before_they_are_read(tiny_llama_dir, monkeypatch):
    from specjax.io import loader

    def no_reads(*args, **kwargs):
        raise AssertionError("the weights were read before the mesh was checked")

    monkeypatch.setattr(loader, "load_hf_dir", no_reads)
    with pytest.raises(ShardingError, match=r"dimension 0 \(layers\) has size 2, which mesh axis 'pp' of size 8"):
        specjax.load_model(tiny_llama_dir, parallel=Parallel.create("pp=8"), progress=False)


def test_rules_errors_name_the_leaf():
    cfg = tiny("llama").config
    with pytest.raises(ShardingError, match=r"param \['layers'\]\['attn_norm'\]: dimension 0 \(layers\) has size 4"):
        Parallel.create("pp=8").param_shardings(cfg)
    import dataclasses

    odd_vocab = dataclasses.replace(cfg, vocab_size=250)
    with pytest.raises(ShardingError, match=r"\(vocab\) has size 250.*keep that dimension whole on every tensor "
                                            r"shard \(Python: ShardingRules\(vocab=None\)\)"):
        Parallel.create("tp=8").param_shardings(odd_vocab)
    Parallel.create("tp=8", rules=ShardingRules(vocab=None)).param_shardings(odd_vocab)  # the way out works
    with pytest.raises(ShardingError, match="both map to mesh axis 'tp'"):
        Parallel.create("tp=8", rules=ShardingRules(embed="tp")).param_shardings(cfg)
    with pytest.raises(ShardingError, match=r"\['layers'\]\['wk'\]: dimension 2 \(kv_heads\) has size 2"):
        Parallel.create("tp=8", rules=ShardingRules(kv_fallback="error")).param_shardings(cfg)
    replicated = Parallel.create("tp=8").param_shardings(cfg)["layers"]["wk"].spec  # GQA fallback
    assert tuple(replicated) == (None, None, None, None)
    with pytest.raises(ShardingError, match=r"dimension \d \(heads\) has size 9.*heads=None, kv_heads=None"):
        Parallel.create("tp=4", devices=jax.devices()[:4]).param_shardings(ModelConfig(
            family="llama", vocab_size=64, hidden_size=36, intermediate_size=64, num_layers=2, num_heads=9,
            num_kv_heads=3, head_dim=4, max_position_embeddings=64))
    with pytest.raises(ShardingError, match="mesh pp=2,dp=1,tp=2 uses 4 of the 8 devices; a mesh must use every"):
        make_mesh("pp=2,tp=2")
    with pytest.raises(ShardingError, match="expected comma-separated AXIS=SIZE"):
        MeshShape.parse("pp=2,xp=4")
    with pytest.raises(ShardingError, match="mesh axes are"):
        ShardingRules(mlp="model")
    with pytest.raises(ShardingError, match=r"a batch of 4 requests \(2 per dp replica\) does not split into 3 "
                                            r"pipeline microbatches per replica; pad the batch to a multiple of 6"):
        Parallel.create("pp=2,dp=2,tp=2", microbatches=3).validate(cfg, batch=4)
    with pytest.raises(ShardingError, match="rules.batch must be 'dp' or None"):
        Parallel.create("tp=8", rules=ShardingRules(batch="tp"))
    pp4 = Parallel.create("pp=4,tp=2")  # a short batch is not padded to pp request groups of its own
    assert [pp4.padding_for(n) for n in (1, 2, 3, 4, 5, 8)] == [0, 0, 0, 0, 3, 0]
    assert [Parallel.create("pp=2,dp=2,tp=2").padding_for(n) for n in (1, 2, 3, 5)] == [1, 0, 1, 3]
    with pytest.raises(ShardingError, match=r"microbatches=2 splits a pipeline's batch, but this mesh has pp=1"):
        Parallel.create("dp=2,tp=4", microbatches=2)  # was accepted and ignored


def test_checkpoint_saved_on_pp2_tp4_restores_on_tp8_and_one_device(tmp_path):
    from specjax.io.checkpoint import save_checkpoint

    model = tiny("llama")
    cfg = model.config
    prompts = _prompts(cfg)
    source = Parallel.create("pp=2,tp=4")
    sharded = source.put_params(model.params, cfg)
    assert tuple(sharded["layers"]["w_up"].sharding.spec) == ("pp", None, "tp")
    save_checkpoint(str(tmp_path / "ckpt"), cfg, sharded)
    saved_run = specjax.generate(model._replace(params=sharded), prompts, **INCREMENTAL, parallel=source).token_ids

    tp8 = Parallel.create("tp=8")
    on_tp8 = specjax.load_model(str(tmp_path / "ckpt"), parallel=tp8)
    on_one = specjax.load_model(str(tmp_path / "ckpt"), split_layers=False)  # stacked, as saved
    assert tuple(on_tp8.params["layers"]["w_up"].sharding.spec) == (None, None, "tp")
    assert len(on_one.params["layers"]["w_up"].sharding.device_set) == 1
    for restored in (on_tp8, on_one):
        for a, b in zip(jax.tree.leaves(restored.params), jax.tree.leaves(model.params)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert specjax.generate(on_tp8, prompts, **INCREMENTAL, parallel=tp8).token_ids == saved_run
    assert specjax.generate(on_one, prompts, **INCREMENTAL).token_ids == saved_run
    prefix = jnp.asarray(_inputs(cfg)[0])
    ref = _float64(full_logits, model.params, prefix, cfg=cfg)
    precision.assert_within(full_logits(on_tp8.params, tp8.put_batch(prefix), cfg=cfg, parallel=tp8), ref,
                            precision.error(full_logits(on_one.params, prefix, cfg=cfg), ref), what="restored on tp=8")
