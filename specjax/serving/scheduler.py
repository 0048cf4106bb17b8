"""The request manager: a queue in front of the engine's slots, one thread that owns the engine.

Between two LLM passes the scheduler retires finished and cancelled requests (their slots are freed
at once) and admits waiting ones (prefill, insert). Prefill is **bounded, not chunked**: while other
requests are running, at most one prompt is prefilled between two steps, so a running request waits
for at most one prefill (of at most ``max_prompt_tokens`` tokens) per token step; when nothing is
running, every free slot is filled at once. Each request keeps its own sampling settings, budget,
stop tokens and statistics in its engine row, so its tokens never depend on its batch mates or on
when it joined.

The HTTP side talks to it through ``Ticket``s: ``submit`` queues one (or refuses it at once when the
queue is full or the server is shutting down), the scheduler thread pushes its events (new token ids,
then one end event) into the ticket's asyncio queue with ``call_soon_threadsafe``, ``cancel`` frees
its slot before the next step.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
import traceback

import numpy as np

from specjax.decoding.sampling import SamplingParams
from specjax.engine import Engine


class QueueFull(Exception):
    """The waiting queue holds ``max_queue`` requests already."""


class ShuttingDown(Exception):
    """The server stopped admitting requests."""


class EngineFailed(Exception):
    """The engine failed in a step; the server admits nothing more and exits."""


@dataclasses.dataclass(frozen=True)
class Submission:
    """One request at the token level: what the engine needs."""

    prompt: list[int]
    sampling: SamplingParams
    max_new_tokens: int
    stop_ids: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Tokens:
    ids: list[int]


@dataclasses.dataclass(frozen=True)
class Finished:
    reason: str  # "stop" (a stop token) or "length" (max_new_tokens)
    llm_passes: int  # this request's LLM passes, its prefill included
    tokens_per_pass: float  # mean tokens emitted per pass (prefill excluded)


@dataclasses.dataclass(frozen=True)
class Failed:
    message: str
    code: str  # "shutting_down", "generation_failed", "engine_error"


class Ticket:
    """One request's life in the scheduler, read by the HTTP side from ``events`` (an asyncio queue)."""

    def __init__(self, submission: Submission, loop: asyncio.AbstractEventLoop):
        self.submission = submission
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = False
        self.slot: int | None = None
        self.emitted = 0  # tokens already pushed
        self.passes = 0
        self.hist: np.ndarray | None = None  # its tokens-per-pass histogram, as of the last step
        self.closed = False  # an end event was pushed

    def _push(self, event) -> None:
        """From the scheduler thread. A closed event loop (server gone) has no reader left."""
        if self.closed:
            return
        if not isinstance(event, Tokens):
            self.closed = True
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:
            pass


class Scheduler:
    """Continuous batching over ``engine.slots`` slots; ``start`` runs it in a daemon thread."""

    def __init__(self, engine: Engine, *, max_queue: int, metrics=None, log=None):
        self.engine = engine
        self.max_queue = max_queue
        self.metrics = metrics
        self.log = log or (lambda *a: None)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: collections.deque[Ticket] = collections.deque()
        self._cancels: list[Ticket] = []
        self._slots: list[Ticket | None] = [None] * engine.slots
        self._admitting: list[Ticket] = []  # taken from the queue, not yet in a slot
        self._accepting = True
        self._stopping = False
        self._stop_message = ""
        self._thread: threading.Thread | None = None
        self.state = None
        self.steps = 0
        self.failure: str | None = None  # the engine's failure, once it failed
        self.on_failure = None  # called (on the scheduler thread) after an engine failure
        self.failed_at_stop = 0  # running requests that ``stop`` failed

    # -- the HTTP side ------------------------------------------------------------------------

    def start(self) -> None:
        self.state = self.engine.init()
        self._thread = threading.Thread(target=self._run, name="specjax-scheduler", daemon=True)
        self._thread.start()

    def submit(self, ticket: Ticket) -> None:
        with self._lock:
            if self.failure is not None:
                raise EngineFailed(self.failure)
            if not self._accepting:
                raise ShuttingDown()
            if len(self._queue) >= self.max_queue:
                raise QueueFull()
            self._queue.append(ticket)
            self._gauges()
            self._wake.notify()

    def cancel(self, ticket: Ticket) -> None:
        """The client went away or a stop string ended the request: free its slot before the next step."""
        with self._lock:
            if ticket.cancelled or ticket.closed:
                return
            ticket.cancelled = True
            if ticket in self._queue:
                self._queue.remove(ticket)
                ticket.closed = True
                self._gauges()
            else:
                self._cancels.append(ticket)
                self._wake.notify()

    def begin_shutdown(self, message: str = "the server is shutting down") -> None:
        """Stop admitting: queued requests fail now; running ones go on until ``stop``."""
        with self._lock:
            self._accepting = False
            queued, self._queue = list(self._queue), collections.deque()
            self._gauges()
        for t in queued:
            t._push(Failed(message, "shutting_down"))

    def stop(self, message: str = "the server shut down before the request finished", timeout: float = 30.0):
        """Stop the thread; requests still running fail with ``message``."""
        self.begin_shutdown()
        with self._lock:
            self._stopping, self._stop_message = True, message
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def healthy(self) -> bool:
        """Admitting requests, with its thread alive."""
        return self._accepting and self._thread is not None and self._thread.is_alive()

    def counts(self) -> tuple[int, int]:
        """(queued, busy slots)."""
        with self._lock:
            return len(self._queue), sum(t is not None for t in self._slots)

    # -- the scheduler thread -----------------------------------------------------------------

    def _gauges(self) -> None:  # under the lock
        if self.metrics is not None:
            self.metrics.queue_length.set(len(self._queue))
            self.metrics.busy_slots.set(sum(t is not None for t in self._slots))

    def _run(self) -> None:
        try:
            while self._iteration():
                pass
        except Exception as e:  # noqa: BLE001 - any engine failure ends every request with its message
            message = f"the engine failed: {type(e).__name__}: {e}"
            with self._lock:
                self.failure = message
                self._accepting = False
                tickets = [t for t in self._slots if t is not None] + self._admitting + list(self._queue)
                self._queue.clear()
                self._slots, self._admitting = [None] * len(self._slots), []
                self._gauges()
            for t in tickets:  # before the log: a log that fails (stderr a closed pipe) must not leave them waiting
                t._push(Failed(message, "engine_error"))
            self.log_safely(f"# specjax serve: the engine failed:\n{traceback.format_exc()}")
            if self.on_failure is not None:
                self.on_failure()  # the server exits, so that a supervisor can start it again
            return
        with self._lock:
            running = [t for t in self._slots if t is not None]
            self._slots = [None] * len(self._slots)
            self.failed_at_stop = len(running)
            self._gauges()
        for t in running:
            t._push(Failed(self._stop_message, "shutting_down"))

    def log_safely(self, text: str) -> None:
        """The log, where it cannot fail the scheduler: a server whose stderr went away (a closed pipe) goes on."""
        try:
            self.log(text)
        except Exception:  # noqa: BLE001, S110 - nowhere left to report it
            pass

    def _iteration(self) -> bool:
        with self._lock:
            while not (self._stopping or self._queue or self._cancels or any(self._slots)):
                self._wake.wait()
            if self._stopping:
                return False
            # Only a cancel whose ticket still holds its slot frees it: one that ended at the step after its
            # cancel (EOS, max_tokens) was released and counted by _deliver already.
            cancels, self._cancels = [t for t in self._cancels if t.slot is not None and self._slots[t.slot] is t], []
            for t in cancels:
                self._slots[t.slot] = None
            running = any(t is not None for t in self._slots)
            free = [i for i, t in enumerate(self._slots) if t is None]
            admit = []
            while free[len(admit):] and self._queue and not (running and admit):
                admit.append(self._queue.popleft())
            self._admitting = list(admit)
            self._gauges()
        for t in cancels:
            self.state = self.engine.release(self.state, t.slot)
            self._observe(t.hist)
        for t, slot in zip(admit, free):
            try:
                self._admit(t, slot)
            except Exception as e:  # noqa: BLE001 - one request's failure (say, its prompt) is not everyone's
                with self._lock:
                    if self._slots[slot] is t:
                        self._slots[slot] = None
                    self._gauges()
                t._push(Failed(f"the engine could not start the request: {type(e).__name__}: {e}", "engine_error"))
                self.log_safely(f"# specjax serve: admitting a request failed:\n{traceback.format_exc()}")
            finally:
                with self._lock:
                    self._admitting.remove(t)
        with self._lock:
            active = [(i, t) for i, t in enumerate(self._slots) if t is not None]
        if not active:
            return True
        self.state = self.engine.step(self.state)
        self.steps += 1
        if self.metrics is not None:
            self.metrics.llm_passes.inc()
        view = self.engine.read(self.state)
        for slot, t in active:
            t.passes += 1
            self._deliver(t, slot, view.tokens[slot], int(view.num_generated[slot]), bool(view.done[slot]),
                          bool(view.failed[slot]), view.tokens_per_pass[slot])
        return True

    def _admit(self, t: Ticket, slot: int) -> None:
        s = t.submission
        row = self.engine.prefill(s.prompt, s.sampling, s.max_new_tokens, s.stop_ids)
        t.passes = 1
        view = self.engine.read(row)
        with self._lock:
            if t.cancelled:  # cancelled while its prompt was prefilled
                return
            t.slot = slot
            self._slots[slot] = t
            self._gauges()
        if not self._deliver(t, slot, view.tokens[0], int(view.num_generated[0]), bool(view.done[0]),
                             bool(view.failed[0]), view.tokens_per_pass[0], inserted=False):
            self.state = self.engine.insert(self.state, row, slot)

    def _observe(self, hist: np.ndarray | None) -> float:
        """A request's mean tokens per LLM pass (prefill excluded), recorded in the metrics."""
        passes = 0 if hist is None else int(hist.sum())
        if not passes:
            return 0.0
        mean = float((hist * np.arange(len(hist))).sum() / passes)
        if self.metrics is not None:
            self.metrics.tokens_per_pass.observe(mean)
        return mean

    def _deliver(self, t: Ticket, slot: int, tokens: np.ndarray, n: int, done: bool, failed: bool, hist: np.ndarray,
                 inserted: bool = True) -> bool:
        """Push the slot's new tokens; on its end, free the slot. True when the request ended."""
        t.hist = hist
        if n > t.emitted:
            t._push(Tokens([int(x) for x in tokens[t.emitted:n]]))
            t.emitted = n
        if not (done or failed):
            return False
        with self._lock:
            if self._slots[slot] is t:
                self._slots[slot] = None
            self._gauges()
        if inserted:
            self.state = self.engine.release(self.state, slot)
        mean = self._observe(hist)
        if failed:
            t._push(Failed("the LLM produced non-finite logits; the request stopped", "generation_failed"))
            return True
        last = int(tokens[n - 1]) if n else -1
        reason = "stop" if last in t.submission.stop_ids else "length"
        t._push(Finished(reason, t.passes, mean))
        return True
