"""Benchmark (a probe, not part of the library): Intel AMX against specjax's AVX-512 float32 matmul
kernel on the weight matmuls of a tree pass, at float32 accuracy and at bfloat16 accuracy.

Issue 17's question: on a CPU a tree pass over more than ~4 nodes is bound by the float32 arithmetic
(the budget therefore mostly verifies small trees), so would AMX's bfloat16 tiles make large trees cheap?
This builds ``scripts/amx_matmul_probe.cc`` with ``specjax/kernels/cpu/matmul.cc`` and prints, for 1-64
rows (tree nodes) and one thread: the float32 kernel's time and three AMX variants' (the exact split:
weights as 2 bfloat16 parts, activations as 3; weights rounded to bfloat16; both rounded), each
variant's worst error against a float64 reference, and first how many of the LLM's own layer weights
(as specjax loads them) the exact split represents exactly (at most 16 significant bits).

    python scripts/bench_amx_matmul.py [--layers 30] [--repetitions 7]

Needs an x86-64 CPU with AMX (amx_tile, amx_bf16) and AVX512-BF16, a Linux that grants AMX state
(arch_prctl), and a C++ compiler. Run it on an idle machine: it times one thread.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
import _bench_common as common  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
NEEDED_FLAGS = ("amx_tile", "amx_bf16", "avx512_bf16", "avx512f")


def sixteen_bit_share(model_name: str) -> tuple[int, int]:
    """(weights of at most 16 significant bits, all weights) over every layer matmul weight of the model."""
    import numpy as np

    import specjax
    from specjax.models.weights import MATMUL_WEIGHTS

    model = specjax.load_model(model_name, progress=False)
    exact = total = 0
    layers = model.params["layers"]
    for layer in (layers if isinstance(layers, (list, tuple)) else [layers]):
        for name, w in layer.items():
            if name not in MATMUL_WEIGHTS:
                continue
            bits = np.asarray(w, dtype=np.float32).view(np.uint32)
            exact += int(np.count_nonzero((bits & 0xFF) == 0))  # the low 8 of 24 significand bits clear
            total += bits.size
    return exact, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=30, help="layers of SmolLM2-135M's 7 weight shapes (default: 30)")
    ap.add_argument("--repetitions", type=int, default=7, help="timed repetitions per row count; the best is shown")
    ap.add_argument("--model", default="smollm2-135m-instruct",
                    help="whose layer weights to count (default: %(default)s)")
    args = ap.parse_args()
    if args.layers < 1 or args.repetitions < 1:
        sys.exit(f"--layers and --repetitions must be positive, got {args.layers} and {args.repetitions}")
    from specjax.kernels.cpu import build  # the kernels' own compiler lookup and CPU flags, as the tests use

    missing = [f for f in NEEDED_FLAGS if f not in build._cpu_flags().split()]
    if missing:
        sys.exit(f"this CPU lacks {', '.join(missing)} (/proc/cpuinfo flags): the probe needs AMX and AVX512-BF16")
    try:
        cxx = build._compiler()
    except build.KernelUnavailable as e:
        sys.exit(str(e))
    kernels = str(build.HERE)
    common.print_header("AMX vs the AVX-512 float32 matmul kernel (tree-pass weight matmuls, 1 thread)")
    exact, total = sixteen_bit_share(args.model)
    print(f"# {args.model}: {exact} of {total} layer matmul weights ({exact / total:.4%}) have at most 16 significant "
          "bits, i.e. are two bfloat16 parts exactly")
    with tempfile.TemporaryDirectory() as tmp:
        binary = os.path.join(tmp, "amx_probe")
        command = [*cxx, "-O3", "-march=native", "-std=c++17", "-mamx-tile", "-mamx-bf16", "-mavx512bf16",
                   "-DSPECJAX_NO_FFI", "-pthread", "-I", kernels, os.path.join(kernels, "matmul.cc"),
                   os.path.join(HERE, "amx_matmul_probe.cc"), "-o", binary]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"building the probe failed ({shlex.join(command)}):\n{done.stderr}")
        run = subprocess.run([binary, str(args.layers), str(args.repetitions)], capture_output=True, text=True)
        print(run.stdout, end="")
        if run.returncode:
            sys.exit(f"the probe failed (exit {run.returncode}): {run.stderr}")


if __name__ == "__main__":
    main()
