"""What a model directory's files say against what specjax loads: end-of-sequence ids in
generation_config.json, stale weight files beside an export, an exported draft vocabulary, a checkpoint's
stored shapes, GGUF head widths and configs that mix the two families."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest

import specjax
from specjax.config import ModelConfig, config_from_gguf
from specjax.errors import CheckpointError, ConfigError


def _copy(src, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def test_generation_config_eos_ids_end_requests_too(tiny_llama_dir, tmp_path):
    """transformers' generate stops at generation_config.json's eos ids (Llama-3-Instruct's end of turn is
    only there); they were ignored, so a request ran past its end."""
    d = _copy(tiny_llama_dir, tmp_path / "m")
    with open(f"{d}/generation_config.json", "w") as f:
        json.dump({"eos_token_id": [5, 7, 7], "bos_token_id": 1}, f)
    model = specjax.load_model(d, progress=False)
    assert model.config.eos_token_ids == (5, 7)
    assert specjax.describe_model(d).config.eos_token_ids == (5, 7)
    from specjax.io.checkpoint import read_checkpoint_config, save_checkpoint

    save_checkpoint(str(tmp_path / "ck"), model.config, model.params)  # kept through convert
    assert read_checkpoint_config(str(tmp_path / "ck"))[0].eos_token_ids == (5, 7)
    # and a request ends there: at the first of the greedy tokens made an eos id by generation_config.json only
    prompt = [[1, 2, 3]]
    free = specjax.generate(model, prompt, max_new_tokens=12, mode="incremental", ignore_eos=True).token_ids[0]
    k, stop = next((i, t) for i, t in enumerate(free)  # before the config's own eos id 5 ends it
                   if i >= 2 and 5 not in free[:i + 1] and t != 7 and t not in free[:i])
    with open(f"{d}/generation_config.json", "w") as f:
        json.dump({"eos_token_id": [stop]}, f)
    ended = specjax.generate(specjax.load_model(d, progress=False), prompt, max_new_tokens=12, mode="incremental")
    assert stop not in specjax.load_model(tiny_llama_dir, progress=False).config.eos_token_ids
    assert ended.token_ids[0] == free[:k + 1]
    with open(f"{d}/generation_config.json", "w") as f:
        json.dump({"eos_token_id": 10**6}, f)
    with pytest.raises(ConfigError, match=r"generation_config.json: ModelConfig.eos_token_ids holds 1000000, outside"):
        specjax.describe_model(d)


def test_an_export_into_a_used_directory_is_refused_and_mixed_weight_files_are_named(tiny_llama_dir, tmp_path):
    """Exporting over an earlier sharded model left its index beside the new model.safetensors, and the
    loader took the old shards with the new config (transformers takes the single file)."""
    from specjax.io.hf_export import export_hf

    model = specjax.load_model(tiny_llama_dir, progress=False)
    used = _copy(tiny_llama_dir, tmp_path / "used")
    with pytest.raises(CheckpointError, match="destination exists and is not empty"):
        export_hf(model, used)
    with open(f"{used}/model.safetensors.index.json", "w") as f:
        json.dump({"weight_map": {}}, f)
    with pytest.raises(CheckpointError, match="holds both model.safetensors and model.safetensors.index.json"):
        specjax.load_model(used, progress=False)
    export_hf(model, str(tmp_path / "new"))
    back = specjax.load_model(str(tmp_path / "new"), progress=False)
    np.testing.assert_array_equal(specjax.logits(back, [[1, 2, 3]]), specjax.logits(model, [[1, 2, 3]]))


@pytest.mark.parametrize("tied", [False, True])
def test_an_exported_draft_vocabulary_loads_back_as_the_same_model(tmp_path, tied):
    from specjax.io.hf_export import export_hf
    from specjax.models import init_params

    cfg = ModelConfig(family="llama", vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256,
                      tie_word_embeddings=tied, draft_vocab=tuple(range(0, 128, 4)))
    model = specjax.Model(cfg, init_params(cfg, jax.random.key(0), scale=0.3), None)
    export_hf(model, str(tmp_path / "ssm"))
    back = specjax.load_model(str(tmp_path / "ssm"), progress=False)
    assert back.config.draft_vocab == cfg.draft_vocab
    # what a request is planned with before the weights load (the CLI's --ssm) is the config that runs
    assert specjax.describe_model(str(tmp_path / "ssm")).config == back.config
    ids = [[4, 8, 13, 16, 21]]  # 13 and 21 are outside the draft vocabulary: the "other" row
    want, got = np.asarray(specjax.logits(model, ids)), np.asarray(specjax.logits(back, ids))
    assert (np.isfinite(got) == np.isfinite(want)).all() and np.isfinite(want).sum(-1).tolist() == [[32] * 5]
    np.testing.assert_allclose(got[np.isfinite(got)], want[np.isfinite(want)], rtol=1e-5, atol=1e-5)


def test_a_checkpoint_whose_params_do_not_fit_its_config_names_every_misfit(tiny_llama_dir, tmp_path):
    from specjax.io.checkpoint import CONFIG_FILE, save_checkpoint

    model = specjax.load_model(tiny_llama_dir, progress=False)
    ck = str(tmp_path / "ck")
    save_checkpoint(ck, model.config, model.params)
    meta = json.load(open(f"{ck}/{CONFIG_FILE}"))
    vocab = meta["config"]["vocab_size"]
    for field, value, message in (
            ("vocab_size", 2 * vocab, rf"embed: stored \({vocab}, 64\), the config needs \({2 * vocab}, 64\)"),
            ("num_layers", 3, r"layers.w_down: stored \(2, 96, 64\), the config needs \(3, 96, 64\)"),
            ("tie_word_embeddings", True, "lm_head: stored but not in the config")):
        edited = _copy(ck, tmp_path / f"ck_{field}")
        with open(f"{edited}/{CONFIG_FILE}", "w") as f:
            json.dump({**meta, "config": {**meta["config"], field: value}}, f)
        with pytest.raises(CheckpointError, match=f"do not fit {CONFIG_FILE}'s config .*{message}"):
            specjax.load_model(edited, progress=False)


def _gguf_fields(**extra):
    return {"general.architecture": "llama", "llama.attention.head_count": 4, "llama.embedding_length": 64,
            "llama.feed_forward_length": 96, "llama.block_count": 1, "llama.context_length": 64,
            "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.vocab_size": 128, **extra}


def test_gguf_head_width_from_key_length_as_llama_cpp_reads_it():
    assert config_from_gguf(_gguf_fields(), "m.gguf").head_dim == 16
    assert config_from_gguf(_gguf_fields(**{"llama.attention.key_length": 32}), "m.gguf").head_dim == 32
    assert config_from_gguf(_gguf_fields(**{"llama.attention.key_length": 32, "llama.attention.value_length": 32,
                                            "llama.rope.dimension_count": 32}), "m.gguf").head_dim == 32
    with pytest.raises(ConfigError, match="rotates part of a head of 16"):  # no key_length: 64 / 4
        config_from_gguf(_gguf_fields(**{"llama.rope.dimension_count": 8}), "m.gguf")
    with pytest.raises(ConfigError, match="rotates part of a head of 32"):
        config_from_gguf(_gguf_fields(**{"llama.attention.key_length": 32, "llama.rope.dimension_count": 16}),
                         "m.gguf")
    with pytest.raises(ConfigError, match="value_length'=16 differs from the key length 32"):
        config_from_gguf(_gguf_fields(**{"llama.attention.key_length": 32, "llama.attention.value_length": 16}),
                         "m.gguf")


def test_configs_that_mix_the_families_are_refused():
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, head_dim=16,
                max_position_embeddings=256)
    with pytest.raises(ConfigError, match="OPT has no grouped-query attention: num_kv_heads must equal num_heads"):
        ModelConfig(family="opt", num_kv_heads=2, **base)
    for field, value in (("do_layer_norm_before", False), ("word_embed_proj_dim", 32), ("enable_bias", False),
                         ("final_layer_norm", False)):
        with pytest.raises(ConfigError, match=f"{field}=.*OPT-only settings"):
            ModelConfig(family="llama", num_kv_heads=2, **{field: value}, **base)
    assert ModelConfig(family="llama", num_kv_heads=2, word_embed_proj_dim=64, **base).embed_dim == 64
