"""specjax's CPU kernels, C++ through the XLA FFI (AVX-512F; the matmul also AVX2; built on first use):
``matmul`` (the weight matmuls of the step programs over weights packed once), ``attention`` (few queries per request
over the stacked cache, read in place) and ``prefill_attention`` (a prefill chunk over the cache and
causally over itself). ``build`` compiles and registers them; ``status()`` says why
they are not all available, ``matmul_status()`` why the matmul is not."""

from specjax.kernels.cpu.build import NO_AVX512, KernelUnavailable, matmul_status, status, unsupported_cpu

__all__ = ["NO_AVX512", "KernelUnavailable", "matmul_status", "status", "unsupported_cpu"]
