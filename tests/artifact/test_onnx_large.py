"""A table set over 2 GB exports to ONNX with external data and runs in onnxruntime like the TBE artifact.

Protobuf caps one message at 2 GB, so the tables must live outside ``model.onnx``. The tables' bytes are
filled in place (random codes, fixed fp16 scale/bias) instead of quantizing 9 GB of fp32 weights.

Run by hand: ``EMBSERVE_LARGE_TESTS=1 python -m pytest tests/artifact/test_onnx_large.py`` (about 70 s on
2 cores, 5.8 GB peak memory, 4.4 GB of temporary files); deselected otherwise.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from infer.artifact.export import export
from infer.artifact.load import load
from infer.config import DataType, ModelSpec, PoolingType, TableConfig
from infer.features import SparseFeatures
from infer.modules.collection import EmbserveModel, QuantizedEmbeddingBagCollection
from tests.conftest import random_batch

ROWS = 17_000_000  # x (124 codes + 4 bytes scale/bias) = 2.18 GB
DIM = 124


@pytest.mark.slow
@pytest.mark.large
def test_table_set_over_2gb_exports_with_external_data_and_runs(tmp_path):
    import onnx

    spec = ModelSpec(
        (
            TableConfig("big", ROWS, DIM, ("big_id",), PoolingType.SUM, DataType.INT8),
            TableConfig("small", 1000, 16, ("small_id",), PoolingType.MEAN, DataType.INT4),
        )
    )
    collection = QuantizedEmbeddingBagCollection(spec)
    generator = torch.Generator().manual_seed(0)
    scale_bias = np.array([0.01, -1.25], dtype=np.float16).view(np.uint8)
    with torch.no_grad():
        for data, sb in collection.table_weights():
            for first in range(0, data.shape[0], 1 << 20):  # in chunks: no 2 GB temporary
                data[first : first + (1 << 20)].random_(0, 256, generator=generator)
            if sb is not None:
                sb.copy_(torch.from_numpy(scale_bias).expand_as(sb))
    model = EmbserveModel(spec, collection)
    weight_bytes = sum(d.numel() + (s.numel() if s is not None else 0) for d, s in collection.table_weights())
    assert weight_bytes > 2**31
    path = export(model, tmp_path / "large", onnx=True)
    del model, collection
    assert (path / "model.onnx").stat().st_size < 1 << 20
    assert (path / "model.onnx.data").stat().st_size >= weight_bytes
    onnx.checker.check_model(str(path / "model.onnx"))
    onnx_runtime = load(path, backend="onnxruntime")
    scripted = load(path)
    batch = random_batch(spec, 64, max_len=30, weighted=True, seed=3)
    high_rows = torch.tensor([ROWS - 1, ROWS - 2, 2**31 // (DIM + 4) + 5], dtype=torch.int64)  # past 2 GB of bytes
    tail = SparseFeatures.from_dict({"big_id": [high_rows.tolist(), []], "small_id": [[0], [999]]})
    for features in (batch, tail):
        expected = scripted.lookup(features)
        got = onnx_runtime.lookup(features)
        assert float((got - expected).abs().max()) <= 1e-5 * max(1.0, float(expected.abs().max()))
