"""Logits equal HuggingFace transformers through the real specjax loader: against transformers in
float64 (its exact math), specjax's float32 logits are as accurate as transformers' own float32 ones
(tests/precision.py)."""

from __future__ import annotations

import copy

import numpy as np
import pytest

import specjax
from tests import precision
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
    hf64 = copy.deepcopy(hf_model).double()
    for seq, got in zip(seqs, ours):
        ref = _hf_logits(hf64, seq)
        assert got.shape == ref.shape
        floor = precision.error(_hf_logits(hf_model, seq), ref)
        precision.assert_within(got, ref, floor, what=f"{kind}/{name}, a {len(seq)}-token prompt")
    # the bound has power: the 600-token prompt read one position late is far outside it
    late = specjax.logits(model, [[0] + seqs[1][:-1]])[0][1:]
    assert precision.error(late, _hf_logits(hf64, seqs[1])[:-1]) > 100 * precision.bound(late, floor)


def test_greedy_generation_matches_hf_generate(tmp_path):
    hf_model = make_hf_model("llama", str(tmp_path), num_attention_heads=4, num_key_value_heads=2)
    model = specjax.load_model(str(tmp_path), progress=False)
    rng = np.random.RandomState(1)
    prompts = [random_ids(rng, model.config.vocab_size, n) for n in (5, 19)]
    ours = specjax.generate(model, prompts, max_new_tokens=24, mode="incremental")
    for prompt, got in zip(prompts, ours.token_ids):
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)
        assert got == out[0, len(prompt):].tolist()


def test_random_weights_model_keeps_the_architecture(tiny_llama_dir, tmp_path):
    """scripts/random_weights_model.py (the GPU table's model, where the GGUF cannot travel): the
    config written from a model, filled with transformers' random weights, loads as the same
    architecture with other weights."""
    import json
    import os
    import subprocess
    import sys

    from specjax.io.hf_export import hf_config

    model = specjax.load_model(tiny_llama_dir, progress=False)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(hf_config(model.config)))
    script = os.path.join(os.path.dirname(__file__), "..", "scripts", "random_weights_model.py")
    done = subprocess.run([sys.executable, script, "--config", str(config), "--out", str(tmp_path / "random")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    other = specjax.load_model(str(tmp_path / "random"), progress=False)
    assert other.config == model.config
    assert not np.allclose(np.asarray(other.params["embed"]), np.asarray(model.params["embed"]))
