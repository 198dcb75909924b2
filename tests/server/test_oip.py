"""The Open Inference Protocol with Triton's own clients (tritonclient.grpc and .http) against a real server.

Expected values come from an in-process ``Runtime`` loaded separately from the same artifact.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from tritonclient.utils import InferenceServerException

from tests.conftest import random_batch
from tests.server.native_support import SERVER_KINDS, start_kind
from tests.server.oip_support import PROTOCOLS, client, make_input, requested, split_features, triton_inputs
from tests.server.support import NUM_DENSE, Served

MODEL = "dense"  # the dense artifact's folder name


@pytest.fixture(scope="module", params=SERVER_KINDS)
def oip_server(request, loop_thread, dense_artifact) -> Iterator[Served]:
    """The dense model on each server, gRPC and REST."""
    served = start_kind(request.param, loop_thread, dense_artifact, http_port=0, max_delay_us=500)
    yield served
    served.close_channels()
    served.stop(grace=1.0)


def _address(served: Served, protocol: str) -> str:
    return served.address if protocol == "grpc" else f"127.0.0.1:{served.running.http_port}"


@pytest.fixture(scope="module", params=PROTOCOLS)
def triton(request, oip_server) -> Iterator[tuple[str, Any]]:
    protocol = request.param
    with client(protocol, _address(oip_server, protocol)) as c:
        yield protocol, c


def _tensor(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(array))  # a copy: tritonclient's arrays are read-only


def _dense(batch: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, NUM_DENSE, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------ metadata
def test_live_ready_and_server_metadata(triton):
    protocol, c = triton
    assert c.is_server_live()
    assert c.is_server_ready()
    assert c.is_model_ready(MODEL)
    assert c.is_model_ready(MODEL, "1")
    assert not c.is_model_ready(MODEL, "7")
    assert not c.is_model_ready("no_such_model")
    metadata = c.get_server_metadata(as_json=True) if protocol == "grpc" else c.get_server_metadata()
    assert metadata["name"] == "embserve"
    assert "binary_tensor_data" in metadata["extensions"]


def test_model_metadata_lists_every_tensor(triton, spec, dense_runtime):
    protocol, c = triton
    metadata = c.get_model_metadata(MODEL, as_json=True) if protocol == "grpc" else c.get_model_metadata(MODEL)
    assert metadata["name"] == MODEL
    assert metadata["versions"] == ["1"]
    inputs = {t["name"]: (t["datatype"], [int(d) for d in t["shape"]]) for t in metadata["inputs"]}
    for feature in spec.feature_names:
        assert inputs[f"{feature}__values"] == ("INT64", [-1])
        assert inputs[f"{feature}__lengths"] == ("INT32", [-1])
        assert inputs[f"{feature}__offsets"] == ("INT32", [-1])
        assert inputs[f"{feature}__weights"] == ("FP32", [-1])
    assert inputs["dense_features"] == ("FP32", [-1, NUM_DENSE])
    outputs = {t["name"]: (t["datatype"], [int(d) for d in t["shape"]]) for t in metadata["outputs"]}
    assert outputs == {"embeddings": ("FP32", [-1, spec.output_dim]), "scores": ("FP32", [-1])}


def test_model_metadata_carries_the_column_ranges(oip_server, spec):
    # tritonclient.grpc parses with Triton's proto, which lacks the spec's `properties`: read them with ours
    # (and over REST, where they are plain JSON)
    from server.proto import open_inference_grpc_pb2 as pb
    from server.proto import open_inference_grpc_pb2_grpc as pb_grpc

    stub = pb_grpc.GRPCInferenceServiceStub(oip_server.channel())
    properties = stub.ModelMetadata(pb.ModelMetadataRequest(name=MODEL), timeout=10).properties
    with client("http", _address(oip_server, "http")) as c:
        assert c.get_model_metadata(MODEL)["properties"] == dict(properties)
    for feature in spec.features:
        assert properties[f"columns.{feature.name}"] == f"{feature.column_start}:{feature.column_end}"
    assert properties["feature_order"] == ",".join(spec.feature_names)


# ------------------------------------------------------------------------------------------ infer
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
@pytest.mark.parametrize("offsets", [False, True], ids=["lengths", "offsets"])
def test_lookup_equals_the_runtime(triton, spec, dense_runtime, weighted, id_dtype, offsets):
    protocol, c = triton
    batch = random_batch(spec, batch_size=11, weighted=weighted, seed=21, id_dtype=id_dtype)
    result = c.infer(MODEL, triton_inputs(protocol, batch, offsets=offsets), outputs=requested(protocol, "embeddings"))
    got = result.as_numpy("embeddings")
    assert got.dtype == np.float32
    assert torch.equal(_tensor(got), dense_runtime.lookup(batch))
    assert result.as_numpy("scores") is None
    response = result.get_response(as_json=True) if protocol == "grpc" else result.get_response()
    assert response["model_name"] == MODEL and response["model_version"] == "1"


def test_features_in_any_order(triton, spec, dense_runtime):
    protocol, c = triton
    batch = random_batch(spec, batch_size=6, seed=22)
    inputs = list(reversed(triton_inputs(protocol, batch)))
    got = c.infer(MODEL, inputs, outputs=requested(protocol, "embeddings")).as_numpy("embeddings")
    assert torch.equal(_tensor(got), dense_runtime.lookup(batch))


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_predict_equals_the_runtime(triton, spec, dense_runtime, weighted):
    protocol, c = triton
    batch = random_batch(spec, batch_size=9, weighted=weighted, seed=23)
    dense = _dense(9, seed=1)
    result = c.infer(MODEL, triton_inputs(protocol, batch, dense), outputs=requested(protocol, "scores"))
    assert torch.equal(_tensor(result.as_numpy("scores")), dense_runtime.predict(batch, dense))
    assert result.as_numpy("embeddings") is None


def test_both_outputs_from_one_request(triton, spec, dense_runtime):
    protocol, c = triton
    batch = random_batch(spec, batch_size=13, weighted=True, seed=24)
    dense = _dense(13, seed=2)
    result = c.infer(MODEL, triton_inputs(protocol, batch, dense), outputs=requested(protocol, "embeddings", "scores"))
    assert torch.equal(_tensor(result.as_numpy("embeddings")), dense_runtime.lookup(batch))
    assert torch.equal(_tensor(result.as_numpy("scores")), dense_runtime.predict(batch, dense))


def test_no_outputs_requested_gives_every_output_the_inputs_allow(triton, spec, dense_runtime):
    protocol, c = triton
    batch = random_batch(spec, batch_size=4, seed=25)
    only_sparse = c.infer(MODEL, triton_inputs(protocol, batch))
    assert torch.equal(_tensor(only_sparse.as_numpy("embeddings")), dense_runtime.lookup(batch))
    assert only_sparse.as_numpy("scores") is None
    dense = _dense(4, seed=3)
    both = c.infer(MODEL, triton_inputs(protocol, batch, dense))
    assert torch.equal(_tensor(both.as_numpy("scores")), dense_runtime.predict(batch, dense))


def test_fp16_output_is_the_fp32_result_cast(triton, spec, dense_runtime):
    protocol, c = triton
    batch = random_batch(spec, batch_size=5, seed=26)
    result = c.infer(
        MODEL,
        triton_inputs(protocol, batch),
        outputs=requested(protocol, "embeddings"),
        parameters={"output_fp16": True},
    )
    got = result.as_numpy("embeddings")
    assert got.dtype == np.float16
    assert torch.equal(_tensor(got), dense_runtime.lookup(batch).to(torch.float16))


@pytest.mark.rest
def test_http_json_tensors_without_the_binary_extension(oip_server, spec, dense_runtime):
    batch = random_batch(spec, batch_size=7, weighted=True, seed=27)
    dense = _dense(7, seed=4)
    with client("http", _address(oip_server, "http")) as c:
        inputs = triton_inputs("http", batch, dense, binary=False)
        result = c.infer(MODEL, inputs, outputs=requested("http", "embeddings", "scores", binary=False))
    # JSON numbers carry float32 values exactly (they are printed as doubles)
    assert torch.equal(_tensor(result.as_numpy("embeddings")).float(), dense_runtime.lookup(batch))
    assert torch.equal(_tensor(result.as_numpy("scores")).float(), dense_runtime.predict(batch, dense))


def test_grpc_typed_contents(oip_server, spec, dense_runtime):
    from server.proto import open_inference_grpc_pb2 as pb
    from server.proto import open_inference_grpc_pb2_grpc as pb_grpc

    batch = random_batch(spec, batch_size=6, weighted=True, seed=28)
    request = pb.ModelInferRequest(model_name=MODEL, id="typed-1")
    for part in split_features(batch):
        values = request.inputs.add(name=f"{part.name}__values", datatype="INT64", shape=[part.values.numel()])
        values.contents.int64_contents.extend(part.values.tolist())
        lengths = request.inputs.add(name=f"{part.name}__lengths", datatype="INT32", shape=[part.lengths.numel()])
        lengths.contents.int_contents.extend(part.lengths.tolist())
        assert part.weights is not None
        weights = request.inputs.add(name=f"{part.name}__weights", datatype="FP32", shape=[part.weights.numel()])
        weights.contents.fp32_contents.extend(part.weights.tolist())
    request.outputs.add(name="embeddings")
    stub = pb_grpc.GRPCInferenceServiceStub(oip_server.channel())
    response = stub.ModelInfer(request, timeout=10)
    assert response.id == "typed-1"
    assert list(response.outputs[0].shape) == [6, spec.output_dim]
    got = torch.frombuffer(bytearray(response.raw_output_contents[0]), dtype=torch.float32).view(6, -1)
    assert torch.equal(got, dense_runtime.lookup(batch))


def _answered(served: Served) -> None:
    """Wait until every model call the server accepted is counted: embserve-server counts a gRPC call when its
    answer's write completes, which can be after the client has the answer (a bound, not a measure)."""
    deadline = time.monotonic() + 10.0
    while served.metric("embserve_in_flight") != 0:
        assert time.monotonic() < deadline, "embserve_in_flight never came back to 0"
        time.sleep(0.02)


def test_calls_are_counted_in_the_metrics(oip_server, spec):
    _answered(oip_server)  # the module's earlier calls counted
    before = oip_server.metric("embserve_requests_total", {"method": "ModelInfer", "code": "OK"})
    before_rest = oip_server.metric("embserve_requests_total", {"method": "REST ModelInfer", "code": "OK"})
    batch = random_batch(spec, batch_size=3, seed=29)
    for protocol in PROTOCOLS:
        with client(protocol, _address(oip_server, protocol)) as c:
            c.infer(MODEL, triton_inputs(protocol, batch))
    _answered(oip_server)
    assert oip_server.metric("embserve_requests_total", {"method": "ModelInfer", "code": "OK"}) == before + 1
    after_rest = oip_server.metric("embserve_requests_total", {"method": "REST ModelInfer", "code": "OK"})
    assert after_rest == before_rest + 1


# ------------------------------------------------------------------------------------------ errors
def _error(call: Any) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as caught:
        call()
    return caught.value


def _status(protocol: str, error: InferenceServerException) -> str:
    return str(error.status())


_BAD_INPUT = {"grpc": "StatusCode.INVALID_ARGUMENT", "http": "400"}
_NOT_FOUND = {"grpc": "StatusCode.NOT_FOUND", "http": "404"}


def test_unknown_model_and_version_are_not_found(triton, spec):
    protocol, c = triton
    batch = random_batch(spec, batch_size=2, seed=30)
    error = _error(lambda: c.infer("no_such_model", triton_inputs(protocol, batch)))
    assert _status(protocol, error) == _NOT_FOUND[protocol]
    assert "unknown model 'no_such_model'" in error.message()
    error = _error(lambda: c.infer(MODEL, triton_inputs(protocol, batch), model_version="9"))
    assert _status(protocol, error) == _NOT_FOUND[protocol]


@pytest.mark.parametrize(
    ("case", "fragment"),
    [
        ("unknown_tensor", "unknown input tensor 'f_int8__idz'"),
        ("missing_feature", "missing feature(s) ['f_fp32']"),
        ("wrong_dtype", "input 'f_int4__lengths': lengths must be a 1-D int32 (or int64) tensor, got FP32"),
        ("scores_without_dense", "output 'scores' needs the input 'dense_features'"),
        ("dense_shape", "dense_features must have shape [3, 5], got [3, 4]"),
        ("shifted_ids", "feature 'f_int8': lengths sum to"),
    ],
)
def test_bad_tensors_name_the_tensor_or_feature(triton, spec, case, fragment):
    protocol, c = triton
    batch = random_batch(spec, batch_size=3, seed=31)
    inputs = triton_inputs(protocol, batch)
    outputs = None
    if case == "unknown_tensor":
        inputs.append(make_input(protocol, "f_int8__idz", np.zeros(2, dtype=np.int64)))
    elif case == "missing_feature":
        inputs = [i for i in inputs if not i.name().startswith("f_fp32__")]
    elif case == "wrong_dtype":
        inputs = [i for i in inputs if i.name() != "f_int4__lengths"]
        inputs.append(make_input(protocol, "f_int4__lengths", np.ones(3, dtype=np.float32)))
    elif case == "scores_without_dense":
        outputs = requested(protocol, "scores")
    elif case == "dense_shape":
        inputs.append(make_input(protocol, "dense_features", np.zeros((3, 4), dtype=np.float32)))
    elif case == "shifted_ids":
        # one id moves from f_int8_b's bags to f_int8's: the totals still agree, the features do not
        parts = {p.name: p for p in split_features(batch)}
        first, second = parts["f_int8"], parts["f_int8_b"]
        assert second.values.numel() > 0
        moved = {
            "f_int8__values": torch.cat([first.values, second.values[:1]]),
            "f_int8_b__values": second.values[1:],
        }
        inputs = [i for i in inputs if i.name() not in moved]
        inputs += [make_input(protocol, name, values.numpy()) for name, values in moved.items()]
    error = _error(lambda: c.infer(MODEL, inputs, outputs=outputs))
    assert _status(protocol, error) == _BAD_INPUT[protocol]
    assert fragment in error.message()
