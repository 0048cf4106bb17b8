"""Attention whose cost follows the real lengths: the committed prefix read through a bucketed view,
plus the pass's own block (causal chain or token tree), in one softmax.

A forward pass of T tokens has written their K/V to the scratch slots ``length[b] + slots[b, i]``
(``slots`` defaults to ``0..T-1``). Query i of request b attends to

* the committed prefix, slots ``s < length[b]``, and
* the block: the pass's own tokens (causal, j <= i, when ``AttentionMeta.ancestor`` is None; or
  the token tree's ancestor bits), or for a drafting pass that scores one frontier of a larger
  tree, the tree's ``region`` slots ``[length[b], length[b] + region)``, by its ancestor bits.

**The prefix costs what is committed, not what is allocated.** The cache buffer is as long as the
longest request may grow, but a step reads only a static *view* of it: the smallest of
``prefix_views(S)`` (0, 128, 256, 384, 512, then four steps per doubling, then S) that covers the
longest committed length of the batch, chosen with ``lax.switch`` so one compiled program serves
every length. A decode step at 300 tokens of context reads 384 slots whether the buffer holds 1k or
8k; a prefill from an empty cache reads none. The block is T x T (T x region), never T x S; a prefill chunk's causal
block is read in query blocks, each against the keys up to its own last query only.

**Non-finite K/V** (NaN-poisoned unused slots, a token whose activations overflowed) reach exactly
the queries that attend to them: masked scores are replaced (never multiplied) by -inf, the prefix
view's values beyond each committed length are zeroed (0 * NaN would otherwise leak), and block
values that some query cannot see are zeroed and re-imposed as NaN on the queries that can.
GQA: query heads are grouped over their KV head, K/V are never repeated.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.attention.meta import AttentionMeta

MIN_VIEW = 128  # the smallest prefix view: below it, reading fewer slots saves nothing measurable
BLOCKED_QUERIES = 64  # from this many queries on (prefill chunks), the prefix is read in key blocks
KEY_BLOCK = 256  # prefix slots per masked block: [G * T, KEY_BLOCK] scores of a prefill chunk stay in cache
FULL_KEY_BLOCK = 512  # prefix slots per block below every committed length (no masks), when ...
MAX_BLOCK_SCORES = 1 << 20  # ... its [G * T, FULL_KEY_BLOCK] scores stay this small (measured, see _prefix_blocked)
CAUSAL_QUERY_BLOCK = 256  # a prefill chunk's own causal block is read in query blocks of this many (_causal_block)
FLAT_COLUMNS = 32  # up to this many query rows x KV heads, a prefix view is read in the cache's own layout (_flat)


def prefix_views(max_len: int) -> tuple[int, ...]:
    """Static prefix views of a cache of ``max_len`` slots: 0, then steps of MIN_VIEW up to 4 MIN_VIEW,
    then four steps per doubling (640, 768, 896, 1024, 1280, ...), then ``max_len``: a view reads at
    most a quarter more slots than the longest committed length needs (doubling views read up to
    twice as many: a decode step at 1.1k tokens of context read 2048 slots)."""
    views, v = [0], MIN_VIEW
    while v < max_len:
        views.append(v)
        v += max(MIN_VIEW, (1 << (v.bit_length() - 1)) // 4)
    return tuple(views) + (max_len,)


def block_mask(meta: AttentionMeta, num_queries: int, region: int) -> jax.Array:
    """bool [B, T, R]: query i sees block slot j (causal: j <= i; tree: bit j of its ancestor row)."""
    j = jnp.arange(region)
    if meta.ancestor is None:
        return jnp.broadcast_to(j[None, None, :] <= jnp.arange(num_queries)[None, :, None],
                                (meta.lengths.shape[0], num_queries, region))
    word = meta.ancestor[:, :, j // 32]  # [B, T, R]
    return ((word >> (j % 32).astype(jnp.uint32)) & jnp.uint32(1)) > 0


def attend(q: jax.Array, k_block: jax.Array | None, v_block: jax.Array | None, k_cache: jax.Array,
           v_cache: jax.Array, meta: AttentionMeta, scale: float, layer: jax.Array | None = None) -> jax.Array:
    """q: [B, T, H, Dh]; k_block, v_block: [B, T, KVH, Dh] the pass's own K/V (None: read the tree
    region from the cache); k_cache, v_cache: the cache with the block written, either one layer's
    [B, S, KVH, Dh] (``layer`` None) or all layers' [L, B, S, KVH, Dh] and the index ``layer``.
    Returns [B, T, H, Dh]; softmax and accumulation in float32 (float64 for a float64 run).

    With all layers given, only the slots read are sliced out of the stacked buffer: indexing the
    layer first would copy its whole [B, S] buffer on every layer of every step (measured: half of
    a decode step at 512 tokens of context with a 4096-slot buffer).

    Queries are laid out head-major once, [B, KVH, G * T, Dh] (G query heads per KV head, scaled),
    so every score matrix is a batched [G * T, keys] product with no per-block transposes."""
    if layer is None:
        k_cache, v_cache, layer = k_cache[None], v_cache[None], 0
    batch, num_q, heads, head_dim = q.shape
    kv_heads = k_cache.shape[3]
    groups = heads // kv_heads
    cd = jnp.promote_types(q.dtype, jnp.float32)
    rows = groups * num_q
    qh = (q * jnp.asarray(scale, q.dtype)).reshape(batch, num_q, kv_heads, groups, head_dim)
    qh = qh.transpose(0, 2, 3, 1, 4).reshape(batch, kv_heads, rows, head_dim)  # row = g * T + t
    lengths = meta.lengths

    # -- a prefill chunk: the prefix in key blocks, its own keys in causal query blocks --------------
    causal_chunk = (k_block is not None and meta.ancestor is None and meta.slots is None
                    and meta.region in (None, num_q) and num_q >= BLOCKED_QUERIES)
    if causal_chunk:
        if meta.empty_prefix:  # what _prefix_blocked returns for no committed slot, without its loops
            shape = (batch, kv_heads, rows)
            prefix = (jnp.full(shape, -jnp.inf, cd), jnp.zeros(shape, cd), jnp.zeros(shape + (head_dim,), cd))
        else:
            prefix = _prefix_blocked(qh, k_cache, v_cache, layer, lengths, cd)
        out = _causal_block(qh.reshape(batch, kv_heads, groups, num_q, head_dim), k_block, v_block, prefix, cd)
        return out.transpose(0, 3, 1, 2, 4).reshape(batch, num_q, heads, head_dim).astype(q.dtype)

    # -- the block: the pass's own tokens, or the tree region of the cache -----------------------
    if k_block is None or meta.slots is not None or (meta.region not in (None, num_q)):
        region = meta.region or num_q
        idx = jnp.minimum(lengths[:, None] + jnp.arange(region)[None, :], k_cache.shape[2] - 1)
        rows_b = jnp.arange(batch)[:, None]
        k_block, v_block = k_cache[layer, rows_b, idx], v_cache[layer, rows_b, idx]  # [B, R, KVH, Dh]
    region = k_block.shape[1]
    mask = jnp.tile(block_mask(meta, num_q, region), (1, groups, 1))[:, None]  # [B, 1, G * T, R]
    finite = jnp.all(jnp.isfinite(k_block), axis=-1) & jnp.all(jnp.isfinite(v_block), axis=-1)  # [B, R, KVH]
    sees_bad = jnp.any(mask & ~finite.transpose(0, 2, 1)[:, :, None, :], axis=-1)  # [B, KVH, G * T]
    v_block = jnp.where(finite[..., None], v_block, 0)
    s_block = jnp.einsum("bkmd,brkd->bkmr", qh, k_block, preferred_element_type=cd)
    s_block = jnp.where(mask, s_block, -jnp.inf)

    # -- the committed prefix ------------------------------------------------------------------------
    if num_q >= BLOCKED_QUERIES:  # many queries: key blocks small enough for the scores to stay in cache
        prefix = _prefix_blocked(qh, k_cache, v_cache, layer, lengths, cd)
    else:  # decoding, tree passes, drafting: one read of the smallest view that covers the prefix
        qg = qh.reshape(batch, kv_heads, groups, num_q, head_dim).transpose(0, 3, 1, 2, 4)  # [B, T, KVH, G, Dh]
        prefix = _prefix_through_view(qg, k_cache, v_cache, layer, lengths, cd)

    # -- one softmax over both ---------------------------------------------------------------------
    out = jnp.where(sees_bad[..., None], jnp.nan, _merge_block(prefix, s_block, v_block, cd))
    out = out.reshape(batch, kv_heads, groups, num_q, head_dim).transpose(0, 3, 1, 2, 4)
    return out.reshape(batch, num_q, heads, head_dim).astype(q.dtype)


def _causal_block(qg, k_block, v_block, prefix, cd):
    """A prefill chunk's own causal block merged with its prefix's softmax state: queries in blocks of
    CAUSAL_QUERY_BLOCK rows, query block i against the chunk's keys ``[0, (i + 1) * QB)`` only, so
    half the masked upper triangle is never computed (3/4 of the T x T products for 2 blocks).
    Measured on 2 Xeon cores (SmolLM2, 512-token chunks, alternating in one process): 1024/2048/4096-
    token prompts 1.27/3.02/7.59 s with one T x T block, 1.18/2.84/7.29 s with 256-query blocks,
    1.19/2.82/7.20 s with 128-query ones, whose extra products cost compile time (a SmolLM2 prefill
    program 3.0 -> 3.5 s).
    qg: [B, KVH, G, T, Dh] scaled queries; k_block, v_block: [B, T, KVH, Dh]; prefix: (row max, row
    sum, unnormalised output) from ``_prefix_blocked``, rows g * T + t. Returns [B, KVH, G, T, Dh].

    As in ``attend``: a non-finite K/V of the chunk is zeroed (0 * NaN would reach the queries before
    it) and the queries that see it (causal: from its position on) are NaN."""
    batch, kv_heads, groups, num_q, head_dim = qg.shape
    qb = min(CAUSAL_QUERY_BLOCK, num_q)
    prefix = tuple(x.reshape((batch, kv_heads, groups, num_q) + x.shape[3:]) for x in prefix)
    finite = jnp.all(jnp.isfinite(k_block), axis=-1) & jnp.all(jnp.isfinite(v_block), axis=-1)  # [B, T, KVH]
    first_bad = jnp.min(jnp.where(finite, num_q, jnp.arange(num_q)[None, :, None]), axis=1)  # [B, KVH]
    k_block = jnp.where(finite[..., None], k_block, 0)
    v_block = jnp.where(finite[..., None], v_block, 0)
    outs = []
    for lo in range(0, num_q, qb):
        hi = min(lo + qb, num_q)
        rows = (batch, kv_heads, groups * (hi - lo))  # this query block's rows, g * (hi - lo) + t
        s = jnp.einsum("bkgtd,bskd->bkgts", qg[:, :, :, lo:hi], k_block[:, :hi], preferred_element_type=cd)
        seen = jnp.arange(hi)[None, :] <= jnp.arange(lo, hi)[:, None]  # [QB, hi]: causal
        s = jnp.where(seen, s, -jnp.inf).reshape(rows + (hi,))
        out = _merge_block(tuple(x[:, :, :, lo:hi].reshape(rows + x.shape[4:]) for x in prefix), s, v_block[:, :hi],
                           cd).reshape(batch, kv_heads, groups, hi - lo, head_dim)
        bad = jnp.arange(lo, hi)[None, None, :] >= first_bad[:, :, None]  # [B, KVH, QB]
        outs.append(jnp.where(bad[:, :, None, :, None], jnp.nan, out))
    return jnp.concatenate(outs, axis=3)


def attend_written_token(q: jax.Array, k: jax.Array, v: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                         lengths: jax.Array, scale: float, layer: jax.Array) -> jax.Array:
    """``attend`` for one query per request whose own K/V (k, v: [B, 1, KVH, Dh]) is already written at
    slot ``lengths[b]`` of the stacked cache (a decoding pass): the prefix view over ``lengths + 1``
    slots is the whole attention, with no separate block to mask and merge (a decode step of SmolLM2
    25.9 -> 24.8 ms on 2 Xeon cores). As in ``attend``, a non-finite K/V of the token makes the
    queries of its KV head NaN (an infinite score could otherwise just drop the token).
    q: [B, 1, H, Dh] -> [B, 1, H, Dh]."""
    batch, _, heads, head_dim = q.shape
    kv_heads = k_cache.shape[3]
    groups = heads // kv_heads
    cd = jnp.promote_types(q.dtype, jnp.float32)
    qg = (q * jnp.asarray(scale, q.dtype)).reshape(batch, 1, kv_heads, groups, head_dim)
    _, denom, acc = _prefix_through_view(qg, k_cache, v_cache, layer, lengths + 1, cd)
    out = acc / denom[..., None]  # [B, KVH, G, Dh]
    finite = jnp.all(jnp.isfinite(k[:, 0]) & jnp.isfinite(v[:, 0]), axis=-1)  # [B, KVH]
    out = jnp.where(finite[:, :, None, None], out, jnp.nan)
    return out.reshape(batch, 1, heads, head_dim).astype(q.dtype)


def _merge_block(prefix, s, v, cd):
    """The prefix's softmax state (row max, row sum, unnormalised output) and a block's masked scores
    s [B, KVH, M, R] over its values v [B, R, KVH, Dh] in one softmax: the output [B, KVH, M, Dh], 0
    for a row that sees nothing."""
    m_pre, l_pre, acc_pre = prefix
    m = _finite_or_zero(jnp.maximum(m_pre, jnp.max(s, axis=-1)))
    p = jnp.exp(s - m[..., None])
    carry = jnp.exp(m_pre - m)  # 0 when the prefix is empty (m_pre = -inf)
    denom = l_pre * carry + jnp.sum(p, axis=-1)
    acc = acc_pre * carry[..., None] + jnp.einsum("bkmr,brkd->bkmd", p.astype(v.dtype), v, preferred_element_type=cd)
    return acc / jnp.where(denom > 0, denom, 1)[..., None]


def _prefix_through_view(qg, k_cache, v_cache, layer, lengths, cd):
    """The committed prefix (slots ``< lengths[b]``) through the smallest of ``prefix_views`` that covers
    the batch's longest length, picked with ``lax.switch``: queries [B, T, KVH, G, Dh] -> (row max, row
    sum, unnormalised output) as ``_prefix_view``."""
    views = prefix_views(k_cache.shape[2])
    which = jnp.searchsorted(jnp.asarray(views, jnp.int32), jnp.max(lengths), side="left")
    return jax.lax.switch(which, [_prefix_view(v, cd) for v in views], qg, k_cache, v_cache, layer, lengths)


def _prefix_view(view: int, cd):
    """The committed prefix through the static view ``[0, view)`` of the cache (one branch of the switch).
    Takes queries [B, T, KVH, G, Dh] (few of them: contracting the cache in its own layout avoids
    copying the view); returns (row max, row sum, unnormalised output), rows as in ``attend``."""
    def run(qg, k_cache, v_cache, layer, lengths):
        batch, num_q, kv_heads, groups, head_dim = qg.shape
        rows = (batch, kv_heads, groups * num_q)
        if view == 0:
            return jnp.full(rows, -jnp.inf, cd), jnp.zeros(rows, cd), jnp.zeros(rows + (head_dim,), cd)
        # A view that is not a whole number of MIN_VIEW slots (the buffer's own length) is padded to
        # one: products over whole MIN_VIEW blocks sum in the same order whatever the view, so a
        # request's results do not depend on the buffer's length or its batch mates' (checked bit
        # for bit; a 301-slot view summed its 300 slots differently from a 384-slot one).
        padded = -(-view // MIN_VIEW) * MIN_VIEW
        k = _pad_slots(_slots(k_cache, layer, 0, view), padded)
        valid = jnp.arange(padded)[None, :] < lengths[:, None]  # [B, V]
        v = jnp.where(valid[:, :, None, None], _pad_slots(_slots(v_cache, layer, 0, view), padded), 0)
        if kv_heads * groups * num_q <= FLAT_COLUMNS:
            return _flat(qg, k, v, valid, cd)
        s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=cd)
        s = jnp.where(valid[:, None, None, None, :], s, -jnp.inf)
        m = jnp.max(s, axis=-1)
        p = jnp.exp(s - _finite_or_zero(m)[..., None])
        acc = jnp.einsum("bkgts,bskd->bkgtd", p.astype(v.dtype), v, preferred_element_type=cd)
        return m.reshape(rows), jnp.sum(p, axis=-1).reshape(rows), acc.reshape(rows + (head_dim,))
    return run


def _flat(qg, k, v, valid, cd):
    """The prefix view for a few queries (decoding): every query row against every (slot, KV head) row
    of the view in its own layout, [B, V * KVH, Dh], rows of another KV head masked out. KVH times the
    arithmetic of per-head products, but no copy of the view into a head-major layout (which cost
    more than the products themselves: a decode step at 1k tokens of context spent ~3x the K/V
    bytes' bandwidth time in attention). Returns (row max, row sum, unnormalised output) as ``run``."""
    batch, num_q, kv_heads, groups, head_dim = qg.shape
    view = k.shape[1]
    cols = qg.transpose(0, 2, 3, 1, 4).reshape(batch, kv_heads * groups * num_q, head_dim)  # col = k*G*T + g*T + t
    s = jnp.einsum("bnd,bcd->bnc", k.reshape(batch, view * kv_heads, head_dim), cols, preferred_element_type=cd)
    same_head = (jnp.arange(view * kv_heads) % kv_heads)[:, None] == jnp.arange(cols.shape[1])[None, :] // (
        groups * num_q)  # [V * KVH, C]
    seen = jnp.repeat(valid, kv_heads, axis=1)[:, :, None] & same_head[None]  # [B, V * KVH, C]
    s = jnp.where(seen, s, -jnp.inf)
    m = jnp.max(s, axis=1)  # [B, C]
    p = jnp.exp(s - _finite_or_zero(m)[:, None, :])
    acc = jnp.einsum("bnc,bnd->bcd", p.astype(v.dtype), v.reshape(batch, view * kv_heads, head_dim),
                     preferred_element_type=cd)
    rows = (batch, kv_heads, groups * num_q)
    return m.reshape(rows), jnp.sum(p, axis=1).reshape(rows), acc.reshape(rows + (head_dim,))


def _pad_slots(block: jax.Array, size: int) -> jax.Array:
    """[B, S, KVH, Dh] zero-padded to ``size`` slots (masked like any slot past a committed length)."""
    return block if block.shape[1] == size else jnp.pad(block, ((0, 0), (0, size - block.shape[1]), (0, 0), (0, 0)))


def _slots(cache: jax.Array, layer, start, size: int) -> jax.Array:
    """[B, size, KVH, Dh]: slots [start, start + size) of one layer of the stacked cache [L, B, S, KVH, Dh]."""
    _, batch, _, kv_heads, head_dim = cache.shape
    zero = jnp.int32(0)  # one index type (int64 under jax_enable_x64 would otherwise mix with int32)
    index = (jnp.asarray(layer, jnp.int32), zero, jnp.asarray(start, jnp.int32), zero, zero)
    return jax.lax.dynamic_slice(cache, index, (1, batch, size, kv_heads, head_dim))[0]


def _prefix_blocked(qh, k_cache, v_cache, layer, lengths, cd):
    """The committed prefix in key blocks with an online softmax (flash style), over
    only the blocks the longest committed length needs: for many queries at once (a prefill chunk),
    where one [rows, view] score matrix would spill out of the CPU caches on every elementwise pass.
    Returns (row max, row sum, unnormalised output), rows as in ``attend``.

    Blocks below every request's committed length hold no slot to mask: they run in a first loop,
    without the masks and FULL_KEY_BLOCK slots at a time while the scores stay small; the rest, up to
    the longest length, in a second loop of masked KEY_BLOCK-slot blocks. Measured on a 2-core EPYC
    (a 256-token prefill chunk over 3840 committed tokens, SmolLM2's heads): 28.2 ms per layer with
    masked 256-slot blocks only, 21.5 ms this way. MAX_BLOCK_SCORES: on 2 Xeon cores (2 MiB of L2
    each), 512-slot blocks of a 512-token chunk (1.5k score rows) beat 256-slot ones (a 4096-token
    prefill 7.61 vs 7.85 s, alternating in one process); on the EPYC they had lost (58 vs 44 ms)."""
    batch, kv_heads, rows, head_dim = qh.shape
    max_len = k_cache.shape[2]
    block = min(KEY_BLOCK, max_len)
    big = min(FULL_KEY_BLOCK if rows * FULL_KEY_BLOCK <= MAX_BLOCK_SCORES else KEY_BLOCK, max_len)

    def step(m, l, acc, k, v, valid):
        """One key block: k, v [B, KB, KVH, Dh]; valid [B, KB] or None (every slot committed)."""
        if valid is not None:
            v = jnp.where(valid[:, :, None, None], v, 0)
        s = jnp.einsum("bkmd,bskd->bkms", qh, k, preferred_element_type=cd)
        if valid is not None:
            s = jnp.where(valid[:, None, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        shift = _finite_or_zero(m_new)
        p = jnp.exp(s - shift[..., None])
        rescale = jnp.exp(m - shift)
        acc = acc * rescale[..., None] + jnp.einsum("bkms,bskd->bkmd", p.astype(v.dtype), v,
                                                    preferred_element_type=cd)
        return m_new, l * rescale + jnp.sum(p, axis=-1), acc

    def full_block(i, carry):
        start = i * big
        return step(*carry, _slots(k_cache, layer, start, big), _slots(v_cache, layer, start, big), None)

    base = jnp.maximum(jnp.min(lengths), 0) // big * big  # slots below it: full blocks

    def partial_block(i, carry):
        first = base + i * block
        start = jnp.minimum(first, max_len - block)  # the last block may overlap the previous one
        pos = start + jnp.arange(block)
        valid = (pos[None, :] < lengths[:, None]) & (pos[None, :] >= first)  # [B, KB], each slot once
        return step(*carry, _slots(k_cache, layer, start, block), _slots(v_cache, layer, start, block), valid)

    shape = (batch, kv_heads, rows)
    init = (jnp.full(shape, -jnp.inf, cd), jnp.zeros(shape, cd), jnp.zeros(shape + (head_dim,), cd))
    carry = jax.lax.fori_loop(0, base // big, full_block, init)
    return jax.lax.fori_loop(0, (jnp.max(lengths) - base + block - 1) // block, partial_block, carry)


def _finite_or_zero(m: jax.Array) -> jax.Array:
    """A row maximum usable as a softmax shift: -inf (nothing visible) becomes 0; NaN stays NaN, so a
    visible non-finite score still poisons its query."""
    return jnp.where(m == -jnp.inf, 0, m)


def attend_xla(q: jax.Array, k: jax.Array, v: jax.Array, meta: AttentionMeta, scale: float) -> jax.Array:
    """Attention of T queries over one layer's cache [B, S, KVH, Dh] whose block (or tree region) is
    already written; the tree-attention entry point's XLA path."""
    return attend(q, None, None, k, v, meta, scale)
