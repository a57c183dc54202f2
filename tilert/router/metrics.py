"""Prometheus metrics of one router instance (own registry, so several apps can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5, 1.0)


class RouterMetrics:
    """TTFT, ITL, queue depth and wait, transfer wait, and requests by outcome."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "tilert_router_requests", "Requests finished, by route and outcome", ["route", "outcome"], registry=r
        )
        self.ttft = Histogram(
            "tilert_router_ttft_seconds",
            "Router arrival to first token sent to the client",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "tilert_router_itl_seconds",
            "Time between successive decode token arrivals at the router (per token)",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge("tilert_router_queue_depth", "Requests waiting for a decode slot", registry=r)
        self.queue_wait = Histogram(
            "tilert_router_queue_wait_seconds", "Time spent waiting for a decode slot", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.prefill = Histogram(
            "tilert_router_prefill_seconds", "Prefill round trip (max_tokens=1)", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.transfer_wait = Histogram(
            "tilert_router_transfer_wait_seconds",
            "Decode request sent to first decode token received (KV transfer wait + first step)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.slots_in_use = Gauge(
            "tilert_router_slots_in_use", "Decode slots this router holds, per node", ["node"], registry=r
        )
        self.node_healthy = Gauge("tilert_router_node_healthy", "1 when the decode node passes health", ["node"], registry=r)
        self.generated_tokens = Counter(
            "tilert_router_generated_tokens", "Completion tokens relayed to clients", registry=r
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
