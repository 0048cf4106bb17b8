"""SIGTERM and SIGHUP (a scheduler's stop, ``timeout``, a closed terminal) as interrupts in the training
and conversion commands: Python's default for them ends the process at once, skipping the clean-up a
Ctrl-C runs (``specjax.io.checkpoint.written_aside`` removing its half-written ``.NAME.partial-*``
directory, which otherwise stayed beside the destination for good). ``specjax launch`` does the same
(``specjax.sharding.launch.stop_signals_interrupt``)."""

from __future__ import annotations

import functools

from specjax.sharding.launch import stop_signals_interrupt


def interruptible(command):
    """A ``_cmd_*`` function run with SIGTERM and SIGHUP as interrupts (status 128 + N)."""

    @functools.wraps(command)
    def run(args, out) -> int:
        with stop_signals_interrupt():
            return command(args, out)

    return run
