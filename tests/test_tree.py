"""TokenTree builders, validation and the drawn example in specjax/speculation/tree.py's docstring."""

from __future__ import annotations

import textwrap

import chex
import jax.numpy as jnp
import numpy as np
import pytest

import specjax.speculation.tree as tree_lib
from specjax.speculation.drafters.merge import depths
from specjax.speculation.tree import (
    TreeError,
    ancestor_bits,
    from_parents,
    from_paths,
    mask_diagram,
    root_path,
)


def test_docstring_literal_is_what_the_code_renders():
    t = from_parents([[5, 6, 7, 8, 9, 10, 11]], [[-1, 0, 0, 1, 1, 2, 5]], n_max=8)
    doc = tree_lib.__doc__
    block = doc.split("``mask_diagram(tree, length=10)``")[1].split("\n\n")[1]
    assert textwrap.dedent(block).strip("\n") == textwrap.dedent(mask_diagram(t, length=10)).strip("\n")
    # ... and the positions column is length + depth
    np.testing.assert_array_equal(np.asarray(t.depth[0, :7]) + 10, [10, 11, 11, 12, 12, 12, 13])


def test_ancestor_bits_by_hand_three_nodes():
    t = from_parents([[1, 2, 3]], [[-1, 0, 0]], n_max=4)
    np.testing.assert_array_equal(np.asarray(t.ancestor[0, :, 0]), [0b001, 0b011, 0b101, 0])


class TestAncestorBits(chex.TestCase):
    """The jittable builders behave the same traced and eagerly (chex variants)."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_span_words(self):
        n = 70  # three uint32 words
        parents = [-1] + list(range(n - 1))  # a chain: node i sees 0..i
        t = from_parents([[0] * n], [parents], n_max=80)
        bits = self.variant(ancestor_bits)(t.parent, t.valid)
        chex.assert_shape(bits, (1, 80, 3))
        chex.assert_type(bits, np.uint32)
        np.testing.assert_array_equal(np.asarray(bits), np.asarray(t.ancestor))
        for i in (0, 31, 32, 33, 64, 69):
            row = np.asarray(bits[0, i])
            visible = [j for j in range(96) if (row[j // 32] >> (j % 32)) & 1]
            assert visible == list(range(i + 1))
        assert not np.asarray(bits[0, 70:]).any(), "padding nodes must have empty rows"

    @chex.variants(with_jit=True, without_jit=True)
    def test_host_builder_equals_the_jittable_one_on_random_trees(self):
        # from_parents builds the mask in numpy (no per-op compiles at start-up); the in-loop merge
        # builds it with ancestor_bits: both must give the same rows, padding included.
        rng = np.random.default_rng(0)
        sizes = [1, 5, 33, 40]
        parents = [[-1] + [int(rng.integers(0, i)) for i in range(1, n)] for n in sizes]
        t = from_parents([[0] * n for n in sizes], parents, n_max=40)
        chex.assert_trees_all_equal(self.variant(ancestor_bits)(t.parent, t.valid), t.ancestor)

    @chex.variants(with_jit=True, without_jit=True)
    def test_depths_from_parents(self):
        parent = jnp.asarray([[-1, 0, 0, 1, 3, 2, -1]], jnp.int32)
        np.testing.assert_array_equal(np.asarray(self.variant(depths)(parent)), [[0, 1, 1, 2, 3, 2, 0]])


def test_children_in_draw_order_and_depth():
    t = from_parents([[9, 1, 2, 3, 4]], [[-1, 0, 0, 1, 0]], n_max=6)
    np.testing.assert_array_equal(np.asarray(t.children[0, 0]), [1, 2, 4])
    np.testing.assert_array_equal(np.asarray(t.children[0, 1]), [3, -1, -1])
    np.testing.assert_array_equal(np.asarray(t.depth[0, :5]), [0, 1, 1, 2, 1])
    assert root_path(t, 0, 3) == [0, 1, 3]


def test_from_paths_merges_shared_prefixes_exactly_once():
    paths = [[5, 6, 7], [5, 6, 8], [5, 9], [5, 6, 7], [1]]
    t = from_paths([4], [paths], n_max=8)
    tokens, parent, valid = (np.asarray(x[0]) for x in (t.tokens, t.parent, t.valid))
    seqs = {tuple(tokens[root_path(t, 0, i)][1:]) for i in range(8) if valid[i]}
    prefixes = {tuple(p[:d]) for p in paths for d in range(0, len(p) + 1)}
    assert seqs == prefixes
    assert valid.sum() == len(prefixes)


@pytest.mark.parametrize("parents,match", [
    ([[0, 0]], "node 0 must be the root"),
    ([[-1, 1]], "is its own parent"),
    ([[-1, 2, 0]], "stored after it"),
    ([[-1, -1]], "only node 0 may be a root"),
    ([[]], "at least the root"),
])
def test_malformed_trees_are_rejected(parents, match):
    with pytest.raises(TreeError, match=match):
        from_parents([[1] * len(parents[0])], parents, n_max=8)


def test_too_many_nodes_and_too_deep():
    with pytest.raises(TreeError, match="9 nodes exceed the static tree size N_max=8"):
        from_parents([[1] * 9], [[-1] + list(range(8))], n_max=8)
    with pytest.raises(TreeError, match="depth 4 > max_depth=3"):
        from_parents([[1] * 5], [[-1, 0, 1, 2, 3]], n_max=8, max_depth=3)
