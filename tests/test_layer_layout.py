"""Split (per-layer buffers, read in place by switched matmuls) vs stacked layer weights: the same
model either way.

``load_model`` gives split weights on one CPU device by default (faster passes on XLA:CPU, slower
compilation, see ``specjax.models.params``) and stacked ones on a mesh (or with split_layers=False).
Checkpoints, HF export, boost students and SSMs cut from an LLM take either; a mesh refuses split
weights. These tests hold
the two layouts to the same results (within the float64-derived bound, identical tokens) and check
that the split pass really reads each layer's weights in place.
"""

from __future__ import annotations

import dataclasses
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.decoding.incremental import full_logits
from specjax.errors import CheckpointError, InputError, ShardingError
from specjax.models import check_params
from specjax.models.cache import init_cache
from specjax.models.layers import run_layers
from specjax.models.params import layers_split, split_layers, stack_layers, take_layers
from specjax.speculation.commit import tree_forward
from specjax.speculation.drafters.lookup import LookupDrafter
from specjax.speculation.drafters.ssm import derive_ssm
from specjax.speculation.tree import from_parents
from tests import precision
from tests.conftest import random_ids


@pytest.fixture(scope="module", params=["tiny_llama_dir", "tiny_opt_dir"])
def both(request):
    """(stacked model, split model) of one tiny checkpoint."""
    path = request.getfixturevalue(request.param)
    return (specjax.load_model(path, progress=False, split_layers=False),
            specjax.load_model(path, progress=False, split_layers=True))


def test_load_model_splits_on_one_cpu_device_and_checks_its_argument(tiny_llama_dir):
    from specjax.sharding import Parallel

    split = specjax.load_model(tiny_llama_dir, progress=False, split_layers=True)
    stacked = specjax.load_model(tiny_llama_dir, progress=False, split_layers=False)
    assert layers_split(split.params) and not layers_split(stacked.params)
    # the default: split on one CPU device, stacked on a mesh
    chex.assert_trees_all_equal(specjax.load_model(tiny_llama_dir, progress=False).params, split.params)
    on_mesh = specjax.load_model(tiny_llama_dir, progress=False, parallel=Parallel.create("dp=8"))
    assert not layers_split(on_mesh.params)
    assert len(split.params["layers"]) == split.config.num_layers
    check_params(split.config, split.params)
    chex.assert_trees_all_equal(stack_layers(split.params), stacked.params)
    chex.assert_trees_all_equal(split_layers(stacked.params), split.params)
    with pytest.raises(InputError, match=r"split_layers must be True, False or None \(auto\)"):
        specjax.load_model(tiny_llama_dir, progress=False, split_layers="yes")
    with pytest.raises(InputError, match="split_layers=True keeps the weights on one device"):
        specjax.load_model(tiny_llama_dir, progress=False, split_layers=True, shardings=lambda cfg: None)
    short = {**split.params, "layers": split.params["layers"][:-1]}
    with pytest.raises(CheckpointError, match=rf"{split.config.num_layers - 1} layers, expected"):
        check_params(split.config, short)


class TestPasses(chex.TestCase):
    """Prefill and tree passes (writing, block-only, with hidden states) traced and eager: the split
    route meets the float64 reference within the stacked route's own measured float32 error (XLA may
    fuse the two programs differently, so the two float32 results can differ in the last bits)."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_same_passes(self):
        for stacked, split in self._models:
            cfg = stacked.config
            rng = np.random.RandomState(0)
            ids = jnp.asarray([random_ids(rng, cfg.vocab_size, 9) for _ in range(2)])
            cache = init_cache(cfg, 2, 16)
            cache = cache.replace(k=cache.k + 0.1, v=cache.v - 0.1, length=jnp.asarray([3, 5], jnp.int32))
            tree = from_parents([[1, 2, 3, 4]] * 2, [[-1, 0, 0, 1]] * 2, n_max=5)
            hidden = (0, cfg.num_layers) if cfg.family == "llama" else None
            passes = {"prefill logits": lambda p: full_logits(p, ids, cfg=cfg)}
            for block_only in (False, True):
                passes[f"tree pass (block_only={block_only})"] = (
                    lambda p, b=block_only: tree_forward(p, tree, cache, cfg, "xla", hidden=hidden, block_only=b))
            for what, fn in passes.items():
                got_stacked = jax.tree.leaves(self.variant(fn)(stacked.params))
                got_split = jax.tree.leaves(self.variant(fn)(split.params))
                with precision.float64():
                    ref = jax.tree.leaves(fn(precision.params64(stacked.params)))
                assert len(got_stacked) == len(got_split) == len(ref), what
                for a, b, r in zip(got_stacked, got_split, ref):
                    r = np.asarray(r)
                    if r.dtype.kind != "f":
                        np.testing.assert_array_equal(np.asarray(b), r)
                        continue
                    precision.assert_within(np.asarray(b), r, precision.error(np.asarray(a), r),
                                            what=f"{cfg.family} {what}, split layers")

    @pytest.fixture(autouse=True)
    def _models_fixture(self, tiny_llama_dir, tiny_opt_dir):
        load = specjax.load_model
        self._models = [(load(p, progress=False, split_layers=False), load(p, progress=False, split_layers=True))
                        for p in (tiny_llama_dir, tiny_opt_dir)]


def test_generation_identical_across_layouts(both):
    """Incremental decoding, lookup speculation and an SSM cut from the LLM: the same tokens."""
    stacked, split = both
    rng = np.random.RandomState(1)
    prompts = [random_ids(rng, stacked.config.vocab_size, n) for n in (5, 11)]
    kw = dict(max_new_tokens=12, chat_template=False, ignore_eos=True)
    for extra in (dict(mode="incremental"), dict(drafters=[specjax.Bound(LookupDrafter())])):
        assert (specjax.generate(split, prompts, **kw, **extra).token_ids
                == specjax.generate(stacked, prompts, **kw, **extra).token_ids)
    ssm_split, ssm_stacked = derive_ssm(split, (0,)), derive_ssm(stacked, (0,))
    assert layers_split(ssm_split.params)  # the LLM's layout, and its very buffers (nothing copied)
    assert ssm_split.params["layers"][0]["wqkv"] is split.params["layers"][0]["wqkv"]
    chex.assert_trees_all_equal(stack_layers(ssm_split.params), ssm_stacked.params)
    chex.assert_trees_all_equal(take_layers(split.params, [1, 0]), take_layers(stacked.params, [1, 0]))


def test_a_split_model_saves_a_stacked_checkpoint_that_restores_either_way(both, tmp_path):
    from specjax.io.checkpoint import save_checkpoint

    stacked, split = both
    save_checkpoint(str(tmp_path / "ckpt"), split.config, split.params)
    restored = specjax.load_model(str(tmp_path / "ckpt"), progress=False, split_layers=True)
    assert layers_split(restored.params)
    chex.assert_trees_all_equal(stack_layers(restored.params), stacked.params)
    kept = specjax.load_model(str(tmp_path / "ckpt"), progress=False, split_layers=False)
    chex.assert_trees_all_equal(kept.params, stacked.params)


def _weight_slices(hlo: str, shape: tuple[int, ...]) -> list[str]:
    """Dynamic slices (fused or not) producing a weight of ``shape``, or of it flattened to 2D for a dot."""
    shapes = {tuple(shape), (shape[0], int(np.prod(shape[1:]))), (int(np.prod(shape[:-1])), shape[-1])}
    found = []
    for dims in (",".join(map(str, s)) for s in shapes):
        found += [line.strip() for line in hlo.splitlines()
                  if re.search(rf"= f32\[{dims}\]\{{[^}}]*\}} (fusion|dynamic-slice)\(", line) and "dynamic" in line]
    return found


@pytest.mark.parametrize("family_dir", ["tiny_llama_dir", "tiny_opt_dir"])
def test_split_pass_reads_weights_in_place(family_dir, request):
    """The reason for the split layout: the scanned pass copies each layer's weights out of the
    stacked buffer (a dynamic slice per weight per layer, ~424 MB per pass for SmolLM2); the split
    pass reads every weight matrix in place (specjax.models.weights), for both families. The stacked
    program is checked too, so the pattern is known to match."""
    path = request.getfixturevalue(family_dir)
    stacked = specjax.load_model(path, progress=False, split_layers=False)
    split = specjax.load_model(path, progress=False, split_layers=True)
    cfg = stacked.config
    cache = init_cache(cfg, 1, 8).replace(length=jnp.asarray([3], jnp.int32))
    tree = from_parents([[1, 2]], [[-1, 0]], n_max=2)
    fwd = jax.jit(lambda p, t, c: tree_forward(p, t, c, cfg, "xla", block_only=True).logits)
    stacked_hlo = fwd.lower(stacked.params, tree, cache).compile().as_text()
    split_hlo = fwd.lower(split.params, tree, cache).compile().as_text()
    def matrices(layer):
        return {name: w.shape for name, w in layer.items()
                if w.ndim >= 2 and not (name.startswith("b") or "bias" in name or "norm" in name)}

    stacked_matrices = matrices(jax.tree.map(lambda a: a[0], stacked.params["layers"]))
    split_matrices = matrices(split.params["layers"][0])
    assert len(stacked_matrices) >= 6, stacked_matrices  # q, k, v, o and the MLP's
    assert "wqkv" in split_matrices and len(split_matrices) == len(stacked_matrices) - 2 - (cfg.family == "llama")
    for name, shape in stacked_matrices.items():
        assert _weight_slices(stacked_hlo, shape), name
    for name, shape in split_matrices.items():
        assert not _weight_slices(split_hlo, shape), f"{name}: copied out of a stacked buffer in the split pass"


def test_the_pipeline_refuses_split_weights_and_a_mesh_refuses_a_split_model(tiny_llama_dir):
    from specjax.sharding import Parallel

    split = specjax.load_model(tiny_llama_dir, progress=False, split_layers=True)
    with pytest.raises(ShardingError, match=r"split layer weights .* run on one device; load the model stacked .* "
                                            r"split_layers=False"):
        specjax.generate(split, [[1, 2, 3]], max_new_tokens=2, chat_template=False, parallel=Parallel.create("dp=8"),
                         mode="incremental")
    with pytest.raises(ValueError, match="2 split layers for a cache of 1 layers"):
        one_layer_cache = init_cache(dataclasses.replace(split.config, num_layers=1), 1, 4)
        run_layers(None, None, split.params["layers"], one_layer_cache, ())

    class Pipelined:
        pipelined = True

    cache = init_cache(split.config, 1, 4)
    with pytest.raises(ValueError, match="the pipeline splits stacked layer weights"):
        run_layers(None, None, split.params["layers"], cache, (), Pipelined())


def test_hf_export_and_students_read_either_layout(tiny_llama_dir, tmp_path):
    """What reads an LLM's layer weights outside the forward (HF export, boost students cut from the
    LLM) gives the same result from a split model as from a stacked one."""
    from safetensors.numpy import load_file

    from specjax.boost.student import make_student
    from specjax.io.hf_export import export_hf

    stacked = specjax.load_model(tiny_llama_dir, progress=False, split_layers=False)
    split = specjax.load_model(tiny_llama_dir, progress=False, split_layers=True)
    for name, m in (("stacked", stacked), ("split", split)):
        export_hf(m, str(tmp_path / name))
    a, b = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("stacked", "split"))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    rng = np.random.RandomState(2)
    sequences = [(random_ids(rng, stacked.config.vocab_size, 12), 4) for _ in range(4)]  # (ids, prompt length)
    students = [make_student(m, sequences, layers=(1,), draft_vocab_size=16) for m in (stacked, split)]
    chex.assert_trees_all_equal(students[0].params, students[1].params)


def test_a_tied_head_is_read_from_its_transposed_copy_in_the_split_layout(tiny_opt_dir):
    """The tiny OPT ties its head to the embedding: the split layout adds the [E, V] copy the logits
    read (``TIED_HEAD``), checked like any parameter, and never saved (stacking drops it)."""
    from specjax.models.params import TIED_HEAD

    split = specjax.load_model(tiny_opt_dir, progress=False, split_layers=True)
    stacked = specjax.load_model(tiny_opt_dir, progress=False, split_layers=False)
    assert split.config.tie_word_embeddings and TIED_HEAD not in stacked.params
    np.testing.assert_array_equal(np.asarray(split.params[TIED_HEAD]), np.asarray(split.params["embed"]).T)
    check_params(split.config, split.params)
    with pytest.raises(CheckpointError, match=rf"parameter \['{TIED_HEAD}'\] is missing"):
        check_params(split.config, {k: v for k, v in split.params.items() if k != TIED_HEAD})
    chex.assert_trees_all_equal(stack_layers(split.params), stacked.params)
    # the forward really reads the copy: a different copy gives different logits
    ids = jnp.asarray([[3, 4, 5]])
    moved = {**split.params, TIED_HEAD: split.params[TIED_HEAD] * 2.0}
    got, doubled = full_logits(split.params, ids, cfg=split.config), full_logits(moved, ids, cfg=split.config)
    np.testing.assert_allclose(np.asarray(doubled), 2.0 * np.asarray(got), rtol=1e-5, atol=1e-5)
