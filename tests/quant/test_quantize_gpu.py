"""CUDA placement of the quantized collection (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from infer.artifact.export import export
from infer.artifact.load import load
from infer.config import DataType, PoolingType
from infer.quant.quantize import quantize
from infer.weights import random_weights
from tests.conftest import CUDA_TOLERANCE, mixed_spec, random_batch, small_spec


@pytest.mark.gpu
@pytest.mark.parametrize("pooling", list(PoolingType), ids=lambda p: p.value)
def test_cuda_model_matches_cpu_model(pooling):
    spec = small_spec(DataType.INT8, pooling)
    weights = random_weights(spec, seed=2)
    cpu = quantize(spec, weights)
    gpu = quantize(spec, weights, device="cuda:0")
    assert gpu.embeddings.tbe.row_alignment == 16
    batch = random_batch(spec, 32, weighted=True)
    expected = cpu(batch.values, batch.lengths, batch.weights)
    got = gpu(batch.values.cuda(), batch.lengths.cuda(), batch.weights.cuda())
    assert got.device.type == "cuda"
    assert torch.allclose(got.cpu(), expected, rtol=CUDA_TOLERANCE, atol=CUDA_TOLERANCE)


@pytest.mark.gpu
def test_cuda_artifact_round_trip(tmp_path):
    spec = mixed_spec()
    model = quantize(spec, random_weights(spec), device="cuda:0")
    runtime = load(export(model, tmp_path / "a"))
    assert runtime.manifest.devices == ("cuda:0",)
    batch = random_batch(spec, 16)
    with torch.no_grad():
        expected = model(batch.values.cuda(), batch.lengths.cuda(), None).cpu()
    got = runtime.lookup(batch)
    assert torch.equal(got, expected), f"max abs diff {float((got - expected).abs().max())}, ids {batch.values.dtype}"
