"""ForwardOutput.hidden equals transformers' hidden states (float32) for LLaMA and OPT: the input of
every asked layer and the final hidden state (the input of the final norm), in prefill, incremental
decoding, the tree pass and the pipeline-parallel path; nothing is computed when nothing is asked."""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.attention import causal_meta
from specjax.errors import InputError
from specjax.models import forward
from specjax.models.cache import init_cache
from specjax.speculation.commit import tree_forward
from specjax.speculation.tree import from_parents, root_path
from tests import precision
from tests.conftest import make_hf_model

CONFIGS = {  # sizes named nowhere else in the suite
    "llama-gqa": ("llama", dict(vocab_size=96, hidden_size=48, intermediate_size=72, num_hidden_layers=4,
                                num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=False)),
    "llama-mqa-tied": ("llama", dict(vocab_size=80, hidden_size=40, intermediate_size=56, num_hidden_layers=2,
                                     num_attention_heads=5, num_key_value_heads=1, tie_word_embeddings=True)),
    "opt-pre-ln-proj": ("opt", dict(vocab_size=88, hidden_size=48, ffn_dim=80, num_hidden_layers=4,
                                    num_attention_heads=6, word_embed_proj_dim=24)),
    "opt-post-ln": ("opt", dict(vocab_size=72, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                num_attention_heads=4, word_embed_proj_dim=32, do_layer_norm_before=False)),
}
SEQ = [5, 17, 3, 44, 9, 21, 30, 2, 11, 60, 7, 13]


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    """(specjax model, transformers' hidden states for SEQ in float32 and in float64: [L + 1, T, D] each,
    entry L = the final norm's input)."""
    kind, overrides = CONFIGS[request.param]
    path = str(tmp_path_factory.mktemp(request.param))
    hf = make_hf_model(kind, path, **overrides)
    states = _hf_states(hf, kind), _hf_states(copy.deepcopy(hf).double(), kind)
    return specjax.load_model(path, progress=False), States(*states)


class States:
    """transformers' float32 states (the floor's route) and float64 ones (the reference)."""

    def __init__(self, f32: np.ndarray, f64: np.ndarray):
        self.f32, self.f64 = f32, f64

    def check(self, got, *index) -> None:
        """``got`` against the float64 states at ``index``, within the float32 floor measured there."""
        ref = self.f64[index] if index else self.f64
        floor = precision.error(self.f32[index] if index else self.f32, ref)
        precision.assert_within(got, ref, floor, what=f"hidden states {index}")


def _hf_states(hf, kind: str) -> np.ndarray:
    import torch

    layers = hf.model.layers if kind == "llama" else hf.model.decoder.layers
    last = {}
    hook = layers[-1].register_forward_hook(lambda mod, args, out: last.__setitem__(
        "h", (out[0] if isinstance(out, tuple) else out).detach()))
    with torch.no_grad():
        out = hf(torch.tensor([SEQ]), output_hidden_states=True)
    hook.remove()
    return np.stack([s[0].numpy() for s in out.hidden_states[:-1]] + [last["h"][0].numpy()])


def test_prefill_hidden_equals_transformers(pair):
    model, want = pair
    cfg = model.config
    layers = tuple(range(cfg.num_layers + 1))
    cache = init_cache(cfg, 1, 32)
    tokens = jnp.asarray([SEQ])
    positions = jnp.arange(len(SEQ))[None]
    out = forward(model.params, tokens, positions, cache, causal_meta(jnp.zeros((1,), jnp.int32)), cfg, hidden=layers)
    got = np.asarray(out.hidden)[0].transpose(1, 0, 2)  # [L + 1, T, D]
    assert got.shape == want.f64.shape
    want.check(got)
    with pytest.raises(AssertionError, match="exceeds"):  # the bound has power: layers off by one fail it
        want.check(np.concatenate([got[:1], got[:-1]]))
    # a subset at selected positions, in the asked order
    idx = jnp.asarray([[3, 11]])
    sub = forward(model.params, tokens, positions, cache, causal_meta(jnp.zeros((1,), jnp.int32)), cfg,
                  logits_indices=idx, hidden=(cfg.num_layers, 1))
    want.check(np.asarray(sub.hidden)[0].transpose(1, 0, 2), np.asarray([cfg.num_layers, 1])[:, None],
               np.asarray([3, 11])[None, :])
    assert forward(model.params, tokens, positions, cache, causal_meta(jnp.zeros((1,), jnp.int32)), cfg).hidden is None


def test_decode_steps_hidden_equals_transformers(pair):
    model, want = pair
    cfg = model.config
    layers = (0, cfg.num_layers - 1, cfg.num_layers)
    cache = init_cache(cfg, 1, 32)
    step = jax.jit(lambda p, c, t: forward(p, t[:, None], c.length[:, None], c, causal_meta(c.length), cfg,
                                           hidden=layers))
    for t, token in enumerate(SEQ):
        out = step(model.params, cache, jnp.asarray([token], jnp.int32))
        cache = out.cache.replace(length=out.cache.length + 1)
        want.check(np.asarray(out.hidden)[0, 0], list(layers), t)


def test_tree_pass_hidden_equals_transformers_on_each_root_path(pair):
    """Tree over the committed prefix SEQ[:5]: node i's hidden states are those of its root path."""
    model, want = pair
    cfg = model.config
    committed = 5
    # node tokens: a chain following SEQ (so transformers' states apply) plus side branches
    tokens = [SEQ[5], SEQ[6], SEQ[7], 1, SEQ[8], 2]
    parents = [-1, 0, 1, 0, 2, 4]
    tree = from_parents([tokens], [parents], n_max=8)
    cache = init_cache(cfg, 1, 32)
    prefix = forward(model.params, jnp.asarray([SEQ[:committed]]), jnp.arange(committed)[None], cache,
                     causal_meta(jnp.zeros((1,), jnp.int32)), cfg)
    cache = prefix.cache.replace(length=jnp.asarray([committed], jnp.int32))
    layers = tuple(range(cfg.num_layers + 1))
    out = jax.jit(tree_forward, static_argnames=("cfg", "impl", "hidden"))(model.params, tree, cache, cfg=cfg,
                                                                        impl="xla", hidden=layers)
    got = np.asarray(out.hidden)[0]  # [N, L + 1, D]
    for node in range(len(tokens)):
        path = [tokens[j] for j in root_path(tree, 0, node)]
        if path != SEQ[committed:committed + len(path)]:
            continue  # a side branch: not a prefix of SEQ, transformers' run has no state for it
        want.check(got[node], slice(None), committed + len(path) - 1)


def test_pipeline_hidden_equals_one_device():
    from specjax.sharding import Parallel
    from tests.toy import mesh_model

    model = mesh_model("llama")
    cfg = model.config
    layers = (0, 1, 2, 3, 4)
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 256, (4, 6)))
    positions = jnp.broadcast_to(jnp.arange(6), (4, 6))
    idx = jnp.asarray([[5], [2], [0], [4]])

    def run(parallel):
        cache = init_cache(cfg, 4, 8)
        params = model.params
        if parallel is not None:
            params = parallel.put_params(params, cfg)
            cache = jax.device_put(cache, parallel.cache_shardings(cfg, 4, 8))
        fn = jax.jit(lambda p, c: forward(p, tokens, positions, c, causal_meta(jnp.zeros((4,), jnp.int32)), cfg,
                                          logits_indices=idx, parallel=parallel, hidden=layers).hidden)
        return np.asarray(fn(params, cache))

    one = run(None)
    with precision.float64():  # the same forward in float64 on one device: the reference
        fn = jax.jit(lambda p, c: forward(p, tokens, positions, c, causal_meta(jnp.zeros((4,), jnp.int32)), cfg,
                                          logits_indices=idx, hidden=layers).hidden)
        ref = np.asarray(fn(precision.params64(model.params), init_cache(cfg, 4, 8, jnp.float64)))
    for mesh in ("pp=2,tp=4", "pp=4,dp=2"):
        precision.assert_within(run(Parallel.create(mesh)), ref, precision.error(one, ref), what=mesh)


def test_bad_hidden_request():
    from tests.toy import mesh_model

    model = mesh_model("llama")
    cache = init_cache(model.config, 1, 4)
    for bad in ((5,), (), [0], (-1,), (True,)):
        with pytest.raises(InputError, match="hidden must be a non-empty tuple of layer indices in"):
            forward(model.params, jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32), cache,
                    causal_meta(jnp.zeros((1,), jnp.int32)), model.config, hidden=bad)
