"""Prometheus metrics of the server: requests by code, rejections by reason, latency, batch sizes, queue depth."""

from __future__ import annotations

import socket
import threading
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

from server.ports import Port, bind_error

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
# per-stage costs: tens of microseconds (decode, encode of small requests) to tens of milliseconds (big lookups)
STAGE_BUCKETS = (1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5)
STAGES = ("decode", "queue", "merge", "lookup", "split", "encode")
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
# a model version's load and warm-up, per phase: a millisecond (a structure copied) to tens of seconds (GBs hashed)
LOAD_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# how often the /metrics thread looks for a stop: prometheus_client's own server polls every 0.5 s,
# which alone made a stop take half a second
_STOP_POLL_S = 0.02


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # scrapes are not worth a log line each
        pass


StageTotals = dict[str, tuple[float, float]]  # stage -> (observations, seconds)


def profile_line(before: StageTotals, after: StageTotals, seconds: float) -> str:
    """The ``--profile`` breakdown of one interval: per stage, observations, mean milliseconds and the share of
    the interval's wall time it took (stages overlap across threads, so shares may add up past 100 %)."""
    parts = []
    for stage in STAGES:
        count = after[stage][0] - before[stage][0]
        spent = after[stage][1] - before[stage][1]
        mean_ms = 1e3 * spent / count if count else 0.0
        share = 100.0 * spent / seconds if seconds > 0 else 0.0
        parts.append(f"{stage} {int(count)}x {mean_ms:.3f} ms ({share:.1f} %)")
    return f"profile over {seconds:.1f} s: " + ", ".join(parts)


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
        self.stage_seconds = Histogram(
            "embserve_stage_seconds",
            "time in each stage of the request pipeline: decode (+validate), queue (wait for a batch), merge, "
            "lookup (the forward), split (per batch), encode (per request)",
            ["stage"],
            buckets=STAGE_BUCKETS,
            registry=self.registry,
        )
        self.load_seconds = Histogram(
            "embserve_model_load_seconds",
            "time to bring a model version in, by phase: the load's (manifest, libraries, small files, plan, model, "
            "weights, checksums, checks, runtime), then batchers and the warm-up of each forward kind (warm-up "
            "lookup, warm-up predict, warm-up both), and total",
            ["phase"],
            buckets=LOAD_BUCKETS,
            registry=self.registry,
        )
        self._calls: dict[tuple[str, str], Any] = {}  # labelled children, looked up once
        self._latencies: dict[str, Any] = {}
        self._stages = {stage: self.stage_seconds.labels(stage) for stage in STAGES}  # labels() costs a lookup
        self.queue_depth = Gauge("embserve_queue_depth", "requests waiting to be batched", registry=self.registry)
        self.in_flight = Gauge(
            "embserve_in_flight", "gRPC model calls accepted and not yet answered", registry=self.registry
        )

    def stage_totals(self) -> StageTotals:
        """stage -> (observations, seconds) so far (``embserve serve --profile`` prints their differences)."""
        totals = {stage: [0.0, 0.0] for stage in STAGES}
        for metric in self.stage_seconds.collect():
            for sample in metric.samples:
                stage = sample.labels.get("stage", "")
                if stage in totals and sample.name.endswith("_count"):
                    totals[stage][0] = sample.value
                elif stage in totals and sample.name.endswith("_sum"):
                    totals[stage][1] = sample.value
        return {stage: (count, seconds) for stage, (count, seconds) in totals.items()}

    def observe_stage(self, stage: str, seconds: float) -> None:
        """One stage of the pipeline (``STAGES``): decode and encode per request, queue wait per request,
        merge, lookup and split per batched forward."""
        self._stages[stage].observe(seconds)

    def observe_call(self, method: str, code: str, seconds: float) -> None:
        """One answered call: its count by method and status code, and its latency."""
        counter = self._calls.get((method, code))
        if counter is None:
            counter = self._calls[(method, code)] = self.requests.labels(method, code)
        counter.inc()
        latency = self._latencies.get(method)
        if latency is None:
            latency = self._latencies[method] = self.latency.labels(method)
        latency.observe(seconds)

    def observe_load(self, phases: dict[str, float]) -> None:
        """One version brought in: the seconds of each of its phases, and their total."""
        for phase, seconds in phases.items():
            self.load_seconds.labels(phase).observe(seconds)
        self.load_seconds.labels("total").observe(sum(phases.values()))

    def observe_batch(self, requests: int, examples: int) -> None:
        self.batch_requests.observe(requests)
        self.batch_examples.observe(examples)

    def serve_http(self, port: int, host: str = "0.0.0.0") -> int:
        """Expose ``/metrics`` on ``host:port`` (0 picks a free one); returns the port. A port in use is a
        ``ConfigError`` naming it."""

        class Server(_ThreadingWSGIServer):
            pass

        try:
            family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[
                0
            ]
            Server.address_family = family
            http = make_server(str(address[0]), port, make_wsgi_app(self.registry), Server, handler_class=_QuietHandler)
        except OSError as err:
            raise bind_error(Port("metrics", host, port, "--metrics-port"), err) from None
        threading.Thread(
            target=http.serve_forever, kwargs={"poll_interval": _STOP_POLL_S}, name="embserve-metrics", daemon=True
        ).start()
        self._http = http
        return int(http.server_port)

    def close(self) -> None:
        """Stop the ``/metrics`` endpoint, if one runs."""
        http, self._http = self._http, None
        if http is not None:
            http.shutdown()
            http.server_close()
