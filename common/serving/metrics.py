"""Prometheus metrics for one app, in the app's own CollectorRegistry (several apps can live in one process)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

OUTCOMES = ("success", "error", "aborted", "rejected")
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


class ServerMetrics:
    def __init__(self, engine):
        self.registry = CollectorRegistry()
        self.requests = Counter("requests", "HTTP generation requests by outcome", ["outcome"], registry=self.registry)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.ttft = Histogram("time_to_first_token_seconds", "Request arrival to its first generated token",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("inter_token_latency_seconds", "Time between generated tokens of a request",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        scheduler = engine.scheduler
        Gauge("num_requests_running", "Requests in the running batch",
              registry=self.registry).set_function(lambda: len(scheduler.running))
        Gauge("num_requests_waiting", "Requests queued for the running batch",
              registry=self.registry).set_function(lambda: len(scheduler.waiting))
        Gauge("kv_cache_usage", "Fraction of KV cache blocks held by requests",
              registry=self.registry).set_function(engine.kv_cache.usage)
        if engine.kv_connector is not None:  # PD
            Gauge("num_requests_waiting_for_remote_kvs", "Decode side: requests whose prompt KV is on its way",
                  registry=self.registry).set_function(lambda: len(scheduler.receiving))
            Gauge("num_requests_sending_kvs", "Prefill side: finished requests whose blocks are being sent",
                  registry=self.registry).set_function(lambda: len(scheduler.sending))
        self.registry.register(_EngineErrors(engine))
        stats = engine.stats
        if engine.config.num_speculative_tokens:  # vLLM's names
            Gauge("spec_decode_draft_acceptance_rate", "Accepted / verified MTP drafts",
                  registry=self.registry).set_function(lambda: stats.acceptance_rate)
            Gauge("spec_decode_mean_accepted_length", "Tokens committed per verifying request step",
                  registry=self.registry).set_function(lambda: stats.mean_accepted_length)
            self.registry.register(_SpecCounts(engine))

    def count(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineErrors:
    """engine_step_errors_total: engine steps whose forward or sampling raised (their requests failed), read from
    the engine's own count."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        yield CounterMetricFamily("engine_step_errors", "Engine steps that failed (their requests got an error)",
                                  value=self.engine.stats.step_errors)


class _SpecCounts:
    """spec_decode_num_draft_tokens_total / spec_decode_num_accepted_tokens_total, from the engine's counts."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        stats = self.engine.stats
        yield CounterMetricFamily("spec_decode_num_draft_tokens", "MTP drafts verified", value=stats.num_draft_tokens)
        yield CounterMetricFamily("spec_decode_num_accepted_tokens", "MTP drafts accepted",
                                  value=stats.num_accepted_tokens)
