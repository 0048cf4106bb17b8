"""Bad input gets a clear error naming the problem, and nothing else."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest

import specjax
from specjax.api import plan_generation
from specjax.errors import CheckpointError, ConfigError, InputError
from specjax.io.safetensors import SafetensorsFile
from tests.conftest import requires_smollm2


def _copy(src, tmp_path, name="m"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def _rewrite_safetensors(path, edit):
    """Rewrite model.safetensors with edit(dict name -> array) applied (numpy-only, no torch)."""
    from safetensors.numpy import save_file

    sf = SafetensorsFile(path / "model.safetensors")
    tensors = {k: np.array(sf.get(k)) for k in sf.keys()}
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_missing_directory_and_file():
    with pytest.raises(CheckpointError, match="neither a registered model"):
        specjax.load_model("/nonexistent/model")


def test_a_registered_model_whose_file_is_gone_says_so(tmp_path, monkeypatch):
    from specjax.io import registry

    monkeypatch.setattr(registry, "resolve", lambda name: str(tmp_path / "gone.gguf"))
    with pytest.raises(CheckpointError, match="the registered model 'smollm2-135m-instruct' should be at .*gone.gguf"):
        specjax.load_model("smollm2-135m-instruct", progress=False)


def test_missing_config(tiny_llama_dir, tmp_path):
    d = _copy(tiny_llama_dir, tmp_path)
    os.remove(d / "config.json")
    with pytest.raises(ConfigError, match="config.json: config file not found"):
        specjax.load_model(str(d))


def test_missing_weights(tiny_llama_dir, tmp_path):
    d = _copy(tiny_llama_dir, tmp_path)
    os.remove(d / "model.safetensors")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        specjax.load_model(str(d))


def test_truncated_safetensors(tiny_llama_dir, tmp_path):
    d = _copy(tiny_llama_dir, tmp_path)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt data offsets"):
        specjax.load_model(str(d))


def test_garbage_safetensors(tiny_llama_dir, tmp_path):
    d = _copy(tiny_llama_dir, tmp_path)
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        specjax.load_model(str(d))


def test_unsupported_architecture_gpt2(tiny_llama_dir, tmp_path):
    d = _copy(tiny_llama_dir, tmp_path)
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
                                               "n_embd": 64, "n_layer": 2}))
    with pytest.raises(ConfigError, match="unsupported architecture model_type='gpt2'"):
        specjax.load_model(str(d))


def test_shape_mismatch_names_the_key(tiny_llama_dir, tmp_path):
    d = _copy(tiny_llama_dir, tmp_path)
    _rewrite_safetensors(d, lambda t: t.__setitem__("model.layers.1.mlp.up_proj.weight",
                                                    np.zeros((95, 64), np.float32)))
    with pytest.raises(CheckpointError, match=r"'model.layers.1.mlp.up_proj.weight' has shape \(95, 64\)"):
        specjax.load_model(str(d))


def test_every_misfit_shape_is_named_before_any_tensor_is_read(tiny_llama_dir, tmp_path, monkeypatch):
    """The shapes come from the header: a checkpoint of another size is refused whole, not after reading
    (and, for GGUF, dequantizing) every tensor sorted before the first misfit."""
    d = _copy(tiny_llama_dir, tmp_path)

    def edit(t):
        t["model.layers.0.self_attn.q_proj.weight"] = np.zeros((60, 64), np.float32)
        t["model.layers.1.mlp.up_proj.weight"] = np.zeros((95, 64), np.float32)

    _rewrite_safetensors(d, edit)

    def no_reads(self, key):
        raise AssertionError(f"tensor {key!r} was read before the shapes were checked")

    monkeypatch.setattr(SafetensorsFile, "get", no_reads)
    with pytest.raises(CheckpointError, match=r"2 tensor\(s\) do not fit .*"
                       r"'model.layers.0.self_attn.q_proj.weight' has shape \(60, 64\), expected \(64, 64\).*"
                       r"'model.layers.1.mlp.up_proj.weight' has shape \(95, 64\)"):
        specjax.load_model(str(d))


def test_a_gguf_of_another_shape_is_refused_from_its_header(tmp_path, monkeypatch):
    from specjax.io import gguf_file, loader
    from tests.toy import tiny_gguf

    path = tiny_gguf(tmp_path / "m.gguf", seed=0, vocab=32, ffn=24, header_ffn=20)
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path / "cache"))

    def no_reads(self, name):
        raise AssertionError(f"tensor {name!r} was dequantized before the shapes were checked")

    monkeypatch.setattr(gguf_file.GGUFFile, "dequantized", no_reads)
    with pytest.raises(CheckpointError, match=r"3 tensor\(s\) do not fit the llama config .*"
                       r"'blk.0.ffn_down.weight' has shape \(16, 24\), expected \(16, 20\)"):
        loader.gguf_params(path, False, progress=False)


def test_missing_key_is_named(tiny_llama_dir, tmp_path):
    d = _copy(tiny_llama_dir, tmp_path)
    _rewrite_safetensors(d, lambda t: t.pop("model.layers.0.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError, match="missing key 'model.layers.0.self_attn.k_proj.weight'"):
        specjax.load_model(str(d))


def test_unexpected_key_is_named(tiny_llama_dir, tmp_path):
    d = _copy(tiny_llama_dir, tmp_path)
    _rewrite_safetensors(d, lambda t: t.__setitem__("model.layers.0.extra.weight", np.zeros(3, np.float32)))
    with pytest.raises(CheckpointError, match="unexpected key 'model.layers.0.extra.weight'"):
        specjax.load_model(str(d))


@pytest.mark.parametrize("dtype", [np.int8, np.bool_])
def test_integer_or_bool_weights_are_refused_not_cast(tiny_llama_dir, tmp_path, dtype):
    d = _copy(tiny_llama_dir, tmp_path)
    key = "model.layers.0.self_attn.q_proj.weight"
    _rewrite_safetensors(d, lambda t: t.__setitem__(key, t[key].astype(dtype)))
    with pytest.raises(CheckpointError, match=f"'{key}' holds {np.dtype(dtype)} values; weights are floating point"):
        specjax.load_model(str(d), progress=False)


def test_a_tied_head_without_its_embedding_names_the_missing_key(tiny_llama_dir, tmp_path):
    d = _copy(tiny_llama_dir, tmp_path)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(config, tie_word_embeddings=True)))

    def drop_embedding(t):
        t["lm_head.weight"] = t.pop("model.embed_tokens.weight")

    _rewrite_safetensors(d, drop_embedding)
    with pytest.raises(CheckpointError, match="missing key 'model.embed_tokens.weight'"):  # was a KeyError
        specjax.load_model(str(d), progress=False)


def test_a_broken_tokenizer_is_reported_before_the_weights_are_read(tiny_llama_dir, tmp_path, monkeypatch):
    from specjax.io import loader

    d = _copy(tiny_llama_dir, tmp_path)
    (d / "tokenizer.json").write_text('{"version": "1.0", "model": ')

    def no_weights(*a, **k):
        raise AssertionError("the weights were read before the tokenizer was checked")

    monkeypatch.setattr(loader, "load_hf_dir", no_weights)
    with pytest.raises(CheckpointError, match="cannot load the tokenizer"):
        specjax.load_model(str(d), progress=False)


def test_a_bad_config_is_reported_as_the_configs_not_the_tokenizers(tiny_llama_dir, tmp_path):
    """transformers' tokenizer loading validates config.json as well, and the tokenizer was blamed: for what
    specjax refuses itself (read first now), and for what only transformers refuses (heads that do not divide
    the hidden size where head_dim is given)."""
    d = _copy(tiny_llama_dir, tmp_path)
    specjax.describe_model("smollm2-135m-instruct").tokenizer.save_pretrained(str(d))
    config = json.loads((d / "config.json").read_text())
    assert config["head_dim"] == 16
    (d / "config.json").write_text(json.dumps({**config, "num_attention_heads": 5, "num_key_value_heads": 5}))
    for read in (specjax.load_model, specjax.describe_model):
        with pytest.raises(CheckpointError, match=r"config.json: transformers refuses it, and reads it to load the "
                                                  r"tokenizer \(.*The hidden size \(64\) is not a multiple of the "
                                                  r"number of attention heads \(5\)"):
            read(str(d))
    del config["head_dim"]
    (d / "config.json").write_text(json.dumps({**config, "num_attention_heads": 5, "num_key_value_heads": 5}))
    for read in (specjax.load_model, specjax.describe_model):
        with pytest.raises(ConfigError, match=r"config.json: hidden_size=64 is not a multiple of "
                                              r"num_attention_heads=5") as e:
            read(str(d))
        assert "tokenizer" not in str(e.value)


def _safetensors_bytes(header: str, data: bytes) -> bytes:
    raw = header.encode()
    return struct.pack("<Q", len(raw)) + raw + data


@pytest.mark.parametrize("config", [{"pad_token_id": -1}, {"bos_token_id": 128},
                                    {"pad_token_id": 128, "bos_token_id": -1}])
def test_unused_token_ids_that_name_no_token_are_read_as_none(tiny_llama_dir, tmp_path, config):
    """BOS (the tokenizer adds it) and padding are never used: a model whose config names no token there
    (early LLaMA conversions: "pad_token_id": -1) was refused where transformers runs it. EOS stays checked."""
    d = _copy(tiny_llama_dir, tmp_path)
    (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()), **config}))
    with pytest.warns(UserWarning, match=r"config.json: '(pad|bos)_token_id' is -?\d+, not a token id of the "
                                         r"vocabulary \[0, 128\); read as none"):
        cfg = specjax.describe_model(str(d)).config
    assert all(getattr(cfg, k) is None for k in config)


@pytest.mark.parametrize("header,message", [
    ('{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, '
     '"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}', "key 'w' appears twice"),
    ('{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, '
     '"b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}', "the data of keys 'a' and 'b' overlap"),
])
def test_a_safetensors_header_naming_a_tensor_twice_or_overlapping_is_refused(tmp_path, header, message):
    path = tmp_path / "x.safetensors"
    path.write_bytes(_safetensors_bytes(header, np.arange(4, dtype=np.float32).tobytes()))
    with pytest.raises(CheckpointError, match=re.escape(message)):
        SafetensorsFile(path)


def test_gguf_arrays_nested_past_the_recursion_limit_are_refused(tmp_path):
    from specjax.io.gguf_file import GGUFFile

    nested = struct.pack("<IQ", 9, 1) * 5000 + struct.pack("<IQ", 0, 0)  # ARRAY of ARRAY of ... of no uint8
    key = b"x.nested"
    path = tmp_path / "n.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
                     + struct.pack("<I", 9) + nested)
    with pytest.raises(CheckpointError, match="not a readable GGUF file .RecursionError"):
        GGUFFile(str(path))


def test_duplicate_key_across_shards(tiny_llama_dir, tmp_path):
    from safetensors.numpy import save_file

    d = _copy(tiny_llama_dir, tmp_path)
    sf = SafetensorsFile(d / "model.safetensors")
    keys = sf.keys()
    half = len(keys) // 2
    save_file({k: np.array(sf.get(k)) for k in keys[:half]}, str(d / "a.safetensors"))
    save_file({k: np.array(sf.get(k)) for k in keys[half - 1:]}, str(d / "b.safetensors"))  # one key twice
    os.remove(d / "model.safetensors")
    weight_map = {k: "a.safetensors" for k in keys[:half]} | {k: "b.safetensors" for k in keys[half:]}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=f"duplicate key '{keys[half - 1]}'"):
        specjax.load_model(str(d))


def test_sharded_checkpoint_loads(tiny_llama_dir, tmp_path):
    from safetensors.numpy import save_file

    d = _copy(tiny_llama_dir, tmp_path)
    sf = SafetensorsFile(d / "model.safetensors")
    keys = sf.keys()
    save_file({k: np.array(sf.get(k)) for k in keys[::2]}, str(d / "a.safetensors"))
    save_file({k: np.array(sf.get(k)) for k in keys[1::2]}, str(d / "b.safetensors"))
    os.remove(d / "model.safetensors")
    weight_map = {k: "a.safetensors" for k in keys[::2]} | {k: "b.safetensors" for k in keys[1::2]}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    sharded = specjax.load_model(str(d), progress=False)
    single = specjax.load_model(tiny_llama_dir, progress=False)
    np.testing.assert_array_equal(specjax.logits(sharded, [[1, 2, 3]])[0], specjax.logits(single, [[1, 2, 3]])[0])


_GGUF = {"general.architecture": "llama", "llama.attention.head_count": 4, "llama.embedding_length": 32,
         "llama.feed_forward_length": 48, "llama.block_count": 2, "llama.context_length": 128,
         "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.vocab_size": 64}


@pytest.mark.parametrize("fields,scaling", [
    ({}, None),
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}, 4.0),
    ({"llama.rope.scaling.factor": 4.0}, 4.0),  # no type: linear, as llama.cpp reads it
    ({"llama.rope.scale_linear": 2.0}, 2.0),  # the older key
    ({"llama.rope.scaling.type": "linear", "llama.rope.scale_linear": 2.0}, 2.0),
    ({"llama.rope.scaling.factor": 1.0}, None),
])
def test_gguf_rope_scaling_is_read_as_llama_cpp_reads_it(fields, scaling):
    from specjax.config import config_from_gguf

    got = config_from_gguf({**_GGUF, **fields}, "x.gguf").rope_scaling
    assert (None if got is None else (got.kind, got.factor)) == (None if scaling is None else ("linear", scaling))


@pytest.mark.parametrize("fields,message", [
    ({"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 4.0}, "type 'none' beside a scaling factor"),
    ({"llama.rope.scaling.type": "linear"}, "type 'linear' needs 'llama.rope.scaling.factor'"),
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}, "type 'yarn' is not supported"),
])
def test_gguf_rope_scaling_that_cannot_be_read_is_refused(fields, message):
    from specjax.config import config_from_gguf

    with pytest.raises(ConfigError, match=re.escape(message)):
        config_from_gguf({**_GGUF, **fields}, "x.gguf")


@pytest.mark.parametrize("dtype", ["int8", "bool", "bogus", None])
def test_a_feature_drafter_stored_dtype_must_be_a_float_type(tmp_path, dtype):
    """An integer dtype restored the weights as zeros, bool as ones, an unknown name was a TypeError."""
    from specjax.io.feature_checkpoint import META_FILE, read_feature_meta

    shipped = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "smollm2-feature")
    with open(os.path.join(shipped, META_FILE)) as f:
        meta = json.load(f)
    (tmp_path / META_FILE).write_text(json.dumps(dict(meta, dtype=dtype)))
    with pytest.raises(CheckpointError, match=f"'dtype' must be one of .*got {re.escape(repr(dtype))}"):
        read_feature_meta(str(tmp_path))


def test_corrupt_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"GGUF" + b"\x00" * 10)
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        specjax.load_model(str(p))


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return specjax.load_model(tiny_llama_dir, progress=False)


def test_prompt_plus_new_tokens_beyond_context(model):
    ctx = model.config.max_positions
    with pytest.raises(InputError, match=f"exceeds the context window of {ctx}"):
        specjax.generate(model, [[1] * (ctx - 10)], max_new_tokens=11)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_non_positive_max_new_tokens(model, bad):
    with pytest.raises(InputError, match="max_new_tokens must be a positive int"):
        specjax.generate(model, [[1, 2]], max_new_tokens=bad)


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-1.0), "temperature must be"),
    (dict(temperature=float("nan")), "temperature must be"),
    (dict(top_k=-1), "top_k must be"),
    (dict(top_p=0.0), "top_p must be in"),
    (dict(top_p=1.5), "top_p must be in"),
    (dict(top_p=1e-46), "float32's smallest normal"),  # 0 on the device: no token kept
    (dict(temperature=1e39), "temperature must be at most 3.403e\\+38"),  # inf on the device: uniform sampling
    (dict(seed=-1), "seed must be"),
])
def test_invalid_sampling_params(kwargs, match):
    with pytest.raises(InputError, match=match):
        specjax.SamplingParams(**kwargs)


def test_sampling_params_take_numpy_numbers_as_their_python_values():

    got = specjax.SamplingParams(temperature=np.float32(0.5), top_k=np.int32(4), top_p=np.float64(0.25),
                                 seed=np.int64(3))
    assert got == specjax.SamplingParams(temperature=0.5, top_k=4, top_p=0.25, seed=3)
    assert type(got.temperature) is float and type(got.seed) is int
    with pytest.raises(InputError, match="temperature must be a finite number"):
        specjax.SamplingParams(temperature=np.float32("nan"))
    with pytest.raises(InputError, match="seed must be an int"):
        specjax.SamplingParams(seed=np.float32(3))


def test_the_host_api_takes_concrete_jax_values_as_numpy_ones_and_refuses_traced_ones(model):
    import jax
    import jax.numpy as jnp

    got = specjax.SamplingParams(temperature=jnp.float32(0.5), top_k=jnp.int32(4), seed=jnp.int32(3))
    assert got == specjax.SamplingParams(temperature=0.5, top_k=4, seed=3) and type(got.seed) is int
    with pytest.raises(InputError, match="seed must be an int"):
        specjax.SamplingParams(seed=jax.random.key(3))  # a key is no seed
    want = specjax.generate(model, [[1, 2, 3], [4, 5, 6]], max_new_tokens=3, mode="incremental").token_ids
    for prompts in (jnp.asarray([[1, 2, 3], [4, 5, 6]]), [jnp.asarray([1, 2, 3]), jnp.asarray([4, 5, 6])]):
        assert specjax.generate(model, prompts, max_new_tokens=jnp.int32(3), mode="incremental").token_ids == want

    @jax.jit
    def inside(params):
        return specjax.generate(model._replace(params=params), [[1, 2, 3]], max_new_tokens=3).token_ids

    with pytest.raises(InputError, match=r"model.params is a traced value .* inside jit call "
                                         r"specjax.generate_incremental"):
        inside(model.params)
    with pytest.raises(InputError, match="prompts is a traced value"):
        jax.jit(lambda p: specjax.generate(model, p, max_new_tokens=3))(jnp.asarray([[1, 2, 3]]))


def test_bad_prompts(model):
    with pytest.raises(InputError, match="prompt 0 is empty"):
        specjax.generate(model, [[]], max_new_tokens=2)
    with pytest.raises(InputError, match=r"prompt 1: token id 9999 is not in \[0, 128\)"):
        specjax.generate(model, [[1], [2, 9999]], max_new_tokens=2)
    with pytest.raises(InputError, match="has no tokenizer"):
        specjax.generate(model, ["hello"], max_new_tokens=2)
    with pytest.raises(InputError, match="sampling must be"):
        specjax.generate(model, [[1], [2]], max_new_tokens=2, sampling=[specjax.SamplingParams()])
    # an empty string is refused before any chat template could wrap it into a conversation
    with pytest.raises(InputError, match="prompt 1 is empty"):
        specjax.generate(model, [[1], ""], max_new_tokens=2)
    with pytest.raises(InputError, match=r"prompt 0 is not valid UTF-8 text \(lone surrogate U\+D800 at character 1"):
        specjax.generate(model, ["a\ud800b"], max_new_tokens=2)


@requires_smollm2
def test_a_tokenizer_id_outside_the_models_vocabulary_is_refused_not_clamped(model):
    """SmolLM2's tokenizer over the tiny model (128 embedding rows): its ids would index past the embedding."""
    from specjax.types import Model

    wide = Model(model.config, model.params, specjax.describe_model("smollm2-135m-instruct").tokenizer)
    with pytest.raises(InputError, match=r"prompt 0: the tokenizer gives token id \d+, outside the model's "
                                         r"vocabulary \[0, 128\)"):
        plan_generation(wide, ["hello world"], max_new_tokens=2, chat_template=False)


@requires_smollm2
def test_a_chat_template_that_refuses_a_prompt_is_an_input_error():
    """Templates refuse conversations in their own words (Gemma's and Mistral's raise_exception): a raw
    jinja2 exception escaped, and the command showed a traceback with status 1."""
    import copy

    from specjax.types import Model

    light = specjax.describe_model("smollm2-135m-instruct")
    tok = copy.deepcopy(light.tokenizer)
    tok.chat_template = "{{ raise_exception('System role not supported') }}"
    strict = Model(light.config, None, tok)
    with pytest.raises(InputError, match=r"prompt 0: the model's chat template refused it: TemplateError: System role "
                                         r"not supported \(chat_template=False"):
        plan_generation(strict, ["hello"], max_new_tokens=2)
    tok.chat_template = "{{ messages[0]['content'] | nosuchfilter }}"  # does not compile
    with pytest.raises(InputError, match="the model's chat template refused it: TemplateAssertionError"):
        plan_generation(strict, ["hello"], max_new_tokens=2)
    assert plan_generation(strict, ["hello"], max_new_tokens=2, chat_template=False).ids


def test_labels_name_the_prompts_in_errors(model):
    with pytest.raises(InputError, match=r"p.jsonl:9: token id 9999 is not in \[0, 128\)"):
        plan_generation(model, [[1], [2, 9999]], max_new_tokens=2, labels=["p.jsonl:4", "p.jsonl:9"])
    ctx = model.config.max_positions
    with pytest.raises(InputError, match=f"p.jsonl:4: {ctx} prompt tokens"):
        plan_generation(model, [[1] * ctx], max_new_tokens=2, labels=["p.jsonl:4"])
    with pytest.raises(InputError, match="labels must be a list of 2 strings"):
        plan_generation(model, [[1], [2]], max_new_tokens=2, labels=["p.jsonl:4"])


@pytest.mark.parametrize("kwargs,match", [
    (dict(on_tokens=5), "on_tokens must be a callable"),
    (dict(parallel="tp=2"), "parallel must be a specjax.sharding.Parallel"),
    (dict(verifier="mss"), "mode 'incremental' neither drafts nor verifies, so it takes no verifier='mss'"),
    (dict(draft="iid", impl="xla"), "takes no draft='iid', impl='xla'"),
    (dict(expansion=(1, 2)), "takes no expansion=\\(1, 2\\)"),
])
def test_arguments_incremental_decoding_would_ignore_are_refused_before_compiling(model, kwargs, match):
    with pytest.raises(InputError, match=match):
        specjax.generate(model, [[1, 2]], max_new_tokens=2, mode="incremental", **kwargs)


def test_an_expansion_without_ssms_is_refused(model):
    with pytest.raises(InputError, match="expansion shapes the drafts of ssms"):
        plan_generation(model, [[1, 2]], max_new_tokens=2, drafters=[specjax.Bound(specjax.LookupDrafter(), ())],
                        expansion=(1, 1, 3, 1))


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "specjax", *args], capture_output=True, text=True, timeout=300)


def test_cli_errors(tiny_llama_dir, tmp_path):
    """A few CLI refusals end to end (tests/test_cli.py sweeps the rest)."""
    r = _cli("generate", "--model", tiny_llama_dir, "--prompt", "hi", "--max-new-tokens", "0")
    assert r.returncode == 2 and "--max-new-tokens must be >= 1" in r.stderr
    r = _cli("generate", "--model", tiny_llama_dir, "--prompt", "hi", "--top-p", "2")
    assert r.returncode == 2 and "top_p must be in (0, 1]" in r.stderr
    for mode in ("tree", "incremental"):
        r = _cli("generate", "--model", tiny_llama_dir, "--prompt", "hi", "--mode", mode)
        assert r.returncode == 2 and "has no tokenizer" in r.stderr, r.stderr
        assert 'a --prompts-file line such as {"prompt": [1, 2, 3]}' in r.stderr  # --prompt takes no ids
    r = _cli("generate", "--model", tiny_llama_dir, "--prompt", "hi", "--expansion", "1,0")
    assert r.returncode == 2 and "expansion widths must be positive ints, got [1, 0]" in r.stderr
    r = _cli("generate", "--model", tiny_llama_dir, "--prompt", "hi", "--verifier", "bogus")
    assert r.returncode == 2 and "invalid choice: 'bogus'" in r.stderr


@pytest.mark.parametrize("config,message", [
    ([1, 2], "expected a JSON object (key/value mapping), got list"),
    ({"num_attention_heads": 0}, "'num_attention_heads' must be >= 1, got 0"),
    ({"vocab_size": "lots"}, "'vocab_size' must be an integer, got 'lots'"),
    ({"hidden_size": 63, "head_dim": None}, "hidden_size=63 is not a multiple of num_attention_heads=4"),
    ({"rms_norm_eps": -1}, "'rms_norm_eps' must be a finite positive number"),
    ({"tie_word_embeddings": "yes"}, "'tie_word_embeddings' must be true or false"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "required key 'low_freq_factor' is missing"),
    ({"num_hidden_layers": 2.5}, "'num_hidden_layers' must be an integer, got 2.5"),
    ({"rope_parameters": None, "rope_scaling": {"factor": 4.0}}, "a RoPE scaling factor of 4.0 without a scaling "
                                                                  "type"),  # a transformers 4 config
    ({"rope_parameters": {"rope_theta": 1e4, "factor": 4.0}}, "a RoPE scaling factor of 4.0 without a scaling type"),
    ({"eos_token_id": [2, 50000]}, "ModelConfig.eos_token_ids holds 50000, outside the vocabulary [0, 128)"),
])
def test_malformed_config_json(tiny_llama_dir, tmp_path, config, message):
    d = _copy(tiny_llama_dir, tmp_path)
    good = json.loads((d / "config.json").read_text())
    bad = config if isinstance(config, list) else {**good, **config}
    (d / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match=re.escape(message)):
        specjax.load_model(str(d))
    with pytest.raises(ConfigError, match=re.escape(message)):
        specjax.describe_model(str(d))


@pytest.mark.parametrize("header,message", [
    ([1, 2], "corrupt safetensors header (a JSON list, expected an object of tensors)"),
    ({"w": {"dtype": "F32", "data_offsets": [0, 4]}}, "key 'w' has no valid 'shape'"),
    ({"w": {"dtype": "F32", "shape": [1]}}, "key 'w' has no valid 'data_offsets'"),
    ({"w": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 4]}}, "key 'w' has unsupported dtype 'Q9'"),
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, "key 'w' has corrupt data offsets 0..4"),
    ({"w": "F32"}, "key 'w' has a corrupt header entry"),
])
def test_malformed_safetensors_header(tmp_path, header, message):
    import struct

    raw = json.dumps(header).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 4)
    with pytest.raises(CheckpointError, match=re.escape(message)):
        SafetensorsFile(path)


def test_truncated_gguf_says_truncated(tmp_path):
    import struct

    def string(s: bytes) -> bytes:
        return struct.pack("<Q", len(s)) + s

    # one F32 tensor of 8 elements declared, 16 of its 32 bytes present
    data = b"GGUF" + struct.pack("<IQQ", 3, 1, 1) + string(b"general.architecture") + struct.pack("<I", 8)
    data += string(b"llama") + string(b"token_embd.weight") + struct.pack("<I", 1) + struct.pack("<Q", 8)
    data += struct.pack("<IQ", 0, 0)
    data += b"\0" * (-len(data) % 32) + b"\0" * 16
    path = tmp_path / "t.gguf"
    path.write_bytes(data)
    with pytest.raises(CheckpointError, match=r"truncated GGUF file \(tensor 'token_embd.weight' needs bytes up to"):
        specjax.load_model(str(path))
    path.write_bytes(data[:30])
    with pytest.raises(CheckpointError, match="truncated GGUF file"):
        specjax.load_model(str(path))
