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
# int32 positions; the device index is 4 bytes per token and n-gram length (16 at the default 4) beside
# the tokens' 4; the host's build peaks near 200 bytes per token (1.37M tokens: +277 MB, AMD EPYC)
MAX_CORPUS_TOKENS = 1 << 26


def capacity_bucket(total: int) -> int:
    """The capacity a corpus of ``total`` tokens (separators included) is indexed at when its size is not
    given: the least m * 2**e >= total with 8 <= m < 16, at most 1/8 more. The index's shapes are part of
    the compiled loop, so an edited corpus of about the same size reuses it instead of compiling again."""
    e = max(total.bit_length() - 4, 0)
    return min(-(-total >> e) << e, MAX_CORPUS_TOKENS)


def document_arrays(documents, vocab_size: int, labels=None) -> list[np.ndarray]:
    """Token-id documents as int64 arrays, each checked (1-D, integer ids in [0, vocab_size)); ``labels``
    name them in errors (default "document i")."""
    docs = list(documents)
    labels = list(labels) if labels is not None else [f"document {i}" for i in range(len(docs))]
    if len(labels) != len(docs):  # zip would drop the documents past the shorter list
        raise InputError(f"corpus drafter: {len(labels)} labels for {len(docs)} documents; give one per document")
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
    return arrays


def require_copyable(arrays) -> None:
    """A corpus the drafter can copy from: a document of at least two tokens."""
    if not any(a.size >= 2 for a in arrays):
        raise InputError("corpus drafter: the corpus needs a document of at least two tokens (nothing to copy)")


def build_index(documents, max_ngram: int, depth: int, vocab_size: int, capacity: int | None = None,
                labels=None) -> dict:
    """The corpus index (the drafter's params) from documents given as 1-D token-id sequences.

    ``capacity``: size the arrays for this many corpus tokens (separators included) instead of exactly
    this corpus, so that another corpus of at most that size runs in the same compiled loop.
    ``labels``: what to call each document in errors (default "document i"). Checked before any work:
    integer ids in [0, vocab_size), 1-D documents, at least one of two tokens, at most
    MAX_CORPUS_TOKENS tokens in all and no more than ``capacity``.

    Each index row holds one entry per (n-gram, next token) group: a window of entries then always
    offers as many different continuations as it holds. An entry's position is the group's *modal*
    occurrence (``_modal_positions``): the chain copied from it follows, token by token up to ``depth``,
    the continuation most of the group's occurrences share, not whatever its first occurrence wrote."""
    arrays = document_arrays(documents, vocab_size, labels)
    require_copyable(arrays)
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
    index, count = _cached_index(corpus, max_ngram, depth, vocab_size)
    tokens = np.concatenate([corpus, np.full(depth + 1, SEPARATOR)]).astype(np.int32)
    return {"tokens": jnp.asarray(tokens), "index": jnp.asarray(index), "count": jnp.asarray(count)}


def _cached_index(corpus: np.ndarray, max_ngram: int, depth: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``_index_rows``, kept on disk (every corpus, shipped or given) by the digest of the corpus tokens,
    the settings and this module's source (an edited indexer never reads an older one's index): the
    shipped corpus's sort took ~2 s of every command's start-up. A cache file that cannot be read, in
    whatever way it is damaged, is rebuilt; one that cannot be written only costs that time again."""
    try:
        with open(__file__, "rb") as f:
            key = hashlib.sha256(f.read())
    except OSError:  # no readable source (a frozen install): no safe key, no cache
        return _index_rows(corpus, max_ngram, depth, vocab_size)
    key.update(f":{max_ngram}:{depth}:{vocab_size}:".encode())
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
    index, count = _index_rows(corpus, max_ngram, depth, vocab_size)
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


def _index_rows(corpus: np.ndarray, max_ngram: int, depth: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The index rows [max_ngram, C] and their valid counts [max_ngram] (see ``build_index``): per n, the
    groups' modal positions, sorted by the n-gram read backwards, then by how often its next token follows
    it (most frequent first), then by the group's first position."""
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
        freq = np.diff(np.append(starts, p.size))
        modal = _modal_positions(corpus, np.cumsum(new_group) - 1, p[by_row], depth)
        cols = [c[first] for c in cols]
        order = np.lexsort([p[first], -freq] + _ngram_keys(cols, vocab_size))
        index[n - 1, :first.size] = modal[order]
        count[n - 1] = first.size
    return index, count


def _modal_positions(corpus: np.ndarray, group: np.ndarray, p: np.ndarray, depth: int) -> np.ndarray:
    """Each group's modal occurrence: the positions ``p`` of a group (``group`` ascending from 0, ``p``
    ascending within a group) all continue with the same next token, corpus[p + 1]; at each further
    offset d = 2..depth keep the occurrences whose token corpus[p + d] is the most frequent one among
    those kept (ties: the token met first; the end of a document only where every kept occurrence ends
    there), until one is left or they all end. The earliest kept occurrence is the group's.

    Why: a chain is copied from one occurrence, and the first one's continuation is as likely to wander
    off as any other; the modal one follows what the corpus most often says next (on the shipped
    corpus, SmolLM2's dev-prompt continuations replayed: 1.800 -> 1.836 tokens per pass at 8 x 2).
    Only groups of several occurrences need the descent, and most end after an offset or two."""
    starts = np.flatnonzero(np.diff(group, prepend=-1))
    modal = p[starts]  # one occurrence: its own
    size = np.diff(np.append(starts, group.size))
    alive = np.flatnonzero(size[group] > 1)  # indices into group / p, still in the descent
    last = corpus.size - 1
    span = int(corpus.max()) + 2  # packed keys: group * span + token + 1 (the separator is -1)
    for d in range(2, depth + 1):
        if alive.size == 0:
            break
        g, q = group[alive], p[alive]
        x = corpus[np.minimum(q + d, last)]  # past the corpus: its final separator
        # runs of equal (group, token), each in position order: ``alive`` is in (group, position) order,
        # so a stable sort by the packed (group, token) keeps it within runs (the shipped corpus's build
        # 4.8 -> 3.1 s against a lexsort of the three columns)
        if int(g[-1]) < (2 ** 63 - 1) // span:
            order = np.argsort(g * span + (x + 1), kind="stable")
        else:  # ids too large to pack (only in tests' huge vocabularies)
            order = np.lexsort([q, x, g])
        gs, xs = g[order], x[order]
        new_run = np.ones(order.size, bool)
        new_run[1:] = (gs[1:] != gs[:-1]) | (xs[1:] != xs[:-1])
        run_start = np.flatnonzero(new_run)
        count = np.diff(np.append(run_start, order.size))
        run_g, run_x, run_q = gs[run_start], xs[run_start], q[order[run_start]]
        score = np.where(run_x == SEPARATOR, 0, count)  # an ended occurrence never outvotes a token
        pick = np.lexsort([run_q, -score, run_g])  # per group: the best score, then the token met first
        best = pick[np.flatnonzero(np.diff(run_g[pick], prepend=-1))]  # one run per group
        modal[run_g[best]] = run_q[best]
        go_on = np.zeros(run_g.size, bool)  # runs that still have a choice to make
        go_on[best] = (count[best] > 1) & (run_x[best] != SEPARATOR)
        alive = alive[order[go_on[np.cumsum(new_run) - 1]]]
        alive.sort()  # back to (group, position) order
    return modal


def _ngram_keys(cols: list, vocab_size: int) -> list:
    """Sort keys (for np.lexsort, the last one primary) ordering n-grams as their columns read in order:
    one int64 of the packed tokens where vocab_size ** n fits, else the columns themselves."""
    if int(vocab_size) ** len(cols) < 2 ** 63:  # Python ints: a numpy integer power would wrap
        packed = np.zeros_like(cols[0], dtype=np.int64)
        for c in cols:
            packed = packed * vocab_size + c
        return [packed]
    return cols[::-1]
