"""specjax: tree-based speculative inference and verification for LLaMA/OPT models in JAX."""

from specjax.api import GenerationResult, Model, describe_model, generate, load_model, logits
from specjax.config import ModelConfig
from specjax.errors import CheckpointError, ConfigError, GenerationError, InputError, ShardingError, SpecjaxError
from specjax.generate import generate_incremental
from specjax.sampling import SamplingArrays, SamplingParams
from specjax import ssm  # noqa: E402 - specjax.ssm.derive_ssm is part of the documented API

__version__ = "0.1.0"

__all__ = ["load_model", "describe_model", "generate", "logits", "Model", "GenerationResult", "ModelConfig",
           "SamplingParams", "SamplingArrays", "generate_incremental", "SpecjaxError", "ConfigError", "CheckpointError",
           "InputError", "ShardingError", "GenerationError"]
