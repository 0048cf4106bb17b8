"""Tree attention: Pallas kernel (interpret) == naive reference == XLA path; NaN padding never leaks;
the kernel lowers for CUDA; all implementations reject the same inputs."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.attention import tree_attention
from specjax.errors import InputError
from specjax.kernels.tree_attention import tree_attention_reference
from specjax.speculation.tree import from_parents
from tests import precision

EPS32 = float(np.finfo(np.float32).eps)


def _random_tree(rng, n_nodes, max_depth=8):
    parents, depth = [-1], [0]
    for i in range(1, n_nodes):
        choices = [j for j in range(i) if depth[j] < max_depth]
        p = int(rng.choice(choices))
        parents.append(p)
        depth.append(depth[p] + 1)
    return parents


def _case(rng, batch, n_max, sizes, lengths, heads, kv_heads, head_dim, max_len):
    parents = [_random_tree(rng, n) for n in sizes]
    tree = from_parents([[1] * len(p) for p in parents], parents, n_max=n_max)
    q = rng.randn(batch, n_max, heads, head_dim).astype(np.float32)
    # Poison every slot that is neither committed prefix nor a real tree node.
    k = np.full((batch, max_len, kv_heads, head_dim), np.nan, np.float32)
    v = np.full_like(k, np.nan)
    for b in range(batch):
        used = lengths[b] + sizes[b]
        k[b, :used] = rng.randn(used, kv_heads, head_dim)
        v[b, :used] = rng.randn(used, kv_heads, head_dim)
    return tree, q, k, v, np.asarray(lengths, np.int32)


SHAPES = [  # (heads, kv_heads, head_dim, n_max, sizes, lengths, max_len)
    (4, 4, 16, 8, [5, 8], [0, 37], 64),  # MHA, empty prefix
    (9, 3, 8, 16, [16, 3], [20, 48], 64),  # GQA 9/3 (odd head count), tree ending at the cache end
    (5, 1, 12, 7, [7, 1], [3, 0], 40),  # MQA, odd head count and head_dim, root-only tree
    (6, 2, 16, 64, [64, 33], [0, 61], 128),  # 64 nodes = two bitmask words... and cache end
    (3, 3, 4, 40, [40, 12], [100, 5], 140),  # 2 words, 40 nodes, long prefix (4 KV blocks)
    (2, 1, 8, 7, [7, 5], [33, 26], 40),  # last KV block and padded tree rows run past the cache end
]


@pytest.mark.parametrize("shape", SHAPES, ids=[f"h{s[0]}kv{s[1]}d{s[2]}n{s[3]}" for s in SHAPES])
def test_pallas_equals_reference_equals_xla(shape):
    heads, kv_heads, head_dim, n_max, sizes, lengths, max_len = shape
    rng = np.random.RandomState(sum(shape[:4]))
    tree, q, k, v, lengths = _case(rng, 2, n_max, sizes, lengths, heads, kv_heads, head_dim, max_len)
    scale = head_dim ** -0.5
    ref = tree_attention_reference(q, k, v, lengths, tree.parent, tree.valid, scale)  # float64
    floor = precision.error(tree_attention_reference(q, k, v, lengths, tree.parent, tree.valid, scale,
                                                     dtype=np.float32), ref)
    args = (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths), tree.ancestor)
    xla = np.asarray(tree_attention(*args, scale=scale, impl="xla"))
    pallas = np.asarray(tree_attention(*args, scale=scale, impl="pallas"))
    for name, out in (("xla", xla), ("pallas", pallas)):
        assert not np.isnan(out).any(), f"{name}: NaN from a poisoned slot leaked into the output"
        precision.assert_within(out, ref, floor, what=name)
    # the bound has power: the same tree with siblings visible to each other (pitfall 11) fails it
    flat = from_parents([[1] * len(p) for p in [[-1] + [0] * (s - 1) for s in sizes]],
                        [[-1] + [0] * (s - 1) for s in sizes], n_max=n_max)
    if any(np.asarray(tree.depth).max(axis=1) > 1):
        wrong = np.asarray(tree_attention(*args[:4], flat.ancestor, scale=scale, impl="xla"))
        assert precision.error(wrong, ref) > 10 * precision.bound(ref, floor)


def test_reference_on_hand_computed_three_node_tree():
    # prefix of one slot; nodes 0 -> {1, 2}; head_dim 1, so attention weights are easy to write down
    q = np.array([[[[1.0]], [[1.0]], [[1.0]]]], np.float32)  # [1, 3, 1, 1]
    k = np.array([[[[0.0]], [[0.0]], [[np.log(2.0)]], [[np.log(3.0)]]]], np.float32)  # [1, 4, 1, 1]
    v = np.array([[[[10.0]], [[20.0]], [[30.0]], [[40.0]]]], np.float32)
    tree = from_parents([[7, 8, 9]], [[-1, 0, 0]], n_max=3)
    out = tree_attention_reference(q, k, v, np.array([1]), tree.parent, tree.valid, scale=1.0)[0, :, 0, 0]
    # node 0 sees prefix + itself: weights 1:1; node 1 sees prefix, 0, 1: weights 1:1:2; node 2: 1:1:3
    # exact up to the float32 rounding of the inputs (log 2, log 3): a few float32 ulps
    np.testing.assert_allclose(out, [15.0, (10 + 20 + 2 * 30) / 4, (10 + 20 + 3 * 40) / 5], rtol=8 * EPS32)


# SmolLM2's heads and a 64-node tree; then head dims that are not powers of two, which Triton's block
# shapes must be: the H100 refused head_dim 12 ("array arguments ... whose size is a power of 2")
# until the kernel read the columns padded under a mask (scripts/gpu_validate.sh, stop 47).
@pytest.mark.parametrize("heads,kv_heads,head_dim,n_max", [(9, 3, 64, 64), (5, 1, 12, 7), (4, 2, 80, 16)])
def test_pallas_kernel_lowers_for_cuda(heads, kv_heads, head_dim, n_max):
    from specjax.kernels.tree_attention.kernel import tree_attention_pallas

    max_len = 320
    q = jax.ShapeDtypeStruct((2, n_max, heads, head_dim), jnp.float32)
    kv = jax.ShapeDtypeStruct((2, max_len, kv_heads, head_dim), jnp.float32)
    lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
    anc = jax.ShapeDtypeStruct((2, n_max, -(-n_max // 32)), jnp.uint32)
    fn = jax.jit(functools.partial(tree_attention_pallas, scale=0.125, interpret=False))
    exported = jax.export.export(
        fn, platforms=("cuda",),
        # Triton custom calls carry no serialization-compatibility guarantee; lowering is what we test.
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(q, kv, kv, lengths, anc)
    text = exported.mlir_module()
    assert "__gpu$xla.gpu.triton" in text and 'name = "tree_attention"' in text
    assert exported.platforms == ("cuda",)


@pytest.mark.parametrize("impl", ["xla", "pallas", "reference"])
def test_all_implementations_reject_the_same_inputs(impl):
    rng = np.random.RandomState(0)
    tree, q, k, v, lengths = _case(rng, 2, 8, [4, 4], [10, 50], 4, 2, 8, 60)

    def call(q, k, v, lengths, tree):
        if impl == "reference":
            return tree_attention_reference(q, k, v, lengths, tree.parent, tree.valid, 1.0)
        return tree_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths),
                              tree.ancestor, scale=1.0, impl=impl)

    with pytest.raises(InputError, match="request 1: prefix 53 \\+ tree 8 = 61 exceeds the cache size 60"):
        call(q, k, v, np.array([10, 53], np.int32), tree)
    with pytest.raises(InputError, match="not a multiple of 2 KV heads"):
        call(q[:, :, :3], k, v, lengths, tree)
    with pytest.raises(InputError, match="describes 8 nodes but q has 6"):
        call(q[:, :6], k, v, lengths, tree)
    with pytest.raises(InputError, match="negative committed length"):
        call(q, k, v, np.array([-1, 0], np.int32), tree)
    with pytest.raises(InputError, match="lengths must be integers, got dtype float32"):  # Pallas truncated them
        call(q, k, v, lengths.astype(np.float32) + 0.7, tree)
    with pytest.raises(InputError, match=r"has no KV heads"):  # a bare ZeroDivisionError
        call(q, k[:, :, :0], v[:, :, :0], lengths, tree)
    if impl == "reference":  # it reads the parents, not the ancestor bits
        return
    ancestor = np.asarray(tree.ancestor)
    # request 1 silently attended with request 0's tree; a third table broadcast or failed unclearly
    for bad in (ancestor[:1], np.concatenate([ancestor, ancestor[:1]]), ancestor[:, :, 0], ancestor.astype(np.int32),
                ancestor.astype(np.float32)):
        with pytest.raises(InputError, match=r"ancestor must be \[B=2, T, W\] uint32 bit rows"):
            call(q, k, v, lengths, tree.replace(ancestor=jnp.asarray(bad)))


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_lengths_known_only_under_jit_that_overrun_the_buffer_give_nan_rows(impl):
    """Checked on the host where they are concrete; under the caller's jit the XLA path read clamped slots
    and returned a finite, wrong row for the request whose prefix + tree ran past the buffer."""
    rng = np.random.RandomState(3)
    tree, q, k, v, lengths = _case(rng, 2, 8, [4, 4], [10, 40], 4, 2, 8, 60)
    k, v = np.nan_to_num(k), np.nan_to_num(v)
    fn = jax.jit(lambda lengths: tree_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), lengths,
                                                tree.ancestor, scale=1.0, impl=impl))
    out = np.asarray(fn(jnp.asarray([10, 53], np.int32)))  # 53 + 8 > 60
    assert np.isfinite(out[0]).all() and np.isnan(out[1]).all()
    np.testing.assert_array_equal(out[0], np.asarray(fn(jnp.asarray([10, 40], np.int32)))[0])


def test_pallas_runs_with_64_bit_mode_on():
    """Under jax_enable_x64 (user code sets it; the float64 references do) the kernel's block count mixed an
    int32 length with an int64 block size: "lax.div requires arguments to have the same dtypes"."""
    rng = np.random.RandomState(4)
    tree, q, k, v, lengths = _case(rng, 2, 8, [4, 7], [10, 33], 4, 2, 8, 60)
    args = (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths), tree.ancestor)
    want = np.asarray(tree_attention(*args, scale=0.5, impl="pallas"))
    with jax.enable_x64(True):
        got = np.asarray(tree_attention(*args, scale=0.5, impl="pallas"))
    np.testing.assert_array_equal(got, want)


def test_the_entry_point_lowers_the_triton_kernel_for_cuda_and_the_interpreter_elsewhere():
    """Whether the kernel is compiled or interpreted was read from this host's backend when tracing: a CUDA
    export made on a CPU host embedded the interpreter's loops, no Triton kernel."""
    S = jax.ShapeDtypeStruct
    args = (S((1, 16, 9, 64), jnp.float32), S((1, 512, 3, 64), jnp.float32), S((1, 512, 3, 64), jnp.float32),
            S((1,), jnp.int32), S((1, 16, 1), jnp.uint32))
    fn = jax.jit(lambda q, k, v, lengths, a: tree_attention(q, k, v, lengths, a, scale=0.125, impl="pallas"))
    triton = "__gpu$xla.gpu.triton"
    cuda = jax.export.export(fn, platforms=("cuda",),
                             disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(triton)])(*args)
    assert triton in cuda.mlir_module()
    cpu = jax.export.export(fn, platforms=("cpu",))(*args).mlir_module()
    assert triton not in cpu and "stablehlo.while" in cpu


def test_frontier_queries_see_ancestors_written_by_earlier_passes():
    """SSM drafting scores one frontier per pass: T queries that are a subset of an N-node tree."""
    rng = np.random.RandomState(5)
    parents = [[-1, 0, 0, 1, 1, 2, 2, 3, 5], [-1, 0, 1, 2, 3, 4, 5, 6, 7]]
    tree = from_parents([[1] * 9] * 2, parents, n_max=9)
    frontier = np.array([[3, 4, 5, 6], [4, 5, 6, 7]], np.int32)  # depth-2 nodes / a chain segment
    heads, kv_heads, head_dim, max_len = 6, 3, 8, 40
    lengths = np.array([12, 31], np.int32)
    q = rng.randn(2, 4, heads, head_dim).astype(np.float32)
    k = np.full((2, max_len, kv_heads, head_dim), np.nan, np.float32)
    v = np.full_like(k, np.nan)
    for b in range(2):
        k[b, :lengths[b] + 9] = rng.randn(lengths[b] + 9, kv_heads, head_dim)
        v[b, :lengths[b] + 9] = rng.randn(lengths[b] + 9, kv_heads, head_dim)
    rows = np.take_along_axis(np.asarray(tree.ancestor), frontier[:, :, None], axis=1)
    ref = tree_attention_reference(q, k, v, lengths, tree.parent, tree.valid, 0.5, query_nodes=frontier)
    floor = precision.error(tree_attention_reference(q, k, v, lengths, tree.parent, tree.valid, 0.5,
                                                     query_nodes=frontier, dtype=np.float32), ref)
    args = (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths), jnp.asarray(rows))
    for impl in ("xla", "pallas"):
        out = np.asarray(tree_attention(*args, scale=0.5, impl=impl, region=9))
        precision.assert_within(out, ref, floor, what=impl)


@pytest.mark.parametrize("num_q,lengths,head_dim", [(1, [300, 37], 16), (1, [300, 37], 64), (16, [500, 129], 16),
                                                    (64, [300, 0], 16), (70, [257, 600], 16), (70, [1100, 600], 16),
                                                    (300, [257, 0], 16)],
                         ids=["decode", "decode-head-dim-64", "tree-sized", "prefill-chunk", "prefill-chunk-long",
                              "prefill-chunk-full-blocks", "prefill-chunk-query-blocks"])
def test_attention_cost_follows_committed_length_not_buffer(num_q, lengths, head_dim):
    """The prefix is read through a view sized by the committed length (decoding, tree passes) or in
    key blocks up to it (prefill chunks): on a 4096-slot buffer and on one just long enough, every
    unused slot NaN-poisoned, both match the float64 reference (a causal block is a chain tree; the
    full-blocks case has unmasked full key blocks below both lengths, then masked ones; the last one
    reads its own causal block in query blocks of 256 and 44 rows), and through a view they
    are equal bit for bit (key blocks may end differently at the buffer's end, which changes only
    the summation order)."""
    from specjax.attention import attend, causal_meta
    from specjax.attention.xla import BLOCKED_QUERIES

    heads, kv_heads = 9, 3  # SmolLM2's heads; its head_dim is 64 (a 301-slot view once summed unlike a 384-slot one)
    rng = np.random.RandomState(num_q)
    chain = [[-1] + list(range(num_q - 1))] * 2
    tree = from_parents([[1] * num_q] * 2, chain, n_max=num_q)
    outs = []
    for max_len in (max(lengths) + num_q, 4096):
        rng_case = np.random.RandomState(num_q)  # the same numbers in both buffers
        q = rng_case.randn(2, num_q, heads, head_dim).astype(np.float32)
        k = np.full((2, max_len, kv_heads, head_dim), np.nan, np.float32)
        v = np.full_like(k, np.nan)
        for b, n in enumerate(lengths):
            k[b, :n + num_q] = rng_case.randn(n + num_q, kv_heads, head_dim)
            v[b, :n + num_q] = rng_case.randn(n + num_q, kv_heads, head_dim)
        lens = np.asarray(lengths, np.int32)
        block = np.stack([k[b, n:n + num_q] for b, n in enumerate(lengths)])
        vblock = np.stack([v[b, n:n + num_q] for b, n in enumerate(lengths)])
        out = jax.jit(attend, static_argnames="scale")(jnp.asarray(q), jnp.asarray(block), jnp.asarray(vblock),
                                                       jnp.asarray(k), jnp.asarray(v),
                                                       causal_meta(jnp.asarray(lens)), scale=head_dim ** -0.5)
        outs.append(np.asarray(out))
    del rng
    assert not np.isnan(outs[0]).any()
    if num_q < BLOCKED_QUERIES:
        np.testing.assert_array_equal(outs[0], outs[1])
    ref = tree_attention_reference(q, k, v, lens, tree.parent, tree.valid, head_dim ** -0.5)
    floor = precision.error(tree_attention_reference(q, k, v, lens, tree.parent, tree.valid, head_dim ** -0.5,
                                                     dtype=np.float32), ref)
    for out in outs:
        precision.assert_within(out, ref, floor, what="attend")
    # power: one committed slot too few changes the result far beyond the bound
    short = causal_meta(jnp.asarray(lens - 1))
    wrong = np.asarray(attend(jnp.asarray(q), jnp.asarray(block), jnp.asarray(vblock), jnp.asarray(k),
                              jnp.asarray(v), short, head_dim ** -0.5))
    assert precision.error(wrong[lens > 0], ref[lens > 0]) > 10 * precision.bound(ref, floor)


@pytest.mark.parametrize("num_q", [64, 300])
def test_a_prefill_chunks_nonfinite_key_or_value_reaches_exactly_the_queries_that_see_it(num_q):
    """A prefill chunk's own causal block (read in query blocks, ``_causal_block``): a NaN value at
    chunk position 150 of request 0 (KV head 1) and an infinite key at position 10 of request 1 (KV
    head 2) make exactly the queries at and after them, of that KV head's query heads, NaN; every
    other output is finite and equals the unpoisoned float64 reference (0 * NaN must not reach the
    queries before the slot, and an infinite score must not just drop the token)."""
    from specjax.attention import attend, causal_meta

    heads, kv_heads, head_dim = 9, 3, 16
    lengths = np.array([40, 0], np.int32)
    rng = np.random.RandomState(5)
    q = rng.randn(2, num_q, heads, head_dim).astype(np.float32)
    k = rng.randn(2, 40 + num_q, kv_heads, head_dim).astype(np.float32)
    v = rng.randn(2, 40 + num_q, kv_heads, head_dim).astype(np.float32)
    tree = from_parents([[1] * num_q] * 2, [[-1] + list(range(num_q - 1))] * 2, n_max=num_q)
    clean = tree_attention_reference(q, k, v, lengths, tree.parent, tree.valid, head_dim ** -0.5)
    bad_v, bad_k = min(150, num_q - 1), 10
    k[1, 0 + bad_k, 2, 3] = np.inf
    v[0, 40 + bad_v, 1, 5] = np.nan
    block = np.stack([k[b, n:n + num_q] for b, n in enumerate(lengths)])
    vblock = np.stack([v[b, n:n + num_q] for b, n in enumerate(lengths)])
    out = np.asarray(jax.jit(attend, static_argnames="scale")(
        jnp.asarray(q), jnp.asarray(block), jnp.asarray(vblock), jnp.asarray(k), jnp.asarray(v),
        causal_meta(jnp.asarray(lengths)), scale=head_dim ** -0.5))
    expect_nan = np.zeros(out.shape[:3], bool)
    expect_nan[0, bad_v:, 3:6] = True
    expect_nan[1, bad_k:, 6:9] = True
    np.testing.assert_array_equal(np.isnan(out).any(-1), expect_nan)
    assert np.isnan(out[expect_nan]).all()
    with np.errstate(invalid="ignore"):  # the reference's own rows that see the poison
        f32 = tree_attention_reference(q, k, v, lengths, tree.parent, tree.valid, head_dim ** -0.5, dtype=np.float32)
    floor = precision.error(f32[~expect_nan], clean[~expect_nan])
    precision.assert_within(out[~expect_nan], clean[~expect_nan], floor, what="unpoisoned outputs")


def test_a_decoding_token_written_to_the_cache_attends_through_the_view_alone():
    """``attend_written_token`` (decoding: the token's own K/V already sits at slot length[b] of the
    stacked cache): the float64 reference within the float32 floor, unused slots NaN-poisoned, bit
    for bit the same on a tight buffer and a 4096-slot one, and a non-finite K/V of the token itself
    poisons exactly its own query."""
    from specjax.attention.xla import attend_written_token

    heads, kv_heads, head_dim, layers, layer = 9, 3, 64, 2, 1
    lengths = np.array([300, 37], np.int32)
    rng = np.random.RandomState(11)
    q = rng.randn(2, 1, heads, head_dim).astype(np.float32)
    rows = {b: rng.randn(2, n + 1, kv_heads, head_dim).astype(np.float32) for b, n in enumerate(lengths)}
    tree = from_parents([[1]] * 2, [[-1]] * 2, n_max=1)
    outs = []
    for max_len in (int(lengths.max()) + 1, 4096):
        k = np.full((layers, 2, max_len, kv_heads, head_dim), np.nan, np.float32)
        v = np.full_like(k, np.nan)
        for b, n in enumerate(lengths):
            k[layer, b, :n + 1], v[layer, b, :n + 1] = rows[b]
        fn = jax.jit(attend_written_token, static_argnames="scale")
        token = [jnp.asarray(np.stack([c[layer, b, n:n + 1] for b, n in enumerate(lengths)])) for c in (k, v)]
        outs.append(np.asarray(fn(jnp.asarray(q), *token, jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths),
                                  scale=head_dim ** -0.5, layer=jnp.int32(layer))))
    np.testing.assert_array_equal(outs[0], outs[1])
    k1, v1 = k[layer, :, :301], v[layer, :, :301]
    ref = tree_attention_reference(q, k1, v1, lengths, tree.parent, tree.valid, head_dim ** -0.5)
    floor = precision.error(tree_attention_reference(q, k1, v1, lengths, tree.parent, tree.valid, head_dim ** -0.5,
                                                     dtype=np.float32), ref)
    precision.assert_within(outs[1], ref, floor, what="attend_written_token")
    # power: reading one slot fewer (the token itself) lands far outside the bound
    short = np.asarray(attend_written_token(jnp.asarray(q), *token, jnp.asarray(k), jnp.asarray(v),
                                            jnp.asarray(lengths - 1), head_dim ** -0.5, jnp.int32(layer)))
    assert precision.error(short, ref) > 10 * precision.bound(ref, floor)
    # request 1's own key overflowed (in KV head 0), with the sign that gives query head 0 a score of
    # -inf: without the check the token would silently drop out of that head's softmax
    bad = -np.sign(q[1, 0, 0, 0]) * np.inf
    k[layer, 1, lengths[1], 0, 0] = bad
    token[0] = token[0].at[1, 0, 0, 0].set(bad)
    poisoned = np.asarray(attend_written_token(jnp.asarray(q), *token, jnp.asarray(k), jnp.asarray(v),
                                               jnp.asarray(lengths), head_dim ** -0.5, jnp.int32(layer)))
    group = heads // kv_heads
    assert np.isfinite(poisoned[0]).all() and np.isfinite(poisoned[1, 0, group:]).all()
    assert np.isnan(poisoned[1, 0, :group]).all()
