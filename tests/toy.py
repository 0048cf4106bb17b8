"""Toy LMs for the statistical tests: tiny random LLaMAs over a vocabulary of a few tokens, with
logits scaled so their distributions are peaked, varied and context dependent."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig
from specjax.decoding.incremental import full_logits
from specjax.decoding.sampling import SamplingArrays, warp_logits
from specjax.models import init_params


def toy_model(vocab: int, seed: int, layers: int = 1, sharpness: float = 3.0):
    cfg = ModelConfig(family="llama", vocab_size=vocab, hidden_size=32, intermediate_size=48, num_layers=layers,
                      num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=64)
    params = init_params(cfg, jax.random.key(seed), scale=0.3)
    params["lm_head"] = params["lm_head"] * sharpness
    return cfg, params


def sampling_arrays(batch: int, temperature: float, top_k: int = 0, top_p: float = 1.0, seeds=None):
    seeds = np.arange(batch) if seeds is None else np.asarray(seeds)
    return SamplingArrays(temperature=jnp.full((batch,), temperature, jnp.float32),
                          top_k=jnp.full((batch,), top_k, jnp.int32), top_p=jnp.full((batch,), top_p, jnp.float32),
                          seed=jnp.asarray(seeds, jnp.int32))


def exact_sequence_law(cfg, params, prompt: list[int], num_tokens: int, temperature: float, top_k: int = 0,
                       top_p: float = 1.0) -> dict[tuple[int, ...], float]:
    """The exact law of the first ``num_tokens`` sampled tokens after ``prompt`` (float64 products of
    the float32-warped conditionals), by enumerating every prefix."""
    vocab = cfg.vocab_size
    law = {(): 1.0}
    for step in range(num_tokens):
        prefixes = [k for k, v in law.items() if v > 0]
        seqs = np.asarray([prompt + list(k) for k in prefixes], np.int32)
        logits = full_logits(params, jnp.asarray(seqs), cfg=cfg)[:, -1]
        warped = warp_logits(logits, sampling_arrays(len(prefixes), temperature, top_k, top_p))
        probs = np.exp(np.asarray(warped, np.float64))
        probs /= probs.sum(axis=1, keepdims=True)
        new = {}
        for i, k in enumerate(prefixes):
            for v in range(vocab):
                if probs[i, v] > 0:
                    new[k + (v,)] = law[k] * probs[i, v]
        law = new
    return law


def perturbed(params, seed: int, eps: float):
    """A related SSM: the LLM's parameters plus relative noise (moderate, imperfect acceptance)."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(treedef, [x + eps * jnp.std(x) * jax.random.normal(k, x.shape, x.dtype)
                                        for x, k in zip(leaves, keys)])


class ContextLaw:
    """ctx (tokens after the prompt) -> the model's warped next-token law, float64 (for the oracle)."""

    def __init__(self, cfg, params, prompt, temperature, top_k=0, top_p=1.0):
        self.cfg, self.params, self.prompt = cfg, params, list(prompt)
        self.sampling = sampling_arrays(1, temperature, top_k, top_p)
        self._memo = {}

    def __call__(self, ctx):
        if ctx not in self._memo:
            seq = jnp.asarray([self.prompt + list(ctx)], jnp.int32)
            logits = full_logits(self.params, seq, cfg=self.cfg)[:, -1]
            probs = np.exp(np.asarray(warp_logits(logits, self.sampling)[0], np.float64))
            self._memo[ctx] = probs / probs.sum()
        return self._memo[ctx]


def mesh_model(family: str):
    """A tiny random model whose sizes every test mesh of 8 devices divides: 4 layers, 8 heads
    (LLaMA: 2 KV heads, so KV heads are replicated at tp >= 4), vocabulary 256. Same weights in every
    process that builds it (fixed key)."""
    import specjax

    cfg = ModelConfig(family=family, vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=4,
                      num_heads=8, num_kv_heads=2 if family == "llama" else 8, head_dim=8,
                      max_position_embeddings=256, word_embed_proj_dim=32 if family == "opt" else None)
    return specjax.Model(cfg, init_params(cfg, jax.random.key(3), scale=0.1), None)


def mesh_prompts(vocab: int, lens=(7, 3, 12, 5)) -> list[list[int]]:
    rng = np.random.RandomState(0)
    return [rng.randint(0, vocab, n).tolist() for n in lens]


# A toy LLM that often goes on repeating its prompt: lookup-style drafts are accepted often enough for
# the chi-square test below to see them.
LAW_VOCAB, LAW_PROMPT, LAW_TOKENS = 6, [3, 2, 4, 2, 3, 2, 4], 4


def law_model():
    return toy_model(LAW_VOCAB, 0, sharpness=1.5)


def assert_drafter_samples_the_exact_law(drafter, drafter_params, verifier: str, label: str) -> None:
    """60k requests of LAW_PROMPT through the speculative loop with this one drafter under a tree budget
    (nearly flat costs, goal "rate": the budget decides for the whole batch, and a costlier tree runs
    when most requests have a draft; "finish" would wait for all): drafts were accepted, the budget
    left level 0, and the first LAW_TOKENS tokens follow the LLM's exact sequence law (chi-square,
    alpha 1e-6)."""
    from specjax.speculation.budget import Budget, default_levels
    from specjax.speculation.loop import SpecConfig, generate_speculative_jit
    from tests.stats import assert_fits

    cfg, params = law_model()
    spec = SpecConfig((drafter,), impl="xla", verifier=verifier,
                      budget=Budget(default_levels((drafter,)), costs=(1.0, 1.01, 1.02), goal="rate"))
    n, width = 60_000, len(LAW_PROMPT) + 1
    prompts = np.zeros((n, width), np.int32)
    prompts[:, :len(LAW_PROMPT)] = LAW_PROMPT
    out = generate_speculative_jit(params, (drafter_params,), jnp.asarray(prompts),
                                   jnp.full((n,), len(LAW_PROMPT), jnp.int32), jnp.full((n,), LAW_TOKENS, jnp.int32),
                                   sampling_arrays(n, 1.0, seeds=np.arange(n) + 7), cfg=cfg, spec=spec,
                                   cache_len=width + LAW_TOKENS + spec.num_nodes + 2, max_out=LAW_TOKENS)
    assert not np.asarray(out.failed).any()
    assert np.asarray(out.tokens_per_pass)[:, 2:].sum() > 1000  # drafts were accepted, not just refused
    assert np.asarray(out.level_passes)[:, 1:].sum() > 0
    samples = list(map(tuple, np.asarray(out.tokens).tolist()))
    assert_fits(samples, exact_sequence_law(cfg, params, LAW_PROMPT, LAW_TOKENS, 1.0), label)


def tiny_gguf(path, seed: int, vocab: int, ffn: int, dim: int = 16, header_ffn: int | None = None) -> str:
    """A one-layer LLaMA GGUF of random float32 weights (no tokenizer: the weights path needs none).
    ``header_ffn``: another feed-forward width in the metadata than the tensors have (a misfit file)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(64), w.add_embedding_length(dim), w.add_block_count(1)
    w.add_feed_forward_length(header_ffn or ffn)
    w.add_head_count(2), w.add_head_count_kv(2), w.add_layer_norm_rms_eps(1e-5), w.add_vocab_size(vocab)
    shapes = {"token_embd.weight": (vocab, dim), "output_norm.weight": (dim,), "output.weight": (vocab, dim),
              **{f"blk.0.{n}.weight": s for n, s in [
                  ("attn_norm", (dim,)), ("ffn_norm", (dim,)), ("attn_q", (dim, dim)), ("attn_k", (dim, dim)),
                  ("attn_v", (dim, dim)), ("attn_output", (dim, dim)), ("ffn_gate", (ffn, dim)), ("ffn_up", (ffn, dim)),
                  ("ffn_down", (dim, ffn))]}}
    rng = np.random.default_rng(seed)
    for name, shape in shapes.items():
        w.add_tensor(name, rng.normal(size=shape).astype(np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return str(path)
