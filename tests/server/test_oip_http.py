"""The REST servers (embserve serve and embserve-server) against malformed HTTP: every bad request gets an answer (or
a closed connection), never a crash.

Plain ``http.client`` and raw sockets: what tritonclient would never send.
"""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Iterator

import grpc
import pytest

from server.proto import open_inference_grpc_pb2 as pb
from server.proto import open_inference_grpc_pb2_grpc as pb_grpc
from tests.conftest import random_batch
from tests.server.native_support import SERVER_KINDS, start_kind
from tests.server.oip_support import client, triton_inputs
from tests.server.support import Served

MAX_MESSAGE = 64 * 1024
# a binary-extension request whose input claims 32 bytes while 8 follow the JSON header
HEADER = b'{"inputs":[{"name":"f_int8__values","datatype":"INT64","shape":[4],"parameters":{"binary_data_size":32}}]}'
SHORT_BINARY = HEADER + bytes(8)
GARBAGE = (
    b"\x00\x01\x02\r\n\r\n",
    b"GET\r\n\r\n",
    b"POST /v2/models/dense/infer HTTP/1.1\r\nContent-Length: x\r\n\r\n",
)


@pytest.fixture(scope="module", params=SERVER_KINDS)
def rest_server(request, loop_thread, dense_artifact) -> Iterator[Served]:
    """The dense model on each server (the Python one and embserve-server) with a small message bound."""
    served = start_kind(request.param, loop_thread, dense_artifact, http_port=0, max_message_bytes=MAX_MESSAGE)
    yield served
    served.close_channels()
    served.stop(1.0)


@pytest.fixture(scope="module")
def both_servers(loop_thread, dense_artifact) -> Iterator[dict[str, Served]]:
    """The Python server and embserve-server side by side (the native one skips when it is not built)."""
    started: dict[str, Served] = {}
    try:
        for kind in SERVER_KINDS:
            started[kind] = start_kind(kind, loop_thread, dense_artifact, http_port=0, max_message_bytes=MAX_MESSAGE)
        yield started
    finally:
        for served in started.values():
            served.close_channels()
            served.stop(1.0)


def _request(served: Served, method: str, path: str, body: bytes = b"", headers: dict | None = None):
    connection = http.client.HTTPConnection("127.0.0.1", served.running.http_port, timeout=10)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


@pytest.mark.parametrize(
    ("method", "path", "body", "headers", "status", "fragment"),
    [
        ("POST", "/v2/models/dense/infer", b"{not json", {}, 400, "not valid JSON"),
        ("POST", "/v2/models/dense/infer", b"[1, 2]", {}, 400, "JSON object with an 'inputs' list"),
        ("POST", "/v2/models/dense/infer", b'{"inputs": [{"name": 3}]}', {}, 400, "input #0"),
        ("POST", "/v2/models/dense/infer", b'{"inputs": [{"name": "f_int8__values", "datatype": "INT64", '
         b'"shape": [2], "data": ["a", "b"]}]}', {}, 400, "are not INT64 numbers"),  # fmt: skip
        ("POST", "/v2/models/dense/infer", SHORT_BINARY, {"Inference-Header-Content-Length": str(len(HEADER))},
         400, "runs past the request's binary data"),  # fmt: skip
        ("POST", "/v2/models/dense/infer", b"{}", {"Inference-Header-Content-Length": "999"}, 400, "exceeds"),
        ("POST", "/v2/models/dense/infer", b"x" * (MAX_MESSAGE + 1), {}, 413, "exceeds the server's limit"),
        ("GET", "/v2/nowhere", b"", {}, 404, "no route GET /v2/nowhere"),
        ("GET", "/v2/models/nobody", b"", {}, 404, "unknown model 'nobody'"),
        ("POST", "/v2/models/dense/infer", b"{}", {"Content-Encoding": "br"}, 415, "not supported"),
        # found by bench/rest_fuzz.py: embserve-server overflowed its stack on a deep nest (a crash), answered 500
        # with its internals in a header to a path or body of bytes that are no UTF-8, and Python answered 500 to
        # a deep nest (RecursionError) and dropped the connection on a body that is no gzip
        ("POST", "/v2/models/dense/infer", b'{"inputs":[{"name":"x","datatype":"INT64","shape":[1],"data":'
         + b"[" * 20_000 + b"1" + b"]" * 20_000 + b"}]}", {}, 400, "nests JSON deeper than 100 levels"),
        ("POST", "/v2/models/dense/infer", b'{"inputs":[],"id":' + b"{\"a\":" * 150 + b"1" + b"}" * 151, {}, 400,
         "nests JSON deeper than 100 levels"),
        ("GET", "/v2/models/%ff", b"", {}, 404, "unknown model '\ufffd'"),
        ("POST", "/v2/models/dense/infer", b'{"inputs":[{"name":"\xc3(x"}]}', {}, 400, "not valid JSON"),
        ("POST", "/v2/models/dense/infer", b"\x1f\x8b\x08garbage", {"Content-Encoding": "gzip"}, 400, ""),
    ],
    ids=[
        "bad_json", "not_an_object", "unnamed_input", "non_numeric_data", "binary_past_the_end",
        "header_length_past_body", "too_large", "unknown_route", "unknown_model", "unknown_encoding",
        "deep_nest", "deep_nest_in_id", "path_not_utf8", "json_not_utf8", "not_gzip",
    ],
)  # fmt: skip
def test_bad_http_requests_get_their_status(rest_server, method, path, body, headers, status, fragment):
    got_status, payload = _request(rest_server, method, path, body, headers)
    assert got_status == status
    assert fragment in json.loads(payload)["error"]


def _answer(sock: socket.socket) -> tuple[int, bytes]:
    """The status and body of the HTTP/1.1 answer on ``sock``, read whole by http.client (a server may write head
    and body in separate sends: one recv held only the head under load)."""
    response = http.client.HTTPResponse(sock)
    response.begin()
    assert response.version == 11, response.version
    return response.status, response.read()


def _raw(served: Served, wire: bytes) -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", served.running.http_port), timeout=10) as sock:
        sock.sendall(wire)
        return _answer(sock)


def test_framing_the_fuzzer_found(rest_server):
    """Two Content-Lengths that disagree are refused (each server read a different one); a POST without one has no
    body (embserve-server read until the client hung up: no answer)."""
    status, body = _raw(
        rest_server, b"POST /v2/repository/index HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 7\r\n\r\n{}"
    )
    assert status == 400 and b"Content-Length is given twice" in body
    status, _ = _raw(rest_server, b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 200


def test_the_server_survives_garbage_and_keeps_serving(rest_server, spec):
    for garbage in (
        b"\x00\x01\x02\r\n\r\n",
        b"GET\r\n\r\n",
        b"POST /v2/models/dense/infer HTTP/1.1\r\nContent-Length: x\r\n\r\n",
    ):
        with socket.create_connection(("127.0.0.1", rest_server.running.http_port), timeout=10) as sock:
            sock.sendall(garbage)
            status, _ = _answer(sock)
        assert status == 400
    with socket.create_connection(("127.0.0.1", rest_server.running.http_port), timeout=10) as sock:
        sock.sendall(b"POST /v2/models/dense/infer HTTP/1.1\r\nContent-Length: 100\r\n\r\n{")  # then hang up
    with client("http", f"127.0.0.1:{rest_server.running.http_port}") as c:
        batch = random_batch(spec, batch_size=2, seed=70)
        assert c.infer("dense", triton_inputs("http", batch)).as_numpy("embeddings").shape == (2, spec.output_dim)


def test_grpc_bytes_that_are_no_message_are_invalid_argument(rest_server):
    channel = rest_server.channel()
    call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
    with pytest.raises(grpc.RpcError) as caught:
        call(b"\xff\xff\xff", timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid ModelInferRequest" in caught.value.details()
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    assert stub.ServerLive(pb.ServerLiveRequest(), timeout=10).live


def _tensor(name: str, datatype: str, shape: list, data: object) -> dict:
    return {"name": name, "datatype": datatype, "shape": shape, "data": data}


_INFER = "/v2/models/dense/infer"
ODD_REQUESTS = [
    ("POST", _INFER, {"inputs": []}),
    ("POST", _INFER, {"inputs": [_tensor("f_int8__values", "INT64", [2], [1, 2])]}),
    ("POST", _INFER, {"inputs": [_tensor("f_int8__values", "INT64", [2], [[1], [2]])]}),
    ("POST", _INFER, {"inputs": [_tensor("f_int8__values", "INT64", [2], [[1], 2])]}),
    ("POST", _INFER, {"inputs": [_tensor("f_int8__values", "INT64", [2], [1, None])]}),
    ("POST", _INFER, {"inputs": [_tensor("f_int8__values", "INT64", [-1], [1])]}),
    ("POST", _INFER, {"inputs": [_tensor("f_int8__values", "INT8", [1], [1])]}),
    ("POST", _INFER, {"inputs": [_tensor("bogus", "INT64", [1], [1])]}),
    ("POST", _INFER, {"inputs": [_tensor("f_int8__values", "INT64", [3], [1, 2])]}),
    ("POST", _INFER, {"inputs": [_tensor("f_int8__values", "FP16", [1], [1])]}),
    ("POST", _INFER, {"inputs": [_tensor("f_int8__values", "INT32", [1], [2**31])]}),
    ("POST", _INFER, {"inputs": [_tensor("f_int8__values", "INT64", [1], [2**63])]}),
    ("POST", _INFER, {"inputs": [_tensor("f_int8__values", "INT64", [1], [True, 2])]}),
    ("POST", _INFER, {"inputs": [{"name": "x", "shape": [1]}]}),
    ("POST", _INFER, {"inputs": [{"name": "x", "shape": "a"}]}),
    ("POST", _INFER, {"inputs": [{"name": "x", "shape": [1.5]}]}),
    ("POST", _INFER, {"inputs": [], "parameters": 3}),
    ("POST", _INFER, {"inputs": [], "outputs": [{"x": 1}]}),
    ("POST", _INFER, {"inputs": [], "outputs": [{"name": "zzz"}]}),
    ("POST", _INFER, {"inputs": [{"name": "x", "shape": [1], "parameters": {"binary_data_size": 4}}]}),
    ("POST", _INFER, {"inputs": [{"name": "x", "shape": [1], "parameters": {"binary_data_size": -1}}]}),
    ("POST", _INFER, {"inputs": [{"name": "x", "shape": [1], "parameters": {"binary_data_size": "a"}}]}),
    # found by bench/rest_fuzz.py: Python answered these with 500s, embserve-server refused an empty string
    ("POST", _INFER, {"inputs": [], "outputs": 5}),
    ("POST", _INFER, {"inputs": [], "outputs": [{"name": "embeddings", "parameters": -7}]}),
    ("POST", _INFER, {"inputs": [_tensor("f_int8__values", "INT64", [1], [1])], "outputs": ""}),
    ("POST", _INFER, {"inputs": [{"name": "x", "datatype": False, "shape": [1], "data": [1]}]}),
    ("POST", _INFER, {"inputs": [{"name": "x", "datatype": "INT64", "shape": [1], "data": [1], "parameters": -7}]}),
    ("POST", "/v2/models/dense/versions/2/infer", {"inputs": []}),
    ("POST", "/v2/models/dense/versions/1/infer", {"inputs": []}),
    ("GET", "/v2/models/dense/versions/2", None),
    ("GET", "/v2/models/dense/versions/1/ready", None),
    ("GET", "/v2/models/dense/versions/2/ready", None),
    ("GET", "/v2/models/dense/versions/2/config", None),
    ("PUT", _INFER, None),
    ("GET", _INFER, None),
    ("POST", "/v2/repository/index", None),
    ("POST", "/v2/repository/index", {"ready": 1}),
    ("POST", "/v2/repository/models/dense/load", None),
    ("POST", "/v2/repository/models/dense/unload", None),
    ("POST", "/v2/repository/models/nobody/unload", None),
    ("GET", "/v2/models/d%65nse", None),
    ("GET", "/v2/", None),
    ("GET", "/", None),
]


@pytest.mark.rest
@pytest.mark.parametrize(("method", "path", "body"), ODD_REQUESTS)
def test_both_servers_give_odd_requests_the_same_answer(both_servers, method, path, body):
    """Status and JSON body (the error's words) of embserve-server equal the Python server's."""
    answers = []
    for served in both_servers.values():
        status, payload = _request(served, method, path, b"" if body is None else json.dumps(body).encode())
        answers.append((status, json.loads(payload) if payload else None))
    python, native = answers
    assert native == python
