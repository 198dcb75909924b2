"""The TBE row layout: bytes per row and per table, by hand and against fbgemm's real allocation."""

from __future__ import annotations

import pytest

from infer.config import DataType
from infer.quant.rowwise import row_bytes, table_bytes


@pytest.mark.parametrize(
    "data_type, dim, alignment, expected",
    [
        (DataType.INT8, 128, 1, 132),  # D + fp16 scale + fp16 bias
        (DataType.INT8, 128, 16, 144),
        (DataType.INT4, 128, 1, 68),  # D/2 + 4
        (DataType.INT4, 128, 16, 80),
        (DataType.INT2, 128, 1, 36),  # D/4 + 4
        (DataType.INT2, 128, 16, 48),
        (DataType.FP16, 100, 1, 200),
        (DataType.FP16, 100, 16, 208),
        (DataType.FP32, 12, 16, 48),
    ],
)
def test_row_bytes(data_type, dim, alignment, expected):
    assert row_bytes(dim, data_type, alignment) == expected


def test_weight_bytes_align_every_table_to_128():
    assert table_bytes(1000, 128, DataType.INT8, 1) == 132_096  # 132,000 rounded up to 1032 x 128
    assert table_bytes(1024, 128, DataType.INT8, 1) == 135_168  # already aligned


@pytest.mark.parametrize("data_type", [DataType.INT8, DataType.INT4, DataType.INT2, DataType.FP16], ids=str)
@pytest.mark.parametrize("alignment", [1, 16])
def test_weight_bytes_equal_the_tbe_allocation(data_type, alignment):
    """To the byte: what fbgemm's inference TBE allocates for these tables on CPU."""
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen

    shapes = [(1001, 64), (77, 32), (3000, 256), (5, 8)]
    tbe = IntNBitTableBatchedEmbeddingBagsCodegen(
        [
            (f"t{i}", rows, dim, SparseType(data_type.value), EmbeddingLocation.HOST)
            for i, (rows, dim) in enumerate(shapes)
        ],
        device="cpu",
        row_alignment=alignment,
    )
    tbe.initialize_weights()
    allocated = tbe.weights_host.numel() * tbe.weights_host.element_size()
    assert allocated == sum(table_bytes(rows, dim, data_type, alignment) for rows, dim in shapes)


@pytest.mark.parametrize("alignment", [1, 16])
@pytest.mark.parametrize("data_type, dim", [(DataType.INT8, 20), (DataType.INT4, 24), (DataType.FP16, 12)])
def test_encoded_rows_are_the_rows_a_tbe_holds_after_filling_it(data_type, dim, alignment):
    """encode_rows (the streaming export's codec) against a real TBE's buffer filled the in-memory way."""
    import torch

    from infer.modules.tbe import make_tbe
    from infer.quant.rowwise import encode_rows, quantize_rows

    rows = torch.randn(37, dim, generator=torch.Generator().manual_seed(dim))
    tbe = make_tbe([("t", 37, dim, data_type)], [0], torch.device("cpu"), row_alignment=alignment)
    data, scale_bias = quantize_rows(rows, data_type)
    ((target, target_scales),) = tbe.split_embedding_weights()
    target.copy_(data)
    if scale_bias is not None:
        target_scales.copy_(scale_bias)
    stride = row_bytes(dim, data_type, alignment)
    assert torch.equal(encode_rows(rows, data_type, alignment), tbe.weights_host[: 37 * stride].view(37, stride))
    # a column slice keeps the whole row's scale and bias, then the slice's bytes
    first = dim * data_type.bits // 8 // 2
    sliced = encode_rows(rows, data_type, 1, col_offset=dim // 2, num_cols=dim // 2)
    if scale_bias is not None:
        assert torch.equal(sliced[:, :4], scale_bias)
    assert torch.equal(sliced[:, sliced.shape[1] - (data.shape[1] - first) :], data[:, first:])
