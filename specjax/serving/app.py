"""The HTTP face: OpenAI-compatible completions and chat completions (streamed as server-sent events
or whole), models, health and Prometheus metrics, on FastAPI.

Each request is checked (``protocol``) before it is queued; the scheduler thread runs it; this side
turns its token events into text (stop strings cut here, and end the request in the engine at once)
and into OpenAI's response objects. A client that disconnects ends its request: the slot is freed
before the next LLM step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import traceback
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse, format_sse_event
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from specjax.serving.metrics import Metrics
from specjax.serving.protocol import APIError, Limits, Parsed, TextTracker, parse_body, parse_request
from specjax.serving.scheduler import EngineFailed, Failed, Finished, QueueFull, Scheduler, ShuttingDown, Ticket, Tokens

# A non-streaming request checks this often whether its client is still there.
_DISCONNECT_POLL_S = 0.25


@dataclasses.dataclass
class ServerState:
    scheduler: Scheduler
    metrics: Metrics
    limits: Limits
    tokenizer: object
    vocab: int
    stop_ids: tuple[int, ...]
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def _read_body(request: Request, cap: int) -> bytes:
    """The body, refused (413) past ``cap`` bytes: by its Content-Length before a byte is read, else as it
    streams in (chunked), so an oversized body is never held whole."""
    def too_large(size: str) -> APIError:
        return APIError(413, f"the request body is {size}; this server takes at most {cap} bytes (specjax serve "
                             f"--max-request-bytes)", code="request_too_large")

    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > cap:
        raise too_large(f"{int(declared)} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > cap:
            raise too_large(f"over {cap} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


class _Run:
    """One admitted request as the client sees it: text deltas, then a finish reason or an error."""

    def __init__(self, server: ServerState, ticket: Ticket, parsed: Parsed, arrived: float):
        self.server, self.ticket, self.parsed, self.arrived = server, ticket, parsed, arrived
        # A completion continues its prompt's text: decoded after the prompt's last tokens, it keeps the space
        # between them. A chat answer is a message of its own: decoded alone, as offline generation's text.
        context = () if parsed.chat else parsed.submission.prompt
        self.text = TextTracker(server.tokenizer, parsed.stop_strings, context)
        self.finish_reason: str | None = None
        self.error: Failed | None = None
        self.first = self.last = None
        self.accounted = False
        self.failed = False  # the server failed while serving it (a 500)

    async def deltas(self, request: Request | None = None):
        """Text deltas until the request ends. ``request``: poll it for a disconnect every
        ``_DISCONNECT_POLL_S``, while tokens flow too (non-streaming; a stream notices the disconnect
        when it writes)."""
        next_poll = time.perf_counter() + _DISCONNECT_POLL_S
        try:
            while True:
                if request is not None and time.perf_counter() >= next_poll:
                    if await request.is_disconnected():
                        return
                    next_poll = time.perf_counter() + _DISCONNECT_POLL_S
                try:
                    event = await asyncio.wait_for(self.ticket.events.get(), _DISCONNECT_POLL_S) if request \
                        else await self.ticket.events.get()
                except TimeoutError:
                    continue
                if isinstance(event, Tokens):
                    self.last = time.perf_counter()
                    if self.first is None:
                        self.first = self.last
                        self.server.metrics.ttft.observe(self.first - self.arrived)
                    delta = self.text.feed(event.ids)
                    if self.text.stopped:
                        self.server.scheduler.cancel(self.ticket)  # the engine stops it before the next step
                        self.finish_reason = "stop"
                    if delta:
                        yield delta
                    if self.finish_reason:
                        return
                elif isinstance(event, Finished):
                    self.finish_reason = event.reason
                    rest = self.text.finish()
                    if rest:
                        yield rest
                    return
                else:
                    self.error = event
                    return
        except BaseException as e:
            # the server's own failure (decoding the text, say): an error, not a client that went away
            self.failed = not isinstance(e, (asyncio.CancelledError, GeneratorExit))
            raise
        finally:
            self.account()

    def account(self) -> None:
        """Once per request, however it ended: count it, and cancel it in the engine if the client left."""
        if self.accounted:
            return
        self.accounted = True
        m = self.server.metrics
        if self.failed:
            self.server.scheduler.cancel(self.ticket)
            outcome = "error"
        elif self.finish_reason is None and self.error is None:
            self.server.scheduler.cancel(self.ticket)
            outcome = "cancelled"
        elif self.error is not None:
            # a request failed while still queued (shutdown) was never admitted: the metric's "rejected"
            outcome = "rejected" if self.ticket.slot is None and self.error.code == "shutting_down" else "error"
        else:
            outcome = self.finish_reason
        m.requests.labels(outcome).inc()
        m.generation_tokens.inc(self.text.served_tokens)
        if self.first is not None and self.text.served_tokens > 1:
            m.tpot.observe((self.last - self.first) / (self.text.served_tokens - 1))

    def usage(self) -> dict:
        prompt = len(self.parsed.submission.prompt)
        return {"prompt_tokens": prompt, "completion_tokens": self.text.served_tokens,
                "total_tokens": prompt + self.text.served_tokens}


def _error_body(failed: Failed) -> dict:
    return {"error": {"message": failed.message, "type": "server_error", "param": None, "code": failed.code}}


def _chunk(run: _Run, rid: str, created: int, delta: str | None, finish: str | None, first: bool = False) -> dict:
    if run.parsed.chat:
        d = {} if delta is None else {"content": delta}
        if first:
            d = {"role": "assistant", "content": ""}
        choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": run.server.limits.model_name, "choices": [choice]}


async def _stream(run: _Run, rid: str, created: int):
    def event(obj) -> bytes:
        return format_sse_event(data_str=json.dumps(obj, ensure_ascii=False))

    try:
        if run.parsed.chat:
            yield event(_chunk(run, rid, created, None, None, first=True))
        async for delta in run.deltas():
            yield event(_chunk(run, rid, created, delta, None))
        if run.error is not None:
            yield event(_error_body(run.error))
        else:
            yield event(_chunk(run, rid, created, None if run.parsed.chat else "", run.finish_reason))
            if run.parsed.include_usage:
                yield event({"id": rid, "object": "chat.completion.chunk" if run.parsed.chat else "text_completion",
                             "created": created, "model": run.server.limits.model_name, "choices": [],
                             "usage": run.usage()})
        yield format_sse_event(data_str="[DONE]")
    finally:  # a client that left before the first write never started run.deltas(): cancel it here
        run.account()


async def _whole(run: _Run, rid: str, created: int, request: Request) -> Response:
    text = "".join([d async for d in run.deltas(request)])
    if run.error is not None:
        return JSONResponse(_error_body(run.error), status_code=503 if run.error.code == "shutting_down" else 500)
    if run.finish_reason is None:  # the client left; nobody reads this
        return Response(status_code=499)
    if run.parsed.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": run.finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": run.finish_reason}
        obj = "text_completion"
    return JSONResponse({"id": rid, "object": obj, "created": created, "model": run.server.limits.model_name,
                         "choices": [choice], "usage": run.usage()})


def create_app(server: ServerState, lifespan=None) -> FastAPI:
    app = FastAPI(title="specjax", description="OpenAI-compatible serving with lossless tree speculation",
                  lifespan=lifespan)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return _error(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc: RequestValidationError):
        return _error(APIError(422, str(exc), code="invalid_type"))

    @app.exception_handler(Exception)
    async def unexpected_error(request, exc: Exception):
        """Anything raised after admission (a whole response's text, say): a 500 in OpenAI's shape, not
        Starlette's plain text. Starlette re-raises it afterwards, so the server's log has the traceback."""
        return _error(APIError(500, f"the server failed: {type(exc).__name__}: {exc}", type="server_error",
                               code="internal_error"))

    async def generate(request: Request, chat: bool):
        arrived = time.perf_counter()
        try:
            body = await _read_body(request, server.limits.max_request_bytes)
            # Off the event loop: tokenizing a long prompt (10M characters: about 7.5 s) would stall every
            # stream and health check meanwhile. The tokenizer releases the GIL while it encodes.
            parsed = await asyncio.to_thread(
                lambda: parse_request(parse_body(body), chat=chat, limits=server.limits, tokenizer=server.tokenizer,
                                      vocab=server.vocab, stop_ids=server.stop_ids))
            ticket = Ticket(parsed.submission, asyncio.get_running_loop())
            run = _Run(server, ticket, parsed, arrived)  # before submitting: once admitted, only the run cancels it
            server.scheduler.submit(ticket)
        except Exception as e:  # noqa: BLE001 - whatever goes wrong with one request, the server answers and lives on
            server.metrics.requests.labels("rejected").inc()
            if not isinstance(e, (APIError, QueueFull, ShuttingDown, EngineFailed)):
                server.scheduler.log_safely(
                    f"# specjax serve: a request failed before admission:\n{traceback.format_exc()}")
                e = APIError(500, f"the server failed to read the request: {type(e).__name__}: {e}",
                             type="server_error", code="internal_error")
            elif isinstance(e, QueueFull):
                e = APIError(429, f"the queue is full ({server.scheduler.max_queue} requests waiting for "
                                  f"{server.scheduler.engine.slots} busy slots); retry "
                                  f"later", type="rate_limit_error", code="queue_full")
            elif isinstance(e, EngineFailed):
                e = APIError(503, f"the server is stopping because {e}", type="server_error", code="engine_failed")
            elif isinstance(e, ShuttingDown):
                e = APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
            return _error(e)
        server.metrics.prompt_tokens.inc(len(parsed.submission.prompt))
        rid, created = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, int(time.time())
        if parsed.stream:
            return EventSourceResponse(_stream(run, rid, created), headers={"Cache-Control": "no-cache"})
        return await _whole(run, rid, created, request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.limits.model_name, "object": "model",
                                            "created": server.created, "owned_by": "specjax",
                                            "max_model_len": server.limits.context_window}]}

    @app.get("/health")
    async def health():
        if not server.scheduler.healthy():
            return JSONResponse({"status": "unavailable"}, status_code=503)
        queued, busy = server.scheduler.counts()
        return {"status": "ok", "queued": queued, "busy_slots": busy}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return app
