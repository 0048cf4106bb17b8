"""Serving: the request manager (scheduler) over the continuous-batching engine, and an
OpenAI-compatible HTTP API in front of it (``specjax serve``)."""

from specjax.serving.app import ServerState, create_app
from specjax.serving.scheduler import Scheduler, Submission, Ticket
from specjax.serving.server import build_state, run, warm_up

__all__ = ["Scheduler", "ServerState", "Submission", "Ticket", "build_state", "create_app", "run", "warm_up"]
