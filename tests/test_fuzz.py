"""Property-based tests of the parsers at the boundary: any input either loads or raises a specjax
error type, never another exception (hypothesis generates the inputs)."""

from __future__ import annotations

import json
import math
import os
import struct

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specjax.config import ModelConfig, config_from_gguf, config_from_hf
from specjax.decoding.sampling import SamplingParams
from specjax.errors import SpecjaxError
from specjax.io.gguf_file import GGUFFile
from specjax.io.prompts import normalize_prompts, read_prompts_file
from specjax.io.safetensors import SafetensorsFile
from specjax.sharding.mesh import MeshShape
from specjax.speculation.expansion import Expansion

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                         HealthCheck.too_slow])

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=True),
                    st.text(max_size=8))
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                           st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                           max_leaves=12)
plausible = st.one_of(st.integers(-2, 300), st.floats(-1, 1e4), st.booleans(), st.none(), st.text(max_size=4),
                      st.lists(st.integers(-2, 300), max_size=3))
HF_KEYS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
           "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
           "rope_theta", "rope_scaling", "rope_parameters", "attention_bias", "mlp_bias", "eos_token_id",
           "bos_token_id", "pad_token_id", "hidden_act", "ffn_dim", "word_embed_proj_dim", "do_layer_norm_before",
           "activation_function", "enable_bias", "_remove_final_layer_norm", "layer_norm_elementwise_affine"]
VALID_LLAMA = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


def _loads_or_refuses(fn, *args):
    try:
        return fn(*args)
    except SpecjaxError:
        return None


@FUZZ
@given(st.one_of(json_values, st.fixed_dictionaries(
    {"model_type": st.sampled_from(["llama", "opt", "gpt2", None])},
    optional={k: st.one_of(plausible, json_values) for k in HF_KEYS})))
def test_hf_config_dicts(d):
    cfg = _loads_or_refuses(config_from_hf, d)
    if cfg is not None:  # what loads is a valid, round-trippable config
        assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


@FUZZ
@given(st.dictionaries(st.sampled_from(HF_KEYS), plausible, max_size=6))
def test_hf_config_mutations_of_a_valid_one(changes):
    _loads_or_refuses(config_from_hf, {**VALID_LLAMA, **changes})


@FUZZ
@given(json_values)
def test_checkpoint_config_dicts(d):
    _loads_or_refuses(ModelConfig.from_dict, d)


GGUF_KEYS = ["llama.attention.head_count", "llama.embedding_length", "llama.feed_forward_length",
             "llama.block_count", "llama.context_length", "llama.attention.layer_norm_rms_epsilon",
             "llama.attention.head_count_kv", "llama.rope.dimension_count", "llama.rope.freq_base",
             "llama.rope.scaling.type", "llama.rope.scaling.factor", "llama.vocab_size",
             "tokenizer.ggml.eos_token_id", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.padding_token_id"]
VALID_GGUF = {"general.architecture": "llama", "llama.attention.head_count": 4, "llama.embedding_length": 32,
              "llama.feed_forward_length": 48, "llama.block_count": 2, "llama.context_length": 128,
              "llama.attention.layer_norm_rms_epsilon": 1e-5}


@FUZZ
@given(st.dictionaries(st.sampled_from(GGUF_KEYS + ["general.architecture"]), plausible, max_size=8),
       st.one_of(st.none(), st.integers(-5, 100)))
def test_gguf_metadata(changes, vocab):
    _loads_or_refuses(config_from_gguf, {**VALID_GGUF, **changes}, "x.gguf", vocab)


def _gguf_bytes(fields: list, tensors: list) -> bytes:
    def string(s: bytes) -> bytes:
        return struct.pack("<Q", len(s)) + s

    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(fields))
    for key, kind, payload in fields:
        out += string(key) + struct.pack("<I", kind) + payload
    for name, dims, kind, offset in tensors:
        out += string(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", kind, offset)
    return out


@FUZZ
@given(st.lists(st.tuples(st.binary(max_size=12), st.integers(0, 14), st.binary(max_size=24)), max_size=4),
       st.lists(st.tuples(st.binary(max_size=8), st.lists(st.integers(0, 70), max_size=3), st.integers(0, 40),
                          st.integers(0, 300)), max_size=3),
       st.binary(max_size=300), st.integers(0, 40))
def test_gguf_files(tmp_path_factory, fields, tensors, tail, cut):
    data = _gguf_bytes(fields, tensors) + tail
    if cut:
        data = data[:-cut]
    path = os.path.join(tmp_path_factory.mktemp("gguf"), "x.gguf")
    with open(path, "wb") as f:
        f.write(data)
    g = _loads_or_refuses(GGUFFile, path)
    if g is not None:
        for name in g.tensors:
            _loads_or_refuses(g.dequantized, name)


@FUZZ
@given(st.one_of(json_values, st.dictionaries(st.text(max_size=6), st.fixed_dictionaries(
    {}, optional={"dtype": st.sampled_from(["F32", "F16", "BF16", "I8", "X", 3]),
                  "shape": st.one_of(st.lists(st.integers(-2, 4), max_size=3), plausible),
                  "data_offsets": st.one_of(st.lists(st.integers(-2, 80), max_size=3), plausible)}), max_size=3)),
       st.binary(max_size=80), st.booleans())
def test_safetensors_headers(tmp_path_factory, header, data, bad_utf8):
    raw = json.dumps(header).encode() if not bad_utf8 else b'{"a": "\xff"}'
    path = os.path.join(tmp_path_factory.mktemp("st"), "m.safetensors")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)
    sf = _loads_or_refuses(SafetensorsFile, path)
    if sf is not None:
        for key in sf.keys():
            assert sf.get(key).nbytes <= len(data)


@FUZZ
@given(st.text(alphabet="0123456789,x -\u0663", max_size=12))
def test_expansion_strings(text):
    e = _loads_or_refuses(Expansion.parse, text)
    if e is not None:
        assert all(w >= 1 for w in e.widths) and list(e.widths) == [int(x) for x in text.split(",")]


@FUZZ
@given(st.text(alphabet="pdt=0123456789,x \u0663", max_size=16))
def test_mesh_strings(text):
    shape = _loads_or_refuses(MeshShape.parse, text)
    if shape is not None:
        assert shape.size >= 1


@FUZZ
@given(st.one_of(st.floats(allow_nan=True), st.integers(-5, 2**40), st.booleans(), st.none(), st.text(max_size=3)),
       st.one_of(st.integers(-5, 2**40), st.floats(allow_nan=True), st.booleans(), st.none()),
       st.one_of(st.floats(allow_nan=True), st.integers(-2, 3), st.booleans(), st.none()),
       st.one_of(st.integers(-5, 2**40), st.floats(), st.booleans(), st.none()))
def test_sampling_parameters(temperature, top_k, top_p, seed):
    p = _loads_or_refuses(lambda: SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed))
    if p is not None:
        assert math.isfinite(p.temperature) and 0 <= p.top_k < 2**31 and 0 < p.top_p <= 1 and 0 <= p.seed < 2**31
        from specjax.decoding.sampling import SamplingArrays

        SamplingArrays.from_params([p])  # fits the int32/float32 arrays


@FUZZ
@given(st.binary(max_size=200))
def test_prompts_files(tmp_path_factory, data):
    path = os.path.join(tmp_path_factory.mktemp("p"), "p.jsonl")
    with open(path, "wb") as f:
        f.write(data)
    prompts = _loads_or_refuses(read_prompts_file, path)
    if prompts is not None:
        assert prompts and all((isinstance(p, str) and p) or (isinstance(p, list) and p) for p in prompts)


@FUZZ
@given(st.one_of(json_values, st.binary(max_size=4), st.lists(st.one_of(st.binary(max_size=3), st.booleans(),
                                                                         st.integers(), st.text(max_size=3),
                                                                         st.lists(st.integers(), max_size=3)),
                                                               max_size=3)))
def test_api_prompts(prompts):
    out = _loads_or_refuses(normalize_prompts, prompts)
    if out is not None:
        assert all(isinstance(p, str) or all(type(t) is int for t in p) for p in out)


def test_api_refuses_none_bytes_and_booleans():
    import pytest

    from specjax.errors import InputError

    for bad, message in ((None, "prompts must be"), ([None], "prompt 0 must be a str"), ([b"hi"], "prompt 0 is bytes"),
                         ([[True, False]], "a token-id list must hold ints only"), (b"hi", "prompts must be"),
                         ([np.array([1.5])], "a token-id list must hold ints only"), ([], "prompts must be")):
        with pytest.raises(InputError, match=message):
            normalize_prompts(bad)
