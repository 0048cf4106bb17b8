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


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _stat(text: str | None, key: str) -> int:
    for line in (text or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return 0


def _cgroup_headroom(cgroup: str) -> int | None:
    """What a cgroup's memory limit still allows (v2: memory.max; v1: memory/memory.limit_in_bytes), None
    without a limit. Its usage counts the page cache, which the kernel drops when the group needs the memory
    (the model file just read is most of it): the inactive file pages are counted as free, as container
    runtimes count them."""
    for limit_file, used_file, stat_file, inactive in (
            ("memory.max", "memory.current", "memory.stat", "inactive_file"),
            ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat",
             "total_inactive_file")):
        limit, used = _read(os.path.join(cgroup, limit_file)), _read(os.path.join(cgroup, used_file))
        if limit is None or used is None or limit.strip() == "max":
            continue
        try:
            limit_bytes, used_bytes = int(limit), int(used)
            reclaimable = _stat(_read(os.path.join(cgroup, stat_file)), inactive)
        except ValueError:
            continue
        if limit_bytes >= 2 ** 62:  # v1's "no limit" is a huge page-aligned number
            continue
        return max(0, limit_bytes - used_bytes + reclaimable)
    return None


def _host_available(meminfo: str = MEMINFO, cgroup: str = CGROUP) -> int | None:
    """MemAvailable (free memory plus what the kernel can reclaim at once) plus free swap, capped by a
    cgroup limit's headroom (a container's limit is not what /proc/meminfo shows); None where neither is
    readable."""
    kib = {}
    for line in (_read(meminfo) or "").splitlines():  # "MemAvailable:   20000000 kB"
        name, _, rest = line.partition(":")
        if rest.split() and rest.split()[0].isdigit():
            kib[name] = int(rest.split()[0])
    available = None
    if "MemAvailable" in kib:
        available = (kib["MemAvailable"] + kib.get("SwapFree", 0)) * 1024  # swapped, slow, yet it runs
    headroom = _cgroup_headroom(cgroup)
    if headroom is not None:
        available = headroom if available is None else min(available, headroom)
    return available


def local_devices_of(params=None, mesh=None) -> list | None:
    """This process's devices of a mesh, or of an already placed model's weights: where its cache will be
    (None where neither says)."""
    import jax

    if mesh is not None:
        found = set(mesh.devices.flat)
    else:
        found = {d for leaf in jax.tree.leaves(params) if isinstance(leaf, jax.Array) for d in leaf.devices()}
    local = sorted((d for d in found if d.process_index == jax.process_index()), key=lambda d: d.id)
    return local or None


def available_bytes(devices=None) -> tuple[int, str] | None:
    """(bytes free for new buffers, where) on this process's devices: the host's memory for CPU devices
    (they share it), else each accelerator's allocator limit minus what it holds, summed. None when
    unknown (no /proc/meminfo, a backend without memory statistics): then nothing is refused."""
    import jax

    devices = list(jax.local_devices() if not devices else devices)  # where the cache will be
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
                     available: tuple[int, str] | None = None, devices=None) -> None:
    """Refuse (``InputError`` naming ``what``, the request's knobs) an LLM cache larger than the memory free
    now on ``devices`` (default: this process's). ``processes``: a cluster's processes each hold about their
    share of it."""
    need = -(-kv_cache_bytes(cfg, batch, positions, dtype) // max(1, processes))
    available = available_bytes(devices) if available is None else available
    if available is None or need <= available[0]:
        return
    share = f" (this process's 1/{processes} share)" if processes > 1 else ""
    raise InputError(
        f"{what}: the KV cache of {batch} request{'s' if batch != 1 else ''} x {positions:,} positions needs "
        f"{size_text(need)}{share} ({cfg.num_layers} layers x {cfg.num_kv_heads} KV heads x {cfg.head_dim} "
        f"x {jnp.dtype(dtype).name}, keys and values), but {available[1]} has {size_text(available[0])} free: "
        f"fewer requests at a time or fewer tokens per request would fit")
