"""XLA:CPU's matmul library per program (``specjax.decoding.programs``): the rule, its one setting
(``SPECJAX_CPU_DOTS``), and that the compiled programs really carry it: the prefill keeps XLA's
default (YNNPACK) and no kernel, the stepping programs of a small batch run their dots in Eigen and
their matmuls of 2+ rows in specjax's kernel (``specjax.kernels.cpu.matmul``) and their attention in
specjax's attention kernel (``specjax.kernels.cpu.attention``), in the one-jit path and the streaming
loop alike, with the same tokens under every setting."""

from __future__ import annotations

import numpy as np
import pytest

import specjax
import specjax.decoding.host_step as host_step
from specjax.decoding.programs import (
    EIGEN_MAX_BATCH,
    ENV,
    step_compiler_options,
    step_library,
    step_program,
)
from specjax.errors import InputError
from specjax.kernels import cpu as cpu_kernels
from specjax.kernels.cpu import attention as cpu_attention
from specjax.kernels.cpu import matmul as cpu_matmul
from specjax.models.weights import KERNEL_MAX_ROWS
from specjax.speculation.cost import table_key
from specjax.speculation.drafters.lookup import LookupDrafter
from tests.conftest import random_ids

YNN = "__ynn_fusion"  # how XLA:CPU names a dot handed to YNNPACK in the compiled HLO
KERNEL = cpu_matmul.TARGET  # the custom call of specjax's matmul kernel
ATTENTION = cpu_attention.TARGET  # ... and of its attention kernel
# Where the kernel cannot be built here, auto runs XLA's libraries alone (tested in test_cpu_matmul).
K = "kernel+" if cpu_kernels.matmul_status() is None else ""
ATTENTION_BUILT = cpu_kernels.attention_status() is None  # the step attention kernel: AVX-512F or AVX2


def test_the_rule_and_its_setting(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert [step_library(b, "cpu") for b in (1, EIGEN_MAX_BATCH, EIGEN_MAX_BATCH + 1, 16)] == \
        [K + "eigen", K + "eigen", K + "ynnpack", K + "ynnpack"]
    assert step_compiler_options(1, "cpu") == {"xla_cpu_experimental_ynn_fusion_type": ""}
    assert step_compiler_options(16, "cpu") is None
    assert step_library(1, "gpu") == "default" and step_compiler_options(1, "gpu") is None
    for value, expected in (("eigen", "eigen"), ("YNNPACK", "ynnpack"), (" auto ", K + "eigen"), ("", K + "eigen")):
        monkeypatch.setenv(ENV, value)
        assert step_library(1, "cpu") == expected, value
    monkeypatch.setenv(ENV, "eigen")
    assert step_library(16, "cpu") == "eigen" and step_library(16, "gpu") == "default"
    monkeypatch.setenv(ENV, "mkl")
    with pytest.raises(InputError, match=rf"{ENV}='mkl': expected one of auto, kernel, eigen, ynnpack"):
        step_library(1, "cpu")


def _double(x, scale):
    return x * scale


def test_one_jitted_object_per_function_and_options(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    a = step_program(_double, 1, ("scale",))
    assert step_program(_double, 2, ("scale",)).jitted is a.jitted  # same options: the same jit (compile cache)
    assert step_program(_double, 8, ("scale",)).jitted is not a.jitted
    assert float(a(np.float32(1.5), scale=2.0)) == 3.0


def test_cost_tables_are_kept_per_library(tiny_llama_dir, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    cfg = specjax.load_model(tiny_llama_dir, progress=False).config
    assert f"|dots={K}eigen|" in table_key(cfg, np.float32, 1, "xla")
    assert f"|dots={K}ynnpack|" in table_key(cfg, np.float32, 8, "xla")
    monkeypatch.setenv(ENV, "eigen")
    assert "|dots=eigen|" in table_key(cfg, np.float32, 8, "xla")


@pytest.fixture()
def compiled_texts(monkeypatch):
    """The HLO of every program specjax.generate compiles, in order (prefill first)."""
    texts = []
    lower = host_step.lower_partial

    def spy(fn, *args, **kwargs):
        lowered = lower(fn, *args, **kwargs)

        class Recorded:
            def compile(self):
                compiled = lowered.compile()
                texts.append(compiled.as_text())
                return compiled
        return Recorded()

    monkeypatch.setattr(host_step, "lower_partial", spy)
    return texts


@pytest.mark.parametrize("stream", [False, True], ids=["one-jit", "streaming"])
def test_prefill_keeps_ynnpack_and_small_batch_steps_run_in_eigen(tiny_llama_dir, compiled_texts, monkeypatch,
                                                                   stream):
    model = specjax.load_model(tiny_llama_dir, progress=False)
    kw = dict(max_new_tokens=10, chat_template=False, ignore_eos=True,
              on_tokens=(lambda i, ids: None) if stream else None)
    tokens = {}
    for setting in ("auto", "ynnpack", "eigen"):
        monkeypatch.setenv(ENV, setting)
        for batch in (1, 8):
            prompts = [random_ids(np.random.RandomState(batch), model.config.vocab_size, 6) for _ in range(batch)]
            for mode in ("incremental", "lookup"):
                extra = (dict(drafters=[specjax.Bound(LookupDrafter())]) if mode == "lookup"
                         else dict(mode="incremental"))
                compiled_texts.clear()
                out = specjax.generate(model, prompts, **kw, **extra)
                prefill, steps = compiled_texts
                assert YNN in prefill and KERNEL not in prefill, (setting, batch, mode)
                eigen = setting == "eigen" or (setting == "auto" and batch <= EIGEN_MAX_BATCH)
                # the kernel takes 2..KERNEL_MAX_ROWS rows: one row (batch-1 incremental decoding) and
                # 8 x 17 tree nodes stay with XLA
                rows = batch * (1 + (LookupDrafter().num_nodes if mode == "lookup" else 0))
                kernel = setting == "auto" and bool(K) and 2 <= rows <= KERNEL_MAX_ROWS
                assert (KERNEL in steps) == kernel, (setting, batch, mode)
                # the attention of every step runs in the CPU attention kernel wherever the kernels are on
                assert (ATTENTION in steps) == (setting == "auto" and ATTENTION_BUILT), (setting, batch, mode)
                if not kernel:  # XLA's library multiplies what the kernels do not (with the kernel: nothing)
                    assert (YNN not in steps) == eigen, (setting, batch, mode)
                tokens.setdefault((batch, mode), out.token_ids)
                assert out.token_ids == tokens[(batch, mode)], (setting, batch, mode)
    for batch in (1, 8):
        assert tokens[(batch, "lookup")] == tokens[(batch, "incremental")]
