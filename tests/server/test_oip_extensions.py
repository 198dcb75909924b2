"""Triton's model-configuration and statistics extensions, read with tritonclient (gRPC and HTTP) and plain urllib.

The configuration is compared with the model's spec (features, output width, dense part) and the server's
settings; the statistics with the calls each test made (how many, of how many examples, which failed). The tests
run on both servers (embserve serve and embserve-server), over gRPC and REST.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from tritonclient.utils import InferenceServerException

from tests.conftest import random_batch
from tests.server.native_support import SERVER_KINDS, start_kind
from tests.server.oip_support import PROTOCOLS, client, make_input, requested, triton_inputs
from tests.server.support import NUM_DENSE, Served, lookup_request
from tests.server.test_repository import make_repository

MODEL = "dense"  # the dense artifact's folder name
MAX_BATCH = 512
DELAY_US = 700


def _address(served: Served, protocol: str) -> str:
    return served.address if protocol == "grpc" else f"127.0.0.1:{served.running.http_port}"


def _get(served: Served, path: str) -> tuple[int, Any]:
    """``GET`` a REST route with urllib (as curl would): status and JSON body."""
    url = f"http://127.0.0.1:{served.running.http_port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture(scope="module", params=SERVER_KINDS)
def config_server(request, loop_thread, dense_artifact) -> Iterator[Served]:
    """The dense model on each server (the Python one and embserve-server), gRPC and REST."""
    served = start_kind(
        request.param, loop_thread, dense_artifact, http_port=0, max_delay_us=DELAY_US, max_batch_size=MAX_BATCH
    )
    yield served
    served.close_channels()
    served.stop(grace=1.0)


def _config(protocol: str, c: Any, name: str = MODEL, version: str = "") -> dict[str, Any]:
    if protocol == "grpc":
        from google.protobuf import json_format

        message = c.get_model_config(name, version).config
        config = json_format.MessageToDict(message, preserving_proto_field_name=True)
        for tensor in config.get("input", []) + config.get("output", []):
            tensor["dims"] = [int(d) for d in tensor["dims"]]  # protobuf's JSON writes int64 as text
        return config
    return c.get_model_config(name, version)  # type: ignore[no-any-return]


# ------------------------------------------------------------------------------------------ configuration
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_the_configuration_describes_the_model_and_the_server(protocol, config_server, spec):
    with client(protocol, _address(config_server, protocol)) as c:
        config = _config(protocol, c)
        assert _config(protocol, c, version="1") == config
    assert config["name"] == MODEL
    assert config["backend"] == "embserve" and config["platform"] == "embserve_torchscript"
    assert config.get("max_batch_size", 0) == 0  # ragged inputs: no batch dimension in front
    assert config["parameters"]["max_batch_size"] == {"string_value": str(MAX_BATCH)}
    assert config["parameters"]["output_dim"] == {"string_value": str(spec.output_dim)}
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] in (DELAY_US, str(DELAY_US))
    inputs = {t["name"]: t for t in config["input"]}
    expected_inputs = {"dense_features"} | {
        f"{f}__{part}" for f in spec.feature_names for part in ("values", "lengths", "offsets", "weights")
    }
    assert set(inputs) == expected_inputs
    for feature in spec.feature_names:
        assert inputs[f"{feature}__values"]["data_type"] == "TYPE_INT64"
        assert inputs[f"{feature}__values"]["dims"] == [-1]
        assert not inputs[f"{feature}__values"].get("optional", False)
        for part, data_type in (("lengths", "TYPE_INT32"), ("offsets", "TYPE_INT32"), ("weights", "TYPE_FP32")):
            assert inputs[f"{feature}__{part}"]["data_type"] == data_type
            assert inputs[f"{feature}__{part}"]["optional"] is True
    assert inputs["dense_features"]["dims"] == [-1, NUM_DENSE] and inputs["dense_features"]["optional"] is True
    outputs = {t["name"]: (t["data_type"], t["dims"]) for t in config["output"]}
    assert outputs == {"embeddings": ("TYPE_FP32", [-1, spec.output_dim]), "scores": ("TYPE_FP32", [-1])}


def test_the_configuration_over_curl_like_rest_equals_tritonclients(config_server):
    status, config = _get(config_server, f"/v2/models/{MODEL}/config")
    assert status == 200
    assert _get(config_server, f"/v2/models/{MODEL}/versions/1/config") == (200, config)
    with client("http", _address(config_server, "http")) as c:
        assert c.get_model_config(MODEL) == config
        assert {"model_configuration", "statistics"} <= set(c.get_server_metadata()["extensions"])


def _start(start_any: Any, server_kind: str, artifact: Any, **config: Any) -> Any:
    """A server of ``server_kind`` with gRPC and REST."""
    return start_any(artifact, http_port=0, **config)


@pytest.fixture(scope="module", params=SERVER_KINDS)
def any_server(request, loop_thread, dense_artifact) -> Iterator[tuple[str, Any]]:
    """(kind, server) of the dense model on each server kind in turn, for tests that only ask it (the statistics
    tests count from a server of their own)."""
    served = start_kind(request.param, loop_thread, dense_artifact, max_delay_us=DELAY_US, http_port=0)
    yield request.param, served
    served.close_channels()
    served.stop(grace=1.0)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_an_unknown_model_or_version_is_not_found_in_the_metadatas_words(protocol, any_server):
    server_kind, served = any_server
    with client(protocol, _address(served, protocol)) as c:
        for name, version in (("no_such_model", ""), (MODEL, "7")):
            with pytest.raises(InferenceServerException) as metadata:
                c.get_model_metadata(name, version)
            with pytest.raises(InferenceServerException) as config:
                c.get_model_config(name, version)
            with pytest.raises(InferenceServerException) as statistics:
                c.get_inference_statistics(name, version)
            assert config.value.message() == statistics.value.message() == metadata.value.message()
            assert name in config.value.message()
            if protocol == "grpc":
                assert config.value.status() == statistics.value.status() == "StatusCode.NOT_FOUND"
    for path, named in (
        ("/v2/models/no_such_model/config", "'no_such_model'"),
        ("/v2/models/no_such_model/stats", "'no_such_model'"),
        (f"/v2/models/{MODEL}/versions/7/stats", "'7'"),
    ):
        status, body = _get(served, path)
        assert status == 404 and named in body["error"], path


# ------------------------------------------------------------------------------------------ statistics
def _statistics(protocol: str, c: Any, name: str = MODEL, version: str = "") -> list[dict[str, Any]]:
    """Every version's statistics as plain numbers, from either client."""
    if protocol == "http":
        return c.get_inference_statistics(name, version)["model_stats"]  # type: ignore[no-any-return]
    entries = []
    for stats in c.get_inference_statistics(name, version).model_stats:
        durations = {
            stage: {
                "count": getattr(stats.inference_stats, stage).count,
                "ns": getattr(stats.inference_stats, stage).ns,
            }
            for stage in ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")
        }
        batches = [
            {
                "batch_size": b.batch_size,
                **{
                    s: {"count": getattr(b, s).count, "ns": getattr(b, s).ns}
                    for s in ("compute_input", "compute_infer", "compute_output")
                },
            }
            for b in stats.batch_stats
        ]
        entries.append(
            {
                "name": stats.name,
                "version": stats.version,
                "last_inference": stats.last_inference,
                "inference_count": stats.inference_count,
                "execution_count": stats.execution_count,
                "inference_stats": durations,
                "batch_stats": batches,
            }
        )
    return entries


def _bad_inputs(protocol: str, spec: Any) -> list[Any]:
    """A request for the model whose first feature's lengths promise more ids than it sends."""
    batch = random_batch(spec, batch_size=2, seed=3)
    inputs = triton_inputs(protocol, batch)
    inputs[1] = make_input(protocol, f"{spec.feature_names[0]}__lengths", np.array([50, 50], dtype=np.int32))
    return inputs


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_statistics_count_the_calls_made(protocol, server_kind, start_any, dense_artifact, spec):
    served = _start(start_any, server_kind, dense_artifact, max_delay_us=DELAY_US)
    sizes = [3, 8, 1, 8, 5]
    with client(protocol, _address(served, protocol)) as c:
        assert "statistics" in (
            c.get_server_metadata()["extensions"] if protocol == "http" else c.get_server_metadata().extensions
        )
        (before,) = _statistics(protocol, c)
        assert before["inference_count"] == before["execution_count"] == before["last_inference"] == 0
        assert before["inference_stats"]["success"]["count"] == 0 and before["batch_stats"] == []
        started_ms = time.time() * 1000
        for index, size in enumerate(sizes):  # one caller at a time: each request is a forward of its own
            batch = random_batch(spec, batch_size=size, seed=index)
            dense = torch.randn(size, NUM_DENSE)
            outputs = requested(protocol, "embeddings", "scores") if index % 2 else requested(protocol, "embeddings")
            c.infer(MODEL, triton_inputs(protocol, batch, dense if index % 2 else None), outputs=outputs)
        ended_ms = time.time() * 1000
        with pytest.raises(InferenceServerException):
            c.infer(MODEL, _bad_inputs(protocol, spec), outputs=requested(protocol, "embeddings"))
        (after,) = _statistics(protocol, c)
        assert _statistics(protocol, c, MODEL, "1") == [after]
        (everything,) = _statistics(protocol, c, "")
        assert everything == after
    assert (after["name"], after["version"]) == (MODEL, "1")
    assert after["inference_count"] == sum(sizes)
    assert after["execution_count"] == len(sizes)
    assert started_ms - 1 <= after["last_inference"] <= ended_ms + 1
    stages = after["inference_stats"]
    assert stages["success"]["count"] == len(sizes) and stages["fail"]["count"] == 1
    for stage in ("queue", "compute_input", "compute_infer", "compute_output"):
        assert stages[stage]["count"] == len(sizes), stage
    assert stages["success"]["ns"] > stages["compute_infer"]["ns"] > 0
    assert {b["batch_size"]: b["compute_infer"]["count"] for b in after["batch_stats"]} == {1: 1, 3: 1, 5: 1, 8: 2}
    # the REST documents equal what tritonclient read
    status, body = _get(served, f"/v2/models/{MODEL}/stats")
    assert status == 200 and [{**body["model_stats"][0], "last_inference": 0}] == [{**after, "last_inference": 0}]
    assert _get(served, "/v2/models/stats")[1]["model_stats"][0]["inference_count"] == sum(sizes)


def test_embserve_v1_forwards_are_executions_not_inferences(server_kind, start_any, dense_artifact, spec):
    """embserve.v1 calls share the model's batchers: their forwards count, their requests are not OIP inferences."""
    served = start_any(dense_artifact, max_delay_us=DELAY_US)
    sizes = [4, 2]
    stub = served.stub()
    for seed, size in enumerate(sizes):  # one caller at a time: a forward each
        stub.Lookup(lookup_request(random_batch(spec, batch_size=size, seed=seed)), timeout=30)
    with client("grpc", served.address) as c:
        (after,) = _statistics("grpc", c)
    assert after["execution_count"] == len(sizes)
    assert {b["batch_size"]: b["compute_infer"]["count"] for b in after["batch_stats"]} == {2: 1, 4: 1}
    assert after["inference_count"] == after["last_inference"] == 0
    assert after["inference_stats"]["success"]["count"] == after["inference_stats"]["fail"]["count"] == 0


def test_each_repository_version_counts_its_own_calls(tmp_path, start_server, dense_artifact, spec):
    layout = {"ctr": {"1": dense_artifact, "2": dense_artifact}, "zzz": {"1": dense_artifact}}
    root = make_repository(tmp_path / "repo", layout)
    served = start_server(root, version_policy="versions:1,2", http_port=0)
    calls = {("ctr", "1"): [4, 2], ("ctr", "2"): [7], ("zzz", "1"): [1, 1, 1]}
    with client("grpc", served.address) as c:
        for (name, version), sizes in calls.items():
            for seed, size in enumerate(sizes):
                batch = random_batch(spec, batch_size=size, seed=seed)
                c.infer(
                    name, triton_inputs("grpc", batch), model_version=version, outputs=requested("grpc", "embeddings")
                )
        every = {(s["name"], s["version"]): s for s in _statistics("grpc", c, "")}
        assert [(s["name"], s["version"]) for s in _statistics("grpc", c, "ctr")] == [("ctr", "1"), ("ctr", "2")]
        with pytest.raises(InferenceServerException) as caught:
            c.get_inference_statistics("ctr", "3")
        assert "StatusCode.NOT_FOUND" in str(caught.value.status()) and "'3'" in caught.value.message()
    assert set(every) == set(calls)
    for key, sizes in calls.items():
        assert every[key]["inference_count"] == sum(sizes), key
        assert every[key]["execution_count"] == len(sizes), key
        assert every[key]["inference_stats"]["success"]["count"] == len(sizes), key
    status, body = _get(served, "/v2/models/ctr/versions/2/stats")
    assert status == 200 and [(s["version"], s["inference_count"]) for s in body["model_stats"]] == [("2", 7)]
    config = _get(served, "/v2/models/zzz/config")[1]
    assert config["name"] == "zzz" and {t["name"] for t in config["output"]} == {"embeddings", "scores"}
