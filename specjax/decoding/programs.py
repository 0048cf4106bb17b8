"""The per-step programs' compilation, and the one setting that picks XLA:CPU's matmul library for them.

XLA:CPU (jax 0.10) hands f32 dots to YNNPACK by default, otherwise to Eigen. Which wins depends on
the rows a matmul multiplies: the weight matmuls of a decode or tree pass over a few rows run faster
in Eigen, a prefill's hundreds of rows (and big batches) faster in YNNPACK. Measured side by side in
one process on 2 Intel Xeon cores (SmolLM2-135M, float32, the tied head read from its transposed
copy in both, ms per LLM pass at a 300-token prefix, a scratch script of stop 37; the same table per
library, 256-token prefix: ``SPECJAX_CPU_DOTS=eigen specjax tree-cost --batch-sizes 1,4,8,16
--remeasure``, then ``=ynnpack``):

    batch  library   1 node  2      3      5      9      17
    1      YNNPACK   28.9    35.0   42.7   50.3   60.7   76.7
    1      Eigen     28.3    33.6   35.7   41.4   62.7   75.1
    4      YNNPACK   55.0    70.5   75.3   80.7  127.1  156.9
    4      Eigen     46.9    70.0   77.9   81.8  112.6  162.3
    8      YNNPACK   76.1    90.1  107.7  137.5  166.9  263.6
    8      Eigen     75.6    91.7   99.3  122.4  172.2  294.3
    16     YNNPACK  102.2   142.2  197.6  189.6  279.6  494.9
    16     Eigen    102.4   146.7  162.9  206.3  329.0  524.2

and a prefill + first token (decode_init) at 64 / 256 / 1024 prompt tokens: 652 / 900 / 841 tokens/s
with YNNPACK, 572 / 808 / 729 with Eigen. So prefill programs keep XLA's default and the programs
that step (one LLM pass per step, or the loop of them) use Eigen up to ``EIGEN_MAX_BATCH`` requests.
Eigen's batched attention dots are the slower ones (30 layers of [3, 27, 64] x [3, 64, 384] scores
and values: 4.9 ms against 2.0 with YNNPACK), which is why 9 nodes at batch 1 lose a little.

The setting: environment variable ``SPECJAX_CPU_DOTS`` = ``auto`` (the rule above, the default),
``eigen`` or ``ynnpack`` (every step program), read when a program is picked. Other backends are
untouched. A caller jitting ``generate_speculative`` or ``spec_step`` itself passes
``step_compiler_options(batch)`` to its own ``jax.jit(..., compiler_options=...)`` to get the same.
"""

from __future__ import annotations

import functools
import os

import jax

from specjax.errors import InputError

ENV = "SPECJAX_CPU_DOTS"
CHOICES = ("auto", "eigen", "ynnpack")
EIGEN_MAX_BATCH = 4  # batch 8 one-node passes are level, bigger trees and batches favour YNNPACK
# An empty list of YNNPACK fusion kinds: every dot goes to Eigen.
_EIGEN = (("xla_cpu_experimental_ynn_fusion_type", ""),)


def cpu_dots() -> str:
    """The ``SPECJAX_CPU_DOTS`` setting (``auto`` when unset); anything else is refused, naming it."""
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise InputError(f"{ENV}={os.environ.get(ENV)!r}: expected one of {', '.join(CHOICES)}")
    return value


def step_library(batch: int, backend: str | None = None) -> str:
    """"eigen", "ynnpack" (XLA:CPU's matmul library for a step program of ``batch`` requests) or
    "default" (not a CPU backend: XLA decides)."""
    if (backend or jax.default_backend()) != "cpu":
        return "default"
    choice = cpu_dots()
    if choice == "auto":
        return "eigen" if batch <= EIGEN_MAX_BATCH else "ynnpack"
    return choice


def step_compiler_options(batch: int, backend: str | None = None) -> dict | None:
    """The XLA compiler options of a program that steps ``batch`` requests (None: XLA's defaults)."""
    return dict(_EIGEN) if step_library(batch, backend) == "eigen" else None


@functools.lru_cache(maxsize=None)
def _jit(fn, options: tuple | None, static_argnames: tuple, donate_argnames: tuple):
    return jax.jit(fn, static_argnames=static_argnames, donate_argnames=donate_argnames,
                   compiler_options=dict(options) if options else None)


def step_program(fn, batch: int, static_argnames=(), donate_argnames=()):
    """``jax.jit(fn, ...)`` compiled with ``step_compiler_options(batch)``; one jitted object per
    (function, options, argument names), so calls share its compilation cache."""
    options = step_compiler_options(batch)
    return _jit(fn, tuple(sorted(options.items())) if options else None, tuple(static_argnames),
                tuple(donate_argnames))
