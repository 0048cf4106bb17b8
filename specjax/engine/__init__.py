"""Continuous batching: request slots that join and leave a running batch between LLM passes."""

from specjax.engine.engine import Engine, SlotView

__all__ = ["Engine", "SlotView"]
