"""The TBE row layout, in one place: bytes per row per data type, where scale and bias sit, alignment,
and the row codec (fp32 rows <-> stored bytes).

INT8/INT4/INT2 rows are ``[fp16 scale][fp16 bias][packed codes]`` (scale/bias first, as the TBE reads
them); FP16/FP32 rows are the plain values. Every table starts on a ``TABLE_ALIGNMENT``-byte boundary
and every row is padded to the device's row alignment (1 on CPU, 16 on CUDA).
"""

from __future__ import annotations

import torch

from infer.config import DataType

# fp16 scale + fp16 bias at the front of every INT row.
SCALE_BIAS_BYTES = 4
# The TBE places every table on a 128-byte boundary.
TABLE_ALIGNMENT = 128
CPU_ROW_ALIGNMENT = 1
CUDA_ROW_ALIGNMENT = 16


def round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def row_data_bytes(num_cols: int, data_type: DataType) -> int:
    """Bytes of one row's values (without scale/bias or padding)."""
    return num_cols * data_type.bits // 8


def unpadded_row_bytes(num_cols: int, data_type: DataType) -> int:
    """Bytes of one stored row before padding: values plus scale/bias for INT types."""
    return row_data_bytes(num_cols, data_type) + (SCALE_BIAS_BYTES if data_type.is_integer else 0)


def row_bytes(num_cols: int, data_type: DataType, row_alignment: int) -> int:
    """Bytes of one stored row as the TBE lays it out (``rounded_row_size_in_bytes``)."""
    return round_up(unpadded_row_bytes(num_cols, data_type), row_alignment)


def table_bytes(num_rows: int, num_cols: int, data_type: DataType, row_alignment: int) -> int:
    """Bytes the TBE allocates for one table (or shard) of ``num_rows`` rows: 128-byte aligned."""
    return round_up(num_rows * row_bytes(num_cols, data_type, row_alignment), TABLE_ALIGNMENT)


def column_byte_range(col_offset: int, num_cols: int, data_type: DataType) -> tuple[int, int]:
    """Bytes ``[first, last)`` of a row's values that hold columns ``col_offset .. col_offset + num_cols``."""
    return row_data_bytes(col_offset, data_type), row_data_bytes(col_offset + num_cols, data_type)


def column_slice_aligned(col_offset: int, num_cols: int, data_type: DataType) -> bool:
    """Whether a column slice starts and ends on whole bytes and on the TBE's 4-column granularity."""
    per_byte = 8 // min(data_type.bits, 8)
    return col_offset % max(per_byte, 4) == 0 and num_cols % 4 == 0


def quantize_rows(weight: torch.Tensor, data_type: DataType) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Quantize ``[rows, dim]`` float rows: returns (value bytes, scale/bias bytes or None)."""
    rows = weight.to(torch.float32).contiguous()
    if data_type == DataType.FP32:
        return rows.view(torch.uint8), None
    if data_type == DataType.FP16:
        return rows.to(torch.float16).view(torch.uint8), None
    from infer.artifact.fbgemm_libs import load_fbgemm

    load_fbgemm()
    # fbgemm's output row is [data][fp16 scale][fp16 bias]: the TBE wants scale/bias first.
    fused = torch.ops.fbgemm.FloatToFusedNBitRowwiseQuantizedSBHalf(rows, data_type.bits)
    return fused[:, :-SCALE_BIAS_BYTES], fused[:, -SCALE_BIAS_BYTES:]


def dequantize_rows(data: torch.Tensor, scale_bias: torch.Tensor | None, data_type: DataType, dim: int) -> torch.Tensor:
    """fp32 values of rows stored in the TBE layout, computed with plain torch ops."""
    if data_type == DataType.FP32:
        return data.contiguous().view(torch.float32)[:, :dim].clone()
    if data_type == DataType.FP16:
        return data.contiguous().view(torch.float16)[:, :dim].to(torch.float32)
    assert scale_bias is not None
    scale_bias = scale_bias.contiguous()
    scale = scale_bias[:, 0:2].contiguous().view(torch.float16).to(torch.float32)
    bias = scale_bias[:, 2:4].contiguous().view(torch.float16).to(torch.float32)
    bits = data_type.bits
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    packed = data.to(torch.int32)
    # Element k of a byte sits at bit offset k * bits (lowest bits first).
    parts = [(packed >> (k * bits)) & mask for k in range(per_byte)]
    codes = torch.stack(parts, dim=2).reshape(data.shape[0], -1)[:, :dim]
    return codes.to(torch.float32) * scale + bias


def encode_rows(
    weight: torch.Tensor,
    data_type: DataType,
    row_alignment: int = CPU_ROW_ALIGNMENT,
    col_offset: int = 0,
    num_cols: int | None = None,
) -> torch.Tensor:
    """The stored bytes ``[rows, row_bytes]`` of float rows as the TBE lays them out: scale/bias first (INT
    types), then the values of columns ``col_offset .. col_offset + num_cols`` (a column shard keeps its whole
    row's scale and bias), then zero padding to ``row_alignment``."""
    num_cols = weight.shape[1] - col_offset if num_cols is None else num_cols
    data, scale_bias = quantize_rows(weight, data_type)
    first, last = column_byte_range(col_offset, num_cols, data_type)
    parts = [scale_bias] if scale_bias is not None else []
    parts.append(data[:, first:last])
    padding = row_bytes(num_cols, data_type, row_alignment) - unpadded_row_bytes(num_cols, data_type)
    if padding:
        parts.append(torch.zeros(weight.shape[0], padding, dtype=torch.uint8))
    return torch.cat(parts, 1) if len(parts) > 1 else parts[0].contiguous()
