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

Both libraries repack every weight on every call, so a pass over 2-17 rows still cost up to 2.5x a
one-row pass. The step programs therefore multiply 2 or more rows by specjax's own kernel
(``specjax.kernels.cpu.matmul``) over weights packed once (``step_params``: each matmul weight and the
head as a ``specjax.models.weights.PackedWeight``, the plain copy kept for one-row products), and run
their attention (up to ``specjax.models.common.CPU_ATTENTION_MAX_QUERIES`` queries per request) in
specjax's attention kernel (``specjax.kernels.cpu.attention``): the packed weights are what switches
both on (AVX-512F, or AVX2 with FMA and F16C; the prefill attention kernel is AVX-512F only).
Measured on 2 Xeon cores (SmolLM2, 300-token prefix, matmul kernel on in both, alternating in one
process): one-node / 9-node / 17-node passes 27.4 / 37.5 / 49.5 ms with XLA's attention, 25.4 / 29.9 /
40.0 ms with the kernel; on 2 AMD EPYC cores (AVX2, 256-token prefix, four alternating rounds) 9 / 17 /
33 nodes 42-49 / 72-84 / 125-141 ms with XLA's, 38-42 / 62-72 / 111-132 ms with the kernel. The rule
above still picks the library for the rest (one-row products).

The setting: environment variable ``SPECJAX_CPU_DOTS`` = ``auto`` (the default: the kernels where they
can run, i.e. a float32 model with split layers on one x86-64 CPU device with AVX-512 (or AVX2, FMA
and F16C: all but the prefill attention kernel), and the rule
above; kernels that cannot be built there are reported once as a warning and the rule above runs
alone; ``step_matmuls`` in the stats and ``specjax tree-cost`` say which ran), ``kernel`` (the same,
but kernels that cannot be built are an error), ``eigen`` or ``ynnpack`` (no kernels, that library
for every step program), read when a program is picked. Other backends are untouched. A caller
jitting ``generate_speculative`` or ``spec_step`` itself passes ``step_compiler_options(batch)`` to
its own ``jax.jit(..., compiler_options=...)`` and ``step_params(params)`` as the params to
get the same.
"""

from __future__ import annotations

import functools
import os
import warnings
import weakref

import jax
import jax.numpy as jnp

from specjax.errors import InputError
from specjax.kernels import cpu as cpu_kernels
from specjax.kernels.cpu import matmul as cpu_matmul
from specjax.kernels.cpu.greedy_head import GreedyHead, pack_head
from specjax.models.params import GREEDY_HEAD, TIED_HEAD, layers_split
from specjax.models.weights import MATMUL_WEIGHTS, PackedWeight

ENV = "SPECJAX_CPU_DOTS"
CHOICES = ("auto", "kernel", "eigen", "ynnpack")
EIGEN_MAX_BATCH = 4  # batch 8 one-node passes are level, bigger trees and batches favour YNNPACK
# An empty list of YNNPACK fusion kinds: every dot goes to Eigen.
_EIGEN = (("xla_cpu_experimental_ynn_fusion_type", ""),)


def cpu_dots() -> str:
    """The ``SPECJAX_CPU_DOTS`` setting (``auto`` when unset); anything else is refused, naming it."""
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise InputError(f"{ENV}={os.environ.get(ENV)!r}: expected one of {', '.join(CHOICES)}")
    return value


@functools.lru_cache(maxsize=None)
def _warn_unavailable(why: str) -> None:
    warnings.warn(f"specjax: the CPU kernels are unavailable, step programs use XLA's matmuls and attention "
                  f"({ENV}=auto): {why}", RuntimeWarning, stacklevel=3)


def kernel_enabled(backend: str | None = None) -> bool:
    """Whether step programs run specjax's CPU kernels (2+ rows of every matmul and the step attention;
    the prefill attention too where ``prefill_kernel_enabled``): CPU backend, the setting ``auto`` or
    ``kernel``, and the matmul kernel built; ``kernel`` with none raises."""
    if (backend or jax.default_backend()) != "cpu" or cpu_dots() in ("eigen", "ynnpack"):
        return False
    why = cpu_kernels.matmul_status()
    if why is None:
        return True
    if cpu_dots() == "kernel":
        raise InputError(f"{ENV}=kernel: {why}")
    if not cpu_kernels.unsupported_cpu(why):  # a CPU it is not tuned for is the rule, not a fault
        _warn_unavailable(why)
    return False


def prefill_kernel_enabled(backend: str | None = None) -> bool:
    """Whether the CPU prefill attention kernel runs (``kernel_enabled`` and built: AVX-512F only)."""
    return kernel_enabled(backend) and cpu_kernels.status() is None


def step_library(batch: int, backend: str | None = None) -> str:
    """"eigen", "ynnpack" (XLA:CPU's matmul library for a step program of ``batch`` requests), either
    prefixed with "kernel+" when specjax's kernels run (2+ rows of each matmul, the attention), or
    "default" (not a CPU backend: XLA decides)."""
    if (backend or jax.default_backend()) != "cpu":
        return "default"
    choice = cpu_dots()
    library = ("eigen" if batch <= EIGEN_MAX_BATCH else "ynnpack") if choice in ("auto", "kernel") else choice
    return f"kernel+{library}" if kernel_enabled(backend) else library


def step_compiler_options(batch: int, backend: str | None = None) -> dict | None:
    """The XLA compiler options of a program that steps ``batch`` requests (None: XLA's defaults)."""
    return dict(_EIGEN) if step_library(batch, backend).endswith("eigen") else None


_PACKED: dict[tuple, tuple] = {}  # (id of the plain weight, contracted, dtype) -> ((weakref to it,), its packed array)


def while_alive(memo: dict, sources: tuple, make, tag=()):
    """``make()``, computed once while every array of ``sources`` lives: ``memo`` is keyed by their ids
    (and ``tag``) and holds weak references to them, so params that share some arrays and differ in
    others never mix, and an entry goes when its first source dies. What ``make`` returns must not
    refer to the sources: the entry would keep them alive."""
    key = tuple(map(id, sources)) + tuple(tag)
    hit = memo.get(key)
    if hit is not None and all(ref() is a for ref, a in zip(hit[0], sources)):
        return hit[1]
    value = make()
    memo[key] = (tuple(weakref.ref(a) for a in sources), value)
    weakref.finalize(sources[0], _drop, memo, key)
    return value


def _drop(memo: dict, key: tuple) -> None:
    hit = memo.get(key)
    if hit is not None and any(ref() is None for ref in hit[0]):
        del memo[key]


def _packed(w, contracted: int = 1, dtype=jnp.float32) -> PackedWeight:
    """w with its packed copy (panels of ``dtype``), packed once while w lives (``while_alive``)."""
    if isinstance(w, jax.core.Tracer):  # inside a caller's own jit: nothing to keep
        return PackedWeight(w, cpu_matmul.pack(w, contracted, dtype))
    return PackedWeight(w, while_alive(_PACKED, (w,), lambda: cpu_matmul.pack(w, contracted, dtype),
                                       (contracted, jnp.dtype(dtype).name)))


# The einsum specs of the layers contract a weight's leading axes: one, or two for the output
# projection [heads, head_dim, D].
_CONTRACTED = {"wo": 2}


def packed_layers(layers, dtype=jnp.float32) -> tuple:
    """Split layers (a tuple of per-layer dicts) with every matmul weight as a ``PackedWeight`` (panels
    of ``dtype``)."""
    return tuple({n: _packed(w, _CONTRACTED.get(n, 1), dtype) if n in MATMUL_WEIGHTS else w for n, w in lp.items()}
                 for lp in layers)


def packed(w, dtype=jnp.float32) -> PackedWeight:
    """A [K, N] weight with its copy packed for the CPU matmul kernel (panels of ``dtype``: float32, or
    float16 where rounding the weight is allowed), packed once while ``w`` lives."""
    return _packed(w, 1, dtype)


def step_drafter_params(drafters, drafter_params: tuple, parallel=None) -> tuple:
    """The drafters' params as the step programs multiply by them: each drafter's ``step_params`` (its
    matmul weights packed for the CPU kernel) where the kernels are on and no mesh is given; else as
    they are. Called once per run, outside jit: the packed copies are kept while the weights live."""
    if parallel is not None or not kernel_enabled():
        return drafter_params
    return tuple(d.step_params(p) for d, p in zip(drafters, drafter_params))


def step_params(params: dict, parallel=None, decides: bool = False) -> dict:
    """The params a step program multiplies by (at any batch size): with the kernel on (see
    ``kernel_enabled``) and a float32 model with split layers on one device, every matmul weight and
    the head as a ``PackedWeight`` (each packed once and kept while its plain array lives: the packed
    copies cost the weights' memory once more), and with ``decides`` (the program verifies greedily or
    seeded, deciding tokens in the head) the head once more for those decisions (``GREEDY_HEAD``:
    float16 panels, half the head's memory);
    otherwise ``params`` itself."""
    if (parallel is not None or not isinstance(params, dict) or not layers_split(params) or not kernel_enabled()
            or params["embed"].dtype != jnp.float32):
        return params
    out = {**params, "layers": packed_layers(params["layers"])}
    for head in ("lm_head", TIED_HEAD):  # whichever the model's head_logits reads
        if head in params:
            out[head] = _packed(params[head])
    if decides and not isinstance(params["embed"], jax.core.Tracer):  # inside a caller's jit: from the logits
        out[GREEDY_HEAD] = _greedy_head(params)
    return out


def _greedy_head(params: dict) -> GreedyHead:
    """The head as greedy decisions read it (``specjax.kernels.cpu.greedy_head``), made once while the
    head lives: its float16 panels, error bounds, and rows (a tied model's embedding itself; an untied
    head's transpose, copied once)."""
    tied = "lm_head" not in params
    head, embed = (params[TIED_HEAD] if tied else params["lm_head"]), params["embed"]

    def make():  # the memo must not hold its sources: a tied model's rows are bound below, not kept
        made = pack_head(head, embed if tied else None)
        return made.packed, None if tied else made.rows, made.err

    packed16, rows, err = while_alive(_PACKED, (head, embed) if tied else (head,), make, ("greedy",))
    return GreedyHead(packed16, embed if tied else rows, err)


def step_matmuls(params: dict, batch: int, parallel=None) -> str:
    """What a step program of ``batch`` requests multiplies with for these params, as
    ``step_library`` names it ("kernel+eigen", "ynnpack", ...): "kernel+" only where ``step_params``
    packs them."""
    library = step_library(batch)
    if library.startswith("kernel+") and step_params(params, parallel) is params:
        return library.removeprefix("kernel+")
    return library


@functools.lru_cache(maxsize=None)
def _jit(fn, options: tuple | None, static_argnames: tuple, donate_argnames: tuple):
    return jax.jit(fn, static_argnames=static_argnames, donate_argnames=donate_argnames,
                   compiler_options=dict(options) if options else None)


# The verifiers whose tree pass decides each node's token in the head (``TokenOutput``).
DECIDING_VERIFIERS = ("greedy", "seeded")


def _decides(kwargs: dict) -> bool:
    """Whether a step program called with these keyword arguments verifies greedily or seeded (its ``spec``)."""
    return getattr(kwargs.get("spec"), "verifier", None) in DECIDING_VERIFIERS


class StepProgram:
    """A jitted step function called with ``step_params(params, parallel, decides)`` in place of its
    first argument (the LLM's params; ``decides`` when its ``spec`` verifies greedily or seeded);
    ``lower`` (AOT) does the same."""

    def __init__(self, jitted):
        self.jitted = jitted

    def __call__(self, params, *args, **kwargs):
        # ~0.4 ms per call for SmolLM2 (the weights are packed once; this rebuilds the dict): a loop
        # calls ``bind``'s partial instead
        return self.jitted(step_params(params, kwargs.get("parallel"), _decides(kwargs)), *args, **kwargs)

    def bind(self, params, *args, **kwargs) -> functools.partial:
        """The jitted function with ``step_params(params, parallel, decides)`` made once, here, and the other
        arguments given bound (``lower`` works on it as on the jitted function). A generation calls
        its step once per LLM pass: rebuilding the packed params each time cost 0.4 ms of host time a
        step (SmolLM2), on 2 cores taken from the threads running the previous step."""
        return functools.partial(self.jitted, step_params(params, kwargs.get("parallel"), _decides(kwargs)), *args,
                                 **kwargs)

    def lower(self, params, *args, **kwargs):
        return self.jitted.lower(step_params(params, kwargs.get("parallel"), _decides(kwargs)), *args, **kwargs)


def step_program(fn, batch: int, static_argnames=(), donate_argnames=()) -> StepProgram:
    """``jax.jit(fn, ...)`` compiled with ``step_compiler_options(batch)`` and fed ``step_params``; one
    jitted object per (function, options, argument names), so calls share its compilation cache."""
    options = step_compiler_options(batch)
    return StepProgram(_jit(fn, tuple(sorted(options.items())) if options else None, tuple(static_argnames),
                            tuple(donate_argnames)))
