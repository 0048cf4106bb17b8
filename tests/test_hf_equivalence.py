"""Logits equal HuggingFace transformers (PyTorch, float32) through the real specjax loader."""

from __future__ import annotations

import numpy as np
import pytest

import specjax
from tests.conftest import make_hf_model, random_ids

torch = pytest.importorskip("torch")

LLAMA_CASES = {
    "mha_untied": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False),
    "gqa_9_3_tied": dict(hidden_size=72, head_dim=8, num_attention_heads=9, num_key_value_heads=3,
                         tie_word_embeddings=True),
    "mqa_bias": dict(num_attention_heads=4, num_key_value_heads=1, attention_bias=True, mlp_bias=True),
    "theta_500k": dict(rope_theta=500000.0),
    "theta_100": dict(rope_theta=100.0),
    "linear_rope": dict(rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "llama3_rope": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
}
OPT_CASES = {
    "pre_ln": dict(do_layer_norm_before=True, word_embed_proj_dim=64),
    "pre_ln_project": dict(do_layer_norm_before=True, word_embed_proj_dim=32),
    "post_ln_project_350m_style": dict(do_layer_norm_before=False, word_embed_proj_dim=32),
}
CASES = [("llama", k, v) for k, v in LLAMA_CASES.items()] + [("opt", k, v) for k, v in OPT_CASES.items()]


def _hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


@pytest.mark.parametrize("kind,name,overrides", CASES, ids=[f"{k}-{n}" for k, n, _ in CASES])
def test_logits_match_hf(tmp_path, kind, name, overrides):
    hf_model = make_hf_model(kind, str(tmp_path), **overrides)
    model = specjax.load_model(str(tmp_path), progress=False)
    rng = np.random.RandomState(hash(name) % 2**31)
    vocab = model.config.vocab_size
    # A batch with padding: 8 tokens, ~600 tokens (position bugs hide in short prompts), 37 tokens.
    seqs = [random_ids(rng, vocab, n) for n in (8, 600, 37)]
    ours = specjax.logits(model, seqs)
    for seq, got in zip(seqs, ours):
        want = _hf_logits(hf_model, seq)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4,
                                   err_msg=f"{kind}/{name}: logits differ for a {len(seq)}-token prompt")


def test_greedy_generation_matches_hf_generate(tmp_path):
    hf_model = make_hf_model("llama", str(tmp_path), num_attention_heads=4, num_key_value_heads=2)
    model = specjax.load_model(str(tmp_path), progress=False)
    rng = np.random.RandomState(1)
    prompts = [random_ids(rng, model.config.vocab_size, n) for n in (5, 19)]
    ours = specjax.generate(model, prompts, max_new_tokens=24)
    for prompt, got in zip(prompts, ours.token_ids):
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)
        assert got == out[0, len(prompt):].tolist()
