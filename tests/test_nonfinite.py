"""Nothing silently wrong: non-finite logits (NaN weights, overflow) fail the request in every mode.

A request stops at the first LLM pass whose logits it needs are non-finite: the tokens decided
before that pass stand (exactly the ones incremental decoding emits), nothing is read off a NaN
row, the API raises ``GenerationError`` naming the request, and its batch mates are unaffected.
"""

from __future__ import annotations

import numpy as np
import pytest

import specjax
from specjax.errors import GenerationError
from specjax.speculation.drafters.ssm import derive_ssm

MODES = [
    ("incremental", dict(mode="incremental")),
    ("default", {}),  # the default drafting (the lookup drafter under the tree budget for this LLM)
    ("tree greedy", dict(ssms="derived", expansion=(1, 2, 1))),
    ("incremental sampled", dict(mode="incremental", sampling=specjax.SamplingParams(temperature=0.9, seed=3))),
    ("tree seeded", dict(ssms="derived", expansion=(2, 1, 1), sampling=specjax.SamplingParams(temperature=0.9, seed=3),
                         verifier="seeded")),
    ("tree mss", dict(ssms="derived", expansion=(2, 1), sampling=specjax.SamplingParams(temperature=0.9, seed=3),
                      verifier="mss")),
    ("tree naive", dict(ssms="derived", expansion=(2, 1), sampling=specjax.SamplingParams(temperature=0.9, seed=3),
                        verifier="naive")),
]


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return specjax.load_model(tiny_llama_dir, progress=False)


def _kw(model, kw, stream=False):
    kw = dict(kw)
    if kw.get("ssms") == "derived":
        kw["ssms"] = [derive_ssm(model, 1)]
    if stream:
        kw["on_tokens"] = lambda i, ids: None
    return kw


def _with_nan_row(model, token: int):
    params = dict(model.params)
    params["embed"] = params["embed"].at[token].set(np.nan)
    return model._replace(params=params)


@pytest.mark.parametrize("name,kw", MODES, ids=[m[0] for m in MODES])
def test_nan_weights_never_yield_tokens(model, name, kw):
    broken = model._replace(params={**model.params, "final_norm": model.params["final_norm"] * np.nan})
    for stream in (False, True):
        with pytest.raises(GenerationError, match=r"requests \[0, 1\]: the LLM produced non-finite logits") as e:
            specjax.generate(broken, [[1, 2, 3], [4, 5]], max_new_tokens=6, **_kw(broken, kw, stream))
        assert e.value.failed == [0, 1]
        assert e.value.result.token_ids == [[], []]  # not one token invented


@pytest.mark.parametrize("name,kw", MODES, ids=[m[0] for m in MODES])
def test_failure_mid_generation_keeps_exactly_the_tokens_decided_before(model, name, kw):
    """Token t_k of the healthy output gets a NaN embedding: feeding it poisons the next logits. The
    broken model emits t_0..t_k (each decided from finite logits), then fails; a batch mate whose
    text never contains t_k is untouched."""
    prompt, mate = [1, 2, 3], [9, 10, 11, 12]
    healthy = specjax.generate(model, [prompt, mate], max_new_tokens=12, ignore_eos=True, **_kw(model, kw))
    out = healthy.token_ids[0]
    k = next(i for i in range(2, len(out)) if out[i] not in out[:i] + prompt and out[i] not in
             healthy.token_ids[1] + mate)
    broken = _with_nan_row(model, out[k])
    for stream in (False, True):
        with pytest.raises(GenerationError, match=r"requests \[0\]") as e:
            specjax.generate(broken, [prompt, mate], max_new_tokens=12, ignore_eos=True, **_kw(broken, kw, stream))
        assert e.value.result.token_ids[0] == out[:k + 1]
        assert e.value.result.token_ids[1] == healthy.token_ids[1]
        assert e.value.result.stats["requests"][0]["failed"] and not e.value.result.stats["requests"][1]["failed"]


def test_cli_exits_nonzero_and_prints_no_tokens_for_nan_weights(model, tmp_path):
    import subprocess
    import sys

    from specjax.io.checkpoint import save_checkpoint

    path = tmp_path / "nan-ckpt"
    save_checkpoint(str(path), model.config, {**model.params, "final_norm": model.params["final_norm"] * np.nan})
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": [1, 2, 3]}\n')
    for mode in ("incremental", "tree"):
        r = subprocess.run([sys.executable, "-m", "specjax", "generate", "--model", str(path), "--prompts-file",
                            str(prompts), "--mode", mode, "--json"], capture_output=True, text=True, timeout=300)
        assert r.returncode == 2, r.stderr
        assert r.stdout == "" and "non-finite logits" in r.stderr and "Traceback" not in r.stderr
