"""Prometheus metrics of the server: requests by code, rejections by reason, latency, batch sizes, queue depth."""

from __future__ import annotations

from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class ServerMetrics:
    """One registry per server, so several servers (tests) never share counters."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._http: WSGIServer | None = None
        self.requests = Counter(
            "embserve_requests", "RPCs handled, by method and status code", ["method", "code"], registry=self.registry
        )
        self.latency = Histogram(
            "embserve_request_latency_seconds",
            "RPC latency in the server, by method",
            ["method"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.batch_examples = Histogram(
            "embserve_batch_examples", "examples per batched forward", buckets=BATCH_BUCKETS, registry=self.registry
        )
        self.batch_requests = Histogram(
            "embserve_batch_requests",
            "requests merged per batched forward",
            buckets=BATCH_BUCKETS,
            registry=self.registry,
        )
        self.rejected = Counter(
            "embserve_rejected",
            "requests answered with an error, by reason (invalid, undecodable, queue_full, warming_up, internal, ...)",
            ["reason"],
            registry=self.registry,
        )
        self.queue_depth = Gauge("embserve_queue_depth", "requests waiting to be batched", registry=self.registry)

    def observe_batch(self, requests: int, examples: int) -> None:
        self.batch_requests.observe(requests)
        self.batch_examples.observe(examples)

    def serve_http(self, port: int, host: str = "0.0.0.0") -> int:
        """Expose ``/metrics`` on ``port`` (0 picks a free one); returns the port."""
        self._http, _thread = start_http_server(port, addr=host, registry=self.registry)
        return int(self._http.server_port)

    def close(self) -> None:
        """Stop the ``/metrics`` endpoint, if one runs (blocks up to its 0.5 s poll interval)."""
        http, self._http = self._http, None
        if http is not None:
            http.shutdown()
            http.server_close()
