"""``EmbserveClient(protocol="oip")`` and ``embserve query --protocol oip`` against a real server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch

from infer.errors import RequestError
from infer.features import SparseFeatures
from server.client import EmbserveClient
from tests.conftest import random_batch
from tests.server.support import CALL_TIMEOUT, NUM_DENSE

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_oip_client_equals_the_runtime(dense_server, dense_runtime, spec, weighted):
    batch = random_batch(spec, batch_size=7, weighted=weighted, seed=60)
    dense = torch.randn(7, NUM_DENSE, generator=torch.Generator().manual_seed(6))
    with EmbserveClient(dense_server.address, timeout=CALL_TIMEOUT, protocol="oip", model="dense") as client:
        assert torch.equal(client.lookup(batch), dense_runtime.lookup(batch))
        assert torch.equal(client.lookup(batch, fp16=True), dense_runtime.lookup(batch).half().float())
        assert torch.equal(client.predict(batch, dense), dense_runtime.predict(batch, dense))
        metadata = client.metadata()
    assert metadata.name == "dense" and list(metadata.versions) == ["1"]


@pytest.mark.parametrize("protocol", ["v1", "oip"])
def test_clients_take_a_kjt(dense_server, dense_runtime, spec, protocol):
    """``client.lookup(kjt)`` / ``client.predict(kjt, dense)`` with TorchRec's own input type, its weights the
    per-id weights: the same answers as the same batch as ``SparseFeatures`` (issue 39 item 5)."""
    pytest.importorskip("torchrec")
    batch = random_batch(spec, batch_size=5, weighted=True, seed=61)
    kjt = batch.to_kjt()
    assert type(kjt).__name__ == "KeyedJaggedTensor"
    dense = torch.randn(5, NUM_DENSE, generator=torch.Generator().manual_seed(7))
    with EmbserveClient(dense_server.address, timeout=CALL_TIMEOUT, protocol=protocol, model="dense") as client:
        assert torch.equal(client.lookup(kjt), dense_runtime.lookup(batch))
        assert torch.equal(client.predict(kjt, dense), dense_runtime.predict(batch, dense))
        with pytest.raises(RequestError, match="weights given beside a KeyedJaggedTensor"):
            client.lookup(kjt, weights={name: [[1.0]] for name in spec.feature_names})


@pytest.mark.parametrize("protocol", ["v1", "oip"])
def test_clients_split_a_batch_over_the_servers_max_batch_size(
    start_server, dense_artifact, dense_runtime, spec, protocol
):
    """A batch over the server's --max-batch-size: a bare call is refused naming the flag and the limit; the
    client reads the limit from the model's metadata and sends the batch as several calls (issue 39 item 6)."""
    served = start_server(dense_artifact, max_batch_size=4)
    batch = random_batch(spec, batch_size=11, weighted=True, seed=62)
    dense = torch.randn(11, NUM_DENSE, generator=torch.Generator().manual_seed(8))
    with EmbserveClient(served.address, timeout=CALL_TIMEOUT, protocol=protocol, model="dense") as client:
        with pytest.raises(RequestError) as refused:
            client._lookup(batch, fp16=False)  # one call, as a client that does not split makes it
        assert "batch of 11 examples exceeds the server's max batch size 4 (embserve serve --max-batch-size 4)" in str(
            refused.value
        )
        assert client.max_batch_size == 4
        assert torch.equal(client.lookup(batch), dense_runtime.lookup(batch))
        assert torch.equal(client.predict(batch, dense), dense_runtime.predict(batch, dense))
        assert torch.equal(client.lookup(batch.examples(0, 4)), dense_runtime.lookup(batch)[:4])
    with EmbserveClient(served.address, timeout=CALL_TIMEOUT, protocol=protocol, model="dense") as fresh:
        # the limit unknown: the first refusal asks for it, then the batch goes in parts
        assert torch.equal(fresh.lookup(batch), dense_runtime.lookup(batch))
        bad = SparseFeatures(batch.keys, batch.values.clone(), batch.lengths, batch.weights)
        bad.values[-1] = 10**6  # in the last part's examples
        with pytest.raises(RequestError, match=r"out of range.*in examples \[8, 11\) of the batch of 11"):
            fresh.lookup(bad)


def test_oip_client_needs_a_model_name(dense_server):
    with pytest.raises(RequestError, match="model="):
        EmbserveClient(dense_server.address, protocol="oip")


@pytest.mark.parametrize("protocol", ["v1", "oip"])
def test_query_command(dense_server, spec, protocol):
    command = [sys.executable, "-m", "infer.cli", "query", dense_server.address, "--batch-size", "3"]
    command += ["--protocol", protocol, "--model", "dense"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"output [3, {spec.output_dim}]" in done.stdout
    assert "scores" in done.stdout


def test_v1_calls_may_name_the_served_model(dense_server, dense_runtime, spec):
    batch = random_batch(spec, batch_size=3, seed=61)
    with EmbserveClient(dense_server.address, timeout=CALL_TIMEOUT, model="dense", version="1") as client:
        assert torch.equal(client.lookup(batch), dense_runtime.lookup(batch))
    with EmbserveClient(dense_server.address, timeout=CALL_TIMEOUT, model="other") as client:
        with pytest.raises(grpc.RpcError) as caught:
            client.lookup(batch)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as caught:
            client.metadata()
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
