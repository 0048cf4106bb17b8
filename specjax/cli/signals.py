"""SIGTERM and SIGHUP (a scheduler's stop, ``timeout``, a closed terminal) as interrupts in the training
and conversion commands: Python's default for them ends the process at once, skipping the clean-up a
Ctrl-C runs (``specjax.io.checkpoint.written_aside`` removing its half-written ``.NAME.partial-*``
directory, which otherwise stayed beside the destination for good)."""

from __future__ import annotations

import contextlib
import signal
import threading

from specjax.sharding.launch import Interrupted

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _raise(signum, frame):
    raise Interrupted(signum)


@contextlib.contextmanager
def stop_signals_interrupt():
    """Within the block, SIGTERM and SIGHUP raise ``Interrupted`` (a KeyboardInterrupt whose ``signum``
    makes the status 128 + N) in the main thread; the handlers before are restored after it."""
    if threading.current_thread() is not threading.main_thread():  # handlers can only be set there
        yield
        return
    before = {s: signal.signal(s, _raise) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def interruptible(command):
    """A ``_cmd_*`` function run with SIGTERM and SIGHUP as interrupts (``stop_signals_interrupt``)."""
    import functools

    @functools.wraps(command)
    def run(args, out) -> int:
        with stop_signals_interrupt():
            return command(args, out)

    return run
