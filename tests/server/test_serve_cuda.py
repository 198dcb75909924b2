"""A CUDA artifact served over gRPC (the Python server on loopback) answers as the in-process runtime does."""

from __future__ import annotations

import pytest
import torch

from infer.artifact.export import export
from infer.artifact.load import load
from infer.quant.quantize import quantize
from infer.weights import random_weights
from server.adapters.v1 import codec
from server.client import EmbserveClient
from tests.conftest import TinyOverArch, cuda_mixed_spec, random_batch
from tests.server.support import CALL_TIMEOUT, NUM_DENSE, lookup_request


@pytest.mark.gpu
@pytest.mark.parametrize("weights", ["mapped", "embedded"])
def test_a_cuda_artifact_serves_what_the_runtime_computes(start_server, tmp_path, weights):
    torch.manual_seed(0)
    spec = cuda_mixed_spec()
    dense_spec = spec.with_dense_arch(TinyOverArch(NUM_DENSE, spec.output_dim), NUM_DENSE)
    model = quantize(dense_spec, random_weights(dense_spec, seed=5), device="cuda:0")
    artifact = export(model, tmp_path / "cuda", weights=weights)
    runtime = load(artifact)
    assert runtime.manifest.devices == ("cuda:0",)
    served = start_server(artifact)
    for seed, batch_size in enumerate((1, 9, 64)):
        batch = random_batch(spec, batch_size=batch_size, weighted=seed == 1, seed=seed)
        response = served.stub().Lookup(lookup_request(batch), timeout=CALL_TIMEOUT)
        served_rows, expected = codec.decode_embeddings(response), runtime.lookup(batch).cpu()
        assert torch.equal(served_rows, expected), f"max abs diff {float((served_rows - expected).abs().max())}"
        dense = torch.randn(batch_size, NUM_DENSE)
        with EmbserveClient(served.address, timeout=CALL_TIMEOUT) as client:
            assert torch.equal(client.predict(batch, dense), runtime.predict(batch, dense).cpu())
