"""Building and loading specjax's CPU kernels (``matmul.cc``, ``greedy_head.cc``, ``attention.cc``,
``prefill_attention.cc``): one shared library,
compiled on first use with the system C++ compiler (``$CXX`` or ``c++``, ``-O3 -march=native``) into
the cache directory (``$SPECJAX_CACHE_DIR``, default ``~/.cache/specjax``), keyed by the sources, the
compiler, the CPU's flags and jax/jaxlib, and registered with XLA as FFI targets.

x86-64 only. With AVX-512F, all of them (their tiles live in AVX-512's 32 vector registers). With
AVX2, FMA and F16C but no AVX-512F (e.g. AMD EPYC guests whose hypervisor hides it), the matmul in its
own AVX2 tile shape (``matmul.cc``: XLA:CPU multiplies 2-17 rows at 2-3x the cost of one there, the
kernel at about one row's) and the attention of decode steps, tree passes and drafting passes
(``attention.cc`` over ``vec16.h``'s two-halves vectors), in one library, so a failure to build
either loses both; the prefill attention stays AVX-512F only.
``status()`` says why the kernels are not all available (no AVX-512F, no compiler, a failed build),
``matmul_status()`` (also named ``attention_status()``) why the matmul and the step attention, which
build together, are not; ``specjax.decoding.programs`` decides where they are used
(``SPECJAX_CPU_DOTS``).
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
import time
from pathlib import Path

import jax
import jaxlib

from specjax.config import cache_root

HERE = Path(__file__).parent
SOURCES = ("matmul.cc", "greedy_head.cc", "attention.cc", "prefill_attention.cc")  # one library (AVX-512F)
AVX2_SOURCES = ("matmul.cc", "greedy_head.cc", "attention.cc")  # where the CPU has AVX2, FMA and F16C but no AVX-512F
HEADERS = ("matmul.h", "parallel.h", "simd.h", "vec16.h")
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-pthread", "-w")
# FFI target name -> the handler symbol the library exports
MATMUL_TARGETS = {"specjax_cpu_matmul": "SpecjaxCpuMatmul", "specjax_cpu_matmul_f16": "SpecjaxCpuMatmulF16",
                  "specjax_cpu_greedy_head": "SpecjaxCpuGreedyHead"}
AVX2_TARGETS = {**MATMUL_TARGETS, "specjax_cpu_attention": "SpecjaxCpuAttention"}
TARGETS = {**AVX2_TARGETS, "specjax_cpu_prefill_attention": "SpecjaxCpuPrefillAttention"}
AVX2 = ("avx2", "fma", "f16c")
BUILD_SECONDS = 600  # the most building the kernels may take (compiling and linking)

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


def _isa() -> str:
    """"avx512" (every kernel), "avx2" (the matmul and the step attention); raises where neither builds."""
    flags = _cpu_flags().split()
    if platform.machine().lower() in ("x86_64", "amd64"):
        if "avx512f" in flags:
            return "avx512"
        if all(f in flags for f in AVX2):
            return "avx2"
    raise KernelUnavailable(f"{NO_AVX512} (nor AVX2 with FMA and F16C), which the CPU kernels are made for; XLA's "
                            "matmul libraries run instead")


def _build(isa: str) -> Path:
    sources = SOURCES if isa == "avx512" else AVX2_SOURCES
    cxx = _compiler()
    try:
        version = subprocess.run([*cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"the C++ compiler {' '.join(cxx)!r} does not run: {e}") from e
    include = jax.ffi.include_dir()
    texts = [(HERE / name).read_text() for name in sources + HEADERS]
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
    try:
        with tempfile.TemporaryDirectory(dir=out.parent, ignore_cleanup_errors=True) as objects:
            _compile_and_link(cxx, sources, include, objects, tmp)
        os.replace(tmp, out)
    except OSError as e:
        raise KernelUnavailable(f"building the CPU kernels under {out.parent} failed: {e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _compile_and_link(cxx: list[str], sources, include: str, objects: str, target: str) -> None:
    """Every source compiled to an object file at once, one compiler process each, then linked into
    ``target``: one process compiling them one after another took 15.4 s on 2 AMD EPYC cores (the two
    attention sources ~5.3 s each at -O3), on the first run of every fresh machine or cache directory."""
    compile_flags = [f for f in FLAGS if f != "-shared"]
    cmds = [[*cxx, *compile_flags, "-I", include, "-I", str(HERE), "-c", str(HERE / name),
             "-o", os.path.join(objects, f"{Path(name).stem}.o")] for name in sources]
    link = [*cxx, *FLAGS, *(cmd[-1] for cmd in cmds), "-o", target]
    running = []
    deadline = time.monotonic() + BUILD_SECONDS  # for the whole build, not each compiler
    try:
        for cmd in cmds:
            running.append((cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
        for cmd, proc in running:
            _, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if proc.returncode != 0:
                raise KernelUnavailable(f"building the CPU kernels failed ({' '.join(cmd)}):\n{stderr.strip()[-2000:]}")
        done = subprocess.run(link, capture_output=True, text=True, timeout=max(1.0, deadline - time.monotonic()))
        if done.returncode != 0:
            raise KernelUnavailable(f"linking the CPU kernels failed ({' '.join(link)}):\n"
                                    f"{done.stderr.strip()[-2000:]}")
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"building the CPU kernels with {' '.join(cxx)!r} failed: {e}") from e
    finally:
        for _, proc in running:  # a failure leaves no compiler running behind its error
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@functools.lru_cache(maxsize=None)
def _load() -> tuple[ctypes.CDLL | None, str | None, str | None]:
    """(the library, the ISA it was built for, None) once built and its targets registered with XLA,
    or (None, None, why not)."""
    try:
        isa = _isa()
        lib = ctypes.cdll.LoadLibrary(str(_build(isa)))
        for target, symbol in (TARGETS if isa == "avx512" else AVX2_TARGETS).items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
        return lib, isa, None
    except (KernelUnavailable, OSError, RuntimeError, AttributeError) as e:
        return None, None, str(e)


def library() -> ctypes.CDLL:
    """The loaded library (building it if needed); raises ``KernelUnavailable`` saying why not."""
    lib, _, why = _load()
    if lib is None:
        raise KernelUnavailable(why)
    return lib


def unsupported_cpu(why: str | None) -> bool:
    """Whether ``status()``'s reason is a CPU the kernels are not made for (not a failure)."""
    return bool(why) and why.startswith(NO_AVX512)


def status() -> str | None:
    """None when every kernel (matmul, step attention, prefill attention) is built and registered,
    else why not."""
    lib, isa, why = _load()
    if lib is None or isa == "avx512":
        return why
    return (f"{NO_AVX512}, which the prefill attention kernel needs (the matmul and step attention kernels "
            "run, built for AVX2); XLA's attention runs in prefill instead")


def matmul_status() -> str | None:
    """None when the matmul kernel is built and registered (AVX-512F or AVX2), else why not."""
    return _load()[2]


# The step attention kernel (decode steps, tree and drafting passes) is built with the matmul on both
# ISAs: one is available exactly when the other is.
attention_status = matmul_status
