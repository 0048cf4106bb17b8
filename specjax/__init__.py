"""specjax: tree-based speculative inference and verification for LLaMA/OPT models in JAX."""

from specjax.api import GenerationResult, Model, generate, load_model, logits
from specjax.config import ModelConfig
from specjax.errors import CheckpointError, ConfigError, InputError, SpecjaxError
from specjax.generate import generate_incremental
from specjax.sampling import SamplingArrays, SamplingParams

__version__ = "0.1.0"

__all__ = ["load_model", "generate", "logits", "Model", "GenerationResult", "ModelConfig", "SamplingParams",
           "SamplingArrays", "generate_incremental", "SpecjaxError", "ConfigError", "CheckpointError",
           "InputError"]
