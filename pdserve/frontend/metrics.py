"""The router's Prometheus metrics, on a registry of its own (one per app, none global)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pdserve_router_requests", "API requests by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("pdserve_router_prompt_tokens", "prompt tokens of finished requests",
                                     registry=r)
        self.generation_tokens = Counter("pdserve_router_generation_tokens",
                                         "tokens generated for clients", registry=r)
        self.ttft = Histogram("pdserve_router_time_to_first_token_seconds",
                              "request arrival to its first generated token", buckets=_LATENCY_BUCKETS,
                              registry=r)
        self.e2e = Histogram("pdserve_router_e2e_request_latency_seconds",
                             "request arrival to its last byte", buckets=_LATENCY_BUCKETS, registry=r)
        self.prefill = Histogram("pdserve_router_prefill_seconds",
                                 "the /prefill call of one choice (prefill and KV transfer)",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.aborts = Counter("pdserve_router_aborts", "rooms aborted on the workers, by reason",
                              ["reason"], registry=r)
        self.running = Gauge("pdserve_router_requests_running", "API requests being served", registry=r)
        self.worker_up = Gauge("pdserve_router_worker_healthy", "1 when a worker takes requests",
                               ["url", "role"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
