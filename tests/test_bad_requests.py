"""The shared bad-request corpus against every entry point: each rejects each case with the same fragment.

Entry points: the in-process ``Runtime``, the scripted model called directly (what TorchScript hosts
run), the gRPC server (packed wire form), the Open Inference Protocol through tritonclient (gRPC and
REST, per-feature tensors) on both servers (the Python one and embserve-server) and the C++ ``embserve_run``.
After each bad call the model still answers a good request exactly as before.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from infer.artifact.cpp_io import read_responses, write_requests
from infer.artifact.export import export
from infer.artifact.load import load
from infer.artifact.runtime import Runtime
from infer.errors import RequestError
from infer.features import SparseFeatures
from infer.quant.quantize import dequantized_weights, quantize
from infer.reference import FloatEmbeddingBagCollection
from infer.request_rules import REQUEST_ERROR_PREFIX
from infer.weights import random_weights
from server.proto import inference_pb2 as pb
from server.proto import inference_pb2_grpc as pb_grpc
from tests.cpp.conftest import build_cpp_loader
from tests.server.native_support import SERVER_KINDS, start_kind
from tests.server.oip_support import PROTOCOLS, corpus_inputs, triton_inputs
from tests.server.oip_support import client as triton_client
from tests.server.support import CALL_TIMEOUT, LoopThread, Served
from tests.support.bad_requests import BAD_REQUESTS, CORPUS_SPEC, BadRequest

GOOD = SparseFeatures(
    CORPUS_SPEC.feature_names, torch.tensor([1, 2, 3, 19]), torch.tensor([1, 1, 1, 1], dtype=torch.int32)
)


@pytest.fixture(scope="module")
def corpus_model():
    model = quantize(CORPUS_SPEC, random_weights(CORPUS_SPEC, seed=21))
    return model


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, corpus_model) -> Path:
    return export(corpus_model, tmp_path_factory.mktemp("corpus") / "artifact")


@pytest.fixture(scope="module")
def runtime(artifact) -> Runtime:
    return load(artifact)


@pytest.fixture(scope="module")
def expected_good(corpus_model) -> torch.Tensor:
    """The good request's output from the fp32 reference on the dequantized tables (independent of the TBE)."""
    reference = FloatEmbeddingBagCollection(CORPUS_SPEC, dequantized_weights(CORPUS_SPEC, corpus_model))
    return reference(GOOD)


@pytest.fixture(scope="module", params=SERVER_KINDS)
def server(request, artifact) -> Iterator[Served]:
    """The corpus model on each server (the Python one and embserve-server), gRPC and REST."""
    loop = LoopThread()
    served = start_kind(request.param, loop, artifact, http_port=0)
    yield served
    served.close_channels()
    served.stop(grace=1.0)
    loop.close()


def test_the_corpus_names_distinct_cases():
    assert len({case.name for case in BAD_REQUESTS}) == len(BAD_REQUESTS) >= 8


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=repr)
def test_runtime(case: BadRequest, runtime, expected_good):
    with pytest.raises(RequestError) as info:
        runtime.lookup(SparseFeatures(CORPUS_SPEC.feature_names, case.values, case.lengths, case.weights))
    assert case.fragment in str(info.value)
    torch.testing.assert_close(runtime.lookup(GOOD), expected_good, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=repr)
def test_scripted_model(case: BadRequest, runtime, expected_good):
    """The TorchScript forward validates on its own (C++ and other TorchScript hosts call it directly)."""
    values, lengths = case.values.clone(), case.lengths.clone()
    with pytest.raises(torch.jit.Error) as info:
        runtime.module(values, lengths, case.weights)
    assert REQUEST_ERROR_PREFIX + case.fragment in str(info.value)
    assert torch.equal(values, case.values) and torch.equal(lengths, case.lengths)  # the caller's tensors
    torch.testing.assert_close(runtime.module(GOOD.values, GOOD.lengths, None), expected_good, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=repr)
def test_grpc_server(case: BadRequest, server: Served, expected_good):
    stub = pb_grpc.InferenceServiceStub(server.channel())
    packed = pb.PackedFeatures(
        feature_order=list(CORPUS_SPEC.feature_names),
        ids=case.values.numpy().tobytes(),
        id_type=pb.ID_TYPE_INT64,
        lengths=case.lengths.numpy().tobytes(),
        weights=case.weights.numpy().tobytes() if case.weights is not None else b"",
    )
    with pytest.raises(grpc.RpcError) as info:
        stub.Lookup(pb.LookupRequest(sparse=pb.SparseFeatures(packed=packed)), timeout=CALL_TIMEOUT)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert case.fragment in info.value.details()
    good = pb.PackedFeatures(
        feature_order=list(CORPUS_SPEC.feature_names),
        ids=GOOD.values.numpy().tobytes(),
        id_type=pb.ID_TYPE_INT64,
        lengths=GOOD.lengths.numpy().tobytes(),
    )
    response = stub.Lookup(pb.LookupRequest(sparse=pb.SparseFeatures(packed=good)), timeout=CALL_TIMEOUT)
    pooled = torch.frombuffer(bytearray(response.embeddings), dtype=torch.float32).view(response.batch_size, -1)
    torch.testing.assert_close(pooled, expected_good, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("case", BAD_REQUESTS, ids=repr)
def test_open_inference_protocol(case: BadRequest, protocol: str, server: Served, expected_good):
    from tritonclient.utils import InferenceServerException

    address = server.address if protocol == "grpc" else f"127.0.0.1:{server.running.http_port}"
    model = "artifact"  # the artifact's folder name
    with triton_client(protocol, address) as client:
        with pytest.raises(InferenceServerException) as info:
            client.infer(model, corpus_inputs(protocol, case))
        assert str(info.value.status()) == {"grpc": "StatusCode.INVALID_ARGUMENT", "http": "400"}[protocol]
        assert case.per_feature_fragment in info.value.message()
        pooled = client.infer(model, triton_inputs(protocol, GOOD)).as_numpy("embeddings")
    torch.testing.assert_close(torch.tensor(pooled), expected_good, rtol=1e-5, atol=1e-5)


def test_embserve_run(artifact, tmp_path, expected_good):
    """One request file holding every case, then a good request: each bad one is a RequestError with its
    fragment, and the good one after them all is answered."""
    embserve_run = build_cpp_loader() / "embserve_run"
    requests = [(case.values, case.lengths, case.weights) for case in BAD_REQUESTS]
    write_requests(tmp_path / "requests.bin", [*requests, (GOOD.values, GOOD.lengths, None)])
    result = subprocess.run(
        [str(embserve_run), str(artifact), "--requests", str(tmp_path / "requests.bin"), "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1, result.stderr  # status 1: some requests failed (each has its error record)
    responses = read_responses(tmp_path / "o")
    assert len(responses) == len(BAD_REQUESTS) + 1
    for case, response in zip(BAD_REQUESTS, responses):
        assert not response.ok, case.name
        assert response.error_type == "RequestError", (case.name, response.error_type, response.message)
        assert case.fragment in (response.message or ""), (case.name, response.message)
    assert responses[-1].output is not None
    torch.testing.assert_close(responses[-1].output, expected_good, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "lengths, num_ids",
    [([2**62] * 4, 0), ([2**62, 2**62, 2**62, 2**62 + 1], 1), ([2**63 - 1, 1, -(2**63) + 1, 0], 1)],
    ids=["wraps_to_zero", "wraps_to_one", "cancels_out"],
)
def test_int64_lengths_whose_sum_wraps_are_rejected(runtime, lengths, num_ids, expected_good):
    """Huge int64 lengths whose sum wraps around to the number of ids are a RequestError in Python and in the
    scripted model, not a raw RuntimeError (or a crash) further down."""
    values = torch.ones(num_ids, dtype=torch.int64)
    lengths_tensor = torch.tensor(lengths, dtype=torch.int64)
    with pytest.raises(RequestError, match="has (length|negative length)"):
        runtime.lookup(SparseFeatures(CORPUS_SPEC.feature_names, values, lengths_tensor))
    with pytest.raises(torch.jit.Error, match=r"embserve\.RequestError: .*has (length|negative length)"):
        runtime.module(values, lengths_tensor, None)
    torch.testing.assert_close(runtime.lookup(GOOD), expected_good, rtol=1e-5, atol=1e-5)


def test_the_unchecked_entry_matches_the_reference_and_the_checked_one_still_refuses(runtime, expected_good):
    """The server validates once and calls ``lookup_unchecked``; every other caller gets ``forward``'s checks."""
    unchecked = runtime.module.lookup_unchecked(GOOD.values, GOOD.lengths, None)
    torch.testing.assert_close(unchecked, expected_good, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        runtime.lookup_unchecked(GOOD.values, GOOD.lengths, None), expected_good, rtol=1e-5, atol=1e-5
    )
    case = next(c for c in BAD_REQUESTS if c.name == "id_legal_elsewhere")  # the kernel's bounds check allows it
    with pytest.raises(torch.jit.Error) as info:
        runtime.module(case.values, case.lengths, case.weights)
    assert REQUEST_ERROR_PREFIX + case.fragment in str(info.value)
