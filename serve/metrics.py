"""Prometheus metrics of `dspark serve` (GET /metrics), on a registry of the server's own.

Counters: requests by outcome (stop, length, error, disconnected, cut (still running when the shutdown
grace ran out); refused: invalid (400), not_found (404), too_large (413, body over --max-body-bytes),
rejected (429, queue full), unavailable (503, warming up or shutting down)), prompt and generated
tokens. Gauges read at scrape time from the engine: tau, per-position conditional acceptance, drafts
verified per request-round, queue depth, active slots. Histogram: wall time of one engine step (one
dispatched program: a speculative round or `rounds_per_call` plain steps).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

ROUND_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class ServerMetrics:
    def __init__(self, loop=None):
        self.registry = r = CollectorRegistry()
        self._loop = loop
        self.requests = Counter("dspark_requests", "Requests by outcome", ["outcome"], registry=r)
        self.prompt = Counter("dspark_prompt_tokens", "Prompt tokens of accepted requests", registry=r)
        self.generated = Counter("dspark_generated_tokens", "Tokens generated for finished requests", registry=r)
        self.rounds = Histogram("dspark_round_seconds", "Wall time of one engine step", buckets=ROUND_BUCKETS,
                                registry=r)
        self.tau = Gauge("dspark_tau", "Tokens per request-round since the engine started", registry=r)
        self.acceptance = Gauge("dspark_acceptance", "Conditional acceptance of draft position k", ["position"],
                                registry=r)
        self.mean_verify = Gauge("dspark_mean_verify", "Drafts verified per request-round", registry=r)
        self.queue = Gauge("dspark_queue_depth", "Accepted requests waiting for a slot", registry=r)
        self.active = Gauge("dspark_active_slots", "Slots holding a request", registry=r)

    def attach(self, loop) -> None:
        self._loop = loop

    def observe_round(self, seconds: float) -> None:
        self.rounds.observe(seconds)

    def prompt_tokens(self, n: int) -> None:
        self.prompt.inc(n)

    def request_done(self, outcome: str, *, generated: int = 0) -> None:
        self.requests.labels(outcome=outcome).inc()
        self.generated.inc(generated)

    def render(self) -> tuple[bytes, str]:
        loop = self._loop
        if loop is not None:
            m = loop.engine.metrics
            self.tau.set(m.tau)
            self.mean_verify.set(m.mean_verify)
            for k, a in enumerate(m.acceptance, start=1):
                self.acceptance.labels(position=str(k)).set(a)  # NaN: position never verified yet
            self.queue.set(loop.queue_depth)
            self.active.set(loop.active_slots)
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
