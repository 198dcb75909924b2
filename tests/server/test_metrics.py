"""The Prometheus /metrics endpoint: requests by code, latency, batch sizes, queue depth."""

from __future__ import annotations

import urllib.error
import urllib.request

import grpc
import pytest
import torch

from server.client import EmbserveClient
from tests.conftest import random_batch
from tests.server.support import CALL_TIMEOUT, rpc_error, scrape_metrics, wait_until


def _value(samples: list, name: str, **labels: str) -> float:
    matching = [s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(matching) == 1, f"{name} {labels}: {matching}"
    return float(matching[0])


def test_metrics_endpoint(start_server, dense_artifact, dense_runtime, spec):
    served = start_server(dense_artifact, metrics_port=0)
    port = served.running.metrics_port
    assert port
    bad = {name: [[0]] for name in spec.feature_names}
    bad["f_int2"] = [[10_000]]
    with EmbserveClient(served.address, timeout=CALL_TIMEOUT) as client:
        for seed in range(3):
            batch = random_batch(spec, batch_size=4 + seed, seed=seed)
            assert torch.equal(client.lookup(batch), dense_runtime.lookup(batch))
        for _ in range(2):
            assert rpc_error(lambda: client.lookup(bad)).code() == grpc.StatusCode.INVALID_ARGUMENT
        client.predict(random_batch(spec, batch_size=2), torch.zeros(2, 5))
        client.metadata()

    metrics = scrape_metrics(port)
    requests = metrics["embserve_requests"]
    assert _value(requests, "embserve_requests_total", method="Lookup", code="OK") == 3
    assert _value(requests, "embserve_requests_total", method="Lookup", code="INVALID_ARGUMENT") == 2
    assert _value(requests, "embserve_requests_total", method="Predict", code="OK") == 1
    assert _value(requests, "embserve_requests_total", method="GetModelMetadata", code="OK") == 1

    latency = metrics["embserve_request_latency_seconds"]
    assert _value(latency, "embserve_request_latency_seconds_count", method="Lookup") == 5
    assert _value(latency, "embserve_request_latency_seconds_bucket", method="Lookup", le="+Inf") == 5
    assert _value(latency, "embserve_request_latency_seconds_sum", method="Lookup") > 0

    # 3 lookups and 1 predict (warm-up runs on the forward threads directly, not through the batcher)
    batch_examples = metrics["embserve_batch_examples"]
    assert _value(batch_examples, "embserve_batch_examples_count") == 4
    assert _value(batch_examples, "embserve_batch_examples_sum") == 4 + 5 + 6 + 2
    batch_requests = metrics["embserve_batch_requests"]
    assert _value(batch_requests, "embserve_batch_requests_count") == 4
    assert _value(batch_requests, "embserve_batch_requests_bucket", le="+Inf") == 4

    assert _value(metrics["embserve_queue_depth"], "embserve_queue_depth") == 0


def test_metrics_endpoint_closes_with_the_server(start_server, dense_artifact):
    served = start_server(dense_artifact, metrics_port=0)
    port = served.running.metrics_port
    assert "embserve_requests" in scrape_metrics(port)
    served.stop(grace=1.0)
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_no_metrics_endpoint_by_default(dense_server):
    assert dense_server.running.metrics_port is None


def test_every_stage_of_the_pipeline_is_measured_per_request(start_server, dense_artifact, dense_runtime, spec):
    served = start_server(dense_artifact, metrics_port=0, forward_threads=1)
    port = served.running.metrics_port
    assert port
    requests = 3
    with EmbserveClient(served.address, timeout=CALL_TIMEOUT) as client:  # one at a time: one batch each
        for seed in range(requests):
            batch = random_batch(spec, batch_size=2, seed=seed)
            assert torch.equal(client.lookup(batch), dense_runtime.lookup(batch))
    samples = scrape_metrics(port)["embserve_stage_seconds"]
    for stage in ("decode", "queue", "merge", "lookup", "split", "encode"):
        assert _value(samples, "embserve_stage_seconds_count", stage=stage) == requests, stage
        assert _value(samples, "embserve_stage_seconds_sum", stage=stage) > 0, stage


def test_profile_line_is_the_difference_of_two_snapshots():
    from server.metrics import STAGES, profile_line

    before = {stage: (0.0, 0.0) for stage in STAGES}
    after = {**before, "decode": (4.0, 0.002), "lookup": (2.0, 0.5)}
    line = profile_line(before, after, 2.0)
    # by hand: decode 2 ms / 4 = 0.5 ms each, 0.1 % of 2 s; lookup 0.5 s / 2 = 250 ms, 25 % of 2 s
    assert "decode 4x 0.500 ms (0.1 %)" in line
    assert "lookup 2x 250.000 ms (25.0 %)" in line
    assert "queue 0x 0.000 ms (0.0 %)" in line


def test_serve_profile_logs_the_breakdown(start_server, dense_artifact, dense_runtime, spec, caplog):
    with caplog.at_level("INFO", logger="server.app"):
        served = start_server(dense_artifact, profile_s=0.05)
        batch = random_batch(spec, batch_size=2, seed=9)
        with EmbserveClient(served.address, timeout=CALL_TIMEOUT) as client:
            assert torch.equal(client.lookup(batch), dense_runtime.lookup(batch))
        wait_until(
            lambda: any("decode 1x" in r.getMessage() for r in caplog.records if "profile over" in r.getMessage()),
            what="a profile line with the lookup",
        )
