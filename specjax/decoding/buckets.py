"""Shape buckets: the sizes prompts, output buffers and KV caches are padded to, so that new requests
reuse compiled programs."""


from __future__ import annotations

# Cache buffers: 1024 slots, 4096, then doubling. Attention reads only the committed prefix
# (specjax.attention.xla) and prefill only the chunks a prompt needs
# (specjax.decoding.incremental.prefill), so a longer buffer costs memory (47 MB for 1024 SmolLM2
# slots) and its zeroing (about 12 ms on a 2-core Xeon), not pass time; and each bucket is one
# compiled program for every prompt length it holds: 900 prompt tokens with 128 new ones still share
# the first bucket with a one-line question (a program of SmolLM2 takes 4-6 s to compile on that
# CPU, the price every new power-of-two prompt bucket used to pay).
# A batch of many requests pays that padding once per request: beyond MAX_PADDING_SLOTS padded slots
# in all (750 MB of SmolLM2 cache), the buffer is the next power of two of what is needed instead.
MIN_CACHE = 1024
QUADRUPLE_UP_TO = 4096
MAX_PADDING_SLOTS = 16384
# Output buffers ([B, max_out] token ids, a shape of every step program): at least MIN_OUTPUT. A
# smaller buffer saves nothing measurable (128 int32 per request), while each power of two below it
# was a program of its own: `--max-new-tokens 64` and the default 128 compiled SmolLM2's default loop
# twice (16-20 s each on 2 cores), and so did every test asking for 8, 16, 32 or 64 tokens.
MIN_OUTPUT = 128


def next_pow2(n: int, minimum: int = 16) -> int:
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def output_bucket(max_new_tokens: int) -> int:
    """The output buffer length for ``max_new_tokens``: the next power of two, at least MIN_OUTPUT."""
    return next_pow2(max_new_tokens, MIN_OUTPUT)


def cache_bucket(slots: int, batch: int = 1) -> int:
    """The cache buffer length for ``slots`` needed slots per request: 1024, 4096, 8192, 16384, ...;
    for a batch whose padding would exceed MAX_PADDING_SLOTS, the next power of two of ``slots``."""
    size = MIN_CACHE
    while size < slots:
        size *= 4 if size < QUADRUPLE_UP_TO else 2
    tight = next_pow2(slots)
    return size if batch * (size - tight) <= MAX_PADDING_SLOTS else tight
