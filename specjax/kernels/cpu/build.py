"""Building and loading specjax's CPU kernels (``matmul.cc``, ``attention.cc``,
``prefill_attention.cc``): one shared library,
compiled on first use with the system C++ compiler (``$CXX`` or ``c++``, ``-O3 -march=native``) into
the cache directory (``$SPECJAX_CACHE_DIR``, default ``~/.cache/specjax``), keyed by the sources, the
compiler, the CPU's flags and jax/jaxlib, and registered with XLA as FFI targets.

x86-64 with AVX-512F only: the kernels keep their tiles in AVX-512's 32 vector registers (built for
AVX2 the matmul's tile spilled and it ran 3x slower than XLA's libraries). ``status()`` says why they
are unavailable (no AVX-512F, no compiler, a failed build); ``specjax.decoding.programs`` decides
where they are used (``SPECJAX_CPU_DOTS``).
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
import jaxlib

from specjax.config import cache_root

HERE = Path(__file__).parent
SOURCES = ("matmul.cc", "attention.cc", "prefill_attention.cc")  # compiled into one library
HEADERS = ("parallel.h", "simd.h")
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-pthread", "-w")
# FFI target name -> the handler symbol the library exports
TARGETS = {"specjax_cpu_matmul": "SpecjaxCpuMatmul", "specjax_cpu_matmul_f16": "SpecjaxCpuMatmulF16",
           "specjax_cpu_attention": "SpecjaxCpuAttention",
           "specjax_cpu_prefill_attention": "SpecjaxCpuPrefillAttention"}

NO_AVX512 = "this CPU has no AVX-512F"


class KernelUnavailable(RuntimeError):
    """The CPU kernels cannot be built or loaded here (the message says why)."""


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
        raise KernelUnavailable("no C++ compiler found ($CXX, c++, g++ or clang++): the CPU kernels are built "
                                "from source on first use; install one or set SPECJAX_CPU_DOTS=eigen")
    return shlex.split(cxx)  # $CXX may carry arguments ("ccache g++")


def _build() -> Path:
    if platform.machine().lower() not in ("x86_64", "amd64") or "avx512f" not in _cpu_flags().split():
        raise KernelUnavailable(f"{NO_AVX512}, which the CPU kernels are tuned for (built for AVX2 the matmul ran 3x "
                                "slower than XLA's matmuls); XLA's matmul libraries run instead")
    cxx = _compiler()
    try:
        version = subprocess.run([*cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"the C++ compiler {' '.join(cxx)!r} does not run: {e}") from e
    include = jax.ffi.include_dir()
    texts = [(HERE / name).read_text() for name in SOURCES + HEADERS]
    key = hashlib.sha256("\0".join([*texts, " ".join(cxx), version, " ".join(FLAGS), _cpu_flags(),
                                    jax.__version__, jaxlib.__version__, include]).encode()).hexdigest()[:20]
    out = cache_dir() / f"specjax_cpu-{key}.so"
    if out.exists():
        return out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        # Built under a temporary name and renamed: concurrent processes never load a half-written file.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
    except OSError as e:
        raise KernelUnavailable(f"cannot write the CPU kernels under {out.parent} ($SPECJAX_CACHE_DIR): {e}") from e
    cmd = [*cxx, *FLAGS, "-I", include, "-I", str(HERE), *(str(HERE / name) for name in SOURCES), "-o", tmp]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise KernelUnavailable(f"building the CPU kernels failed ({' '.join(cmd)}):\n"
                                    f"{done.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"building the CPU kernels failed ({' '.join(cmd)}): {e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.lru_cache(maxsize=None)
def _load() -> tuple[ctypes.CDLL | None, str | None]:
    """(the library, None) once built and its targets registered with XLA, or (None, why not)."""
    try:
        lib = ctypes.cdll.LoadLibrary(str(_build()))
        for target, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
        return lib, None
    except (KernelUnavailable, OSError, RuntimeError, AttributeError) as e:
        return None, str(e)


def library() -> ctypes.CDLL:
    """The loaded library (building it if needed); raises ``KernelUnavailable`` saying why not."""
    lib, why = _load()
    if lib is None:
        raise KernelUnavailable(why)
    return lib


def unsupported_cpu(why: str | None) -> bool:
    """Whether ``status()``'s reason is a CPU the kernels are not made for (not a failure)."""
    return bool(why) and why.startswith(NO_AVX512)


def status() -> str | None:
    """None when the kernels are built and registered, else why they are not."""
    return _load()[1]
