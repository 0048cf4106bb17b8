"""Exception types. Every error names the offending file, key, shape or value."""


class SpecjaxError(ValueError):
    """Base class for all errors raised by specjax on bad input."""


class ConfigError(SpecjaxError):
    """A model configuration is invalid or describes an unsupported architecture."""


class CheckpointError(SpecjaxError):
    """A weight file is missing, corrupt, or does not match the configuration."""


class InputError(SpecjaxError):
    """A generation request (prompts, lengths, sampling parameters) is invalid."""


class ShardingError(SpecjaxError):
    """A mesh, sharding rule or multi-host setup does not fit the model, the devices or the peers."""


class GenerationError(SpecjaxError):
    """Some requests failed (the LLM gave non-finite logits: NaN weights, overflow); they emitted no
    token from the failing step on. ``result`` holds every request's tokens (failed ones up to the
    failure), ``failed`` the indices of the failed requests."""

    def __init__(self, message: str, result=None, failed=()):
        super().__init__(message)
        self.result = result
        self.failed = list(failed)
