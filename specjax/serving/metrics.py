"""Prometheus metrics of one server (its own registry, so several servers in one process never mix)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Seconds: from a fast cached decode step on a GPU to a long prefill on a 2-core CPU.
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
_TOKENS_PER_PASS_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0)

OUTCOMES = ("stop", "length", "cancelled", "error", "rejected")


class Metrics:
    def __init__(self, slots: int):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("specjax_requests", "Requests by outcome: stop (stop token or string), length "
                                "(max_tokens), cancelled (client gone), error (failed after admission), rejected "
                                "(refused before admission: bad request, full queue, shutting down)",
                                ["outcome"], registry=r)
        for outcome in OUTCOMES:  # every series present from the start (a scrape sees zeros, not gaps)
            self.requests.labels(outcome)
        self.prompt_tokens = Counter("specjax_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("specjax_generation_tokens", "Tokens served to clients", registry=r)
        self.llm_passes = Counter("specjax_llm_passes", "Batched LLM passes (engine steps; prefills not counted)",
                                  registry=r)
        self.tokens_per_pass = Histogram("specjax_tokens_per_llm_pass", "Per finished request: mean tokens emitted "
                                         "per LLM pass (1 = no speculation gain)", buckets=_TOKENS_PER_PASS_BUCKETS,
                                         registry=r)
        self.ttft = Histogram("specjax_time_to_first_token_seconds", "From request arrival to its first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("specjax_time_per_output_token_seconds", "Per request: (last token time - first "
                              "token time) / (tokens - 1)", buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_length = Gauge("specjax_queue_length", "Requests waiting for a slot", registry=r)
        self.busy_slots = Gauge("specjax_busy_slots", "Slots holding a running request", registry=r)
        self.slots = Gauge("specjax_slots", "Request slots of the engine", registry=r)
        self.slots.set(slots)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
