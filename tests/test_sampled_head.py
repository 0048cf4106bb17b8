"""The seeded head (``specjax.kernels.cpu.greedy_head.sampled_decision``): each row's seeded sample, the
first argmax of fl(fl(l r) + g) over the float32 kernel's logits l, though the head streams as float16:
against ``seeded_tokens`` at temperature 1 and 0 (greedy rows) and against numpy's two roundings at other
temperatures, on random heads of every tile shape, near-ties the noise cannot break (with a mutation:
zero error bounds pick the rounded order), noise that decides the winner, exact ties and rows that are not
finite; its refusals; a SmolLM2 tree pass asked for ``seeded`` against its logits (the kernel at
temperature 1, the logits at other temperatures and with top-k); and the cost table's seeded passes."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.decoding.sampling import SamplingArrays, SamplingParams, finite_rows, first_argmax, seeded_tokens
from specjax.kernels import cpu as cpu_kernels
from specjax.kernels.cpu import greedy_head
from specjax.kernels.cpu import matmul as cpu_matmul
from tests.test_greedy_head import SHAPES, near_ties, smollm2_tree_pass

needs_kernel = pytest.mark.skipif(cpu_kernels.matmul_status() is not None,
                                  reason=f"kernel unavailable: {cpu_kernels.matmul_status()}")


def kernel_logits(x, w) -> np.ndarray:
    return np.asarray(cpu_matmul.matmul(jnp.asarray(x), cpu_matmul.pack(jnp.asarray(w)), w.shape[1]))


def numpy_reference(logits, inv_t, noise, row) -> np.ndarray:
    """The kernel's definition in numpy: greedy rows (r = 0) the first argmax of the logits, sampled rows of
    (l * r) + g rounded twice in float32; the first NaN where there is one."""
    out = []
    for m, r in enumerate(inv_t):
        s = logits[m] if r == 0 else (logits[m] * np.float32(r)).astype(np.float32) + noise[row[m]]
        out.append(int(np.argmax(np.isnan(s))) if np.isnan(s).any() else int(np.argmax(s)))
    return np.asarray(out, np.int32)


def xla_reference(logits, temperature, noise, row) -> np.ndarray:
    """What incremental sampling decides from these logits (``seeded_tokens``)."""
    m = logits.shape[0]
    sampling = SamplingArrays(temperature=jnp.asarray(temperature, jnp.float32), top_k=jnp.zeros((m,), jnp.int32),
                              top_p=jnp.ones((m,), jnp.float32), seed=jnp.zeros((m,), jnp.int32))
    return np.asarray(jax.jit(seeded_tokens)(jnp.asarray(logits), sampling, jnp.asarray(noise[row])))


def decide(x, w, inv_t, noise, row, head=None, fn=greedy_head.sampled_decision):
    head = greedy_head.pack_head(jnp.asarray(w)) if head is None else head
    ids, finite = fn(jnp.asarray(x), head, jnp.asarray(inv_t, jnp.float32), jnp.asarray(noise),
                     jnp.asarray(row, jnp.int32))
    chex.assert_shape((ids, finite), (x.shape[0],))
    chex.assert_type((ids, finite), (jnp.int32, jnp.bool_))
    return np.asarray(ids), np.asarray(finite)


@needs_kernel
class TestSampledHead(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_decides_as_seeded_sampling_on_random_heads(self):
        """Rows at temperature 1 and 0 (greedy) mixed, several noise rows: the tokens ``seeded_tokens``
        draws from the float32 kernel's logits, and the same finiteness."""
        rng = np.random.default_rng(0)
        for m, k, n in SHAPES:
            x = rng.standard_normal((m, k)).astype(np.float32)
            w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
            noise = rng.gumbel(size=(3, n)).astype(np.float32)
            row = rng.integers(0, 3, m)
            temperature = np.where(rng.random(m) < 0.75, 1.0, 0.0)
            ids, finite = decide(x, w, temperature, noise, row, fn=self.variant(greedy_head.sampled_decision))
            logits = kernel_logits(x, w)
            np.testing.assert_array_equal(ids, xla_reference(logits, temperature, noise, row), err_msg=f"{m}x{k}x{n}")
            np.testing.assert_array_equal(finite, np.asarray(finite_rows(jnp.asarray(logits))))
            assert (ids != np.asarray(first_argmax(jnp.asarray(logits))))[temperature > 0].any() or m < 3

    def test_other_temperatures_round_the_product_and_the_sum_apart(self):
        """At r = 1 / 0.7, 1 / 1.3, 1 / 0.05 the kernel's definition, fl(fl(l r) + g), in numpy."""
        rng = np.random.default_rng(1)
        x = rng.standard_normal((12, 576)).astype(np.float32)
        w = (rng.standard_normal((576, 3000)) / 24).astype(np.float32)
        noise = rng.gumbel(size=(2, 3000)).astype(np.float32)
        inv_t = np.float32(1) / np.asarray([0.7, 1.3, 0.05] * 4, np.float32)
        row = np.arange(12) % 2
        ids, _ = decide(x, w, inv_t, noise, row)
        np.testing.assert_array_equal(ids, numpy_reference(kernel_logits(x, w), inv_t, noise, row))

    def test_near_ties_resolve_as_float32_does(self):
        """Columns within float16 rounding of each other and noise far smaller than their gaps' float32
        resolution matters little: the rounded head's choice differs in most rows, the kernel's never;
        with its error bounds zeroed (the mutation) it returns the rounded choice."""
        rng = np.random.default_rng(2)
        x, w = near_ties(rng, 17, 576, 512)
        noise = (1e-9 * rng.standard_normal((1, 512))).astype(np.float32)
        row, temperature = np.zeros(17, np.int32), np.ones(17)
        want = xla_reference(kernel_logits(x, w), temperature, noise, row)
        rounded = np.asarray(x, np.float64) @ w.astype(np.float16).astype(np.float64) + noise[0]
        assert (rounded.argmax(axis=1) != want).sum() >= 8  # the rounding does reorder them
        ids, finite = decide(x, w, temperature, noise, row)
        np.testing.assert_array_equal(ids, want)
        assert finite.all()
        head = greedy_head.pack_head(jnp.asarray(w))
        blind = greedy_head.GreedyHead(head.packed, head.rows, jnp.zeros_like(head.err))
        assert (decide(x, w, temperature, noise, row, head=blind)[0] != want).sum() >= 8

    def test_the_noise_decides_and_exact_ties_take_the_first_column(self):
        """Equal columns: the first one whose noise is largest among them wins; noise large enough moves
        the winner to a column the logits alone rank low."""
        rng = np.random.default_rng(3)
        x = rng.standard_normal((4, 64)).astype(np.float32)
        col = rng.standard_normal((64, 1)).astype(np.float32)
        w = np.concatenate([rng.standard_normal((64, 7)).astype(np.float32) * 0.01, col, col, col, col], axis=1)
        noise = np.zeros((2, 11), np.float32)
        noise[1, [8, 10]] = 0.5  # row 1: columns 8 and 10 tie above 7 and 9
        noise[1, 2] = 1e3  # ... unless a column gets far more noise than any logit gap
        row = np.asarray([0, 0, 1, 1])
        noise_b = noise.copy()
        noise_b[1, 2] = 0.0
        for nz in (noise, noise_b):
            ids, _ = decide(x, w, np.ones(4), nz, row)
            np.testing.assert_array_equal(ids, xla_reference(kernel_logits(x, w), np.ones(4), nz, row))
        positive = (x @ col)[:, 0] > 0
        ids, _ = decide(x, w, np.ones(4), noise_b, row)
        assert (ids[:2][positive[:2]] == 7).all() and (ids[2:][positive[2:]] == 8).all()
        ids, _ = decide(x, w, np.ones(4), noise, row)
        assert (ids[2:] == 2).all()

    def test_rows_that_are_not_finite(self):
        """NaN inputs or weights, weights past float16's range, logits that overflow: recomputed in full,
        the first NaN and the finiteness as from the logits."""
        rng = np.random.default_rng(4)
        k, n = 64, 300
        x = rng.standard_normal((6, k)).astype(np.float32)
        x[1, 5] = np.nan
        x[2] *= 1e4
        w = (rng.standard_normal((k, n)) / 8).astype(np.float32)
        w[:, 200] = 1e36
        noise = rng.gumbel(size=(1, n)).astype(np.float32)
        row, temperature = np.zeros(6, np.int32), np.ones(6)
        for nan_weight in (True, False):
            w[3, 250] = np.nan if nan_weight else 0.5
            logits = kernel_logits(x, w)
            ids, finite = decide(x, w, temperature, noise, row)
            np.testing.assert_array_equal(ids, xla_reference(logits, temperature, noise, row))
            np.testing.assert_array_equal(finite, np.asarray(finite_rows(jnp.asarray(logits))))
        assert not finite[[1, 2]].any() and finite[[0, 3, 4, 5]].all()

    def test_refuses_mismatched_inputs(self):
        head = greedy_head.pack_head(jnp.zeros((4, 8), jnp.float32))
        x = jnp.zeros((2, 4), jnp.float32)
        ones, rows, noise = jnp.ones((2,), jnp.float32), jnp.zeros((2,), jnp.int32), jnp.zeros((3, 8), jnp.float32)
        with pytest.raises(ValueError, match="sampled decision of 2 rows over 8 columns"):
            greedy_head.sampled_decision(x, head, ones, jnp.zeros((3, 9), jnp.float32), rows)
        with pytest.raises(ValueError, match="sampled decision"):
            greedy_head.sampled_decision(x, head, ones.astype(jnp.float16), noise, rows)
        with pytest.raises(Exception, match="noise_row 3 is outside the noise's 3 rows"):
            jax.block_until_ready(greedy_head.sampled_decision(x, head, ones, noise, jnp.asarray([0, 3], jnp.int32)))
        # a greedy row's noise_row is never read
        ids, _ = greedy_head.sampled_decision(x, head, jnp.asarray([1.0, 0.0]), noise, jnp.asarray([0, 7], jnp.int32))
        chex.assert_shape(ids, (2,))


@needs_kernel
def test_smollm2_tree_pass_samples_as_its_logits(smollm2):
    """A SmolLM2 tree pass asked for ``seeded`` (through the step programs' params, as the speculative loop
    runs it) gives every node the token ``seeded_tokens`` draws from the same pass's logits with its
    depth's noise: at temperature 1 with a greedy request beside (the kernel), at temperature 0.7 and with
    top-k (both from the logits)."""
    from specjax.models import SeededHead
    from specjax.speculation.verify.seeded import seeded_head, seeded_noise

    cfg = smollm2.config
    params, tree, cache, run = smollm2_tree_pass(smollm2)
    logits = np.asarray(run(params, tree, cache, cfg=cfg, impl="xla", block_only=True).logits)
    for settings in ([SamplingParams(1.0, seed=3), SamplingParams()], [SamplingParams(0.7, seed=3)] * 2,
                     [SamplingParams(1.0, seed=3), SamplingParams(1.0, top_k=20, seed=4)]):
        sampling = SamplingArrays.from_params(settings)
        noise = seeded_noise(sampling, cache.length, 9, cfg.vocab_size)
        head = seeded_head(sampling, noise, tree)
        assert isinstance(head, SeededHead)
        got = run(params, tree, cache, cfg=cfg, impl="xla", block_only=True, seeded=head)
        chex.assert_shape((got.token, got.finite), (2, 9))
        for b in range(2):
            per = jax.tree.map(lambda a: jnp.repeat(a[b:b + 1], 9), sampling)
            want = seeded_tokens(jnp.asarray(logits[b]), per, noise[b][np.asarray(tree.depth[b])])
            np.testing.assert_array_equal(np.asarray(got.token[b]), np.asarray(want), err_msg=str(settings))
        assert np.asarray(got.finite).all()
        sampled = np.asarray(sampling.temperature > 0)
        assert (np.asarray(got.token) != logits.argmax(-1))[sampled].any()  # the noise is really added


@needs_kernel
def test_cost_table_measures_seeded_passes_apart(llama, tmp_path, monkeypatch):
    """The seeded verifier's passes are timed as it runs them (its own key in the table), and a head the
    table does not know is refused by name."""
    from specjax.errors import InputError
    from specjax.speculation import cost

    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path))
    costs, _ = cost.cached_pass_costs(llama.params, llama.config, 1, [1, 3], "xla", head="seeded")
    assert set(costs) == {1, 3} and all(s > 0 for s in costs.values())
    keys = list(cost._read(cost.cache_path()))
    assert len(keys) == 1 and keys[0].endswith("|head=seeded")
    assert cost.pass_head("seeded") == "seeded" and cost.pass_head("mss") == "logits"
    with pytest.raises(InputError, match="head is one of"):
        cost.table_key(llama.config, jnp.float32, 1, "xla", head="argmax")
