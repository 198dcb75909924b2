"""Quantized collection vs the independent fp32 reference over the dequantized tables."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from infer.config import DataType, ModelSpec, PoolingType, TableConfig
from infer.errors import WeightsError
from infer.quant.accuracy import accuracy_report
from infer.quant.quantize import dequantized_weights, quantize
from infer.quant.rowwise import dequantize_rows, quantize_rows
from infer.reference import FloatEmbeddingBagCollection
from infer.weights import load_checkpoint, random_weights
from tests.conftest import mixed_spec, random_batch, small_spec

ALL_TYPES = [DataType.INT8, DataType.INT4, DataType.INT2, DataType.FP16, DataType.FP32]


def _assert_close_to_magnitude(got: torch.Tensor, expected: torch.Tensor, rel: float = 1e-5) -> None:
    scale = max(float(expected.abs().max()), 1.0)
    diff = float((got - expected).abs().max()) if got.numel() else 0.0
    assert diff <= rel * scale, f"max abs diff {diff} exceeds {rel} x magnitude {scale}"


@pytest.mark.parametrize("data_type", ALL_TYPES, ids=lambda d: d.value)
@pytest.mark.parametrize("pooling", list(PoolingType), ids=lambda p: p.value)
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_lookup_equals_embedding_bag_on_dequantized_tables(data_type, pooling, weighted):
    spec = small_spec(data_type, pooling)
    weights = random_weights(spec, seed=3)
    model = quantize(spec, weights)
    reference = FloatEmbeddingBagCollection(spec, dequantized_weights(spec, model))
    for seed, id_dtype in ((0, torch.int64), (1, torch.int32)):
        batch = random_batch(spec, batch_size=24, weighted=weighted, seed=seed, id_dtype=id_dtype)
        assert int((batch.lengths == 0).sum()) > 0
        got = model(batch.values, batch.lengths, batch.weights)
        assert got.shape == (24, spec.output_dim) and got.dtype == torch.float32
        _assert_close_to_magnitude(got, reference(batch))


def test_mixed_types_share_one_kernel_call_and_match_reference():
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen

    spec = mixed_spec()
    weights = random_weights(spec, seed=5)
    model = quantize(spec, weights)
    from torch.utils._python_dispatch import TorchDispatchMode

    kernels = [m for m in model.modules() if isinstance(m, IntNBitTableBatchedEmbeddingBagsCodegen)]
    assert len(kernels) == 1
    calls = []

    class CountLookups(TorchDispatchMode):  # every call of fbgemm's lookup op, however the module reaches it
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "int_nbit_split_embedding_codegen_lookup_function" in str(func):
                calls.append(1)
            return func(*args, **(kwargs or {}))

    reference = FloatEmbeddingBagCollection(spec, dequantized_weights(spec, model))
    batch = random_batch(spec, batch_size=32, weighted=True, seed=2)
    with CountLookups():
        got = model(batch.values, batch.lengths, batch.weights)
    _assert_close_to_magnitude(got, reference(batch))
    assert calls == [1]


@pytest.mark.parametrize("data_type", [DataType.INT8, DataType.INT4, DataType.INT2], ids=lambda d: d.value)
def test_our_dequantizer_agrees_with_fbgemm(data_type):
    """The test reference's dequantizer is plain torch; cross-check it against fbgemm's own."""
    import fbgemm_gpu  # noqa: F401

    weight = torch.randn(50, 64) * 3
    data, scale_bias = quantize_rows(weight, data_type)
    ours = dequantize_rows(data, scale_bias, data_type, 64)
    fused = torch.cat([data, scale_bias], dim=1).contiguous()
    theirs = torch.ops.fbgemm.FusedNBitRowwiseQuantizedSBHalfToFloat(fused, data_type.bits)
    assert torch.equal(ours, theirs)
    # and the kernel's stored rows are the quantizer's bytes, scale/bias moved to the front
    spec = ModelSpec((TableConfig("t", 50, 64, ("f",), data_type=data_type),))
    model = quantize(spec, {"t": weight})
    stored_data, stored_scale_bias = model.embeddings.table_weights()[0]
    assert torch.equal(stored_data, data) and torch.equal(stored_scale_bias, scale_bias)


def test_fp16_and_fp32_store_values_exactly():
    weight = torch.randn(40, 16)
    for data_type, expected in ((DataType.FP32, weight), (DataType.FP16, weight.half().float())):
        spec = ModelSpec((TableConfig("t", 40, 16, ("f",), data_type=data_type),))
        model = quantize(spec, {"t": weight})
        assert torch.equal(dequantized_weights(spec, model)["t"], expected)


def test_int8_relative_error_vs_fp32_under_one_percent():
    spec = ModelSpec((TableConfig("t", 5000, 128, ("f",)),))
    weights = {"t": torch.randn(5000, 128, generator=torch.Generator().manual_seed(0))}
    model = quantize(spec, weights)
    batch = random_batch(spec, batch_size=256, max_len=20, seed=4)
    expected = FloatEmbeddingBagCollection(spec, weights)(batch)
    got = model(batch.values, batch.lengths, None)
    relative = float(torch.linalg.vector_norm(got - expected) / torch.linalg.vector_norm(expected))
    assert relative <= 0.01
    [row] = accuracy_report(spec, weights, model)
    assert row.table == "t" and 0 < row.relative_error <= 0.01


def test_accuracy_report_orders_types_by_precision():
    spec = ModelSpec(tuple(TableConfig(f"t_{d.value}", 2000, 64, (f"f_{d.value}",), data_type=d) for d in ALL_TYPES))
    weights = random_weights(spec, seed=1)
    report = {row.data_type: row.relative_error for row in accuracy_report(spec, weights, quantize(spec, weights))}
    assert report[DataType.FP32] == 0.0
    assert 0 < report[DataType.FP16] < report[DataType.INT8] < report[DataType.INT4] < report[DataType.INT2]


def test_shape_mismatch_names_table_and_both_shapes(tmp_path):
    spec = small_spec()
    weights = random_weights(spec)
    weights["single"] = torch.randn(300, 32)
    path = tmp_path / "ckpt.pt"
    torch.save(weights, path)
    with pytest.raises(WeightsError, match=r"'single'.*\[300, 32\].*\[301, 32\]"):
        load_checkpoint(path, spec)
    with pytest.raises(WeightsError, match="'single'"):
        quantize(spec, weights)


def test_checkpoint_loading_is_weights_only(tmp_path):
    spec = small_spec()
    path = tmp_path / "evil.pt"
    torch.save({"shared": subprocess.Popen, "single": torch.zeros(301, 32)}, path)
    with pytest.raises(WeightsError, match="cannot load"):
        load_checkpoint(path, spec)
    good = tmp_path / "good.pt"
    weights = random_weights(spec)
    torch.save(weights, good)
    loaded = load_checkpoint(good, spec)
    assert all(torch.equal(loaded[k], weights[k]) for k in weights)
    with pytest.raises(WeightsError, match="does not exist"):
        load_checkpoint(tmp_path / "missing.pt", spec)


def test_non_finite_weights_are_rejected_with_the_row():
    spec = small_spec()
    weights = random_weights(spec)
    weights["shared"][123, 5] = float("nan")
    with pytest.raises(WeightsError, match=r"'shared'.*row 123"):
        quantize(spec, weights)


def test_progress_reports_every_chunk_and_ends_at_total():
    spec = ModelSpec((TableConfig("big", 200_000, 8, ("f",)),))
    seen = []
    quantize(
        spec, {"big": torch.randn(200_000, 8)}, progress=lambda name, done, total: seen.append((name, done, total))
    )
    assert seen[-1] == ("big", 200_000, 200_000)
    assert len(seen) >= 3 and all(a[1] < b[1] for a, b in zip(seen, seen[1:]))


@pytest.mark.slow
def test_quantizing_a_large_table_holds_no_extra_fp32_copy():
    """Peak memory while quantizing stays well below one more fp32 copy of the table."""
    script = textwrap.dedent(
        """
        import resource, torch
        from infer.config import ModelSpec, TableConfig
        from infer.quant.quantize import quantize
        rows, dim = 1_500_000, 128
        spec = ModelSpec((TableConfig("big", rows, dim, ("f",)),))
        weight = torch.randn(rows, dim)
        import fbgemm_gpu  # load the libraries before the baseline
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        quantize(spec, {"big": weight})
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(after - before, weight.numel() * 4, rows * (dim + 4))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    growth, fp32_bytes, int8_bytes = map(int, out)
    assert growth < int8_bytes + fp32_bytes // 4, (growth, fp32_bytes, int8_bytes)


def test_empty_batch_gives_zero_rows():
    spec = small_spec()
    model = quantize(spec, random_weights(spec))
    out = model(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int32), None)
    assert out.shape == (0, spec.output_dim)
