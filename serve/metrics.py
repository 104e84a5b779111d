"""Prometheus metrics of one server (its own registry, so several servers can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    """Gauges read from the engine at scrape time; counters and latency histograms from handlers."""

    def __init__(self, engine):
        self.engine = engine
        self.registry = registry = CollectorRegistry()
        self.running = Gauge("jaxlora_requests_running", "Sequences in the running batch", registry=registry)
        self.waiting = Gauge("jaxlora_requests_waiting", "Sequences waiting for admission", registry=registry)
        self.adapters_on_device = Gauge("jaxlora_adapters_on_device", "Adapters in device slots", registry=registry)
        self.adapters_known = Gauge("jaxlora_adapters_known", "Adapters registered (host memory)", registry=registry)
        self.free_pages = Gauge("jaxlora_kv_pages_free", "Free KV-cache pages", registry=registry)
        self.total_pages = Gauge("jaxlora_kv_pages_total", "KV-cache pages", registry=registry)
        self.tokens_per_second = Gauge("jaxlora_generation_tokens_per_second",
                                       "Generated tokens per second over the last 10 s", registry=registry)
        self.requests = Counter("jaxlora_requests", "Finished HTTP generation requests",
                                ["endpoint", "status"], registry=registry)
        self.prompt_tokens = Counter("jaxlora_prompt_tokens", "Prompt tokens submitted", registry=registry)
        self.generation_tokens = Counter("jaxlora_generation_tokens", "Tokens generated", registry=registry)
        self.adapter_loads = Gauge("jaxlora_adapter_device_loads", "Adapter copies into device slots so far",
                                   registry=registry)
        self.dropped = Gauge("jaxlora_requests_dropped_overloaded",
                             "Requests dropped before their first token by early abort (TTFT objective)",
                             registry=registry)
        self.ttft = Histogram("jaxlora_time_to_first_token_seconds", "Time to first token",
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.e2e = Histogram("jaxlora_request_latency_seconds", "End-to-end request latency",
                             buckets=LATENCY_BUCKETS, registry=registry)
        self.tpot = Histogram("jaxlora_time_per_output_token_seconds", "Mean time per output token of a request",
                              buckets=LATENCY_BUCKETS, registry=registry)

    def render(self) -> bytes:
        snap = self.engine.snapshot()
        self.running.set(snap["running"])
        self.waiting.set(snap["waiting"])
        self.adapters_on_device.set(snap["adapters_on_device"])
        self.adapters_known.set(snap["adapters_known"])
        self.free_pages.set(snap["free_pages"])
        self.total_pages.set(snap["total_pages"])
        self.tokens_per_second.set(snap["tokens_per_second"])
        self.adapter_loads.set(self.engine.stats.adapter_loads)
        self.dropped.set(snap["dropped_overloaded"])
        return generate_latest(self.registry)
