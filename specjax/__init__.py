"""specjax: tree-based speculative inference and verification for LLaMA/OPT models in JAX."""

from specjax.api import GenerationResult, generate, logits
from specjax.config import ModelConfig
from specjax.decoding.incremental import generate_incremental
from specjax.decoding.sampling import SamplingArrays, SamplingParams
from specjax.errors import (
    CheckpointError,
    ConfigError,
    GenerationError,
    InputError,
    ShardingError,
    SpecjaxError,
)
from specjax.io.detokenize import IncrementalText
from specjax.io.loader import describe_model, load_model
from specjax.speculation.budget import Budget
from specjax.speculation.drafters.base import Bound, Drafter
from specjax.speculation.drafters.corpus import CorpusDrafter, corpus_drafter
from specjax.speculation.drafters.lookup import LookupDrafter
from specjax.speculation.drafters.ssm import SSMDrafter, derive_ssm
from specjax.types import Model

__version__ = "0.1.0"

__all__ = ["load_model", "describe_model", "generate", "logits", "Model", "GenerationResult", "ModelConfig",
           "SamplingParams", "SamplingArrays", "generate_incremental", "SpecjaxError", "ConfigError", "CheckpointError",
           "InputError", "ShardingError", "GenerationError", "derive_ssm", "Bound", "Drafter", "SSMDrafter",
           "LookupDrafter", "CorpusDrafter", "corpus_drafter", "Budget", "IncrementalText"]
