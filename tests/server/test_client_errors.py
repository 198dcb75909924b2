"""The Python client raises the ``EmbserveError`` family for a server's rejections, over both protocols:
``RejectedRequestError`` (a ``RequestError``) for INVALID_ARGUMENT, ``ServerError`` with its ``kind`` for the
rest, each keeping the gRPC status and the server's message. The reference for "the server's message" is
the same call made with a raw gRPC stub."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import pytest
import torch

from infer.errors import EmbserveError, RejectedRequestError, RequestError, ServerError, ServerErrorKind
from server.adapters.v1 import codec
from server.client import EmbserveClient
from server.oip_client import infer_request
from server.proto import inference_pb2 as pb
from server.proto import inference_pb2_grpc as v1_grpc
from server.proto import open_inference_grpc_pb2_grpc as oip_grpc
from tests.conftest import random_batch
from tests.server.support import CALL_TIMEOUT, rpc_error, wait_until

PROTOCOLS = ("v1", "oip")


def _client(address: str, protocol: str, model: str = "dense", **kwargs: Any) -> EmbserveClient:
    return EmbserveClient(address, timeout=CALL_TIMEOUT, protocol=protocol, model=model, **kwargs)


def _raised(call: Callable[[], Any]) -> EmbserveError:
    with pytest.raises(EmbserveError) as caught:
        call()
    return caught.value


def _raw_lookup_error(address: str, protocol: str, features: Any, model: str = "dense") -> grpc.RpcError:
    """The same lookup with a raw stub: the status and message the server answers."""
    channel = grpc.insecure_channel(address)
    try:
        if protocol == "v1":
            stub = v1_grpc.InferenceServiceStub(channel)
            request = pb.LookupRequest(sparse=codec.encode_packed(features), model_name=model)
            return rpc_error(lambda: stub.Lookup(request, timeout=CALL_TIMEOUT))
        oip = oip_grpc.GRPCInferenceServiceStub(channel)
        return rpc_error(lambda: oip.ModelInfer(infer_request(model, "", features), timeout=CALL_TIMEOUT))
    finally:
        channel.close()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_an_invalid_request_is_a_request_error_with_the_servers_message(dense_server, spec, protocol):
    bad = random_batch(spec, batch_size=2, seed=90)
    bad.values[0] = 10**9  # past every table's rows
    with _client(dense_server.address, protocol) as client:
        error = _raised(lambda: client.lookup(bad))
    reference = _raw_lookup_error(dense_server.address, protocol, bad)
    assert reference.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert isinstance(error, RejectedRequestError) and isinstance(error, RequestError)
    assert error.status == "INVALID_ARGUMENT"
    assert error.server_message == reference.details()
    assert reference.details() in str(error)
    assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.INVALID_ARGUMENT  # still one


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_an_unknown_model_is_a_not_found_server_error(dense_server, spec, protocol):
    batch = random_batch(spec, batch_size=2, seed=91)
    with _client(dense_server.address, protocol, model="nobody") as client:
        error = _raised(lambda: client.lookup(batch))
    reference = _raw_lookup_error(dense_server.address, protocol, batch, model="nobody")
    assert reference.code() == grpc.StatusCode.NOT_FOUND
    assert isinstance(error, ServerError) and not isinstance(error, RequestError)
    assert error.kind is ServerErrorKind.NOT_FOUND and error.status == "NOT_FOUND"
    assert error.server_message == reference.details() and "nobody" in error.server_message


def test_predict_without_a_dense_part_is_failed_precondition(start_server, sparse_artifact, spec):
    served = start_server(sparse_artifact)
    batch = random_batch(spec, batch_size=2, seed=92)
    with EmbserveClient(served.address, timeout=CALL_TIMEOUT) as client:
        error = _raised(lambda: client.predict(batch, torch.zeros(2, 1)))
    assert isinstance(error, ServerError) and error.kind is ServerErrorKind.FAILED_PRECONDITION
    assert "no dense part" in error.server_message


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_missing_token_is_unauthenticated(start_server, dense_artifact, spec, protocol):
    served = start_server(dense_artifact, auth_token="s3cret")
    with _client(served.address, protocol) as client:
        error = _raised(client.metadata)
    assert isinstance(error, ServerError) and error.kind is ServerErrorKind.UNAUTHENTICATED
    assert "token" in error.server_message


def test_a_full_queue_is_resource_exhausted(start_server, gated, spec):
    runtime, gate = gated
    served = start_server(runtime, max_queue=1, forward_threads=1, max_delay_us=0)
    first, second, third = (random_batch(spec, batch_size=2, seed=93 + i) for i in range(3))
    gate.hold()
    with EmbserveClient(served.address, timeout=CALL_TIMEOUT) as client:
        stub = served.stub()
        running = stub.Lookup.future(pb.LookupRequest(sparse=codec.encode_packed(first)), timeout=CALL_TIMEOUT)
        gate.wait_entered()
        queued = stub.Lookup.future(pb.LookupRequest(sparse=codec.encode_packed(second)), timeout=CALL_TIMEOUT)
        wait_until(lambda: served.running.servicer.lookups.depth == 1, what="the second request to be queued")
        error = _raised(lambda: client.lookup(third))
        gate.release()
        running.result()
        queued.result()
    assert isinstance(error, ServerError) and error.kind is ServerErrorKind.RESOURCE_EXHAUSTED
    assert "queue is full" in error.server_message


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_stopped_server_is_unavailable(start_server, dense_artifact, spec, protocol):
    served = start_server(dense_artifact)
    served.stop(grace=1.0)  # the port is closed: nothing answers there
    with _client(served.address, protocol) as client:
        error = _raised(lambda: client.lookup(random_batch(spec, batch_size=1, seed=96)))
    assert isinstance(error, ServerError) and error.kind is ServerErrorKind.UNAVAILABLE
