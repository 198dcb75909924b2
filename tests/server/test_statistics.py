"""``server.statistics``: the per-version counters of the statistics extension, from hand-made timings."""

from __future__ import annotations

import time

from google.protobuf import json_format

from server.proto import open_inference_grpc_pb2 as pb
from server.statistics import StageTimes, VersionStatistics


def test_requests_and_forwards_add_up_per_stage_and_batch_size():
    statistics = VersionStatistics()
    assert statistics.as_json("m", "3")["last_inference"] == 0
    statistics.execution(8, 0.001, 0.010, 0.002)
    statistics.execution(8, 0.003, 0.030, 0.004)
    statistics.execution(2, 0.0, 0.005, 0.0)
    before_ms = time.time() * 1000
    statistics.request_succeeded(
        6, 0.050, 0.004, 0.001, StageTimes(queue=0.002, merge=0.001, forward=0.010, split=0.002)
    )
    statistics.request_succeeded(2, 0.020, 0.001, 0.0, StageTimes(queue=0.0, merge=0.0, forward=0.005, split=0.0))
    statistics.request_failed(0.007)
    entry = statistics.as_json("m", "3")
    assert (entry["name"], entry["version"]) == ("m", "3")
    assert entry["inference_count"] == 8 and entry["execution_count"] == 3
    assert before_ms - 1 <= entry["last_inference"] <= time.time() * 1000 + 1
    stages = entry["inference_stats"]
    assert stages["success"] == {"count": 2, "ns": 70_000_000}
    assert stages["fail"] == {"count": 1, "ns": 7_000_000}
    assert stages["queue"] == {"count": 2, "ns": 2_000_000}
    assert stages["compute_input"] == {"count": 2, "ns": 6_000_000}  # decode + merge
    assert stages["compute_infer"] == {"count": 2, "ns": 15_000_000}
    assert stages["compute_output"] == {"count": 2, "ns": 3_000_000}  # split + encode
    by_size = {b["batch_size"]: b for b in entry["batch_stats"]}
    assert list(by_size) == [2, 8]
    assert by_size[8]["compute_infer"] == {"count": 2, "ns": 40_000_000}
    assert by_size[8]["compute_input"] == {"count": 2, "ns": 4_000_000}
    assert by_size[2]["compute_output"] == {"count": 1, "ns": 0}
    # the JSON shape is the protocol's: gRPC parses it into ModelStatistics as it is
    message = json_format.ParseDict(entry, pb.ModelStatistics())
    assert message.batch_stats[1].compute_infer.ns == 40_000_000 and message.inference_stats.fail.count == 1
