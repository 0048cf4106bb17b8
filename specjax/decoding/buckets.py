"""Shape buckets: prompts and output buffers padded to powers of two, so new requests reuse compiled code."""


from __future__ import annotations


def _next_pow2(n: int, minimum: int = 16) -> int:
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())
