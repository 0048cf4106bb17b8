"""The corpus drafter (lookup with a user-given corpus as a second source): its on-device index search
equals a plain-Python scan of the corpus and both sources' chains are ranked as documented;
speculation with it, whole tree or budgeted, alone or merged with an SSM, is exactly incremental
decoding (greedy and seeded) and really copies what the corpus holds; it samples the exact law under
MSS, RRS and naive verification; it runs in the serving engine (tests/test_engine.py); bad corpora and
settings are refused by name."""

from __future__ import annotations

import collections
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.errors import InputError
from specjax.speculation.budget import Budget, default_levels
from specjax.speculation.drafters import corpus_index
from specjax.speculation.drafters.corpus import (
    CorpusDrafter,
    corpus_drafter,
    find_in_corpus,
    parse_arg,
    pick_chains,
    read_documents,
)
from specjax.speculation.drafters.corpus_index import SEPARATOR, build_index
from specjax.speculation.drafters.lookup import LookupDrafter
from tests.conftest import random_ids
from tests.toy import LAW_PROMPT, LAW_VOCAB, assert_drafter_samples_the_exact_law


def modal_occurrence(corpus, positions, depth):
    """Of occurrences (ascending) sharing an n-gram and its next token, the one a chain is copied from:
    at each offset 2..depth keep those whose token there is the most frequent among the kept (ties: the
    token met first; a document's end only where all kept end), until one is left or all end; the
    earliest kept."""
    alive = list(positions)
    for d in range(2, depth + 1):
        if len(alive) == 1:
            break
        toks = [corpus[p + d] if p + d < len(corpus) else SEPARATOR for p in alive]
        freq = collections.Counter(t for t in toks if t != SEPARATOR)
        if not freq:
            break
        top = max(freq.values())
        tok = next(t for t in toks if t != SEPARATOR and freq[t] == top)
        alive = [p for p, t in zip(alive, toks) if t == tok]
    return alive[0]


def reference_chains(documents, history, length, depth, branches, max_ngram, min_ngram, window, index_depth=None):
    """The corpus rule of specjax/speculation/drafters/corpus.py, one request, by scanning the corpus:
    for the longest matching n, the distinct next tokens after the request's last n tokens, most
    frequent first (then the earliest), each copied from its modal occurrence (``modal_occurrence``,
    descending ``index_depth`` tokens: the depth the index was built for)."""
    corpus = [t for d in documents for t in list(d) + [SEPARATOR]]
    for n in range(max_ngram, min_ngram - 1, -1):
        if length - n + 1 < 0:
            continue
        key = [history[length - j] for j in range(n)]
        entries = [p for p in range(n - 1, len(corpus) - 1)
                   if corpus[p + 1] != SEPARATOR and [corpus[p - j] for j in range(n)] == key]
        if not entries:
            continue
        freq = collections.Counter(corpus[p + 1] for p in entries)
        first = {}
        for p in entries:
            first.setdefault(corpus[p + 1], p)
        groups = sorted(first.values(), key=lambda p: (-freq[corpus[p + 1]], p))[:window]
        chains = []
        for g in groups[:branches]:
            p = modal_occurrence(corpus, [e for e in entries if corpus[e + 1] == corpus[g + 1]], index_depth or depth)
            chain = []
            for t in corpus[p + 1:p + 1 + depth]:
                if t == SEPARATOR:
                    break
                chain.append(t)
            chains.append((chain, n))
        return chains
    return []


class TestCorpusRule(chex.TestCase):
    """The binary search over the index equals the scan, traced and eagerly, on small vocabularies (many
    matches, ties broken by frequency then position) and with several documents (no n-gram and no
    continuation crosses a document's end)."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_matches_the_reference(self):
        rng = np.random.RandomState(0)
        for trial in range(16):
            vocab = int(rng.randint(3, 9))
            depth, branches, max_n, window = int(rng.randint(1, 6)), int(rng.randint(1, 4)), int(rng.randint(1, 5)), \
                int(rng.randint(1, 10))
            min_n = int(rng.randint(1, max_n + 1))
            docs = [rng.randint(0, vocab, rng.randint(2, 30)).tolist()]  # one copyable document, then any
            docs += [rng.randint(0, vocab, rng.randint(0, 30)).tolist() for _ in range(rng.randint(0, 3))]
            total = sum(len(d) + 1 for d in docs)
            # odd trials: a vocabulary whose n-grams do not fit one int64 (build_index sorts their columns)
            index_vocab = vocab if trial % 2 == 0 else 1 << 40
            # the index built for deeper chains than drafted (every third trial): the modal descent goes on
            index_depth = depth + trial % 3 // 2 * 2
            capacity = total + trial % 3 * 7  # padded or exact
            params = build_index(docs, max_n, index_depth, index_vocab, capacity=capacity)
            batch, size = 6, 16
            history = rng.randint(0, vocab, (batch, size)).astype(np.int32)
            length = rng.randint(0, size - 1, batch).astype(np.int32)
            find = self.variant(lambda h, n: find_in_corpus(params, h, n, depth, branches, max_n, min_n, window))
            chains, known, ngram = (np.asarray(x) for x in find(jnp.asarray(history), jnp.asarray(length)))
            chex.assert_shape(chains, (batch, branches, depth))
            for b in range(batch):
                want = reference_chains(docs, history[b].tolist(), int(length[b]), depth, branches, max_n, min_n,
                                        window, index_depth)
                got = [(chains[b, c, :known[b, c]].tolist(), int(ngram[b, c])) for c in range(branches)
                       if known[b, c] > 0]
                assert got == want, f"trial {trial}, request {b}"
                assert (known[b, len(want):] == 0).all() and (ngram[b, len(want):] == 0).all()


def test_the_most_frequent_continuation_comes_first():
    # "1 2" is followed by 3 once (first) and by 4 twice: with one branch the drafter copies "4 ..".
    docs = [[1, 2, 3, 9], [1, 2, 4, 5], [7, 1, 2, 4, 6]]
    params = build_index(docs, 2, 3, 10)
    chains, known, ngram = find_in_corpus(params, jnp.asarray([[1, 2]]), jnp.asarray([1]), 3, 2, 2, 1, 8)
    assert chains[0, 0, :known[0, 0]].tolist() == [4, 5]  # cut at its document's end
    assert chains[0, 1, :known[0, 1]].tolist() == [3, 9]
    assert ngram[0].tolist() == [2, 2]
    # The chain follows what most occurrences say next: "1 2 3" goes on "9 9" once (first) and "5 .." twice,
    # then "6" and "8" once each (the tie goes to the one met first): "3 5 6", not the first occurrence's
    # "3 9 9". Only the index's depth bounds the descent.
    docs = [[1, 2, 3, 9, 9], [1, 2, 3, 5, 6], [7, 1, 2, 3, 5, 8], [1, 2, 4]]
    for depth in (3, 4):
        params = build_index(docs, 2, depth, 10)
        chains, known, ngram = find_in_corpus(params, jnp.asarray([[1, 2]]), jnp.asarray([1]), 3, 2, 2, 1, 8)
        assert chains[0, 0, :known[0, 0]].tolist() == [3, 5, 6] and chains[0, 1, :known[0, 1]].tolist() == [4]
    # Where the kept occurrences' document ends for some, the others' token wins: "2 3" then "9" (ends) once,
    # "9 4" twice.
    params = build_index([[2, 3, 9], [2, 3, 9, 4], [0, 2, 3, 9, 4]], 2, 3, 10)
    chains, known, _ = find_in_corpus(params, jnp.asarray([[2, 3]]), jnp.asarray([1]), 3, 1, 2, 1, 8)
    assert chains[0, 0, :known[0, 0]].tolist() == [9, 4]
    # The corpus's first token has no token before it: "1 1" matches only at position 1 (next 2), never at
    # position 0 (which would copy "1 2").
    params = build_index([[1, 1, 2]], 2, 3, 10)
    chains, known, ngram = find_in_corpus(params, jnp.asarray([[1, 1]]), jnp.asarray([1]), 3, 2, 2, 1, 8)
    assert chains[0, 0, :known[0, 0]].tolist() == [2] and known[0, 1] == 0 and ngram[0, 0] == 2


def rows_reference_index(documents, max_ngram: int, depth: int) -> tuple[np.ndarray, np.ndarray]:
    """The index rows as first written (np.unique over (n-gram, next token) rows, then a lexsort by the
    n-gram read backwards, -frequency, first position), each group's entry at its modal occurrence
    (``modal_occurrence``, a scan): (index [N, C], count [N])."""
    corpus = np.concatenate([np.append(np.asarray(d, np.int64), SEPARATOR) for d in documents])
    size, pos = corpus.size, np.arange(corpus.size)
    index, count = np.zeros((max_ngram, size), np.int32), np.zeros(max_ngram, np.int32)
    nxt = np.append(corpus[1:], SEPARATOR)
    ok = (corpus != SEPARATOR) & (nxt != SEPARATOR)
    for n in range(1, max_ngram + 1):
        if n > 1:
            back = np.full(size, SEPARATOR)
            back[n - 1:] = corpus[:size - (n - 1)]
            ok = ok & (back != SEPARATOR)
        p = pos[ok]
        cols = [corpus[p - j] for j in range(n)]
        rows = np.stack(cols + [nxt[p]], axis=1).reshape(p.size, n + 1)
        _, first, inverse, freq = np.unique(rows, axis=0, return_index=True, return_inverse=True,
                                            return_counts=True)
        modal = np.asarray([modal_occurrence(corpus.tolist(), p[inverse.ravel() == g].tolist(), depth)
                            for g in range(first.size)], np.int64)
        p, cols = p[first], [c[first] for c in cols]
        index[n - 1, :p.size] = modal[np.lexsort((p, -freq) + tuple(cols[::-1]))]
        count[n - 1] = p.size
    return index, count


@pytest.mark.parametrize("vocab", [5, 55108, 55109, 1 << 40])  # 55108 ** 4 < 2 ** 63 <= 55109 ** 4
def test_the_index_equals_the_rows_reference_with_packed_and_column_keys(vocab, tmp_path, monkeypatch):
    """build_index packs an n-gram into one int64 where vocab_size ** n fits, else sorts its columns;
    either way the index equals the first version's (np.unique over rows): many ties with a vocabulary
    of 5, ids near the packing limit's vocabulary (55108 packs 4-grams, 55109 does not)."""
    rng = np.random.RandomState(3)
    top = min(vocab, 1 << 20)
    pool = np.unique(np.concatenate([rng.randint(0, min(vocab, 5), 6), top - 1 - rng.randint(0, min(top, 4), 4)]))
    docs = [pool[rng.randint(0, pool.size, rng.randint(1, 80))].tolist() for _ in range(16)]
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path))  # sort now, never read a cached index
    params = build_index(docs, 5, 4, vocab)
    index, count = rows_reference_index(docs, 5, 4)
    np.testing.assert_array_equal(np.asarray(params["count"]), count)
    np.testing.assert_array_equal(np.asarray(params["index"]), index)


def test_the_modal_descent_does_not_depend_on_how_ids_pack():
    """_modal_positions packs (group, token) into one int64 where it fits and sorts both columns where
    not (ids beyond 2 ** 37 with 2 ** 26 groups): either way the same occurrences, ties broken by
    position, never by id, so shifting every id changes nothing."""
    rng = np.random.RandomState(5)
    corpus = rng.randint(0, 4, 400).astype(np.int64)
    corpus[rng.rand(400) < 0.05] = SEPARATOR
    group = np.sort(rng.randint(0, 40, 300))
    p = np.sort(rng.choice(390, 300, replace=False))  # ascending, so ascending within each group too
    want = corpus_index._modal_positions(corpus, group, p, 6)
    shifted = np.where(corpus == SEPARATOR, SEPARATOR, corpus + (1 << 60))
    np.testing.assert_array_equal(corpus_index._modal_positions(shifted, group, p, 6), want)
    for i, g in enumerate(np.unique(group)):  # and each equals the scan
        assert want[i] == modal_occurrence(corpus.tolist(), p[group == g].tolist(), 6)


def test_bad_corpora_and_settings_are_refused(tmp_path):
    with pytest.raises(InputError, match="a document of at least two tokens"):
        build_index([[1], []], 3, 4, 10)
    with pytest.raises(InputError, match="document 1 has token id 10, not in"):
        build_index([[1, 2], [3, 10]], 3, 4, 10)
    params = build_index([[1, 2, 3]], 2, 4, 10)
    with pytest.raises(InputError, match="n-grams up to 2, the drafter asks for 3"):
        find_in_corpus(params, jnp.zeros((1, 4), jnp.int32), jnp.zeros(1, jnp.int32), 4, 1, 3, 1, 4)
    with pytest.raises(InputError, match="4 corpus tokens \\(with separators\\) exceed the capacity 3"):
        build_index([[1, 2, 3]], 2, 4, 10, capacity=3)
    with pytest.raises(InputError, match="window must be a positive int"):
        CorpusDrafter(window=0)
    with pytest.raises(InputError, match="corpus_min_ngram 3 exceeds corpus_max_ngram 2"):
        CorpusDrafter(corpus_max_ngram=2, corpus_min_ngram=3)
    with pytest.raises(InputError, match="needs the corpus path"):
        parse_arg(",depth=3")
    with pytest.raises(InputError, match="expected corpus:PATH then comma-separated"):
        parse_arg("docs.jsonl,deep=3")
    with pytest.raises(InputError, match="beyond the tree limit of 64"):
        parse_arg("docs.jsonl,depth=40,branches=2")
    with pytest.raises(InputError, match=r"64 nodes, beyond the tree limit of 64 \(the root and 63 drafted"):
        parse_arg("docs.jsonl,depth=32,branches=2")  # 64 drafted nodes and the root: past the tree's 64
    with pytest.raises(InputError, match="window 65 exceeds 64"):
        CorpusDrafter(window=65)
    with pytest.raises(InputError, match="corpus_max_ngram 33 exceeds 32"):
        CorpusDrafter(corpus_max_ngram=33)
    with pytest.raises(InputError, match="2 labels for 3 documents"):  # zip dropped the third document
        corpus_index.document_arrays([[1, 2], [3, 4], [5, 6]], 10, labels=["a", "b"])
    from specjax.speculation.drafters.corpus import from_arg
    from tests.toy import toy_model

    text = tmp_path / "t.jsonl"
    text.write_text('{"text": "a text"}\n')
    no_tokenizer = specjax.Model(toy_model(8, 0)[0], None, None)  # as described before the weights load
    with pytest.raises(InputError, match="t.jsonl:1 is text but the model has no tokenizer"):
        from_arg(str(text), no_tokenizer, load=False, expansion=None, draft="topk")
    with pytest.raises(InputError, match="1 labels for 2 documents"):
        corpus_drafter(no_tokenizer, [[1, 2], [3, 4]], labels=["a"])
    with pytest.raises(InputError, match=r"its params are the corpus index .* specjax.corpus_drafter\(model"):
        CorpusDrafter().propose((), {}, None)  # Bound(CorpusDrafter()) without its index
    with pytest.raises(InputError, match="does not exist"):
        read_documents(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"nope": 1}\n')
    with pytest.raises(InputError, match="bad.jsonl:2 needs a string field"):
        read_documents(str(bad))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InputError, match="holds no files"):
        read_documents(str(empty))
    with pytest.raises(InputError, match="document 0 must be a flat list of int token ids, got dtype float64"):
        build_index([[1.7, 2.0]], 2, 4, 10)
    with pytest.raises(InputError, match="must be a flat list of int token ids, got dtype bool"):
        build_index([[True, False, True]], 2, 4, 10)
    with pytest.raises(InputError, match="shape \\(2, 2\\)"):
        build_index([[[1, 2], [3, 4]]], 2, 4, 10)
    with pytest.raises(InputError, match="a.jsonl:3 is bytes, not a list of token ids"):
        build_index([[1, 2], b"\x01\x02"], 2, 4, 10, labels=["a.jsonl:1", "a.jsonl:3"])
    with pytest.raises(InputError, match="capacity must be an int of at most"):
        build_index([[1, 2, 3]], 2, 4, 10, capacity=1 << 40)
    with pytest.raises(InputError, match="continuations of 4 tokens, the drafter asks for 5"):
        find_in_corpus(params, jnp.zeros((1, 4), jnp.int32), jnp.zeros(1, jnp.int32), 5, 1, 2, 1, 4)
    with pytest.raises(InputError, match="depth given twice"):
        parse_arg("docs.jsonl,depth=3,depth=4")
    labelled = tmp_path / "ids.jsonl"
    labelled.write_text('{"token_ids": [1, 2]}\n\n{"token_ids": [3, 99]}\n')
    named = read_documents(str(labelled), labels=True)
    with pytest.raises(InputError, match="ids.jsonl:3 has token id 99, not in \\[0, 10\\)"):
        build_index([d for _, d in named], 2, 4, 10, labels=[label for label, _ in named])


def test_corpus_settings_errors_name_the_drafter_and_the_defaults_they_meet():
    with pytest.raises(InputError, match="^corpus drafter: depth must be a positive int"):
        parse_arg("docs.jsonl,depth=0")  # was "lookup drafter: ...", a drafter the user never named
    with pytest.raises(InputError, match=r"corpus_min_ngram 2 exceeds corpus_max_ngram 1 \(corpus_min_ngram "
                                         r"defaults to 2\)"):
        parse_arg("docs.jsonl,corpus-ngram=1")
    with pytest.raises(InputError, match=r"^lookup drafter: min_ngram 4 exceeds max_ngram 3 \(max_ngram defaults "
                                         r"to 3\)$"):
        specjax.LookupDrafter(min_ngram=4)
    with pytest.raises(InputError, match="min_ngram 3 exceeds max_ngram 2$"):  # both given: no note
        specjax.LookupDrafter(min_ngram=3, max_ngram=2)


def test_a_corpus_path_is_indexed_at_a_bucketed_capacity_and_empty_text_is_refused_before_loading(tmp_path):
    """The index's shapes are the compiled loop's: a corpus:PATH edited by one token compiled it again
    (78 s cold, 7 s warm, 20 s after the edit on a tiny model). Empty text was refused only after the
    weights loaded."""
    from specjax.speculation.drafters.corpus import from_arg
    from tests.toy import toy_model

    model = specjax.Model(toy_model(50, 0)[0], None, None)
    shapes = []
    for n in (1000, 1001):
        path = tmp_path / f"c{n}.jsonl"
        path.write_text(json.dumps({"token_ids": [i % 50 for i in range(n - 1)]}) + "\n")  # n with the separator
        bound = from_arg(str(path), model, load=True, expansion=None, draft="topk")
        shapes.append(jax.tree.map(lambda a: a.shape, bound.params))
    assert shapes[0] == shapes[1] and shapes[0]["index"][1] == corpus_index.capacity_bucket(1000) == 1024
    buckets = [corpus_index.capacity_bucket(t) for t in range(1, 5000)]
    assert all(t <= b <= t + t // 8 for t, b in zip(range(1, 5000), buckets))
    assert len(set(buckets)) < 150  # few distinct shapes
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    def chars(text, add_special_tokens):  # a tokenizer of one token per character
        return {"input_ids": [ord(c) % 50 for c in text]}

    described = specjax.Model(model.config, None, chars)  # before the weights load: a tokenizer, no params
    for text, copyable in (("", False), ("a", False), ("ab", True)):
        empty.write_text(text)
        if copyable:
            from_arg(str(empty), described, load=False, expansion=None, draft="topk")
        else:
            with pytest.raises(InputError, match="a document of at least two tokens"):
                from_arg(str(empty), described, load=False, expansion=None, draft="topk")


def test_a_large_text_document_is_tokenized_in_pieces_and_the_limit_checked_as_it_goes(monkeypatch):
    from specjax.speculation.drafters import corpus

    calls = []

    def tokenizer(text, add_special_tokens):
        assert not add_special_tokens
        calls.append(text)
        return {"input_ids": [ord(c) % 7 for c in text]}

    monkeypatch.setattr(corpus, "TOKENIZE_CHARS", 10)
    text = "abc\ndefgh\nijklmnopqrstu\nv\n" + "w" * 3
    assert corpus._tokenize(tokenizer, text, "doc", 0) == [ord(c) % 7 for c in text]
    # whole lines up to 10 characters; a longer line whole
    assert calls == ["abc\ndefgh\n", "ijklmnopqrstu\n", "v\nwww"]
    monkeypatch.setattr(corpus, "MAX_CORPUS_TOKENS", 12)
    calls.clear()
    with pytest.raises(InputError, match="the corpus passes 12 tokens \\(with separators\\) in doc"):
        corpus._tokenize(tokenizer, text, "doc", 0)
    assert len(calls) == 2  # stopped at the piece that passed the limit


def test_documents_are_read_from_jsonl_text_files_and_directories(tmp_path):
    d = tmp_path / "docs"
    d.mkdir()
    # a JSON string may hold U+2028 unescaped: one line of the file, not two
    (d / "a.jsonl").write_text('{"text": "first\u2028part"}\n\n{"token_ids": [1, 2, 3]}\n', encoding="utf-8")
    (d / "b.txt").write_text("second document\nwith two lines")
    (d / ".hidden").write_bytes(b"\xff\xfe not text")  # hidden files are not documents
    (d / "sub").mkdir()  # nor are subdirectories
    assert read_documents(str(d)) == ["first\u2028part", [1, 2, 3], "second document\nwith two lines"]
    assert [label for label, _ in read_documents(str(d), labels=True)] == [
        f"{d}/a.jsonl:1", f"{d}/a.jsonl:3", f"{d}/b.txt"]
    # the file's own bytes: CRLF kept (open() made it LF), a byte-order mark dropped (it was text)
    (tmp_path / "crlf.txt").write_bytes(b"\xef\xbb\xbfline one\r\nline two\r\n")
    assert read_documents(str(tmp_path / "crlf.txt")) == ["line one\r\nline two\r\n"]
    (tmp_path / "bom.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "a"}\r\n{"token_ids": [1, 2]}\r\n')
    assert read_documents(str(tmp_path / "bom.jsonl")) == ["a", [1, 2]]
    (tmp_path / "both.jsonl").write_text('{"text": "a", "token_ids": [1, 2]}\n')
    with pytest.raises(InputError, match="both.jsonl:1 has both \"text\" and \"token_ids\"; give one"):
        read_documents(str(tmp_path / "both.jsonl"))


def test_short_corpora_and_long_ngrams_index_without_error():
    """An n-gram length beyond every document: its index row is empty, nothing matches, no crash."""
    params = build_index([[1, 2]], 5, 3, 10)
    assert np.asarray(params["count"]).tolist() == [1, 0, 0, 0, 0]
    chains, known, ngram = find_in_corpus(params, jnp.asarray([[0, 0, 0, 1]]), jnp.asarray([3]), 3, 1, 5, 1, 4)
    assert chains[0, 0, :known[0, 0]].tolist() == [2] and ngram[0, 0] == 1


def _prompts(vocab):
    rng = np.random.RandomState(5)
    return [random_ids(rng, vocab, 7), random_ids(rng, vocab, 5), random_ids(rng, vocab, 9)]


def test_chains_of_both_sources_are_ranked_by_match_length_then_own_text_first():
    """pick_chains: a longer corpus match beats the request's own text; at equal length its own text
    wins; chains start with different tokens; the statistics rows tell the sources apart."""
    own = (jnp.asarray([[[5, 6], [7, 8]]]), jnp.asarray([[2, 1]]), jnp.asarray([[2, 1]]))
    quoted = (jnp.asarray([[[9, 9], [5, 1]]]), jnp.asarray([[2, 2]]), jnp.asarray([[3, 2]]))
    chains, known, ngram, source = (np.asarray(x) for x in pick_chains(own, quoted, 2, 3))
    # corpus 3-gram [9 9] first; own 2-gram [5 6] before the corpus 2-gram [5 1] (same first token:
    # dropped); then own 1-gram [7 8]
    assert chains[0].tolist() == [[9, 9], [5, 6], [7, 8]] and known[0].tolist() == [2, 2, 1]
    assert ngram[0].tolist() == [3, 2, 1] and source[0].tolist() == [1, 0, 0]


def _context(history, length):
    from specjax.speculation.drafters.base import DraftContext
    from specjax.speculation.state import greedy_sampling
    return DraftContext(history=jnp.asarray(history, jnp.int32), length=jnp.asarray(length, jnp.int32),
                        sampling=greedy_sampling(len(length)))


def test_corpus_chains_keep_the_most_frequent_first_and_learn_in_their_own_rows():
    """Through propose: among corpus chains of one match length the most frequent continuation comes
    first, however far the rarer one's document goes on; commit scores corpus and own-text chains in
    different statistics rows, and expected_accepted reads them back."""
    from specjax.speculation.drafters.base import Accepted
    d = CorpusDrafter(depth=4, branches=2, max_ngram=2, corpus_max_ngram=2)
    index = build_index([[1, 2, 3], [1, 2, 3], [1, 2, 4, 5, 6, 7]], d.corpus_max_ngram, d.depth, 10)
    # request 0: "8 1 2" -> only the corpus knows "1 2"; request 1: "1 2 9 1 2" -> its own text too
    history = [[8, 1, 2, 0, 0, 0, 0, 0], [1, 2, 9, 1, 2, 0, 0, 0]]
    length = [2, 4]
    state = d.init((), jnp.zeros((2, 8), jnp.int32), jnp.asarray(length), cache_len=16)
    assert state["counts"].shape == (2, 2 * d._rows, 2)
    proposal, state = d.propose(index, state, _context(history, length))
    tokens, ok = np.asarray(proposal.tokens), np.asarray(proposal.ok)
    assert tokens[0, 1:2].tolist() == [3] and ok[0, 1:5].tolist() == [True, False, False, False]  # [3] first
    assert tokens[0, 5:9].tolist() == [4, 5, 6, 7] and ok[0, 5:9].all()
    rows = np.asarray(state["ngram"])
    assert rows[0].tolist() == [2 + d._rows, 2 + d._rows]  # both corpus chains, 2-token matches
    assert rows[1, 0] == 2  # own text "1 2" -> 9 beats the corpus at equal length
    # the LLM emits 3 then something else for request 0, 9 1 for request 1
    emitted = jnp.asarray([[3, 0, 0, 0, 0], [9, 1, 0, 0, 0]], jnp.int32)
    accepted = Accepted(path=jnp.zeros((2, 5), jnp.int32), num_accepted=jnp.asarray([1, 2]), emitted=emitted,
                        num_emitted=jnp.asarray([2, 3]), length=jnp.asarray([4, 7]))
    counts = np.asarray(d.commit(index, state, accepted)["counts"])
    assert counts[0, 2 + d._rows, 0] > 0 and counts[0, :d._rows].sum() == 0  # corpus row only
    assert counts[1, 2, 0] > 0  # own-text row
    expected = np.asarray(d.expected_accepted(index, dict(state, counts=jnp.asarray(counts)), (0, 4, 8)))
    assert expected.shape == (2, 3) and (expected[:, 0] == 0).all() and (expected[:, 1:] > 0).all()


@pytest.mark.parametrize("budget", [None, "finish"])
def test_corpus_speculation_equals_incremental_and_copies_the_corpus(llama, budget):
    """A corpus holding the LLM's own greedy continuations (as a deployment would hold earlier answers):
    its drafts are accepted (more tokens per pass than the lookup drafter alone), and the output is
    incremental decoding's, greedy and seeded, whole tree or budgeted, with a corpus that helps and
    one that does not, alone and merged with an SSM."""
    vocab = llama.config.vocab_size
    prompts = _prompts(vocab)
    want = specjax.generate(llama, prompts, max_new_tokens=24, ignore_eos=True, mode="incremental")
    rng = np.random.RandomState(9)
    answers = [p + t for p, t in zip(prompts, want.token_ids)]
    unrelated = [random_ids(rng, vocab, 40) for _ in range(3)]
    costs = (1.0, 1.1, 1.4, 1.8, 2.5)
    levels = default_levels((CorpusDrafter(),))
    lookup = specjax.generate(llama, prompts, max_new_tokens=24, ignore_eos=True,
                              drafters=[specjax.Bound(LookupDrafter())],
                              budget=Budget(levels, costs=costs, goal=budget) if budget else None)
    assert lookup.token_ids == want.token_ids
    for docs, copies in ((unrelated + answers, True), (unrelated, False)):
        bound = corpus_drafter(llama, docs)
        b = Budget(levels, costs=costs, goal=budget) if budget else None
        got = specjax.generate(llama, prompts, max_new_tokens=24, ignore_eos=True, drafters=[bound], budget=b)
        assert got.token_ids == want.token_ids
        if copies:
            assert got.stats["mean_tokens_per_pass"] > max(4.0, lookup.stats["mean_tokens_per_pass"] + 1), (
                got.stats["mean_tokens_per_pass"], lookup.stats["mean_tokens_per_pass"])
    ssm = specjax.derive_ssm(llama, 1)
    got = specjax.generate(llama, prompts, max_new_tokens=20, ignore_eos=True, ssms=[ssm], expansion=(2,),
                           drafters=[corpus_drafter(llama, unrelated + answers, depth=4)])
    assert got.token_ids == [t[:20] for t in want.token_ids]
    seeded = specjax.SamplingParams(temperature=0.9, top_k=30, seed=4)
    inc = specjax.generate(llama, prompts, max_new_tokens=24, ignore_eos=True, sampling=seeded, mode="incremental")
    spec = specjax.generate(llama, prompts, max_new_tokens=24, ignore_eos=True, sampling=seeded,
                            drafters=[corpus_drafter(llama, unrelated + answers)], verifier="seeded")
    assert spec.token_ids == inc.token_ids


def test_generate_command_takes_a_corpus_drafter(tiny_llama_dir, tmp_path):
    from tests.test_cli import cli
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": [1, 2, 3]}\n')
    common = ("generate", "--model", tiny_llama_dir, "--prompts-file", str(prompts), "--max-new-tokens", "12",
              "--json")
    plain = cli(*common, "--mode", "incremental")
    assert plain.returncode == 0, plain.stderr
    answer = json.loads(plain.stdout)["token_ids"]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"token_ids": [1, 2, 3] + answer}) + "\n")
    r = cli(*common, "--drafter", f"corpus:{corpus},depth=6,branches=1", "--budget", "off")
    assert r.returncode == 0, r.stderr
    record = json.loads(r.stdout)
    assert record["token_ids"] == answer
    # Incremental decoding takes 12 passes (the prefill's and 11 more); copying up to 7 tokens a pass takes
    # 3 when every copy is right, a few more when the answer repeats an n-gram with another continuation.
    assert record["llm_passes"] <= 6, record["llm_passes"]
    missing = cli(*common, "--drafter", f"corpus:{tmp_path / 'missing.jsonl'}")
    assert missing.returncode == 2 and "does not exist" in missing.stderr and "loading" not in missing.stderr


# -- exact laws under every verifier the corpus drafter allows ------------------------------------------

@pytest.mark.parametrize("verifier", ["mss", "rrs", "naive"])
def test_corpus_samples_the_exact_law(verifier):
    """Deterministic entries (declared one-hot) from a corpus of likely continuations follow the LLM's
    exact sequence law under the sampled verifiers and a tree budget that switches levels
    (``tests.toy.assert_drafter_samples_the_exact_law``)."""
    d = CorpusDrafter(depth=2, branches=2, max_ngram=2, corpus_max_ngram=3, corpus_min_ngram=1)
    index = build_index([[4, 2, 3, 2, 4, 2], [2, 4, 5, 1], [4, 0, 4, 1]], d.corpus_max_ngram, d.depth, LAW_VOCAB)
    # the prompt's last 3 tokens are in the corpus: its first chain is the corpus's (longer than any own match)
    state = d.init((), jnp.zeros((1, 8), jnp.int32), jnp.asarray([6]), cache_len=16)
    _, state = d.propose(index, state, _context([LAW_PROMPT + [0]], [len(LAW_PROMPT) - 1]))
    assert int(state["ngram"][0, 0]) == 3 + d._rows
    assert_drafter_samples_the_exact_law(d, index, verifier, f"corpus + {verifier}")


def test_the_index_is_cached_on_disk_and_rebuilt_from_a_damaged_cache(tmp_path, monkeypatch):
    """A second build of the same corpus reads the index back instead of sorting again (start-up of
    every command with the shipped corpus), equal to the built one; a damaged file is rebuilt; another
    corpus, n-gram length or depth is never served another's index."""
    import specjax.speculation.drafters.corpus_index as index_lib

    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path))
    docs = [random_ids(np.random.RandomState(1), 30, 40), [3, 4, 5, 3, 4, 6]]
    built = build_index(docs, 3, 4, 30)
    files = list((tmp_path / "corpus-index").iterdir())
    assert len(files) == 1
    sorts = []
    monkeypatch.setattr(index_lib, "_index_rows", lambda *a: sorts.append(a) or rows_reference_index(docs, 3, 4))
    chex.assert_trees_all_equal(build_index(docs, 3, 4, 30), built)
    assert not sorts, "the cached index was not read back"
    whole = files[0].read_bytes()
    for damaged in (b"not an npz", b"", whole[:len(whole) // 2], whole[:-40] + bytes(40)):
        files[0].write_bytes(damaged)
        chex.assert_trees_all_equal(build_index(docs, 3, 4, 30), built)
    assert len(sorts) == 4, "a damaged cache file must be rebuilt"
    build_index(docs[:1], 3, 4, 30)
    build_index(docs, 2, 4, 30)
    build_index(docs, 3, 5, 30)  # the modal occurrences depend on the depth
    assert len(sorts) == 7, "another corpus, n-gram length or depth must not read this index"
    assert not [f for f in (tmp_path / "corpus-index").iterdir() if f.name.endswith(".tmp.npz")]
