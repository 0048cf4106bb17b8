"""The corpus drafter: lookup drafting with a second source, a user-given corpus (documents requests quote).

The lookup drafter (``lookup.py``) copies continuations from a request's own prompt and output. This
one also copies them from a corpus fixed before serving: documents a deployment's requests are likely
to quote or repeat (a code base, a manual, earlier answers to recurring questions). It replaces the
lookup drafter rather than merging with it: both sources' candidates compete for the same
``branches`` chains (longest match first, the request's own text first at equal length), so it
proposes no more nodes than the lookup drafter and climbs the same budget ladder.

The corpus is tokenized and indexed once on the host (``corpus_index.build_index``); every step, inside
the jitted loop, each request's last tokens are looked up in it with static shapes and no host round trip:

1. for every n-gram length n the index holds, for each (n-gram, next token) pair of the corpus, one
   position p where that n-gram (lying in one document) ends and is followed by that token: of all
   such positions, the one whose continuation the others most often share (``corpus_index``: at each
   further token the most frequent one among the positions still kept), sorted by the n tokens read
   backwards from p, then by how often the next token follows that n-gram in the corpus (most
   frequent first), then by the pair's first position;
2. a binary search finds the first entry whose n-gram equals the request's last n tokens; the next
   ``window`` entries are the candidates of that n (entries beyond the match are masked);
3. the longest n with a match wins; its candidates (each a different next token) are taken in index
   order;
4. each chain is the candidate's continuation ``corpus[p + 1 : p + 1 + depth]``, cut at the end of
   its document.

Like the lookup drafter every entry is a deterministic function of committed tokens and the fixed
corpus (law ``"onehot"``): greedy, seeded, naive, MSS and RRS verification stay exact. Its acceptance
statistics (for the tree budget) are kept per source and match length.

The index is the drafter's params (arrays passed to the loop, not constants compiled into it):
``tokens`` [C + depth + 1] int32 (documents separated by -1, padded with -1), ``index`` [N, C]
int32 (per n, valid entries first) and ``count`` [N] int32 (valid entries per n).
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from specjax.errors import InputError
from specjax.speculation.drafters.base import Bound, DraftContext, Proposal
from specjax.speculation.drafters.corpus_index import (
    MAX_CORPUS_TOKENS,
    SEPARATOR,
    build_index,
    capacity_bucket,
    document_arrays,
    require_copyable,
)
from specjax.speculation.drafters.lookup import MAX_NGRAM, LookupDrafter, default_note, find_chains
from specjax.speculation.drafters.settings import parse_int_settings

MAX_WINDOW = 64  # corpus entries read after a match: its most frequent next tokens


@dataclasses.dataclass(frozen=True)
class CorpusDrafter(LookupDrafter):
    """The lookup drafter with a second source: ``branches`` chains of ``depth`` tokens copied from the
    request's own text (matches of ``min_ngram``..``max_ngram`` tokens, as ``LookupDrafter``) or from
    a fixed corpus (matches of ``corpus_min_ngram``..``corpus_max_ngram`` tokens; its index is the
    params). Candidates of both sources are ranked by match length, then the request's own text
    first, then the most committed continuation; chains start with different tokens. So a corpus
    match wins only where it is longer than any match in the request's own text, and the drafter
    proposes no more nodes than the lookup drafter it replaces (the same budget ladder).

    ``window``: corpus entries read after the first match of an n-gram: its ``window`` most frequent
    next tokens.
    Acceptance statistics are kept per source and match length."""

    corpus_max_ngram: int = 4
    corpus_min_ngram: int = 2  # one-token matches in a corpus are mostly noise
    window: int = 8
    _what = "corpus drafter"

    def __post_init__(self):
        super().__post_init__()
        for name in ("corpus_max_ngram", "corpus_min_ngram", "window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise InputError(f"corpus drafter: {name} must be a positive int, got {value!r}")
        if self.corpus_max_ngram > MAX_NGRAM:  # the index holds one row of entries per n-gram length
            raise InputError(f"corpus drafter: corpus_max_ngram {self.corpus_max_ngram} exceeds {MAX_NGRAM}")
        if self.window > MAX_WINDOW:
            raise InputError(f"corpus drafter: window {self.window} exceeds {MAX_WINDOW} (the most frequent next "
                             f"tokens read after a match)")
        if self.corpus_min_ngram > self.corpus_max_ngram:
            raise InputError(f"corpus drafter: corpus_min_ngram {self.corpus_min_ngram} exceeds corpus_max_ngram "
                             f"{self.corpus_max_ngram}{default_note(self, 'corpus_min_ngram', 'corpus_max_ngram')}")

    @property
    def _rows(self) -> int:
        """Statistics rows per source: match lengths 0..max."""
        return max(self.max_ngram, self.corpus_max_ngram) + 1

    @property
    def stat_rows(self) -> int:
        """The request's own text in rows 0.._rows-1, the corpus in the next _rows (see ``propose``)."""
        return 2 * self._rows

    def describe(self) -> str:
        return (f"lookup+corpus(depth {self.depth}, branches {self.branches}, "
                f"n-grams {self.max_ngram}..{self.min_ngram}, "
                f"corpus n-grams {self.corpus_max_ngram}..{self.corpus_min_ngram}, window {self.window})")

    def propose(self, params, state: dict, ctx: DraftContext) -> tuple[Proposal, dict]:
        if not isinstance(params, dict) or not {"tokens", "index", "count"} <= params.keys():
            raise InputError(f"corpus drafter: its params are the corpus index ({{'tokens', 'index', 'count'}}), got "
                             f"{type(params).__name__}; bind it with specjax.corpus_drafter(model, documents)")
        own = find_chains(ctx.history, ctx.length, self.depth, self.branches, self.max_ngram, self.min_ngram)
        quoted = find_in_corpus(params, ctx.history, ctx.length, self.depth, self.branches, self.corpus_max_ngram,
                                self.corpus_min_ngram, self.window)
        chains, known, ngram, source = pick_chains(own, quoted, self.depth, self.branches)
        proposal = self.chain_proposal(ctx, chains, known)
        # The statistics row of each chain: its match length, in the corpus rows for corpus chains
        # (LookupDrafter.commit and node_acceptance read state["ngram"] as the row; 0 = no chain).
        row = jnp.where(ngram > 0, ngram + source * self._rows, 0)
        return proposal, dict(state, chains=chains, known=known, ngram=row)


def pick_chains(own, quoted, depth: int, branches: int):
    """Chains of both sources ranked by match length, then the request's own text (most committed
    continuation first) before the corpus (in the index's order), each starting with a different
    token: (chains [B, K, D], known [B, K], ngram [B, K], source [B, K]: 0 = the request's own text,
    1 = the corpus)."""
    chains = jnp.concatenate([own[0], quoted[0]], axis=1)  # [B, 2K, D]
    known = jnp.concatenate([own[1], quoted[1]], axis=1)
    ngram = jnp.concatenate([own[2], quoted[2]], axis=1)
    source = jnp.concatenate([jnp.zeros_like(own[1]), jnp.ones_like(quoted[1])], axis=1)
    # known breaks ties only among the request's own chains (the most committed continuation, as the
    # lookup drafter ranks); corpus chains keep the index's order (most frequent continuation first):
    # their known is only how far their document goes on. Remaining ties: the earlier candidate.
    score = jnp.where(known > 0, (ngram * 2 + 1 - source) * (depth + 1) + jnp.where(source == 0, known, 0), -1)
    first = chains[:, :, 0]
    rows = jnp.arange(chains.shape[0])
    out = [], [], [], []
    for _ in range(branches):
        best = jnp.argmax(score, axis=1)
        found = jnp.max(score, axis=1) >= 0
        for acc, x in zip(out, (chains, known, ngram, source)):
            taken = x[rows, best]
            acc.append(taken if x is chains else jnp.where(found, taken, 0))
        score = jnp.where(first == first[rows, best][:, None], -1, score)
    return tuple(jnp.stack(x, 1).astype(jnp.int32) for x in out)


def find_in_corpus(params: dict, history: jax.Array, length: jax.Array, depth: int, branches: int,
                   max_ngram: int, min_ngram: int, window: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The corpus rule (module docstring). history [B, S], history[b, length[b]] = the root. Returns
    (chains [B, K, D] int32, known [B, K] drafted tokens per chain (0 = none), ngram [B, K] the match
    length of each chain (0 = none)), as ``lookup.find_chains``."""
    corpus, index, count = params["tokens"], params["index"], params["count"]
    if index.shape[0] < max_ngram:
        raise InputError(f"corpus drafter: the index holds n-grams up to {index.shape[0]}, the drafter asks for "
                         f"{max_ngram} (build the index with max_ngram >= {max_ngram})")
    batch = history.shape[0]
    size = index.shape[1]
    if corpus.shape[0] < size + depth + 1:
        raise InputError(f"corpus drafter: the index was built for continuations of {corpus.shape[0] - size - 1} "
                         f"tokens, the drafter asks for {depth} (build the index with depth >= {depth})")
    steps = max(1, int(size).bit_length())
    back = jnp.arange(max_ngram)
    key = jnp.take_along_axis(history, jnp.maximum(length[:, None] - back[None, :], 0), axis=1)  # [B, N]
    key_ok = (length[:, None] - back[None, :]) >= 0  # [B, N]

    def gram(entry, n):
        """[B, ..., n] the n-gram read backwards from each entry's corpus position."""
        p = index[n - 1][jnp.clip(entry, 0, size - 1)]
        return corpus[jnp.maximum(p[..., None] - jnp.arange(n), 0)], p

    best_n = jnp.zeros(batch, jnp.int32)
    cand = jnp.zeros((batch, window), jnp.int32)  # corpus positions of the chosen n's candidates
    cand_ok = jnp.zeros((batch, window), bool)
    for n in range(min_ngram, max_ngram + 1):  # longer matches overwrite shorter ones
        k = key[:, :n]

        def less(entry, k=k, n=n):  # entry's n-gram < the key, lexicographically
            g, _ = gram(entry, n)
            diff = g != k
            first = jnp.argmax(diff, axis=1)
            return jnp.any(diff, axis=1) & (jnp.take_along_axis(g, first[:, None], 1)[:, 0]
                                            < jnp.take_along_axis(k, first[:, None], 1)[:, 0])

        def search(_, lohi, less=less):
            lo, hi = lohi
            mid = (lo + hi) // 2
            go_right = (lo < hi) & less(mid)
            return jnp.where(go_right, mid + 1, lo), jnp.where((lo < hi) & ~go_right, mid, hi)

        start = (jnp.zeros(batch, jnp.int32), jnp.broadcast_to(count[n - 1], (batch,)))
        lo, _ = jax.lax.fori_loop(0, steps, search, start)
        entries = lo[:, None] + jnp.arange(window)[None, :]  # [B, W]
        g, p = gram(entries, n)  # [B, W, n], [B, W]
        match = (entries < count[n - 1]) & jnp.all(g == k[:, None, :], axis=2) & jnp.all(key_ok[:, :n], axis=1)[:, None]
        found = jnp.any(match, axis=1)
        best_n = jnp.where(found, n, best_n)
        cand = jnp.where(found[:, None], p, cand)
        cand_ok = jnp.where(found[:, None], match, cand_ok)

    # Up to ``branches`` candidates in index order, each starting with a new token (as find_chains).
    first_tok = corpus[cand + 1]  # [B, W]
    rows = jnp.arange(batch)
    chains, known, ngram = [], [], []
    avail = cand_ok
    steps_d = jnp.arange(1, depth + 1)
    for _ in range(branches):
        pick = jnp.argmax(avail, axis=1)
        found = jnp.any(avail, axis=1)
        start = cand[rows, pick]
        chain = corpus[start[:, None] + steps_d[None, :]]  # [B, D]
        inside = jnp.cumprod(chain != SEPARATOR, axis=1)  # stop at the document's end
        chains.append(jnp.where(inside > 0, chain, 0))
        known.append(jnp.where(found, jnp.sum(inside, axis=1), 0))
        ngram.append(jnp.where(found, best_n, 0))
        avail = avail & (first_tok != first_tok[rows, pick][:, None])
    return jnp.stack(chains, 1).astype(jnp.int32), jnp.stack(known, 1).astype(jnp.int32), jnp.stack(ngram, 1)


def read_documents(path: str, labels: bool = False) -> list:
    """Corpus documents: a .jsonl file (one per line: its "text" string or its "token_ids" list), another
    file (one document, its UTF-8 text), or a directory (every regular file at its top level whose name
    does not start with ".", sorted by name, each as above). With ``labels``, (label, document) pairs,
    the label naming the file (and line) for errors."""
    if not os.path.exists(path):
        raise InputError(f"corpus drafter: {path!r} does not exist")
    if os.path.isdir(path):
        names = sorted(n for n in os.listdir(path) if os.path.isfile(os.path.join(path, n)) and not n.startswith("."))
        if not names:
            raise InputError(f"corpus drafter: directory {path!r} holds no files")
        out = [doc for n in names for doc in read_documents(os.path.join(path, n), labels=True)]
        return out if labels else [d for _, d in out]
    try:  # the file's own line ends (CRLF stays CRLF: the text copied is the text given); a BOM is no text
        with open(path, encoding="utf-8-sig", newline="") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"corpus drafter: cannot read {path!r} as UTF-8 text: {e}") from e
    if not path.lower().endswith(".jsonl"):
        out = [(path, text)]
        return out if labels else [text]
    out = []
    for i, line in enumerate(text.split("\n"), 1):  # not splitlines: JSON strings may hold U+2028 etc.
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"corpus drafter: {path}:{i} is not JSON: {e}") from e
        if isinstance(rec, dict) and "text" in rec and "token_ids" in rec:
            raise InputError(f"corpus drafter: {path}:{i} has both \"text\" and \"token_ids\"; give one")
        if isinstance(rec, dict) and isinstance(rec.get("text"), str):
            out.append((f"{path}:{i}", rec["text"]))
        elif isinstance(rec, dict) and isinstance(rec.get("token_ids"), list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in rec["token_ids"]):
            out.append((f"{path}:{i}", rec["token_ids"]))
        else:
            raise InputError(f"corpus drafter: {path}:{i} needs a string field \"text\" or a list of ints "
                             f"\"token_ids\"")
    if not out:
        raise InputError(f"corpus drafter: {path!r} holds no documents")
    return out if labels else [d for _, d in out]


TOKENIZE_CHARS = 1 << 20
SHORT_TEXT_CHARS = 4096  # text corpora this short are tokenized in the checks before loading too


def _tokenize(tokenizer, text: str, label: str, total: int) -> list[int]:
    """A document's token ids, tokenized in pieces of whole lines of at most TOKENIZE_CHARS characters:
    a fast tokenizer holds ~500 bytes per token of a call (2.7M tokens: +1.4 GB), so one call on a
    large file could run the machine out of memory before the corpus's size is ever checked. Tokens
    at a piece's start may differ from one call's; they only seed drafts, which the LLM verifies.
    ``total``: corpus tokens before this document, to refuse a corpus past MAX_CORPUS_TOKENS as soon
    as it is."""
    ids: list[int] = []
    start = 0
    while start < len(text):
        end = len(text) if len(text) - start <= TOKENIZE_CHARS else text.rfind("\n", start, start + TOKENIZE_CHARS) + 1
        if end <= start:  # a line longer than a piece: it is tokenized whole
            end = text.find("\n", start + TOKENIZE_CHARS) + 1 or len(text)
        ids += tokenizer(text[start:end], add_special_tokens=False)["input_ids"]
        if total + len(ids) + 1 > MAX_CORPUS_TOKENS:
            raise InputError(f"corpus drafter: the corpus passes {MAX_CORPUS_TOKENS} tokens (with separators) "
                             f"in {label}")
        start = end
    return ids


def corpus_drafter(model, texts, capacity: int | None = None, labels=None, *, bucket: bool = False,
                   **settings) -> Bound:
    """A ``Bound`` corpus drafter over documents (strings, tokenized with the model's tokenizer without
    special tokens, or token-id lists); ``settings`` are ``CorpusDrafter`` fields, ``capacity`` and
    ``labels`` (names for errors) as in ``build_index``; ``bucket`` (without ``capacity``): index it at
    ``capacity_bucket`` of its size, so that an edited corpus of about the same size reuses the loop."""
    drafter = CorpusDrafter(**settings)
    if isinstance(texts, (str, bytes)):
        raise InputError("corpus drafter: pass a list of documents, not one string")
    texts = list(texts)
    labels = list(labels) if labels is not None else [f"document {i}" for i in range(len(texts))]
    if len(labels) != len(texts):  # zip would drop the documents past the shorter list
        raise InputError(f"corpus drafter: {len(labels)} labels for {len(texts)} documents; give one per document")
    docs, total = [], 0
    for label, t in zip(labels, texts):
        if isinstance(t, str):
            if model.tokenizer is None:
                raise InputError(f"corpus drafter: {label} is a string but the model has no tokenizer; pass token ids")
            docs.append(_tokenize(model.tokenizer, t, label, total))
        else:
            docs.append(t)
        total += len(docs[-1]) + 1
    if bucket and capacity is None and total <= MAX_CORPUS_TOKENS:
        capacity = capacity_bucket(total)
    index = build_index(docs, drafter.corpus_max_ngram, drafter.depth, model.config.vocab_size, capacity, labels)
    return Bound(drafter, index)


_NAMES = {"depth": "depth", "branches": "branches", "ngram": "max_ngram", "min-ngram": "min_ngram",
          "corpus-ngram": "corpus_max_ngram", "corpus-min-ngram": "corpus_min_ngram", "window": "window"}


def parse_arg(arg: str) -> tuple[str, dict]:
    """``corpus:PATH`` or ``corpus:PATH,depth=D,branches=K,ngram=N,min-ngram=M,corpus-ngram=N,corpus-min-ngram=M,
    window=W`` (ngram / min-ngram: matches in the request's own text; corpus-ngram / corpus-min-ngram: in the
    corpus)."""
    path, *items = arg.split(",")
    if not path:
        raise InputError("--drafter corpus:PATH needs the corpus path (a .jsonl, a text file or a directory), "
                         "or auto / a shipped corpus's name")
    values = parse_int_settings(items, _NAMES, f"--drafter corpus:{arg}", f"corpus:PATH then comma-separated "
                                f"{'/'.join(_NAMES)}=N items (a path may not contain commas)")
    CorpusDrafter(**values)  # settings checked before the corpus is read
    return path, values


def from_arg(arg: str, llm, *, load: bool, expansion, draft: str) -> Bound:
    """``--drafter corpus:ARG`` (see ``parse_arg``): ``corpus:auto`` (the shipped corpus of the LLM's own
    answers), ``corpus:NAME`` (a shipped corpus, ``registry.corpus_names()``) or ``corpus:PATH``. Without
    ``load`` (the checks before the weights load) the corpus files are read and checked too, not yet
    tokenized and indexed."""
    from specjax.io import registry

    path, values = parse_arg(arg)
    if path == "auto" or registry.is_corpus(path):
        if os.path.exists(path):
            shipped = "the shipped corpus of the LLM's answers" if path == "auto" else f"the shipped corpus {path!r}"
            raise InputError(f"--drafter corpus:{path} names both {shipped} and the path {os.path.abspath(path)!r}; "
                             f"for the path write corpus:./{path}")
        name = registry.default_corpus(llm.config) if path == "auto" else path
        return shipped_corpus_drafter(name, llm, load=load, **values)
    named = read_documents(path, labels=True)
    if not load:  # the token-id documents checked now, before the weights load (texts are tokenized later)
        text = next((label for label, d in named if isinstance(d, str)), None)
        if text is not None and llm.tokenizer is None:
            raise InputError(f"corpus drafter: {text} is text but the model has no tokenizer; give its documents as "
                             f"token ids (\"token_ids\" in a .jsonl)")
        given = [(label, d) for label, d in named if not isinstance(d, str)]
        arrays = document_arrays([d for _, d in given], llm.config.vocab_size, [label for label, _ in given])
        texts = [d for _, d in named if isinstance(d, str)]
        if not any(a.size >= 2 for a in arrays) and sum(map(len, texts)) < SHORT_TEXT_CHARS:
            # whether the texts make a document of two tokens: known cheaply for short ones, which are the
            # ones that may not (found after the weights loaded, before)
            tokens = [np.asarray(llm.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
            require_copyable(arrays + tokens)
        return Bound(CorpusDrafter(**values), ())
    return corpus_drafter(llm, [d for _, d in named], labels=[label for label, _ in named], bucket=True, **values)


def save_documents(path: str, documents) -> None:
    """Token-id documents as one .npz (``tokens``: all of them concatenated, uint16 where every id fits;
    ``offsets`` [n + 1]: document i is tokens[offsets[i]:offsets[i + 1]])."""
    docs = [np.asarray(d) for d in documents]
    for i, d in enumerate(docs):
        if d.ndim != 1 or (d.size and (d.dtype.kind not in "iu" or d.dtype == bool)):
            raise InputError(f"corpus documents: document {i} must be a flat list of int token ids, got dtype "
                             f"{d.dtype} and shape {d.shape}")
    tokens = np.concatenate([d.astype(np.int64) for d in docs]) if docs else np.zeros(0, np.int64)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2 ** 31):
        bad = tokens[(tokens < 0) | (tokens >= 2 ** 31)][0]
        raise InputError(f"corpus documents: token id {int(bad)} is not in [0, 2**31)")
    dtype = np.uint16 if not tokens.size or tokens.max() < 2 ** 16 else np.int32
    offsets = np.concatenate([[0], np.cumsum([d.size for d in docs])]).astype(np.int64)
    np.savez_compressed(path, tokens=tokens.astype(dtype), offsets=offsets)


def load_documents(path: str) -> list[np.ndarray]:
    """The documents of a ``save_documents`` file, checked (keys, shapes, offsets)."""
    try:
        z = np.load(path)
    except (OSError, ValueError) as e:
        raise InputError(f"corpus documents {path}: not a readable .npz: {e}") from e
    if not isinstance(z, np.lib.npyio.NpzFile):
        raise InputError(f"corpus documents {path}: a .npy array, not an .npz of tokens and offsets")
    with z:
        missing = {"tokens", "offsets"} - set(z.files)
        if missing:
            raise InputError(f"corpus documents {path}: missing {sorted(missing)} (has {sorted(z.files)})")
        try:
            tokens, offsets = z["tokens"], z["offsets"]
        except (OSError, ValueError) as e:  # e.g. object arrays (pickles are not loaded)
            raise InputError(f"corpus documents {path}: unreadable tokens or offsets: {e}") from e
    for key, a in (("tokens", tokens), ("offsets", offsets)):
        if a.dtype.kind not in "iu":
            raise InputError(f"corpus documents {path}: {key} must hold integers, got dtype {a.dtype}")
    if tokens.ndim != 1 or offsets.ndim != 1 or offsets.size < 1 or offsets[0] != 0 or offsets[-1] != tokens.size \
            or np.any(np.diff(offsets) < 0):
        raise InputError(f"corpus documents {path}: offsets {offsets.shape} must rise from 0 to the {tokens.size} "
                         f"tokens (tokens shape {tokens.shape})")
    tokens = tokens.astype(np.int64)
    return [tokens[a:b] for a, b in zip(offsets[:-1], offsets[1:])]


def shipped_corpus_drafter(name: str, llm, load: bool = True, **settings) -> Bound:
    """The corpus drafter over a shipped corpus (``registry.corpus_names()``), refused for an LLM other than
    the one whose tokenizer and answers it holds; ``settings`` are ``CorpusDrafter`` fields."""
    from specjax.io import registry

    path = registry.resolve_corpus(name)
    owner = registry.corpus_llm(name)
    if registry.registered_config(owner) != llm.config:
        raise InputError(f"corpus {name!r} holds token ids of {owner}, and this LLM is not {owner} (its configuration "
                         f"differs): pass a corpus of its own, corpus:PATH")
    if not load:
        return Bound(CorpusDrafter(**settings), ())
    docs = load_documents(path)
    return corpus_drafter(llm, docs, labels=[f"{name} document {i}" for i in range(len(docs))], **settings)
