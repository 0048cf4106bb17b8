"""LLM forward over token trees: every node's logits equal incremental decoding of its root path;
committing an accepted path leaves exactly the cache incremental decoding builds."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import specjax
from specjax.attention.meta import causal_meta
from specjax.decoding.incremental import full_logits
from specjax.models import forward
from specjax.models.cache import KVCache, init_cache
from specjax.speculation.commit import commit_path, tree_forward
from specjax.speculation.tree import from_parents, root_path
from tests import precision

N_MAX, MAX_LEN, BATCH = 64, 160, 2


@pytest.fixture(scope="module", params=["llama", "opt"])
def model(request, tiny_llama_dir, tiny_opt_dir):
    return specjax.load_model(tiny_llama_dir if request.param == "llama" else tiny_opt_dir, progress=False)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _prefix_cache(params, prefix, lengths, cfg):
    """Cache holding prefix[b, :lengths[b]] committed (written as a causal chain), NaN elsewhere."""
    cache = init_cache(cfg, prefix.shape[0], MAX_LEN, jax.tree.leaves(params)[0].dtype, poison=True)
    positions = jnp.broadcast_to(jnp.arange(prefix.shape[1]), prefix.shape)
    _, cache, _ = forward(params, prefix, positions, cache, causal_meta(jnp.zeros_like(lengths)), cfg)
    # Re-poison everything beyond the committed length so stray reads of scratch slots show up.
    slot = jnp.arange(MAX_LEN)[None, None, :, None, None]
    committed = slot < lengths[None, :, None, None, None]
    return KVCache(k=jnp.where(committed, cache.k, jnp.nan), v=jnp.where(committed, cache.v, jnp.nan),
                   length=lengths)


_tree_forward_jit = jax.jit(tree_forward, static_argnames=("cfg", "impl"))


def _random_parents(rng, n, max_depth=8):
    parents, depth = [-1], [0]
    for i in range(1, n):
        p = int(rng.choice([j for j in range(i) if depth[j] < max_depth]))
        parents.append(p)
        depth.append(depth[p] + 1)
    return parents


def _check_tree_logits(model, sizes, lengths, seed, impl="xla", tree_pass=None):
    cfg = model.config
    rng = np.random.RandomState(seed)
    prefix = rng.randint(0, cfg.vocab_size, (BATCH, MAX_LEN)).astype(np.int32)
    parents = [_random_parents(rng, n) for n in sizes]
    tokens = [rng.randint(0, cfg.vocab_size, len(p)).tolist() for p in parents]
    tree = from_parents(tokens, parents, n_max=N_MAX, max_depth=8)
    cache = _prefix_cache(model.params, jnp.asarray(prefix[:, :MAX_LEN - N_MAX]), jnp.asarray(lengths, jnp.int32),
                          cfg)
    logits, _, _ = (tree_pass or _tree_forward_jit)(model.params, tree, cache, cfg=cfg, impl=impl)
    logits = np.asarray(logits)
    # Incremental reference: each node's full sequence = committed prefix + its root path tokens.
    seqs, where = [], []
    for b in range(BATCH):
        for i in range(len(parents[b])):
            path_tokens = [tokens[b][j] for j in root_path(tree, b, i)]
            seqs.append(prefix[b, :lengths[b]].tolist() + path_tokens)
            where.append((b, i))
    width = MAX_LEN
    padded = np.zeros((len(seqs), width), np.int32)
    for r, s in enumerate(seqs):
        padded[r, :len(s)] = s
    recompute = np.asarray(full_logits(model.params, jnp.asarray(padded), cfg=cfg))
    assert not np.isnan(logits[[b for b, _ in where], [i for _, i in where]]).any()
    last = [len(s) - 1 for s in seqs]
    got = np.stack([logits[b, i] for b, i in where])
    ref = np.stack([row[-1] for row in precision.logits64(model, seqs)])  # float64, each node's root path
    floor = precision.error(recompute[np.arange(len(seqs)), last], ref)  # the causal recompute's float32 error
    precision.assert_within(got, ref, floor, what=f"tree logits ({impl})")
    return got, ref, floor


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(1, N_MAX), min_size=BATCH, max_size=BATCH),
       where=st.lists(st.sampled_from(["zero", "end", "mid"]), min_size=BATCH, max_size=BATCH),
       mid=st.integers(1, MAX_LEN - N_MAX - 1), seed=st.integers(0, 2**31 - 1))
def test_tree_node_logits_equal_incremental(model, sizes, where, mid, seed):
    # committed length 0 (no prefix beyond the root), at the cache end (length + N_max = S), or between
    lengths = [{"zero": 0, "end": MAX_LEN - N_MAX, "mid": mid}[w] for w in where]
    _check_tree_logits(model, sizes, lengths, seed)


def test_tree_logits_with_pallas_kernel(model):
    _check_tree_logits(model, [64, 9], [MAX_LEN - N_MAX, 0], seed=3, impl="pallas")


def test_tree_logits_bound_has_power(model):
    """The same check with node positions off by one (pitfall 11) fails: the bound catches real bugs."""
    _check_tree_logits(model, [9, 5], [20, 3], seed=5)
    shifted = jax.jit(lambda params, tree, cache, cfg, impl: tree_forward(
        params, tree.replace(depth=tree.depth + 1), cache, cfg, impl), static_argnames=("cfg", "impl"))
    with pytest.raises(AssertionError, match="exceeds"):
        _check_tree_logits(model, [9, 5], [20, 3], seed=5, tree_pass=shifted)


def test_commit_equals_incremental_cache_and_decoding_continues(model):
    cfg = model.config
    rng = np.random.RandomState(11)
    lengths = np.array([7, 30], np.int32)
    prefix = rng.randint(0, cfg.vocab_size, (BATCH, 40)).astype(np.int32)
    parents = [_random_parents(rng, 20), _random_parents(rng, 12)]
    tokens = [rng.randint(0, cfg.vocab_size, len(p)).tolist() for p in parents]
    tree = from_parents(tokens, parents, n_max=32)
    cache = _prefix_cache(model.params, jnp.asarray(prefix), jnp.asarray(lengths), cfg)
    tree_logits, cache, _ = _tree_forward_jit(model.params, tree, cache, cfg=cfg, impl="xla")
    # Accept the root path of the deepest node of each request.
    depth = np.asarray(tree.depth)
    paths = [root_path(tree, b, int(np.argmax(np.where(np.asarray(tree.valid[b]), depth[b], -1))))
             for b in range(BATCH)]
    width = max(len(p) for p in paths)
    path = np.full((BATCH, width), -1, np.int32)
    for b, p in enumerate(paths):
        path[b, :len(p)] = p
    keep = np.array([len(p) for p in paths], np.int32)
    committed = jax.jit(commit_path)(cache, jnp.asarray(path), jnp.asarray(keep))
    np.testing.assert_array_equal(np.asarray(committed.length), lengths + keep)

    # What incremental decoding builds for the same tokens: the whole sequence as a causal chain.
    seqs = [prefix[b, :lengths[b]].tolist() + [tokens[b][j] for j in paths[b]] for b in range(BATCH)]
    chain = np.zeros((BATCH, 64), np.int32)
    for b, s in enumerate(seqs):
        chain[b, :len(s)] = s
    lens = jnp.asarray([len(s) for s in seqs], jnp.int32)
    ref_cache = _prefix_cache(model.params, jnp.asarray(chain), lens, cfg)
    with precision.float64():  # the same chain in float64: the reference both caches are measured against
        params64 = precision.params64(model.params)
        cache64 = _prefix_cache(params64, jnp.asarray(chain), lens, cfg)
        cache64 = jax.tree.map(np.asarray, cache64)
    for b, s in enumerate(seqs):
        for name in ("k", "v"):
            got = np.asarray(getattr(committed, name)[:, b, :len(s)])
            chain32 = np.asarray(getattr(ref_cache, name)[:, b, :len(s)])
            want = getattr(cache64, name)[:, b, :len(s)]
            precision.assert_within(got, want, precision.error(chain32, want), what=f"request {b} cache {name}")

    # Decoding continues identically: feed the same next token to both caches (and the float64 one).
    nxt = jnp.asarray([int(np.argmax(np.asarray(tree_logits)[b, paths[b][-1]])) for b in range(BATCH)])
    step = jax.jit(lambda p, c, t: forward(p, t[:, None], c.length[:, None], c, causal_meta(c.length), cfg))
    a, b_, c64 = committed, ref_cache, cache64
    for _ in range(5):
        la, a, _ = step(model.params, a, nxt)
        lb, b_, _ = step(model.params, b_, nxt)
        with precision.float64():
            lc, c64, _ = step(params64, jax.tree.map(jnp.asarray, c64), nxt)
            lc, c64 = np.asarray(lc), jax.tree.map(np.asarray, c64)
        precision.assert_within(la, lc, precision.error(lb, lc), what="decoding after commit")
        a, b_ = a.replace(length=a.length + 1), b_.replace(length=b_.length + 1)
        c64 = c64.replace(length=c64.length + 1)
        nxt = jnp.argmax(la[:, 0], axis=-1).astype(jnp.int32)


def test_commit_compiles_to_in_place_updates_without_full_cache_copy():
    cfg_shape = (4, 2, 64, 2, 8)
    cache = KVCache(k=jnp.zeros(cfg_shape), v=jnp.zeros(cfg_shape), length=jnp.array([3, 7], jnp.int32))
    compiled = jax.jit(commit_path, donate_argnums=0).lower(
        cache, jnp.zeros((2, 5), jnp.int32), jnp.ones((2,), jnp.int32)).compile()
    hlo = compiled.as_text()
    full = r"f32\[4,2,64,2,8\]"
    copies = [line for line in hlo.splitlines() if re.search(full + r"\S* copy\(", line)]
    assert not copies, f"commit copies the full cache: {copies}"
    assert re.search(r"input_output_alias=\{ \{0\}: \(0", hlo), "cache k is not updated in place"
    assert re.search(full + r"\S* (scatter|fusion)\(", hlo)
