"""The embedded default model: loads torch-free, and greedy generation equals transformers'."""

from __future__ import annotations

import os
import site
import subprocess
import sys

import numpy as np
import pytest

import specjax
from tests.conftest import dev_prompts, requires_smollm2

pytestmark = [requires_smollm2, pytest.mark.slow]

# Every 7th dev prompt: covers all categories of the set (generic, knowledge, roleplay, common-sense,
# fermi, counterfactual, coding, math, writing) inside the CI budget. scripts/check_smollm2_vs_hf.py
# runs all 78.
PROMPT_STRIDE = 7


def test_loads_and_generates_without_torch_installed(tmp_path):
    """A site-packages view without torch: find_spec('torch') is None, as on a torch-free machine."""
    view = tmp_path / "site"
    view.mkdir()
    for sd in site.getsitepackages():
        if not os.path.isdir(sd):
            continue
        for name in os.listdir(sd):
            if name.split("-")[0].split(".")[0] in ("torch", "torchgen", "functorch"):
                continue
            if not (view / name).exists():
                os.symlink(os.path.join(sd, name), view / name)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = (f"import site, sys; site.addsitedir({str(view)!r}); sys.path.insert(0, {repo!r})\n"
            "import importlib.util; assert importlib.util.find_spec('torch') is None\n"
            "import specjax\n"
            "m = specjax.load_model('smollm2-135m-instruct', progress=False)\n"
            "r = specjax.generate(m, ['Name a colour.'], max_new_tokens=8)\n"
            "assert 'torch' not in sys.modules\n"
            "print('TOKENS', r.token_ids[0])\n")
    env = {**os.environ, "SPECJAX_CACHE_DIR": str(tmp_path / "cache")}  # also exercise a cold tokenizer
    r = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "TOKENS [" in r.stdout


@pytest.fixture(scope="module")
def hf_smollm2():
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from specjax.registry import resolve

    path = resolve("smollm2-135m-instruct")
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32)
    return model.eval()


def test_greedy_64_tokens_equal_transformers_on_dev_prompts(smollm2, hf_smollm2):
    import torch

    prompts = dev_prompts()[::PROMPT_STRIDE]
    ours = specjax.generate(smollm2, prompts, max_new_tokens=64)  # one mixed-length batch
    for prompt, ids, got in zip(prompts, ours.prompt_token_ids, ours.token_ids):
        with torch.no_grad():
            out = hf_smollm2.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False)
        want = out[0, len(ids):].tolist()
        assert got == want, f"prompt {prompt!r}: specjax and transformers diverge"


def test_batched_equals_single_on_smollm2(smollm2):
    prompts = dev_prompts()[1::PROMPT_STRIDE * 2][:4]
    batched = specjax.generate(smollm2, prompts, max_new_tokens=32).token_ids
    for p, b in zip(prompts, batched):
        assert specjax.generate(smollm2, [p], max_new_tokens=32).token_ids[0] == b


def test_logits_match_transformers(smollm2, hf_smollm2):
    import torch

    ids = smollm2.tokenizer("The quick brown fox jumps over the lazy dog. " * 12)["input_ids"]
    ours = specjax.logits(smollm2, [ids])[0]
    with torch.no_grad():
        want = hf_smollm2(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(ours, want, rtol=0, atol=1e-3)
