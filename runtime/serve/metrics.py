"""Prometheus metrics of the service (prometheus-client), one registry per app so that several servers
can live in one process (the tests do that)."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

disable_created_metrics()  # no *_created series: scrapers do not need them, readers are spared them

PREFIX = "ffn_serve"
# Latency buckets from 1 ms to 60 s: CPU decode steps are ~10-100 ms, GPU ones ~1-10 ms.
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    0.75,
    1,
    2.5,
    5,
    10,
    30,
    60,
)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            f"{PREFIX}_requests",
            "HTTP API requests by endpoint and status code",
            ["endpoint", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "prompt tokens processed", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "tokens generated", registry=r)
        self.queue_depth = Gauge(f"{PREFIX}_queue_depth", "requests waiting for a batch slot", registry=r)
        self.running = Gauge(f"{PREFIX}_running", "sequences in the running batch", registry=r)
        self.time_to_first_token = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "arrival to first generated token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.time_per_output_token = Histogram(
            f"{PREFIX}_time_per_output_token_seconds",
            "time between consecutive tokens of a request",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.request_latency = Histogram(
            f"{PREFIX}_request_duration_seconds",
            "arrival to the last token of a generation request",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            f"{PREFIX}_batch_size", "sequences per decode step", buckets=(1, 2, 4, 8, 16, 32, 64), registry=r
        )
        self.prefill_batch_size = Histogram(
            f"{PREFIX}_prefill_batch_size",
            "sequences prefilled together (admitted in the same step)",
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
