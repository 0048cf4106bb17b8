"""``specjax launch``: start N local processes of one command as a JAX cluster (for tests and one-node
runs), watch them, and stop all of them when one fails or the time limit passes.

Each process gets ``SPECJAX_COORDINATOR=127.0.0.1:PORT``, ``SPECJAX_NUM_PROCESSES``,
``SPECJAX_PROCESS_ID`` (read by ``specjax.sharding.distributed.detect_cluster``) and, with
``--cpu-devices K``, ``JAX_NUM_CPU_DEVICES=K`` and ``JAX_PLATFORMS=cpu``. Process 0's stdout is
passed through unchanged; every other stream is copied to stderr prefixed with ``[process i]``.
On a real cluster use srun/mpirun with ``specjax generate --distributed slurm`` or explicit flags.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

from specjax.errors import ShardingError
from specjax.sharding.distributed import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID

# Known last words of a process, and what they mean for the person reading the launcher's error.
_DIAGNOSES = (
    ("RegisterTask", "not every process reached the coordinator in time: check that the process count "
                     "matches the processes actually started"),
    ("another task died", "a peer process died, so the others were stopped"),
    ("unreachable", "the coordinator could not be reached"),
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(stream, sink, prefix: str, tail: list):
    for line in iter(stream.readline, ""):
        tail.append(line)
        del tail[:-40]
        sink.write(prefix + line)
        sink.flush()
    stream.close()


def launch(command: list[str], num_processes: int, cpu_devices: int | None = None, port: int | None = None,
           timeout_s: float = 600.0, env_overrides: dict | None = None) -> int:
    """Run ``command`` as ``num_processes`` local processes; returns 0 when all succeed.

    Raises ShardingError naming the first process that failed (its exit code and the likely cause)
    or the time limit; the other processes are terminated in both cases."""
    if not command:
        raise ShardingError("specjax launch: no command given (specjax launch -n 2 -- COMMAND ...)")
    if num_processes < 1:
        raise ShardingError(f"--num-processes must be >= 1, got {num_processes}")
    port = port or free_port()
    procs, pumps, tails = [], [], []
    for i in range(num_processes):
        env = dict(os.environ, PYTHONUNBUFFERED="1", **{ENV_COORDINATOR: f"127.0.0.1:{port}",
                                                       ENV_NUM_PROCESSES: str(num_processes), ENV_PROCESS_ID: str(i)})
        if cpu_devices is not None:
            env.update(JAX_NUM_CPU_DEVICES=str(cpu_devices), JAX_PLATFORMS="cpu")
        env.update(env_overrides or {})
        p = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
        procs.append(p)
        for stream, sink, prefix in ((p.stdout, sys.stdout, "" if i == 0 else f"[process {i}] "),
                                     (p.stderr, sys.stderr, f"[process {i}] ")):
            tail: list = []
            tails.append((i, tail))
            t = threading.Thread(target=_pump, args=(stream, sink, prefix, tail), daemon=True)
            t.start()
            pumps.append(t)
    deadline = time.monotonic() + timeout_s
    failure = None
    while failure is None:
        codes = [p.poll() for p in procs]
        bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if bad:
            failure = bad[0]
        elif all(c == 0 for c in codes):
            break
        elif time.monotonic() > deadline:
            failure = (None, None)
        else:
            time.sleep(0.1)
    if failure is not None:
        _stop(procs)
    for t in pumps:
        t.join(timeout=5)
    if failure is None:
        return 0
    index, code = failure
    if index is None:
        raise ShardingError(f"specjax launch: {num_processes} processes still running after {timeout_s:g}s; "
                            f"stopped all of them")
    text = "".join("".join(tail) for i, tail in tails if i == index)
    why = next((d for key, d in _DIAGNOSES if key in text), "see its output above")
    signame = f" ({signal.Signals(-code).name})" if code < 0 and -code in signal.Signals._value2member_map_ else ""
    raise ShardingError(f"specjax launch: process {index} exited with code {code}{signame}: {why}; "
                        f"stopped the other {num_processes - 1}")


def _stop(procs, grace_s: float = 5.0) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    end = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
