"""Multi-host setup on JAX's own runtime: ``jax.distributed.initialize`` + XLA collectives (gloo on CPU).

Where the cluster comes from, first match wins:

1. explicit values (``specjax generate --coordinator HOST:PORT --num-processes N --process-id I``);
2. ``SPECJAX_COORDINATOR`` / ``SPECJAX_NUM_PROCESSES`` / ``SPECJAX_PROCESS_ID`` (set by ``specjax launch``);
3. SLURM (``SLURM_NTASKS``, ``SLURM_PROCID``, first host of ``SLURM_STEP_NODELIST`` or
   ``SLURM_JOB_NODELIST``, port ``SPECJAX_COORDINATOR_PORT`` or 12355), only when asked for.

Every wait is bounded (by about twice ``timeout_s`` in all): a coordinator that cannot be reached
within ``timeout_s`` (or a port that cannot be bound) is a ShardingError before JAX is touched;
peers that never arrive end JAX's initialisation after another ``timeout_s`` (JAX then terminates
the process with DEADLINE_EXCEEDED; ``specjax launch`` reports it); a peer that dies later is
detected by the heartbeat (``max(10, timeout_s)``) and shutdown waits at most ``timeout_s``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import sys
import time

from specjax.errors import ShardingError

ENV_COORDINATOR = "SPECJAX_COORDINATOR"
ENV_NUM_PROCESSES = "SPECJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "SPECJAX_PROCESS_ID"
DEFAULT_SLURM_PORT = 12355


@dataclasses.dataclass(frozen=True)
class Cluster:
    coordinator: str  # "host:port" of process 0
    num_processes: int
    process_id: int
    source: str = "flags"  # where these values came from, for error messages

    def __post_init__(self):
        if not re.fullmatch(r"[^:\s]+:\d{1,5}", self.coordinator or ""):
            raise ShardingError(f"coordinator ({self.source}) must be HOST:PORT, got {self.coordinator!r}")
        if self.num_processes < 1:
            raise ShardingError(f"num_processes ({self.source}) must be >= 1, got {self.num_processes}")
        if not 0 <= self.process_id < self.num_processes:
            raise ShardingError(f"process_id ({self.source}) must be in [0, {self.num_processes}), "
                                f"got {self.process_id}")

    @property
    def host(self) -> str:
        return self.coordinator.rsplit(":", 1)[0]

    @property
    def port(self) -> int:
        return int(self.coordinator.rsplit(":", 1)[1])


def _int(value: str, name: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ShardingError(f"{name} must be an integer, got {value!r}") from None


def first_slurm_host(nodelist: str) -> str:
    """``"gpu[003-004,007],cpu1"`` -> ``"gpu003"``."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m or not m.group(1):
        raise ShardingError(f"cannot read a host name from SLURM nodelist {nodelist!r}")
    if m.group(2) is None:
        return m.group(1)
    return m.group(1) + m.group(2).split(",")[0].split("-")[0]


def detect_cluster(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
                   slurm: bool = False, environ=None) -> Cluster | None:
    """The cluster to join, or None for a single process. Partial settings are an error."""
    env = os.environ if environ is None else environ
    given = {"coordinator": coordinator, "num_processes": num_processes, "process_id": process_id}
    if any(v is not None for v in given.values()):
        missing = [k for k, v in given.items() if v is None]
        if missing:
            raise ShardingError(f"multi-host flags: {missing} missing (give --coordinator, --num-processes and "
                                f"--process-id together)")
        return Cluster(coordinator, int(num_processes), int(process_id), "flags")
    names = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
    if any(n in env for n in names):
        missing = [n for n in names if n not in env]
        if missing:
            raise ShardingError(f"environment: {missing} missing (set {list(names)} together)")
        return Cluster(env[ENV_COORDINATOR], _int(env[ENV_NUM_PROCESSES], ENV_NUM_PROCESSES),
                       _int(env[ENV_PROCESS_ID], ENV_PROCESS_ID), "SPECJAX_* environment")
    if slurm:
        if "SLURM_NTASKS" not in env or "SLURM_PROCID" not in env:
            raise ShardingError("SLURM requested but SLURM_NTASKS / SLURM_PROCID are not set (run under srun)")
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        if not nodelist:
            raise ShardingError("SLURM requested but neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST is set")
        port = _int(env.get("SPECJAX_COORDINATOR_PORT", str(DEFAULT_SLURM_PORT)), "SPECJAX_COORDINATOR_PORT")
        return Cluster(f"{first_slurm_host(nodelist)}:{port}", _int(env["SLURM_NTASKS"], "SLURM_NTASKS"),
                       _int(env["SLURM_PROCID"], "SLURM_PROCID"), "SLURM")
    return None


def check_coordinator(cluster: Cluster, timeout_s: float) -> None:
    """Process 0: the port can be bound. Others: the coordinator accepts TCP within ``timeout_s``."""
    if cluster.process_id == 0:
        try:
            with socket.create_server(("", cluster.port)):
                pass
        except OSError as e:
            raise ShardingError(f"process 0 cannot serve as coordinator on port {cluster.port} ({cluster.source}): "
                                f"{e.strerror or e}") from None
        return
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((cluster.host, cluster.port), timeout=1.0):
                return
        except OSError as e:
            last = e
            time.sleep(0.2)
    raise ShardingError(f"process {cluster.process_id}: coordinator {cluster.coordinator} ({cluster.source}) "
                        f"unreachable for {timeout_s:g}s ({last}); is process 0 running and the address right?")


def initialize(cluster: Cluster | None, timeout_s: float = 60.0, cpu_devices: int | None = None) -> None:
    """Join the cluster (no-op for None). Call before any other JAX use in the process."""
    import jax

    if cpu_devices is not None:
        jax.config.update("jax_num_cpu_devices", int(cpu_devices))
    if cluster is None:
        return
    # CPU devices of different processes talk through gloo (no-op for GPU/TPU backends).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    check_coordinator(cluster, timeout_s)
    print(f"specjax: process {cluster.process_id}/{cluster.num_processes} joining {cluster.coordinator} "
          f"({cluster.source}; peers must arrive within {timeout_s:g}s)", file=sys.stderr, flush=True)
    timeout = max(1, int(timeout_s))
    try:
        jax.distributed.initialize(cluster.coordinator, num_processes=cluster.num_processes,
                                   process_id=cluster.process_id, initialization_timeout=timeout,
                                   heartbeat_timeout_seconds=max(10, timeout), shutdown_timeout_seconds=timeout)
    except RuntimeError as e:  # e.g. called after the backend started
        raise ShardingError(f"jax.distributed.initialize failed for process {cluster.process_id}: {e}") from None
    if jax.process_count() != cluster.num_processes:
        raise ShardingError(f"expected {cluster.num_processes} processes, JAX reports {jax.process_count()}")
