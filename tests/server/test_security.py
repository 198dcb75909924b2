"""Bearer-token authentication and TLS.

The tests that only call a server share one per module and server kind (``token_server``, ``tls_server``); a
test whose server needs its own settings starts it (``start_any``)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from infer.errors import ConfigError
from server.adapters.v1 import codec
from server.app import SERVICE_NAME, create_server
from server.client import EmbserveClient
from server.proto import inference_pb2_grpc as pb_grpc
from tests.conftest import random_batch
from tests.server.native_support import SERVER_KINDS, start_kind
from tests.server.support import CALL_TIMEOUT, local_config, lookup_request, rpc_error

TOKEN = "s3cret-token"


@pytest.fixture(scope="module", params=SERVER_KINDS)
def token_server(request, loop_thread, dense_artifact) -> Iterator[Any]:
    """The dense model behind a bearer token, on each server kind in turn (shared: the tests only call it)."""
    served = start_kind(request.param, loop_thread, dense_artifact, auth_token=TOKEN)
    yield served
    served.close_channels()
    served.stop(grace=1.0)


@pytest.mark.parametrize(
    "token", [None, "wrong", TOKEN + "x", TOKEN[:-1]], ids=["missing", "wrong", "longer", "prefix"]
)
def test_token_server_rejects_a_missing_or_wrong_token(token_server, spec, token):
    batch = random_batch(spec, batch_size=2)
    with EmbserveClient(token_server.address, token=token, timeout=CALL_TIMEOUT) as client:
        for call in (lambda: client.lookup(batch), client.metadata):
            error = rpc_error(call)
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "token" in error.details()


def test_token_must_be_a_bearer_token(token_server, spec):
    stub = pb_grpc.InferenceServiceStub(token_server.channel())
    for value in (TOKEN, f"Basic {TOKEN}", f"bearer {TOKEN}"):
        error = rpc_error(
            lambda value=value: stub.Lookup(
                lookup_request(random_batch(spec, 1)), timeout=CALL_TIMEOUT, metadata=(("authorization", value),)
            )
        )
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED


def test_token_server_accepts_the_right_token(token_server, dense_runtime, spec):
    batch = random_batch(spec, batch_size=6, weighted=True, seed=31)
    with EmbserveClient(token_server.address, token=TOKEN, timeout=CALL_TIMEOUT) as client:
        counted = token_server.metric("embserve_requests_total", {"method": "Lookup", "code": "OK"})
        assert torch.equal(client.lookup(batch), dense_runtime.lookup(batch))
        assert client.metadata().output_dim == spec.output_dim
    assert token_server.metric("embserve_requests_total", {"method": "Lookup", "code": "OK"}) == counted + 1


def test_health_and_reflection_need_no_token(token_server):
    assert token_server.health("") == health_pb2.HealthCheckResponse.SERVING
    assert token_server.health(SERVICE_NAME) == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(token_server.channel())
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    response = next(iter(stub.ServerReflectionInfo(iter([request]), timeout=CALL_TIMEOUT)))
    assert SERVICE_NAME in {s.name for s in response.list_services_response.service}


def _self_signed(folder: Path, name: str) -> tuple[Path, Path]:
    cert, key = folder / f"{name}.crt", folder / f"{name}.key"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
            "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )  # fmt: skip
    return cert, key


@pytest.fixture(scope="module", params=SERVER_KINDS)
def tls_server(request, loop_thread, dense_artifact, tmp_path_factory) -> Iterator[tuple[Any, Path]]:
    """(server, its certificate): the dense model over TLS on each server kind in turn (shared: the tests only
    call it)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = _self_signed(tmp_path_factory.mktemp("tls"), "server")
    served = start_kind(request.param, loop_thread, dense_artifact, tls_cert=str(cert), tls_key=str(key))
    yield served, cert
    served.close_channels()
    served.stop(grace=1.0)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_tls_serves_correct_results(tls_server, dense_runtime, spec, host):
    served, cert = tls_server
    batch = random_batch(spec, batch_size=5, seed=32)
    address = f"{host}:{served.port}"
    with EmbserveClient(address, root_certificates=cert.read_bytes(), timeout=CALL_TIMEOUT) as client:
        assert torch.equal(client.lookup(batch), dense_runtime.lookup(batch))
        assert list(client.metadata().feature_order) == list(spec.feature_names)


def test_tls_refuses_plaintext_and_untrusted_clients(tls_server, tmp_path, dense_runtime, spec):
    served, cert = tls_server
    batch = random_batch(spec, batch_size=2)
    with EmbserveClient(served.address, timeout=2.0) as plaintext:
        assert rpc_error(lambda: plaintext.lookup(batch)).code() == grpc.StatusCode.UNAVAILABLE
    other, _ = _self_signed(tmp_path, "other")
    with EmbserveClient(served.address, root_certificates=other.read_bytes(), timeout=2.0) as untrusted:
        assert rpc_error(lambda: untrusted.lookup(batch)).code() == grpc.StatusCode.UNAVAILABLE
    with EmbserveClient(served.address, root_certificates=cert.read_bytes(), timeout=CALL_TIMEOUT) as trusted:
        assert torch.equal(trusted.lookup(batch), dense_runtime.lookup(batch))


def test_tls_and_token_together(start_any, dense_artifact, dense_runtime, spec, tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = _self_signed(tmp_path, "server")
    served = start_any(dense_artifact, tls_cert=str(cert), tls_key=str(key), auth_token=TOKEN)
    batch = random_batch(spec, batch_size=3, seed=33)
    with EmbserveClient(served.address, root_certificates=cert.read_bytes(), timeout=CALL_TIMEOUT) as anonymous:
        assert rpc_error(lambda: anonymous.lookup(batch)).code() == grpc.StatusCode.UNAUTHENTICATED
    with EmbserveClient(served.address, token=TOKEN, root_certificates=cert.read_bytes(), timeout=CALL_TIMEOUT) as c:
        assert torch.equal(c.lookup(batch), dense_runtime.lookup(batch))


def test_tls_needs_both_cert_and_key(loop_thread, dense_artifact, tmp_path):
    with pytest.raises(ConfigError, match="both"):
        loop_thread.run(create_server(dense_artifact, local_config(tls_cert=str(tmp_path / "cert.pem"))))


def test_response_embeddings_decode_over_tls(tls_server, dense_runtime, spec):
    served, cert = tls_server
    credentials = grpc.ssl_channel_credentials(cert.read_bytes())
    with grpc.secure_channel(f"localhost:{served.port}", credentials) as channel:
        batch = random_batch(spec, batch_size=4, seed=34)
        response = pb_grpc.InferenceServiceStub(channel).Lookup(lookup_request(batch, typed=True), timeout=10)
    assert torch.equal(codec.decode_embeddings(response), dense_runtime.lookup(batch))


def test_configuration_errors_are_config_errors(tmp_path):
    """Bad server settings are ConfigError (an EmbserveError the CLI prints as one line), naming the setting."""
    from infer.errors import ConfigError
    from server.auth import BearerTokenInterceptor, read_token_file
    from server.batcher import DynamicBatcher, QueueFullError

    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        read_token_file(str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="empty"):
        BearerTokenInterceptor("")
    with pytest.raises(ConfigError, match="max_queue=0"):
        DynamicBatcher(lambda *a: None, max_queue=0)  # type: ignore[arg-type, return-value]
    from infer.errors import EmbserveError

    assert issubclass(QueueFullError, EmbserveError)
