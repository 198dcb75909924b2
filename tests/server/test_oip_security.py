"""The Open Inference Protocol behind the server's bearer token and TLS, over gRPC and REST, with tritonclient, on both
servers (embserve serve and embserve-server)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from tritonclient.utils import InferenceServerException

from tests.conftest import random_batch
from tests.server.oip_support import client, triton_inputs
from tests.server.test_security import TOKEN, _self_signed

MODEL = "dense"
HEADERS = {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def token_server(start_any, dense_artifact):
    return start_any(dense_artifact, auth_token=TOKEN, http_port=0)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_the_token_guards_inference_but_not_the_probes(token_server, dense_runtime, spec, protocol):
    address = token_server.address if protocol == "grpc" else f"127.0.0.1:{token_server.running.http_port}"
    batch = random_batch(spec, batch_size=4, seed=50)
    with client(protocol, address) as c:
        assert c.is_server_live() and c.is_server_ready()
        for headers in (None, {"authorization": f"Bearer {TOKEN}x"}, {"authorization": TOKEN}):
            with pytest.raises(InferenceServerException) as caught:
                c.infer(MODEL, triton_inputs(protocol, batch), headers=headers)
            assert str(caught.value.status()) in ("StatusCode.UNAUTHENTICATED", "401")
            assert "token" in caught.value.message()
        # a copy: tritonclient.http adds its Inference-Header-Content-Length (an int) to the dict it is given
        got = c.infer(MODEL, triton_inputs(protocol, batch), headers=dict(HEADERS)).as_numpy("embeddings")
        assert torch.equal(torch.from_numpy(np.array(got)), dense_runtime.lookup(batch))


def test_tls_serves_both_protocols(start_any, dense_artifact, dense_runtime, spec, tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = _self_signed(tmp_path, "server")
    served = start_any(dense_artifact, tls_cert=str(cert), tls_key=str(key), http_port=0)
    batch = random_batch(spec, batch_size=3, seed=51)
    expected = dense_runtime.lookup(batch)
    with client("grpc", f"localhost:{served.port}", ssl=True, root_certificates=str(cert)) as c:
        got = c.infer(MODEL, triton_inputs("grpc", batch)).as_numpy("embeddings")
        assert torch.equal(torch.from_numpy(np.array(got)), expected)
    http_address = f"localhost:{served.running.http_port}"
    with client("http", http_address, ssl=True, ssl_options={"ca_certs": str(cert)}) as c:
        got = c.infer(MODEL, triton_inputs("http", batch)).as_numpy("embeddings")
        assert torch.equal(torch.from_numpy(np.array(got)), expected)
    with client("http", http_address) as plaintext:  # no TLS: the server answers nothing useful
        with pytest.raises(Exception):  # noqa: B017 - geventhttpclient raises connection errors of several types
            plaintext.infer(MODEL, triton_inputs("http", batch))
