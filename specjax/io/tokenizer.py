"""Tokenizers through ``transformers.AutoTokenizer`` (optional: tiny test checkpoints have none)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
import warnings

from specjax._compat import gguf_tokenizer_from_fields
from specjax.config import cache_root
from specjax.errors import CheckpointError
from specjax.io.gguf_file import file_identity, open_gguf

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

# Tokenizers already built in this process, by the digest of their GGUF file: a command describes the
# model (checks before the weights load), then loads it, and the registry reads registered models'
# configs, each asking for the same tokenizer (~0.5 s a read). specjax never modifies a tokenizer.
_LOADED: dict = {}


def load_dir_tokenizer(path: str):
    """The tokenizer saved in a model directory, or None if it has no tokenizer files."""
    if not any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - transformers raises many types for broken files
        error = e
    # transformers reads config.json to load a tokenizer, and validates it more strictly than specjax needs
    # (LLaMA heads x head_dim may differ from the hidden size): name the file it refused, not the tokenizer.
    from transformers import AutoConfig

    config = os.path.join(path, "config.json")
    if os.path.exists(config):
        try:
            AutoConfig.from_pretrained(path)
        except Exception as e:  # noqa: BLE001 - as above
            said = " ".join(str(e).split())  # its validators' messages span lines
            raise CheckpointError(f"{config}: transformers refuses it, and reads it to load the tokenizer "
                                  f"({type(e).__name__}: {said})") from None
    raise CheckpointError(f"{path}: cannot load the tokenizer ({type(error).__name__}: {error})") from None


# GGUF metadata key -> transformers name, for the tokenizer and the tokenizer config.
_GGUF_TOKENIZER_KEYS = {
    "tokenizer.ggml.model": "tokenizer_type", "tokenizer.ggml.pre": "pre_tokenizer_type",
    "tokenizer.ggml.tokens": "tokens", "tokenizer.ggml.scores": "scores",
    "tokenizer.ggml.token_type": "token_type", "tokenizer.ggml.merges": "merges",
    "tokenizer.ggml.precompiled_charsmap": "precompiled_charsmap",
    "tokenizer.ggml.bos_token_id": "bos_token_id", "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.unknown_token_id": "unk_token_id", "tokenizer.ggml.padding_token_id": "pad_token_id",
    "tokenizer.ggml.add_space_prefix": "add_prefix_space",
}
_GGUF_CONFIG_KEYS = {"tokenizer.chat_template": "chat_template", "tokenizer.ggml.add_bos_token": "add_bos_token",
                     "tokenizer.ggml.add_eos_token": "add_eos_token"}
_SPECIAL = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unk_token_id",
            "pad_token": "pad_token_id"}


def _gguf_tokenizer_fields(gguf_path: str):

    fields = open_gguf(gguf_path).fields
    values = {key: fields[key] for key in {**_GGUF_TOKENIZER_KEYS, **_GGUF_CONFIG_KEYS, "general.architecture": None}
              if key in fields}
    if "tokenizer.ggml.tokens" not in values:
        raise CheckpointError(f"{gguf_path}: no embedded tokenizer (metadata key 'tokenizer.ggml.tokens')")
    tokenizer = {name: values[k] for k, name in _GGUF_TOKENIZER_KEYS.items() if k in values}
    config = {name: values[k] for k, name in _GGUF_CONFIG_KEYS.items() if k in values}
    tokens = tokenizer["tokens"]
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise CheckpointError(f"{gguf_path}: metadata 'tokenizer.ggml.tokens' is not a list of strings")
    for name, id_key in _SPECIAL.items():
        token_id = tokenizer.get(id_key)
        if token_id is not None and (not isinstance(token_id, int) or not 0 <= token_id < len(tokens)):
            raise CheckpointError(f"{gguf_path}: metadata {id_key!r} = {token_id!r} is not a token id in "
                                  f"[0, {len(tokens)})")
        config[name] = tokens[token_id] if token_id is not None else None
    return values.get("general.architecture"), tokenizer, config


def load_gguf_tokenizer(gguf_path: str):
    """The tokenizer embedded in a GGUF file, built torch-free; the conversion is cached on disk, and the
    tokenizer built once per process: every model loaded from the same file shares this object (a
    setting changed on it, e.g. ``pad_token``, shows in every one of them).

    The cached conversion is read back as the class it was saved from (a fast tokenizer), not through
    ``AutoTokenizer``, whose import chain imports torch where it is installed: 2.7 s instead of 1.2 s
    with torch 2.13 on an AMD EPYC (transformers' import included), paid by every ``specjax`` command."""

    digest = hashlib.sha256(json.dumps(file_identity(gguf_path)).encode()).hexdigest()
    if digest in _LOADED:
        return _LOADED[digest]
    converted = os.path.join(cache_root(), "tokenizers", digest[:16])
    tok = _read_converted(converted)
    if tok is None:
        try:
            tok = gguf_tokenizer_from_fields(*_gguf_tokenizer_fields(gguf_path))
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - transformers/tokenizers raise many types
            raise CheckpointError(f"{gguf_path}: cannot build the tokenizer ({type(e).__name__}: {e})") from None
        tmp = f"{converted}.tmp-{uuid.uuid4().hex[:8]}"
        try:  # written aside and renamed into place: a reader never sees half an entry
            tok.save_pretrained(tmp)
            os.rename(tmp, converted)
        except OSError:
            pass  # a read-only cache, or another process's entry renamed first: only the conversion's time
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    _LOADED[digest] = tok
    return tok


def _read_converted(converted: str):
    """The cached conversion at ``converted``, or None when there is none; a damaged one (an interrupted
    write of an older version, a truncated file) is reported and removed, and the caller converts again."""
    from transformers import PreTrainedTokenizerFast

    if not os.path.exists(os.path.join(converted, "tokenizer.json")):
        return None
    try:
        return PreTrainedTokenizerFast.from_pretrained(converted)
    except Exception as e:  # noqa: BLE001 - transformers/tokenizers raise many types for a broken file
        warnings.warn(f"specjax: the cached tokenizer {converted} is damaged ({type(e).__name__}: {str(e)[:200]}); "
                      f"converting again", stacklevel=3)
        shutil.rmtree(converted, ignore_errors=True)
        return None
