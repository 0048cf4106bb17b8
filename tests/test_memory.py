"""A KV cache that cannot fit in the memory free now is refused, naming the request's knobs, before the
weights load or a program compiles (``specjax.memory``). Before, ``specjax serve --slots 512`` of SmolLM2
(56 GiB of cache) loaded, compiled and was then killed by the kernel's OOM killer, status 137, no message."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

import specjax
from specjax import memory
from specjax.engine import Engine
from specjax.errors import InputError
from specjax.models.cache import init_cache

TINY_FREE = (64 * 1024, "the test's host")  # 64 KiB: less than any request's cache below


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_counted_bytes_are_what_init_cache_allocates(llama, dtype):
    cache = init_cache(llama.config, 3, 40, jnp.dtype(dtype))
    assert memory.kv_cache_bytes(llama.config, 3, 40, dtype) == cache.k.nbytes + cache.v.nbytes


def test_host_memory_is_meminfo_and_swap_capped_by_a_cgroup_limits_headroom(tmp_path):
    gib = 2 ** 30
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24683784 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n"
                       "SwapTotal:       2097152 kB\nSwapFree:        1048576 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    host = 20000000 * 1024 + gib  # swapped pages are slow, yet the run fits
    assert memory._host_available(str(meminfo), str(cgroup)) == host  # no cgroup files: meminfo alone
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text("123\n")
    assert memory._host_available(str(meminfo), str(cgroup)) == host  # no limit
    (cgroup / "memory.max").write_text(f"{4 * gib}\n")
    (cgroup / "memory.current").write_text(f"{gib}\n")
    assert memory._host_available(str(meminfo), str(cgroup)) == 3 * gib  # the container's headroom
    # the group's usage counts the page cache (a model file just read): its inactive part is dropped on demand,
    # so a container at its limit with 2 GiB of it had 2 GiB, not nothing
    (cgroup / "memory.current").write_text(f"{4 * gib}\n")
    (cgroup / "memory.stat").write_text(f"anon 1\nfile {3 * gib}\ninactive_file {2 * gib}\nactive_file 5\n")
    assert memory._host_available(str(meminfo), str(cgroup)) == 2 * gib
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # cgroup v1: no limit
    (v1 / "memory" / "memory.usage_in_bytes").write_text(f"{gib}\n")
    assert memory._host_available(str(meminfo), str(v1)) == host
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{6 * gib}\n")
    (v1 / "memory" / "memory.stat").write_text(f"cache {gib}\ntotal_inactive_file {gib // 2}\n")
    assert memory._host_available(str(meminfo), str(v1)) == 5 * gib + gib // 2
    assert memory._host_available(str(tmp_path / "none"), str(tmp_path / "none")) is None


def test_the_devices_counted_are_those_of_the_mesh_or_the_weights(llama):
    import jax

    from specjax.sharding import Parallel

    assert memory.local_devices_of(llama.params) == sorted({d for x in jax.tree.leaves(llama.params)
                                                            for d in x.devices()}, key=lambda d: d.id)
    mesh = Parallel.create("dp=2,tp=4").mesh
    assert memory.local_devices_of(llama.params, mesh) == sorted(mesh.devices.flat, key=lambda d: d.id)
    assert len(memory.local_devices_of(llama.params, mesh)) == 8
    assert memory.local_devices_of({}) is None


def test_a_cache_that_cannot_fit_is_refused_with_its_size_and_the_free_memory(llama):
    cfg = llama.config
    need = memory.kv_cache_bytes(cfg, 4, 1024, "float32")
    memory.check_cache_fits(cfg, 4, 1024, "float32", "--slots 4", available=(need, "host"))  # exactly fits
    with pytest.raises(InputError) as e:
        memory.check_cache_fits(cfg, 4, 1024, "float32", "--slots 4", available=(need - 1, "this host"))
    assert str(e.value).startswith(f"--slots 4: the KV cache of 4 requests x 1,024 positions needs "
                                   f"{memory.size_text(need)} ({cfg.num_layers} layers x {cfg.num_kv_heads} KV heads x "
                                   f"{cfg.head_dim} x float32, keys and values), but this host has ")
    # a cluster's processes each hold their share
    memory.check_cache_fits(cfg, 4, 1024, "float32", "x", processes=2, available=(need // 2, "host"))
    with pytest.raises(InputError, match=r"this process's 1/2 share"):
        memory.check_cache_fits(cfg, 4, 1024, "float32", "x", processes=2, available=(need // 2 - 1, "host"))
    assert [memory.size_text(n) for n in (12 * 2**40, 56 * 2**30 + 2**29, 3 * 2**20, 12800)] == [
        "12.0 TiB", "56.5 GiB", "3.0 MiB", "12.5 KiB"]


def test_unknown_free_memory_refuses_nothing(llama, monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda devices=None: None)  # no /proc/meminfo, no device stats
    memory.check_cache_fits(llama.config, 10**9, 1024, "float32", "x")


def test_this_hosts_free_memory_is_known():
    free, where = memory.available_bytes()
    assert where == "this host" and 0 < free


def test_the_generate_command_refuses_before_loading(tiny_llama_dir, monkeypatch, capsys, tmp_path):
    from specjax.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": [1, 2, 3]}\n{"prompt": [4, 5]}\n{"prompt": [6]}\n')
    monkeypatch.setattr(memory, "available_bytes", lambda devices=None: TINY_FREE)
    assert main(["generate", "--model", tiny_llama_dir, "--prompts-file", str(prompts), "--batch-size", "2",
                 "--max-new-tokens", "100", "--mode", "incremental"]) == 2
    err = capsys.readouterr().err
    assert "--batch-size 2 at --max-new-tokens 100: the KV cache of 2 requests x" in err, err
    assert "the test's host has 64.0 KiB free" in err and "loading" not in err and "Traceback" not in err


def test_the_api_and_the_engine_refuse_before_tracing_a_program(llama, monkeypatch):
    import jax

    monkeypatch.setattr(memory, "available_bytes", lambda devices=None: TINY_FREE)
    traced = []

    def listen(event, seconds, **kw):
        if event == "/jax/core/compile/jaxpr_trace_duration":
            traced.append(kw.get("fun_name"))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        jax.clear_caches()
        with pytest.raises(InputError, match=r"2 prompts at max_new_tokens=8: the KV cache of 2 requests x [\d,]+ "
                                             r"positions needs \d"):
            specjax.generate(llama, [[1, 2, 3], [4, 5]], max_new_tokens=8, mode="incremental")
        with pytest.raises(InputError, match=r"slots=3 with max_prompt_tokens=24, max_new_tokens=14: the KV cache "
                                             r"of 3 requests x 48 positions"):
            Engine(llama, slots=3, max_prompt_tokens=24, max_new_tokens=14, impl="xla")
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert not traced, f"traced before the refusal: {traced}"
