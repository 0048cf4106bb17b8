"""specjax's CPU kernels, C++ through the XLA FFI (AVX-512F; all but the prefill attention also AVX2;
built on first use):
``matmul`` (the weight matmuls of the step programs over weights packed once), ``attention`` (few queries per request
over the stacked cache, read in place) and ``prefill_attention`` (a prefill chunk over the cache and
causally over itself). ``build`` compiles and registers them; ``status()`` says why
they are not all available, ``matmul_status()`` why the matmul is not and ``attention_status()`` why
the step attention is not (they build together)."""

from specjax.kernels.cpu.build import (
    NO_AVX512,
    KernelUnavailable,
    attention_status,
    matmul_status,
    status,
    unsupported_cpu,
)

__all__ = ["NO_AVX512", "KernelUnavailable", "attention_status", "matmul_status", "status", "unsupported_cpu"]
