"""Build a server around a loaded model and run it with uvicorn until SIGTERM or SIGINT.

Shutdown: the first signal stops admitting (new requests get 503, queued ones fail with "the server is
shutting down"); running requests go on for up to ``shutdown_grace`` seconds, then fail with a clear
error event or body; then the process exits (uvicorn re-raises the signal after its own clean
shutdown, so the exit status says SIGTERM). Nothing hangs on a client that never reads.
"""

from __future__ import annotations

import contextlib
import threading

import jax
import uvicorn

from specjax.engine import Engine
from specjax.serving.app import ServerState, create_app
from specjax.serving.metrics import Metrics
from specjax.serving.protocol import DEFAULT_MAX_REQUEST_BYTES, Limits
from specjax.serving.scheduler import Scheduler
from specjax.types import Model


def build_state(model: Model, *, model_name: str, slots: int, max_prompt_tokens: int, max_tokens: int,
                max_queue: int, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, drafters=(),
                budget: str | None = "auto", impl: str = "xla", log=lambda *a: None,
                special_tokens: str = "parse") -> ServerState:
    """The engine, its scheduler (not started) and the HTTP side's state. ``drafters``: ``Bound`` pairs
    (none: plain decoding); ``budget``: "auto" (measured tree budget) or None (whole tree);
    ``special_tokens``: what special-token text in prompts becomes (``specjax.io.special_tokens``)."""
    from specjax.api import eos_ids_of
    from specjax.errors import InputError
    from specjax.io.special_tokens import check_policy

    if model.tokenizer is None:
        raise InputError("serving needs a tokenizer (text in, text out); this model has none")
    check_policy(special_tokens)
    if not isinstance(max_queue, int) or max_queue < 1:
        raise InputError(f"max_queue must be a positive int, got {max_queue!r}")
    stop_ids = eos_ids_of(model)
    engine = Engine(model, slots=slots, max_prompt_tokens=max_prompt_tokens, max_new_tokens=max_tokens,
                    drafters=drafters, verifier="seeded", impl=impl, max_stop_tokens=max(1, len(stop_ids)),
                    budget=budget, progress=lambda n: log(f"# measuring the LLM pass time of a {n}-node tree at "
                                                          f"batch {slots} (once per machine; cached)"))
    metrics = Metrics(slots)
    limits = Limits(model_name=model_name, max_prompt_tokens=max_prompt_tokens, max_tokens=max_tokens,
                    context_window=model.config.max_positions, max_stop_tokens=len(stop_ids),
                    max_request_bytes=max_request_bytes, special_tokens=special_tokens)
    return ServerState(scheduler=Scheduler(engine, max_queue=max_queue, metrics=metrics, log=log), metrics=metrics,
                       limits=limits, tokenizer=model.tokenizer, vocab=model.config.vocab_size, stop_ids=stop_ids)


def warm_up(engine: Engine, log=lambda *a: None) -> None:
    """Compile the prefill (one program for every prompt length), insert, the step and release, so no
    request pays a compilation."""
    log("# compiling the prefill")
    # two new tokens where the engine allows them (one comes from the prefill, one from the step)
    state = engine.insert(engine.init(), engine.prefill([0], max_new_tokens=min(2, engine.max_new_tokens)), 0)
    log("# compiling the batched speculative step")
    state = engine.release(engine.step(state), 0)
    jax.block_until_ready(state)


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, telling the scheduler the moment a shutdown signal arrives."""

    def __init__(self, config: uvicorn.Config, state: ServerState, grace: float):
        super().__init__(config)
        self.state, self.grace, self._timer = state, grace, None

    def handle_exit(self, sig, frame):
        if self._timer is None:
            # A signal handler runs on the main thread between two bytecodes, maybe while that thread
            # holds the scheduler's lock (submit, cancel): take the lock from another thread.
            threading.Thread(target=self.state.scheduler.begin_shutdown, name="specjax-shutdown", daemon=True).start()
            self._timer = threading.Timer(self.grace, self.state.scheduler.stop)
            self._timer.daemon = True
            self._timer.start()
        super().handle_exit(sig, frame)


def run(state: ServerState, *, host: str, port: int, shutdown_grace: float = 10.0, log=lambda *a: None,
        on_ready=None, sock=None) -> None:
    """Serve until a signal; blocks. ``sock``: a socket already bound to host:port (``specjax serve`` binds
    it before loading the model, so that an address in use is found before minutes of work)."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.scheduler.start()
        engine = state.scheduler.engine
        drafting = "; ".join(d.describe() for d in engine.spec.drafters) or "no speculation"
        log(f"# serving '{state.limits.model_name}' on http://{host}:{port}/v1 ({engine.slots} slots, queue "
            f"{state.scheduler.max_queue}; drafting: {drafting})")
        if on_ready is not None:
            on_ready()
        yield
        state.scheduler.stop()
        if state.scheduler.failure is not None:
            log(f"# specjax serve: stopped, because {state.scheduler.failure}")
        else:  # counted by the scheduler as it failed them (the grace timer's stop may have come first)
            log(f"# specjax serve: stopped ({state.scheduler.failed_at_stop} running request(s) failed at shutdown)")

    config = uvicorn.Config(create_app(state, lifespan=lifespan), host=host, port=port, log_level="warning",
                            timeout_graceful_shutdown=shutdown_grace + 5.0, lifespan="on")
    server = _Uvicorn(config, state, shutdown_grace)
    # An engine that failed in a step cannot serve again: exit (``specjax serve`` with status 1), so that a
    # supervisor starts a fresh one, rather than answer every request with an error while /health says 503.
    state.scheduler.on_failure = lambda: setattr(server, "should_exit", True)
    server.run(sockets=None if sock is None else [sock])
