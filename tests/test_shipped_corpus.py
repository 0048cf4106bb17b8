"""The shipped corpus (models/smollm2-answers: SmolLM2's own answers, token ids) and the default drafter
built on it: documents round-trip through their file and bad files are refused by name; ``corpus:auto``
and ``corpus:NAME`` find it, refuse another LLM's vocabulary and a name that is also a path; the default
`specjax generate` speculates with it, and its greedy output is exactly incremental decoding."""

from __future__ import annotations

import numpy as np
import pytest

import specjax
from specjax.errors import InputError
from specjax.io import registry
from specjax.speculation.drafters.corpus import from_arg, load_documents, save_documents
from tests.conftest import dev_prompts


def test_documents_round_trip_and_bad_files_are_refused(tmp_path):
    docs = [[1, 2, 3], [], [70000, 5]]  # an id past uint16: stored as int32
    path = str(tmp_path / "d.npz")
    save_documents(path, docs)
    assert [d.tolist() for d in load_documents(path)] == docs
    save_documents(path, [[1, 2], [3]])
    with np.load(path) as z:
        assert z["tokens"].dtype == np.uint16
    np.savez(str(tmp_path / "nokey.npz"), tokens=np.arange(3))
    with pytest.raises(InputError, match="nokey.npz: missing \\['offsets'\\]"):
        load_documents(str(tmp_path / "nokey.npz"))
    np.savez(str(tmp_path / "off.npz"), tokens=np.arange(3), offsets=np.array([0, 2, 1, 3]))
    with pytest.raises(InputError, match="off.npz: offsets \\(4,\\) must rise from 0 to the 3 tokens"):
        load_documents(str(tmp_path / "off.npz"))
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(InputError, match="junk.npz: not a readable .npz"):
        load_documents(str(tmp_path / "junk.npz"))
    with pytest.raises(InputError, match="negative token id -1"):
        save_documents(path, [[1, -1]])


def test_corpus_auto_is_refused_for_another_llm_and_a_name_that_is_also_a_path(tiny_llama_dir, tmp_path,
                                                                                 monkeypatch):
    llama = specjax.load_model(tiny_llama_dir, progress=False)
    with pytest.raises(InputError, match="no shipped corpus was written by this LLM"):
        from_arg("auto", llama, load=False, expansion=None, draft="topk")
    with pytest.raises(InputError, match="corpus 'smollm2-answers' holds token ids of smollm2-135m-instruct"):
        from_arg("smollm2-answers", llama, load=False, expansion=None, draft="topk")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2-answers").mkdir()
    with pytest.raises(InputError, match="names both the shipped corpus 'smollm2-answers' and the path"):
        from_arg("smollm2-answers", llama, load=False, expansion=None, draft="topk")


def test_the_shipped_corpus_holds_smollm2_token_ids(smollm2):
    docs = load_documents(registry.resolve_corpus("smollm2-answers"))
    assert len(docs) > 10_000 and sum(d.size for d in docs) > 1_000_000
    assert all(d.size == 0 or (d.min() >= 0 and d.max() < smollm2.config.vocab_size) for d in docs)
    assert registry.default_drafters(smollm2.config) == ("corpus:auto",)
    assert registry.default_corpus(smollm2.config) == "smollm2-answers"


def test_default_drafter_greedy_equals_incremental_on_smollm2(smollm2):
    """The default (corpus:auto under the tree budget), batched, on dev prompts: exactly incremental
    decoding's tokens, with speculation accepted somewhere."""
    bound = from_arg("auto", smollm2, load=True, expansion=None, draft="topk")
    prompts = dev_prompts()[:3]
    want = specjax.generate(smollm2, prompts, max_new_tokens=40).token_ids
    got = specjax.generate(smollm2, prompts, max_new_tokens=40, drafters=[bound], budget="auto")
    assert got.token_ids == want
    assert got.stats["llm_passes"] < 40, "no drafted token was ever accepted"


def test_default_generate_command_speculates_with_the_shipped_corpus(smollm2, capsys):
    """`specjax generate` with no --drafter: the stats line names corpus:auto, the text is incremental's."""
    from specjax.cli import main

    prompt = dev_prompts()[1]
    assert main(["generate", "--prompt", prompt, "--max-new-tokens", "24"]) == 0
    out, err = capsys.readouterr()
    assert "tree, corpus:auto: lookup+corpus(" in err
    assert out.strip() == specjax.generate(smollm2, [prompt], max_new_tokens=24).texts[0].strip()
