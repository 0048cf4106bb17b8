"""Whether a request's KV cache can fit at all, checked before anything is loaded, compiled or allocated.

The cache is [layers, batch, positions, KV heads, head dim] for keys and for values, allocated whole when
generation starts. One that cannot fit used to be found only then: after the weights loaded and the
programs compiled, as an allocation error, or, on a Linux host that overcommits, as the kernel's OOM
killer ending the process without a word. The check counts the LLM's cache alone, a lower bound of what
the run needs (weights, drafters' caches and temporaries come on top), against the memory free now: a
request it refuses could not have run.
"""

from __future__ import annotations

import os

import jax.numpy as jnp

from specjax.errors import InputError

GIB = 2 ** 30
MEMINFO = "/proc/meminfo"
CGROUP = "/sys/fs/cgroup"


def size_text(n: int) -> str:
    """Bytes as people read them: 11.9 TiB, 56.2 GiB, 3.0 MiB, 12.5 KiB."""
    for unit, scale in (("TiB", 2 ** 40), ("GiB", GIB), ("MiB", 2 ** 20)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 1024:.1f} KiB"


def kv_cache_bytes(cfg, batch: int, positions: int, dtype) -> int:
    """Bytes of an LLM cache of ``batch`` rows x ``positions`` (``specjax.models.cache.init_cache``)."""
    return 2 * cfg.num_layers * batch * positions * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize


def _host_available(meminfo: str = MEMINFO, cgroup: str = CGROUP) -> int | None:
    """MemAvailable (free memory plus what the kernel can reclaim at once), capped by a cgroup v2 limit's
    headroom (a container's limit is not what /proc/meminfo shows); None where neither is readable."""
    available = None
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    try:
        with open(os.path.join(cgroup, "memory.max")) as f:
            limit = f.read().strip()
        with open(os.path.join(cgroup, "memory.current")) as f:
            used = int(f.read().strip())
        if limit != "max":
            headroom = max(0, int(limit) - used)
            available = headroom if available is None else min(available, headroom)
    except (OSError, ValueError):
        pass
    return available


def available_bytes(devices=None) -> tuple[int, str] | None:
    """(bytes free for new buffers, where) on this process's devices: the host's memory for CPU devices
    (they share it), else each accelerator's allocator limit minus what it holds, summed. None when
    unknown (no /proc/meminfo, a backend without memory statistics): then nothing is refused."""
    import jax

    devices = list(jax.local_devices() if devices is None else devices)
    if all(d.platform == "cpu" for d in devices):
        host = _host_available()
        return None if host is None else (host, "this host")
    free = 0
    for d in devices:
        stats = d.memory_stats() if hasattr(d, "memory_stats") else None
        if not stats or "bytes_limit" not in stats:
            return None
        free += stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    return free, f"{len(devices)} {devices[0].platform} device{'s' if len(devices) > 1 else ''}"


def check_cache_fits(cfg, batch: int, positions: int, dtype, what: str, processes: int = 1,
                     available: tuple[int, str] | None = None) -> None:
    """Refuse (``InputError`` naming ``what``, the request's knobs) an LLM cache larger than the memory free
    now. ``processes``: a cluster's processes each hold about their share of it."""
    need = -(-kv_cache_bytes(cfg, batch, positions, dtype) // max(1, processes))
    available = available_bytes() if available is None else available
    if available is None or need <= available[0]:
        return
    share = f" (this process's 1/{processes} share)" if processes > 1 else ""
    raise InputError(
        f"{what}: the KV cache of {batch} request{'s' if batch != 1 else ''} x {positions:,} positions needs "
        f"{size_text(need)}{share} ({cfg.num_layers} layers x {cfg.num_kv_heads} KV heads x {cfg.head_dim} "
        f"x {jnp.dtype(dtype).name}, keys and values), but {available[1]} has {size_text(available[0])} free: "
        f"fewer requests at a time or fewer tokens per request would fit")
