"""Shared types every layer imports downward."""

from __future__ import annotations

from typing import Any, NamedTuple

from specjax.config import ModelConfig


class Model(NamedTuple):
    """What ``load_model`` returns; unpacks as ``cfg, params, tokenizer = load_model(...)``."""

    config: ModelConfig
    params: Any
    tokenizer: Any  # a transformers tokenizer, or None
