"""A float32 matmul for XLA:CPU over weights packed once at load: the weight matmuls of the decode and
tree passes (2 to ``specjax.models.weights.KERNEL_MAX_ROWS`` rows) on a CPU.

Why: XLA:CPU's matmul libraries repack the weight on every call and switch their threading at 8 rows,
so on 2 Intel Xeon cores a tree pass of 17 nodes cost 2.5x a one-node pass, where streaming each
weight once should cost about the same. ``matmul.cc`` reads weights packed as panels ``[P, K, CW]``
(``CW`` columns each, zero-padded; one contiguous stream per panel, prefetched ahead) and keeps an
MR x CW tile of the output in registers; units of (panel, 64 rows) are shared with XLA's intra-op
thread pool through the XLA FFI. Measured side by side in one process (30 distinct 576 x 3072
weights, the fused gate/up projection of SmolLM2; ms): 1 / 3 / 17 rows Eigen 6.6 / 9.2 / 19.9,
YNNPACK 6.7 / 10.7 / 20.5, this kernel 8.1 / 7.9 / 12.5; it ties YNNPACK at 512 rows. One row stays
with XLA (its vector product is faster), so the step programs keep both copies of each weight
(``specjax.models.weights.PackedWeight``).

x86-64 with AVX-512F only (built for AVX2 the register tile spills and it ran 3x slower than XLA's
libraries). Built on first use with the system C++ compiler (``$CXX`` or ``c++``, ``-O3 -march=native``) into the
cache directory (``$SPECJAX_CACHE_DIR``, default ``~/.cache/specjax``), keyed by the source, the
compiler, the CPU's flags and jax/jaxlib; ``status()`` says why it is unavailable (no AVX-512F, no
compiler, a failed build). ``specjax.decoding.programs`` decides where it is used (``SPECJAX_CPU_DOTS``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from specjax.config import cache_root

TARGET = "specjax_cpu_matmul"
SOURCE = Path(__file__).with_name("matmul.cc")
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-pthread", "-w")


NO_AVX512 = "this CPU has no AVX-512F"


class KernelUnavailable(RuntimeError):
    """The CPU matmul kernel cannot be built or loaded here (the message says why)."""


def cache_dir() -> Path:
    return Path(cache_root()) / "kernels"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compiler() -> list[str]:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not cxx:
        raise KernelUnavailable("no C++ compiler found ($CXX, c++, g++ or clang++): the CPU matmul kernel is built "
                                "from source on first use; install one or set SPECJAX_CPU_DOTS=eigen")
    return shlex.split(cxx)  # $CXX may carry arguments ("ccache g++")


def _build() -> Path:
    if platform.machine().lower() not in ("x86_64", "amd64") or "avx512f" not in _cpu_flags().split():
        raise KernelUnavailable(f"{NO_AVX512}, which the CPU matmul kernel is tuned for (built for AVX2 it ran 3x "
                                "slower than XLA's matmuls); XLA's matmul libraries run instead")
    cxx = _compiler()
    try:
        version = subprocess.run([*cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"the C++ compiler {' '.join(cxx)!r} does not run: {e}") from e
    include = jax.ffi.include_dir()
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(cxx), version, " ".join(FLAGS), _cpu_flags(),
                                    jax.__version__, jaxlib.__version__, include]).encode()).hexdigest()[:20]
    out = cache_dir() / f"cpu_matmul-{key}.so"
    if out.exists():
        return out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        # Built under a temporary name and renamed: concurrent processes never load a half-written file.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
    except OSError as e:
        raise KernelUnavailable(f"cannot write the CPU matmul kernel under {out.parent} "
                                f"($SPECJAX_CACHE_DIR): {e}") from e
    cmd = [*cxx, *FLAGS, "-I", include, str(SOURCE), "-o", tmp]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise KernelUnavailable(f"building the CPU matmul kernel failed ({' '.join(cmd)}):\n"
                                    f"{done.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"building the CPU matmul kernel failed ({' '.join(cmd)}): {e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.lru_cache(maxsize=None)
def _load() -> tuple[int | None, str | None]:
    """(panel width, None) once built and registered with XLA, or (None, why not)."""
    try:
        lib = ctypes.cdll.LoadLibrary(str(_build()))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.SpecjaxCpuMatmul), platform="cpu")
        return int(lib.specjax_cpu_matmul_panel_width()), None
    except (KernelUnavailable, OSError, RuntimeError) as e:
        return None, str(e)


def unsupported_cpu(why: str | None) -> bool:
    """Whether ``status()``'s reason is a CPU the kernel is not made for (not a failure)."""
    return bool(why) and why.startswith(NO_AVX512)


def status() -> str | None:
    """None when the kernel is built and registered, else why it is not."""
    return _load()[1]


def panel_width() -> int:
    """Columns per packed panel (64); builds the kernel if needed."""
    width, why = _load()
    if width is None:
        raise KernelUnavailable(why)
    return width


def pack(w: jax.Array, contracted: int = 1) -> jax.Array:
    """A weight whose leading ``contracted`` axes are multiplied ([K..., N...]) -> panels [P, K, CW]
    (K, N the products of those axes; columns past N zero)."""
    width = panel_width()
    k = int(np.prod(w.shape[:contracted]))
    n = int(np.prod(w.shape[contracted:]))
    panels = -(-n // width)
    return _pack(w.reshape(k, n), panels, width)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _pack(w2d: jax.Array, panels: int, width: int) -> jax.Array:
    k, n = w2d.shape
    padded = jnp.pad(w2d, ((0, 0), (0, panels * width - n)))
    return padded.reshape(k, panels, width).transpose(1, 0, 2)


def matmul(x: jax.Array, packed: jax.Array, n: int) -> jax.Array:
    """x [M, K] float32 @ the weight ``pack`` made ([K, n]) -> [M, n] float32, on XLA:CPU."""
    if x.dtype != jnp.float32 or packed.dtype != jnp.float32:
        raise TypeError(f"the CPU matmul kernel is float32 only, got {x.dtype} x {packed.dtype}")
    width = panel_width()  # also registers the target before XLA lowers the call
    if (x.ndim != 2 or packed.ndim != 3 or packed.shape[1] != x.shape[1] or packed.shape[2] != width
            or packed.shape[0] != -(-n // width)):
        raise ValueError(f"x {x.shape} does not match packed weight {packed.shape} for {n} columns "
                         f"(panels of {width})")
    return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))(x, packed)
