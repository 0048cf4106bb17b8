"""Multi-host on one machine: ``specjax launch`` starts 2 processes x 4 CPU devices (gloo), the
pipeline axis across the processes and the tensor axis inside; tree-speculative generation gives
exactly the single-process tokens. Misconfigurations end with a clear error in bounded time."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

import specjax
from specjax.errors import ShardingError
from specjax.sharding.distributed import (
    Cluster,
    check_coordinator,
    detect_cluster,
    first_slurm_host,
)
from specjax.sharding.launch import free_port, launch
from specjax.speculation.drafters.ssm import derive_ssm
from tests.toy import mesh_model, mesh_prompts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _launch(n: int, *child_args: str, timeout: float = 300, env: dict | None = None,
            child: str = "tests.multihost_child"):
    cmd = [sys.executable, "-m", "specjax", "launch", "-n", str(n), "--cpu-devices", "4", "--timeout", str(timeout),
           "--", sys.executable, "-m", child, *child_args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout + 60,
                          env=dict(os.environ, **(env or {})))


def _failure(out) -> str:
    """How far each process got (the child's timestamped phase lines), the processes' error lines,
    then the end of stderr: a JAX abort's stack traces alone fill the last few thousand characters."""
    phases = [line for line in out.stderr.splitlines() if "] phase " in line]
    errors = [line for line in out.stderr.splitlines() if re.search(r"Error\b|error:", line) and "    @ " not in line]
    return "\n".join(phases + ["..."] + errors + ["..."]) + "\n" + out.stderr[-3000:]


def test_two_processes_pipeline_and_replicas_across_them_match_single_process():
    model = mesh_model("llama")
    prompts = mesh_prompts(model.config.vocab_size)
    kw = dict(max_new_tokens=12, ignore_eos=True)
    incremental = specjax.generate(model, prompts, mode="incremental", **kw)
    tree = specjax.generate(model, prompts, mode="tree", ssms=[derive_ssm(model, 2)], expansion=(1, 2, 1), **kw)
    # Process 1 starts 40 s late: more than gloo's 30 s for a first collective, which a slower host's
    # compilation took in CI; the processes wait for each other after compiling (wait_for_peers).
    out = _launch(2, "pp=2,tp=4;dp=2,tp=4", timeout=480, env={"SPECJAX_TEST_LATE_S": "40"})
    assert out.returncode == 0, _failure(out)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["process_count"] == 2 and got["devices"] == 8
    pipeline, replicas = got["pp=2,tp=4"], got["dp=2,tp=4"]
    assert pipeline["stage_processes"] == [[0], [1]]  # stage 0 lives in process 0, stage 1 in process 1
    assert replicas["replica_processes"] == [[0], [1]]  # requests split across the processes
    for run in (pipeline, replicas):
        assert run["incremental"] == incremental.token_ids
        assert run["tree"] == tree.token_ids == incremental.token_ids
        assert run["tree_passes"] == tree.stats["llm_passes"]
        assert run["histogram"] == tree.stats["tokens_per_pass_histogram"]


def test_processes_with_different_cost_tables_measure_together_and_share_process_0s_costs(tmp_path):
    """budget="auto" across 2 processes whose hosts' cost tables differ (tests/multihost_costs_child.py):
    they measure the same sizes (else the measuring passes' collectives deadlock) and use process 0's
    costs (else each process compiles a loop that branches differently); tokens stay the single-process ones."""
    model = mesh_model("llama")
    alone = specjax.generate(model, mesh_prompts(model.config.vocab_size), max_new_tokens=12, ignore_eos=True,
                             mode="incremental")
    out = _launch(2, str(tmp_path), child="tests.multihost_costs_child")
    assert out.returncode == 0, out.stderr[-4000:]
    runs = {}
    for line in out.stderr.splitlines():
        if m := re.match(r"\[process (\d)\] costs (.*)", line):
            got = json.loads(m.group(2))
            runs[got["run"], int(m.group(1))] = got
    assert sorted(runs) == [(k, p) for k in (1, 2, 3) for p in (0, 1)]
    for k in (1, 2, 3):
        assert runs[k, 0]["seconds"] == runs[k, 1]["seconds"], f"run {k}: the processes hold different costs"
        assert runs[k, 0]["tokens"] == runs[k, 1]["tokens"] == alone.token_ids
        assert all("process 0's measurement" in runs[k, p]["source"] for p in (0, 1))
    made_up = 5.0
    assert "measured now" in runs[1, 0]["source"] and made_up not in runs[1, 0]["seconds"]
    # Process 1's made-up table is ignored: process 0 lacked the costs, so both measured again.
    assert "measured now" in runs[2, 1]["source"] and made_up not in runs[2, 0]["seconds"]
    # Process 0's table decides: nobody measured, everyone runs with its (made-up) costs.
    assert "measured earlier" in runs[3, 1]["source"] and set(runs[3, 1]["seconds"]) == {made_up}
    assert not (tmp_path / "p1" / "tree_costs.json").exists(), "process 1 measured nothing in run 3: no table written"


def test_dead_peer_after_joining_stops_the_cluster_and_is_named(monkeypatch):
    """Process 1 dies after jax.distributed.initialize while process 0 enters collectives: no hang,
    the launcher names process 1 (not process 0, which JAX may take down as collateral)."""
    monkeypatch.chdir(ROOT)
    t0 = time.monotonic()
    with pytest.raises(ShardingError, match=r"process 1 exited with code 3.*stopped the other 1"):
        launch([sys.executable, "-m", "tests.multihost_child", "pp=2,tp=4", "20", "die"], num_processes=2,
               cpu_devices=4, timeout_s=120)
    assert time.monotonic() - t0 < 60


def test_process_count_mismatch_fails_within_the_timeout(monkeypatch):
    """2 processes started, each told there are 3: the coordinator waits for a third that never comes.
    A clear error naming what is missing, in bounded time, no C++ abort (SIGABRT)."""
    monkeypatch.chdir(ROOT)
    t0 = time.monotonic()
    with pytest.raises(ShardingError, match=r"process \d exited with code 1: process \d: (only 1 of 2 peer processes "
                                            r"reached the coordinator .* within 5s \(missing process ids \[2\]\)|"
                                            r"the coordinator .* did not see all 3 processes within 5s)"):
        launch([sys.executable, "-m", "tests.multihost_child", "pp=2,tp=4", "5"], num_processes=2, cpu_devices=4,
               timeout_s=120, env_overrides={"SPECJAX_NUM_PROCESSES": "3"})
    assert time.monotonic() - t0 < 60


def test_coordinator_without_peers_is_a_clear_error_in_bounded_time():
    """Process 0 of a 2-process cluster started alone (specjax generate --coordinator ...)."""
    port = free_port()
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "specjax", "generate", "--coordinator", f"127.0.0.1:{port}",
                        "--num-processes", "2", "--process-id", "0", "--init-timeout", "3", "--mesh", "tp=2",
                        "--prompt", "x"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2, r.stderr
    assert "only 0 of 1 peer processes reached the coordinator" in r.stderr and "missing process ids [1]" in r.stderr
    assert "Traceback" not in r.stderr
    assert time.monotonic() - t0 < 60


def test_dead_process_stops_the_others_and_names_it():
    child = "import os, sys, time; sys.exit(3) if os.environ['SPECJAX_PROCESS_ID'] == '1' else time.sleep(120)"
    t0 = time.monotonic()
    with pytest.raises(ShardingError, match=r"process 1 exited with code 3.*stopped the other 2") as failed:
        launch([sys.executable, "-c", child], num_processes=3, timeout_s=100)
    assert time.monotonic() - t0 < 30
    assert failed.value.exit_code == 3  # the launcher's status: the process's own (it was 2, as a usage error)
    killed = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    with pytest.raises(ShardingError, match=r"process 0 exited with code -9 \(SIGKILL\): see its output above$") \
            as failed:
        launch([sys.executable, "-c", killed], num_processes=1, timeout_s=100)
    assert failed.value.exit_code == 128 + signal.SIGKILL  # as a shell reports it


def test_launch_time_limit():
    with pytest.raises(ShardingError, match=r"2 of 2 processes \(ids \[0, 1\]\) still running after 1s; stopped them") \
            as failed:
        launch([sys.executable, "-c", "import time; time.sleep(60)"], num_processes=2, timeout_s=1)
    assert failed.value.exit_code == 124  # as timeout(1)


def test_the_launch_command_exits_with_its_process_status_and_2_for_bad_usage():
    def status(*args):
        return subprocess.run([sys.executable, "-m", "specjax", "launch", *args], capture_output=True, text=True,
                              timeout=120, cwd=ROOT).returncode

    assert status("-n", "1", "--", sys.executable, "-c", "import sys; sys.exit(7)") == 7
    assert status("-n", "0", "--", sys.executable, "-c", "pass") == 2


def _per_host(tiny_llama_dir, tmp_path, model1: str, prompts1: str):
    """``specjax launch -n 2`` of a generate command whose process 1 reads ``model1`` and ``prompts1``."""
    (tmp_path / "p.jsonl").write_text('{"prompt": [1, 2, 3]}\n{"prompt": [7, 8, 9, 10]}\n')
    (tmp_path / "q.jsonl").write_text('{"prompt": [1, 2, 3]}\n{"prompt": [40, 41, 42, 43]}\n')  # same lengths
    script = tmp_path / "per_host.sh"
    script.write_text(f'#!/bin/sh\nmodel={tiny_llama_dir}\nprompts={tmp_path}/p.jsonl\n'
                      f'[ "$SPECJAX_PROCESS_ID" = 1 ] && model={model1} && prompts={prompts1}\n'
                      f'exec {sys.executable} -m specjax generate --model "$model" --prompts-file "$prompts" '
                      f'--max-new-tokens 4 --mode incremental --mesh dp=2 --json\n')
    script.chmod(0o755)
    return subprocess.run([sys.executable, "-m", "specjax", "launch", "-n", "2", "--cpu-devices", "1", "--timeout",
                           "240", "--", str(script)], capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_an_error_on_one_host_after_joining_ends_the_cluster_at_once_with_its_status(tiny_llama_dir, tmp_path):
    """Process 1's model path is missing on its host: it printed the error, then waited in JAX's shutdown
    barrier for process 0 (still loading) for 5 minutes, and both aborted (SIGABRT)."""
    t0 = time.monotonic()
    r = _per_host(tiny_llama_dir, tmp_path, f"{tmp_path}/missing", f"{tmp_path}/p.jsonl")
    assert r.returncode == 2, r.stderr[-3000:]
    assert re.search(r"process 1 exited with code 2: .*missing.* is neither a registered model", r.stderr), \
        r.stderr[-3000:]
    assert time.monotonic() - t0 < 90


def test_processes_given_other_prompts_are_refused_before_loading(tiny_llama_dir, tmp_path):
    """Each process shards the inputs from its own host's copy: process 0 printed process 1's prompt's
    continuation as its own prompt's, with status 0."""
    # process 1's copy of the model has no weights: a check made after loading would fail there instead
    import shutil

    weightless = tmp_path / "weightless"
    shutil.copytree(tiny_llama_dir, weightless, ignore=shutil.ignore_patterns("*.safetensors"))
    r = _per_host(tiny_llama_dir, tmp_path, str(weightless), f"{tmp_path}/q.jsonl")
    assert r.returncode == 2 and not r.stdout, r.stderr[-3000:]
    assert "process(es) [1] of 2 got other arguments, prompts or models than process 0" in r.stderr, r.stderr[-3000:]
    same = _per_host(tiny_llama_dir, tmp_path, tiny_llama_dir, f"{tmp_path}/p.jsonl")
    assert same.returncode == 0, same.stderr[-3000:]
    assert len(same.stdout.splitlines()) == 2


_CHATTY = ("import sys; sys.stdout.buffer.write(b'caf\\xe9\\n'); sys.stdout.flush(); "
           "[print('line', i) for i in range(20000)]")  # a non-UTF-8 byte, then more than a pipe holds


def test_launch_passes_any_bytes_through_and_drains_a_process_to_its_end():
    """A byte that is not UTF-8 killed the pump, the process blocked on its full pipe and the launcher
    reported it as still running at the time limit."""
    r = subprocess.run([sys.executable, "-m", "specjax", "launch", "-n", "1", "--timeout", "100", "--",
                        sys.executable, "-c", _CHATTY], capture_output=True, timeout=200, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(b"caf\xe9\nline 0\n") and r.stdout.endswith(b"line 19999\n")


def test_launch_drains_its_processes_when_its_own_stdout_closes():
    """``specjax launch ... | head -1``: the launcher's stdout breaks; its process must still be read to
    its end (it blocked on a full pipe until the time limit)."""
    launcher = subprocess.Popen([sys.executable, "-m", "specjax", "launch", "-n", "1", "--timeout", "100", "--",
                                 sys.executable, "-c", _CHATTY], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                cwd=ROOT)
    assert launcher.stdout.readline() == b"caf\xe9\n"
    launcher.stdout.close()
    try:
        launcher.wait(60)  # well inside the launcher's own 100 s limit
    finally:
        launcher.kill()
    assert b"still running" not in launcher.stderr.read()


def test_a_hangup_of_the_launcher_stops_its_processes(tmp_path):
    """The processes run in sessions of their own: a closed terminal (SIGHUP) reached only the launcher,
    and they ran on."""
    child = ("import os, pathlib, time; "
             f"pathlib.Path({str(tmp_path)!r}, os.environ['SPECJAX_PROCESS_ID']).write_text(str(os.getpid())); "
             "time.sleep(120)")
    launcher = subprocess.Popen([sys.executable, "-m", "specjax", "launch", "-n", "2", "--timeout", "150", "--",
                                 sys.executable, "-c", child], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    deadline = time.monotonic() + 60
    while len(list(tmp_path.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.2)  # the pid files are written
    pids = [int(f.read_text()) for f in tmp_path.iterdir()]
    assert len(pids) == 2
    launcher.send_signal(signal.SIGHUP)
    launcher.wait(60)

    def alive(pid):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

    deadline = time.monotonic() + 30
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, "processes outlived their launcher's hangup"


def test_unreachable_coordinator_is_a_clear_error_in_bounded_time():
    cluster = Cluster(f"127.0.0.1:{free_port()}", num_processes=2, process_id=1)
    t0 = time.monotonic()
    with pytest.raises(ShardingError, match=r"process 1: coordinator 127.0.0.1:\d+ .* unreachable for 1.5s"):
        check_coordinator(cluster, timeout_s=1.5)
    assert time.monotonic() - t0 < 10


def test_cluster_detection_flags_environment_slurm():
    assert detect_cluster(environ={}) is None
    assert detect_cluster("10.0.0.1:1234", 4, 2, environ={}) == Cluster("10.0.0.1:1234", 4, 2, "flags")
    env = {"SPECJAX_COORDINATOR": "127.0.0.1:99", "SPECJAX_NUM_PROCESSES": "2", "SPECJAX_PROCESS_ID": "1"}
    assert detect_cluster(environ=env).process_id == 1
    slurm = {"SLURM_NTASKS": "8", "SLURM_PROCID": "5", "SLURM_STEP_NODELIST": "gpu[003-004,007],cpu1"}
    assert detect_cluster(slurm=True, environ=slurm) == Cluster("gpu003:12355", 8, 5, "SLURM")
    assert detect_cluster(environ=slurm) is None  # SLURM variables are read only when asked for
    assert first_slurm_host("node17") == "node17"
    with pytest.raises(ShardingError, match=r"\['num_processes', 'process_id'\] missing"):
        detect_cluster("10.0.0.1:1234", environ={})
    with pytest.raises(ShardingError, match=r"\['SPECJAX_PROCESS_ID'\] missing"):
        detect_cluster(environ={k: v for k, v in env.items() if k != "SPECJAX_PROCESS_ID"})
    with pytest.raises(ShardingError, match=r"process_id \(flags\) must be in \[0, 2\), got 2"):
        detect_cluster("10.0.0.1:1234", 2, 2, environ={})
    with pytest.raises(ShardingError, match="must be HOST:PORT"):
        detect_cluster("10.0.0.1", 2, 0, environ={})
    with pytest.raises(ShardingError, match="SLURM_NTASKS / SLURM_PROCID are not set"):
        detect_cluster(slurm=True, environ={})


def test_launch_generate_json_is_valid_jsonl(tiny_llama_dir, tmp_path):
    """`specjax launch -n 2 ... generate --json`: stdout holds exactly one JSON record per prompt and
    nothing else (gloo's native connection lines go to stderr), with the single-process tokens."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": [1, 2, 3]}\n{"prompt": [7, 8, 9, 10]}\n')
    cmd = [sys.executable, "-m", "specjax", "launch", "-n", "2", "--cpu-devices", "4", "--timeout", "240", "--",
           sys.executable, "-m", "specjax", "generate", "--model", tiny_llama_dir, "--prompts-file", str(prompts),
           "--max-new-tokens", "6", "--mode", "incremental", "--mesh", "pp=2,tp=4", "--batch-size", "2", "--json"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    records = [json.loads(line) for line in r.stdout.splitlines()]  # every stdout line is JSON
    assert [rec["prompt"] for rec in records] == [[1, 2, 3], [7, 8, 9, 10]]
    alone = specjax.generate(specjax.load_model(tiny_llama_dir, progress=False), [[1, 2, 3], [7, 8, 9, 10]],
                             max_new_tokens=6, mode="incremental")
    assert [rec["token_ids"] for rec in records] == alone.token_ids


def test_wait_for_peers_meets_every_process_and_names_the_point_a_peer_never_reached():
    """Processes meet at a ``wait_for_peers`` point (the long-compiling programs are each followed by one); a point
    some process never reaches ends in a ShardingError naming it after the timeout, not in a hang."""
    out = _launch(2, timeout=60, child="tests.multihost_barrier_child")
    assert out.returncode == 0, out.stderr[-3000:]
    waited = {int(m.group(1)): float(m.group(2))
              for m in re.finditer(r"\[process (\d)\] met after waiting ([\d.]+)s", out.stderr)}
    assert sorted(waited) == [0, 1] and waited[0] >= 1.0  # process 0 waited for process 1's late arrival
    error = out.stdout[out.stdout.index("ShardingError: "):]
    # the time it waited, not the limit alone (a peer found dead by the heartbeat after 8 s read "waited 600s")
    assert re.match(r"ShardingError: process 0 waited [34]s \(of 3s\) for the other processes at "
                    r"'the program only process 0 compiled': not all arrived", error), error
    assert "reached the barrier: 1/2" in error  # JAX's own account: one of the two processes got there
