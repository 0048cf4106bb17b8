"""Multi-host setup on JAX's own runtime: ``jax.distributed.initialize`` + XLA collectives (gloo on CPU).

Where the cluster comes from, first match wins:

1. explicit values (``specjax generate --coordinator HOST:PORT --num-processes N --process-id I``);
2. ``SPECJAX_COORDINATOR`` / ``SPECJAX_NUM_PROCESSES`` / ``SPECJAX_PROCESS_ID`` (set by ``specjax launch``);
3. SLURM (``SLURM_NTASKS``, ``SLURM_PROCID``, first host of ``SLURM_STEP_NODELIST`` or
   ``SLURM_JOB_NODELIST``, port ``SPECJAX_COORDINATOR_PORT`` or 12355), only when asked for.

Every wait is bounded: before JAX is touched, the processes meet on the coordinator's port
(``rendezvous``), so an unreachable coordinator, a port that cannot be bound, a peer that never
arrives or a miscounted cluster is a ShardingError within ``timeout_s`` naming the problem (JAX's
own coordination service would abort the process instead); a peer that dies later is detected by
the heartbeat (``max(10, timeout_s)``); at exit a process waits for its live peers at most
``max(timeout_s, SHUTDOWN_S)``.

Processes compile at different speeds (a loaded host, a cold cache), and gloo gives a process 30 s
to meet its peers in a program's first collective: one process arriving later than that failed the
run ("Gloo context initialization failed: ... GetKeyValue() timed out"). So the programs whose
compilation takes long (the prefill and the decoding loop, ``decoding.host_step``; each pass the
tree budget measures, ``speculation.cost``) are followed by ``wait_for_peers`` (the coordination
service's barrier, up to ``COMPILE_SKEW_S``) before they run: the processes enter their collectives
together.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
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
        if not 1 <= self.port <= 65535:
            raise ShardingError(f"coordinator ({self.source}) port must be in [1, 65535], got {self.port}")
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
    _connect(cluster, timeout_s).close()


def _connect(cluster: Cluster, timeout_s: float) -> socket.socket:
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            return socket.create_connection((cluster.host, cluster.port), timeout=1.0)
        except OSError as e:
            last = e
            time.sleep(0.2)
    raise ShardingError(f"process {cluster.process_id}: coordinator {cluster.coordinator} ({cluster.source}) "
                        f"unreachable for {timeout_s:g}s ({last}); is process 0 running and the address right?")


_HELLO = "specjax-join"


def rendezvous(cluster: Cluster, timeout_s: float) -> None:
    """Meet every peer on the coordinator's port before ``jax.distributed.initialize`` binds it.

    JAX's coordination service aborts the whole process (SIGABRT, a C++ fatal error) when peers do
    not all arrive in time; meeting them first in Python turns a missing or miscounted peer into a
    ShardingError within ``timeout_s`` that names what is missing. Process 0 listens, each peer
    connects and says (num_processes, process_id), process 0 answers "go" once all have come."""
    deadline = time.monotonic() + timeout_s
    n = cluster.num_processes
    if cluster.process_id != 0:
        conn = _connect(cluster, timeout_s)
        with conn:
            conn.sendall(f"{_HELLO} {n} {cluster.process_id}\n".encode())
            conn.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                answer = conn.makefile("r").readline().strip()
            except OSError:
                answer = ""
        if answer != "go":
            raise ShardingError(f"process {cluster.process_id}: the coordinator {cluster.coordinator} did not see all "
                                f"{n} processes within {timeout_s:g}s ({answer or 'no answer'}); check that "
                                f"{n} processes were started with the same --num-processes")
        return
    try:
        server = socket.create_server(("", cluster.port))
    except OSError as e:
        raise ShardingError(f"process 0 cannot serve as coordinator on port {cluster.port} ({cluster.source}): "
                            f"{e.strerror or e}") from None
    peers: dict[int, socket.socket] = {}
    try:
        with server:
            while len(peers) < n - 1:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(set(range(1, n)) - set(peers))
                    raise ShardingError(f"process 0: only {len(peers)} of {n - 1} peer processes reached the "
                                        f"coordinator "
                                        f"{cluster.coordinator} within {timeout_s:g}s (missing process ids {missing}); "
                                        f"check --num-processes ({n}) against the processes actually started")
                server.settimeout(remaining)
                try:
                    conn, _ = server.accept()
                except socket.timeout:
                    continue
                conn.settimeout(max(0.1, deadline - time.monotonic()))
                try:
                    words = conn.makefile("r").readline().split()
                except OSError:
                    words = []
                if len(words) != 3 or words[0] != _HELLO or not words[1].isdigit() or not words[2].isdigit():
                    conn.close()  # not one of ours
                    continue
                count, pid = int(words[1]), int(words[2])
                if count != n:
                    conn.sendall(f"process {pid} was told {count} processes, process 0 {n}\n".encode())
                    conn.close()
                    raise ShardingError(f"process 0: process {pid} was started with {count} processes, process 0 with "
                                        f"{n}; give every process the same --num-processes")
                if pid in peers or not 0 < pid < n:
                    conn.close()
                    raise ShardingError(f"process 0: a second process claims process id {pid}" if pid in peers else
                                        f"process 0: a peer claims process id {pid}, outside [1, {n})")
                peers[pid] = conn
            for conn in peers.values():
                conn.sendall(b"go\n")
            for conn in peers.values():  # the peers close first, so no port lingers in TIME_WAIT here
                conn.settimeout(5.0)
                try:
                    conn.recv(1)
                except OSError:
                    pass
    finally:
        for conn in peers.values():
            conn.close()


# How long a finished process waits at JAX's shutdown barrier for peers that are still alive (JAX's own
# default): peers finish at different times (process 0 writes the outputs; on a loaded machine one
# process's teardown can run late). A dead peer does not make anyone wait that long: the heartbeat
# reports it. (A 2-process test aborted here in CI with one process of two at the barrier: process 0
# had failed in gloo's 30 s first-collective rendezvous because process 1 compiled late, and process
# 1 never got there; see wait_for_peers.)
SHUTDOWN_S = 300


def initialize(cluster: Cluster | None, timeout_s: float = 60.0, cpu_devices: int | None = None) -> None:
    """Join the cluster (no-op for None). Call before any other JAX use in the process."""
    import jax

    if cpu_devices is not None:
        jax.config.update("jax_num_cpu_devices", int(cpu_devices))
    if cluster is None:
        return
    # CPU devices of different processes talk through gloo (no-op for GPU/TPU backends).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    print(f"specjax: process {cluster.process_id}/{cluster.num_processes} joining {cluster.coordinator} "
          f"({cluster.source}; peers must arrive within {timeout_s:g}s)", file=sys.stderr, flush=True)
    if cluster.num_processes > 1:
        rendezvous(cluster, timeout_s)
    else:
        check_coordinator(cluster, timeout_s)
    timeout = max(1, int(timeout_s))
    try:
        jax.distributed.initialize(cluster.coordinator, num_processes=cluster.num_processes,
                                   process_id=cluster.process_id, initialization_timeout=timeout,
                                   heartbeat_timeout_seconds=max(10, timeout),
                                   shutdown_timeout_seconds=max(timeout, SHUTDOWN_S))
    except RuntimeError as e:  # e.g. called after the backend started
        raise ShardingError(f"jax.distributed.initialize failed for process {cluster.process_id}: {e}") from None
    if jax.process_count() != cluster.num_processes:
        raise ShardingError(f"expected {cluster.num_processes} processes, JAX reports {jax.process_count()}")


def joined_cluster() -> bool:
    """Whether this process joined a JAX cluster of several processes (``initialize``). Such a process
    must not leave through Python's normal exit after an error: JAX's shutdown barrier then waits for
    peers that will not come (up to ``SHUTDOWN_S``) and aborts."""
    if "jax" not in sys.modules:
        return False
    from jax._src import distributed as jax_distributed

    state = jax_distributed.global_state
    return state.client is not None and (state.num_processes or 1) > 1


def check_agreement(what: str, value) -> None:
    """Refuse a cluster whose processes were given different ``what`` (``value``: anything whose repr
    is stable: arguments, token ids, a config). Each process builds its shards of the inputs from its
    own host's copy, so prompts files that differed between hosts gave process 1's continuations as
    process 0's prompts' output, with status 0. Every process calls it, at the same point."""
    import jax

    if jax.process_count() == 1:
        return
    import numpy as np
    from jax.experimental import multihost_utils

    mine = np.frombuffer(hashlib.sha256(repr(value).encode()).digest(), np.uint8)
    every = np.asarray(multihost_utils.process_allgather(mine)).reshape(jax.process_count(), -1)
    differ = [i for i in range(len(every)) if not np.array_equal(every[i], every[0])]
    if differ:
        raise ShardingError(f"process(es) {differ} of {len(every)} got other {what} than process 0: every process "
                            f"must run the same command on the same inputs")


# How much later than the first process the last one may finish compiling a program. Compilation
# differs by host load and cache state; gloo alone allows 30 s. A dead peer is still found sooner, by
# the heartbeat.
COMPILE_SKEW_S = 600
_barriers = itertools.count()


def wait_for_peers(what: str, timeout_s: float = COMPILE_SKEW_S) -> None:
    """Wait until every process of the cluster got here (no-op in one process); ``what`` names the
    point in the error. Every process calls it at the same points in the same order (they run the same
    programs), so the n-th call of each process meets the n-th call of the others."""
    import jax

    if jax.process_count() == 1:
        return
    from jax._src import distributed as jax_distributed  # the client jax.experimental's own barriers use

    client = jax_distributed.global_state.client
    if client is None:
        raise ShardingError(f"{jax.process_count()} processes but no distributed client: join the cluster with "
                            "specjax.sharding.distributed.initialize")
    name = f"specjax:{next(_barriers)}:{what}"
    started = time.monotonic()
    try:
        client.wait_at_barrier(name, timeout_in_ms=int(timeout_s * 1000))
    except jax.errors.JaxRuntimeError as e:  # DEADLINE_EXCEEDED, or the service reporting a dead peer
        waited = time.monotonic() - started
        dead = any(word in str(e).lower() for word in ("heartbeat", "unhealthy", "another task died"))
        why = "a peer process died or lost its connection" if dead else \
            "not all arrived (one still compiling, dead, or running other code)"
        raise ShardingError(f"process {jax.process_index()} waited {waited:.0f}s (of {timeout_s:g}s) for the other "
                            f"processes at {what!r}: {why}: {e}") from None
