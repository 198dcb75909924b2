"""CUDA placement of the quantized collection (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from infer.artifact.export import export
from infer.artifact.load import load
from infer.config import DataType, PoolingType
from infer.errors import ConfigError
from infer.modules.cuda_probe import kernel_type_error
from infer.quant.quantize import quantize
from infer.weights import random_weights
from tests.conftest import CUDA_TOLERANCE, cuda_mixed_spec, random_batch, small_spec


@pytest.mark.gpu
@pytest.mark.parametrize("data_type", list(DataType), ids=lambda d: d.value)
@pytest.mark.parametrize("pooling", list(PoolingType), ids=lambda p: p.value)
def test_cuda_model_matches_cpu_model(pooling, data_type):
    """One data type per case (on an H200 and an H100 with fbgemm_gpu 1.6, INT2 rows came back as garbage: a type
    the probe refuses must be refused, every other must answer as the CPU model)."""
    spec = small_spec(data_type, pooling)
    weights = random_weights(spec, seed=2)
    cpu = quantize(spec, weights)
    if kernel_type_error(data_type, "cuda:0") is not None:
        with pytest.raises(ConfigError, match="table 'shared' is " + data_type.value):
            quantize(spec, weights, device="cuda:0")
        return
    gpu = quantize(spec, weights, device="cuda:0")
    assert gpu.embeddings.tbe.row_alignment == 16
    batch = random_batch(spec, 32, weighted=True)
    expected = cpu(batch.values, batch.lengths, batch.weights)
    got = gpu(batch.values.cuda(), batch.lengths.cuda(), batch.weights.cuda())
    assert got.device.type == "cuda"
    assert torch.allclose(got.cpu(), expected, rtol=CUDA_TOLERANCE, atol=CUDA_TOLERANCE)


@pytest.mark.gpu
def test_cuda_artifact_round_trip(tmp_path):
    spec = cuda_mixed_spec()
    model = quantize(spec, random_weights(spec), device="cuda:0")
    runtime = load(export(model, tmp_path / "a"))
    assert runtime.manifest.devices == ("cuda:0",)
    batch = random_batch(spec, 16)
    with torch.no_grad():
        expected = model(batch.values.cuda(), batch.lengths.cuda(), None).cpu()
    got = runtime.lookup(batch)
    assert torch.equal(got, expected), f"max abs diff {float((got - expected).abs().max())}, ids {batch.values.dtype}"


@pytest.mark.gpu
@pytest.mark.parametrize("data_type", [*DataType, None], ids=lambda d: d.value if d else "mixed")
def test_cuda_lookups_repeat_exactly(data_type):
    """The same batch twice, and as int32 and int64 ids, gives the same rows (no uninitialized memory is read)."""
    spec = small_spec(data_type, PoolingType.SUM) if data_type is not None else cuda_mixed_spec()
    if data_type is not None and kernel_type_error(data_type, "cuda:0") is not None:
        pytest.skip(f"the probe refuses {data_type.value} on this GPU (test_cuda_model_matches_cpu_model checks it)")
    model = quantize(spec, random_weights(spec, seed=2), device="cuda:0")
    batch = random_batch(spec, 32)
    with torch.no_grad():
        first = model(batch.values.cuda(), batch.lengths.cuda(), None).cpu()
        again = model(batch.values.cuda(), batch.lengths.cuda(), None).cpu()
        narrow = model(batch.values.to(torch.int32).cuda(), batch.lengths.cuda(), None).cpu()
    assert torch.isfinite(first).all()
    assert torch.equal(first, again) and torch.equal(first, narrow), float((first - narrow).abs().max())


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case", ["negative_length", "length_past_ids", "lengths_sum", "id_negative", "id_past_table", "id_past_small_table"]
)
def test_cuda_model_refuses_as_the_cpu_model(case):
    """A request on the GPU is checked from one summary read back to the host; a bad one then goes through the
    checks one by one, so the refusal names the same feature and value as on the CPU."""
    spec = small_spec()
    weights = random_weights(spec, seed=2)
    cpu = quantize(spec, weights)
    gpu = quantize(spec, weights, device="cuda:0")
    batch = random_batch(spec, 8, max_len=3)
    values, lengths = batch.values.clone(), batch.lengths.clone()
    if case == "negative_length":
        lengths[3] = -1
    elif case == "length_past_ids":
        lengths[2] = values.numel() + 5
    elif case == "lengths_sum":
        lengths[1] += 1
    elif case == "id_negative":
        values[-1] = -3
    elif case == "id_past_table":
        values[0] = 997
    else:  # feature c's table has 301 rows, the shared table 997: 500 passes a and b but not c
        values[-1] = 500
    with pytest.raises(ValueError) as on_cpu:
        cpu(values, lengths, None)
    with pytest.raises(ValueError) as on_gpu:
        gpu(values.cuda(), lengths.cuda(), None)
    assert str(on_gpu.value) == str(on_cpu.value)
    # no id out of range reached the kernel: the device still answers, and right
    good = gpu(batch.values.cuda(), batch.lengths.cuda(), None).cpu()
    torch.cuda.synchronize()
    expected = cpu(batch.values, batch.lengths, None)
    assert torch.allclose(good, expected, rtol=CUDA_TOLERANCE, atol=CUDA_TOLERANCE)


@pytest.mark.gpu
@pytest.mark.parametrize("data_type", list(DataType), ids=lambda d: d.value)
def test_loading_refuses_a_cuda_kernel_of_a_type_the_probe_refuses(data_type):
    """The load-time check (before any file is read) refuses exactly the types the probe refuses, naming the type
    and the device map that loads the model on the CPU instead."""
    from infer.artifact.kernel_types import Kernel, KernelTable
    from infer.artifact.kernels import check_device_kernels
    from infer.errors import ArtifactError

    kernels = [Kernel(0, "cuda:0", 16, (KernelTable(10, 32, data_type),), (0,))]
    check_device_kernels(kernels, {"cuda:0": "cpu"}, "artifact")  # mapped to the CPU: never refused
    if kernel_type_error(data_type, "cuda:0") is None:
        check_device_kernels(kernels, {}, "artifact")
    else:
        with pytest.raises(ArtifactError, match=f"places {data_type.value} tables on cuda:0.*cuda:0=cpu"):
            check_device_kernels(kernels, {}, "artifact")
