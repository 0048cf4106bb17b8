"""The corpus drafter's index (its params), built once on the host from token-id documents.

Layout and lookup rule: ``corpus.py``'s module docstring. The sort behind it takes ~2 s for the shipped
corpus (1.56M tokens) on 2 cores, so the rows are cached on disk (``_cached_index``).
"""

from __future__ import annotations

import hashlib
import os
import tempfile

import jax.numpy as jnp
import numpy as np

from specjax.config import cache_root
from specjax.errors import InputError

SEPARATOR = -1  # between documents and after the corpus: no n-gram or continuation crosses it
# int32 positions; the device index is 4 bytes per token and n-gram length (16 at the default 4), the
# host's sort ~40 bytes per token while it builds
MAX_CORPUS_TOKENS = 1 << 26


def build_index(documents, max_ngram: int, depth: int, vocab_size: int, capacity: int | None = None,
                labels=None) -> dict:
    """The corpus index (the drafter's params) from documents given as 1-D token-id sequences.

    ``capacity``: size the arrays for this many corpus tokens (separators included) instead of exactly
    this corpus, so that another corpus of at most that size runs in the same compiled loop.
    ``labels``: what to call each document in errors (default "document i"). Checked before any work:
    integer ids in [0, vocab_size), 1-D documents, at least one of two tokens, at most
    MAX_CORPUS_TOKENS tokens in all and no more than ``capacity``.

    Each index row holds one entry per (n-gram, next token) group, at the group's first position: a
    window of entries then always offers as many different continuations as it holds."""
    docs = list(documents)
    labels = list(labels) if labels is not None else [f"document {i}" for i in range(len(docs))]
    arrays = []
    for label, d in zip(labels, docs):
        if isinstance(d, (str, bytes)):
            raise InputError(f"corpus drafter: {label} is {type(d).__name__}, not a list of token ids")
        a = np.asarray(d)
        if a.ndim != 1 or (a.size and (a.dtype.kind not in "iu" or a.dtype == bool)):
            raise InputError(f"corpus drafter: {label} must be a flat list of int token ids, got dtype {a.dtype} "
                             f"and shape {a.shape}")
        a = a.astype(np.int64)
        bad = a[(a < 0) | (a >= vocab_size)]
        if bad.size:
            raise InputError(f"corpus drafter: {label} has token id {int(bad[0])}, not in [0, {vocab_size})")
        arrays.append(a)
    if not any(a.size >= 2 for a in arrays):
        raise InputError("corpus drafter: the corpus needs a document of at least two tokens (nothing to copy)")
    total = sum(a.size + 1 for a in arrays)
    if total > MAX_CORPUS_TOKENS:
        raise InputError(f"corpus drafter: {total} corpus tokens (with separators), more than {MAX_CORPUS_TOKENS}")
    if capacity is not None:
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity > MAX_CORPUS_TOKENS:
            raise InputError(f"corpus drafter: capacity must be an int of at most {MAX_CORPUS_TOKENS}, "
                             f"got {capacity!r}")
        if total > capacity:
            raise InputError(f"corpus drafter: {total} corpus tokens (with separators) exceed the capacity {capacity}")
    parts = []
    for a in arrays:
        parts += [a, np.asarray([SEPARATOR])]
    corpus = np.concatenate(parts)  # ends with a separator
    if capacity is not None:  # more separators: positions no entry ever reads
        corpus = np.concatenate([corpus, np.full(capacity - total, SEPARATOR)])
    index, count = _cached_index(corpus, max_ngram, vocab_size)
    tokens = np.concatenate([corpus, np.full(depth + 1, SEPARATOR)]).astype(np.int32)
    return {"tokens": jnp.asarray(tokens), "index": jnp.asarray(index), "count": jnp.asarray(count)}


def _cached_index(corpus: np.ndarray, max_ngram: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``_index_rows``, kept on disk (every corpus, shipped or given) by the digest of the corpus tokens,
    the settings and this module's source (an edited indexer never reads an older one's index): the
    shipped corpus's sort took ~2 s of every command's start-up. A cache file that cannot be read, in
    whatever way it is damaged, is rebuilt; one that cannot be written only costs that time again."""
    try:
        with open(__file__, "rb") as f:
            key = hashlib.sha256(f.read())
    except OSError:  # no readable source (a frozen install): no safe key, no cache
        return _index_rows(corpus, max_ngram, vocab_size)
    key.update(f":{max_ngram}:{vocab_size}:".encode())
    key.update(corpus.astype(np.int64).tobytes())
    directory = os.path.join(cache_root(), "corpus-index")
    path = os.path.join(directory, key.hexdigest()[:32] + ".npz")
    try:
        with np.load(path) as z:
            index, count = z["index"], z["count"]
        if index.shape == (max_ngram, corpus.size) and count.shape == (max_ngram,) and index.dtype == np.int32:
            return index, count
    except Exception:  # noqa: BLE001 - a damaged zip raises BadZipFile, EOFError, ValueError, ...: rebuild it
        pass
    index, count = _index_rows(corpus, max_ngram, vocab_size)
    partial = None
    try:
        os.makedirs(directory, exist_ok=True)
        fd, partial = tempfile.mkstemp(dir=directory, suffix=".tmp.npz")  # unique across threads and hosts
        with os.fdopen(fd, "wb") as f:
            np.savez(f, index=index, count=count)
        os.replace(partial, path)  # readers never see a half-written file
        partial = None
    except OSError:
        pass
    finally:
        if partial is not None:
            try:
                os.remove(partial)
            except OSError:
                pass
    return index, count


def _index_rows(corpus: np.ndarray, max_ngram: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The index rows [max_ngram, C] and their valid counts [max_ngram] (see ``build_index``)."""
    size = corpus.size
    pos = np.arange(size)
    index = np.zeros((max_ngram, size), np.int32)
    count = np.zeros(max_ngram, np.int32)
    nxt = np.append(corpus[1:], SEPARATOR)
    ok = (corpus != SEPARATOR) & (nxt != SEPARATOR)  # a token with a continuation in its document
    for n in range(1, max_ngram + 1):
        if n > 1:  # the n-gram ending at p starts at or after the corpus start and stays in one document
            back = np.full(size, SEPARATOR)
            back[n - 1:] = corpus[:max(size - (n - 1), 0)]
            ok = ok & (back != SEPARATOR)
        p = pos[ok]
        cols = [corpus[p - j] for j in range(n)]  # the n-gram read backwards from p
        # Groups of equal (n-gram, next token), each at its smallest p: sorted by the row, then by p (a
        # lexsort of int keys; np.unique over rows sorts byte strings, 6x slower at 1.56M tokens).
        keys = [p, nxt[p]] + _ngram_keys(cols, vocab_size)
        by_row = np.lexsort(keys)  # the last key is the primary one
        new_group = np.ones(p.size, bool)
        new_group[1:] = np.any(np.stack([np.diff(k[by_row]) != 0 for k in keys[1:]]), axis=0)
        starts = np.flatnonzero(new_group)
        first = by_row[starts]  # each group's smallest p
        counts = np.diff(np.append(starts, p.size))
        p, freq = p[first], counts
        cols = [c[first] for c in cols]
        order = np.lexsort([p, -freq] + _ngram_keys(cols, vocab_size))
        index[n - 1, :p.size] = p[order]
        count[n - 1] = p.size
    return index, count


def _ngram_keys(cols: list, vocab_size: int) -> list:
    """Sort keys (for np.lexsort, the last one primary) ordering n-grams as their columns read in order:
    one int64 of the packed tokens where vocab_size ** n fits, else the columns themselves."""
    if int(vocab_size) ** len(cols) < 2 ** 63:  # Python ints: a numpy integer power would wrap
        packed = np.zeros_like(cols[0], dtype=np.int64)
        for c in cols:
            packed = packed * vocab_size + c
        return [packed]
    return cols[::-1]
