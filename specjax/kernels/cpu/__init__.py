"""specjax's CPU kernels, C++ through the XLA FFI (AVX-512F, built on first use): ``matmul`` (the weight
matmuls of the step programs over weights packed once), ``attention`` (few queries per request
over the stacked cache, read in place) and ``prefill_attention`` (a prefill chunk over the cache and
causally over itself). ``build`` compiles and registers them; ``status()`` says why
they are unavailable."""

from specjax.kernels.cpu.build import NO_AVX512, KernelUnavailable, status, unsupported_cpu

__all__ = ["NO_AVX512", "KernelUnavailable", "status", "unsupported_cpu"]
