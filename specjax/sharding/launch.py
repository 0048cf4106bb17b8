"""``specjax launch``: start N local processes of one command as a JAX cluster (for tests and one-node
runs), watch them, and stop all of them when one fails or the time limit passes.

Each process gets ``SPECJAX_COORDINATOR=127.0.0.1:PORT``, ``SPECJAX_NUM_PROCESSES``,
``SPECJAX_PROCESS_ID`` (read by ``specjax.sharding.distributed.detect_cluster``) and, with
``--cpu-devices K``, ``JAX_NUM_CPU_DEVICES=K`` and ``JAX_PLATFORMS=cpu``. Process 0's stdout is
passed through unchanged; every other stream is copied to stderr prefixed with ``[process i]``.
If the launcher itself is interrupted, terminated or hung up on, it stops its processes first.
On a real cluster use srun/mpirun with ``specjax generate --distributed slurm`` or explicit flags.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

from specjax.errors import ShardingError
from specjax.sharding.distributed import (
    ENV_COORDINATOR,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
)

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


# gloo's per-connection chatter ("[Gloo] Rank 3 is connected to 7 peer ranks ..."): kept for the
# failure diagnosis, not shown.
_NOISE = re.compile(r"^\[Gloo\] Rank \d+ is connected to \d+ peer ranks")


def _pump(stream, sink, prefix: str, tail: list):
    """Copy a process's byte stream to ``sink`` line by line until it ends. It drains to the end whatever
    happens: bytes that are not UTF-8 pass through unchanged (decoded leniently for the diagnosis), and
    once the sink breaks (``specjax launch ... | head -1``) the rest is read and dropped. A pump that
    stopped would leave the process blocked on a full pipe, and the launcher would blame a timeout on it."""
    out = getattr(sink, "buffer", None)
    broken = False
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", errors="replace")
        tail.append(line)
        del tail[:-40]
        if broken or _NOISE.match(line):
            continue
        try:
            if out is not None:
                sink.flush()  # text written to the sink before, in order
                out.write(prefix.encode() + raw)
                out.flush()
            else:
                sink.write(prefix + line)
                sink.flush()
        except (OSError, ValueError):  # a closed pipe or file: keep draining
            broken = True
    stream.close()


def launch(command: list[str], num_processes: int, cpu_devices: int | None = None, port: int | None = None,
           timeout_s: float = 600.0, env_overrides: dict | None = None) -> int:
    """Run ``command`` as ``num_processes`` local processes; returns 0 when all succeed.

    Raises ``LaunchFailed`` naming the first process that failed (its exit code, which becomes the
    launcher's, and the likely cause) or the time limit (status 124); the other processes are
    terminated in both cases. Bad arguments raise ShardingError (status 2)."""
    if not command:
        raise ShardingError("specjax launch: no command given (specjax launch -n 2 -- COMMAND ...)")
    if num_processes < 1:
        raise ShardingError(f"--num-processes must be >= 1, got {num_processes}")
    if cpu_devices is not None and cpu_devices < 1:
        raise ShardingError(f"--cpu-devices must be >= 1, got {cpu_devices}")
    if port is not None and not 1 <= port <= 65535:
        raise ShardingError(f"--port must be in [1, 65535], got {port}")
    if not timeout_s > 0:
        raise ShardingError(f"--timeout must be > 0 seconds, got {timeout_s}")
    if shutil.which(command[0]) is None:
        raise ShardingError(f"specjax launch: command {command[0]!r} not found (not an executable file or on PATH)")
    port = port or free_port()
    procs, pumps, tails = [], [], []
    # The processes run in sessions of their own (stopped as groups), so a hangup of the launcher's terminal
    # does not reach them: SIGHUP stops them as SIGTERM and Ctrl-C do.
    with stop_signals_interrupt():  # the caller's handlers come back however this ends (a second Ctrl-C too)
        try:
            for i in range(num_processes):
                env = dict(os.environ, PYTHONUNBUFFERED="1", **{ENV_COORDINATOR: f"127.0.0.1:{port}",
                                                               ENV_NUM_PROCESSES: str(num_processes),
                                                               ENV_PROCESS_ID: str(i)})
                if cpu_devices is not None:
                    env.update(JAX_NUM_CPU_DEVICES=str(cpu_devices), JAX_PLATFORMS="cpu")
                env.update(env_overrides or {})
                p = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     start_new_session=True)
                procs.append(p)
                label = f"[process {i}] "
                for stream, sink, prefix in ((p.stdout, sys.stdout, "") if i == 0 else (p.stdout, sys.stderr, label),
                                             (p.stderr, sys.stderr, label)):
                    tail: list = []
                    tails.append((i, tail))
                    t = threading.Thread(target=_pump, args=(stream, sink, prefix, tail), daemon=True)
                    t.start()
                    pumps.append(t)
            failed = _watch(procs, time.monotonic() + timeout_s)
        finally:  # also on Ctrl-C / SIGTERM / SIGHUP of the launcher, even mid-start: never leave a cluster running
            _stop(procs)
    for t in pumps:
        t.join(timeout=5)
    if not failed:
        return 0
    if isinstance(failed, tuple):  # ("timeout", processes still running at the deadline)
        running = failed[1]
        raise LaunchFailed(f"specjax launch: {len(running)} of {num_processes} processes (ids {running}) still "
                           f"running after {timeout_s:g}s; stopped them", TIMEOUT_EXIT)
    text: dict = {}
    for i, tail in tails:  # stdout and stderr of each process
        text[i] = text.get(i, "") + "".join(tail)
    collateral = [i for i, _ in failed if "another task died" in text.get(i, "")]
    index, code = next(((i, c) for i, c in failed if i not in collateral), failed[0])  # blame the first real death
    own = [m.group(1).strip() for line in text.get(index, "").splitlines()
           if (m := re.search(r"(?:specjax: error:|specjax\.errors\.\w+Error:)(.*)", line))]
    why = own[-1] if own else next((d for key, d in _DIAGNOSES if key in text.get(index, "")), "see its output above")
    signame = f" ({signal.Signals(-code).name})" if code < 0 and -code in signal.Signals._value2member_map_ else ""
    others = f"; stopped the other {num_processes - 1}" if num_processes > 1 else ""
    # the process's own status, as a shell reports it (128 + N for a signal): mpirun and srun pass it on too
    raise LaunchFailed(f"specjax launch: process {index} exited with code {code}{signame}: {why}{others}",
                       code if code > 0 else 128 - code)


TIMEOUT_EXIT = 124  # as timeout(1)


class LaunchFailed(ShardingError):
    """A launched process failed (``exit_code``: its own status) or the time limit passed (124): the
    command's status tells them apart from a usage error (2)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Interrupted(KeyboardInterrupt):
    """The process was sent ``signum``; its status is then 128 + signum, as a shell reports it."""

    def __init__(self, signum: int):
        super().__init__(f"specjax received signal {signum}")
        self.signum = signum


def _raise_interrupt(signum, frame):
    raise Interrupted(signum)


@contextlib.contextmanager
def stop_signals_interrupt():
    """Within the block, SIGTERM and SIGHUP raise ``Interrupted`` (a KeyboardInterrupt, so the clean-up a
    Ctrl-C runs runs too) in the main thread, where handlers live; the handlers before come back after it,
    however the block ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {s: signal.signal(s, _raise_interrupt) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def _watch(procs, deadline: float):
    """Poll until all succeed ([]), some fail ([(index, code), ...] in the order seen) or the deadline
    (("timeout", ids of the processes still running)).
    After the first failure, wait briefly so that the processes it takes down are told apart from it."""
    failed: list = []
    settle = None
    while True:
        for i, p in enumerate(procs):
            code = p.poll()
            if code not in (None, 0) and all(i != j for j, _ in failed):
                failed.append((i, code))
        if failed:
            settle = settle or time.monotonic() + 1.0
            if time.monotonic() > settle or all(p.poll() is not None for p in procs):
                return failed
        elif all(p.poll() == 0 for p in procs):
            return []
        elif time.monotonic() > deadline:
            return "timeout", [i for i, p in enumerate(procs) if p.poll() is None]
        time.sleep(0.05)


def _stop(procs, grace_s: float = 5.0) -> None:
    """SIGTERM to every process group, SIGKILL to those still running after ``grace_s`` (JAX's preemption
    notifier catches SIGTERM, so a JAX process usually needs it). A second Ctrl-C while they stop (the
    grace period is easily long enough to press it) kills them at once: it had left them running."""
    try:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        end = time.monotonic() + grace_s
        for p in procs:
            try:
                p.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill(p)
    except KeyboardInterrupt:
        for p in procs:
            _kill(p)
        raise


def _kill(p) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:  # ended meanwhile
            pass
    p.wait()
