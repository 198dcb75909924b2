"""The fbgemm TBE as embserve uses it: building one inference TBE, its bag offsets, and id-range checks.

fbgemm is imported on first use only, so importing this module stays light.
"""

from typing import List, Optional, Tuple

import torch
from torch import Tensor, nn

from infer.artifact.fbgemm_libs import load_fbgemm
from infer.config import DataType
from infer.request_rules import id_range_error


def _tbe_classes():  # type: ignore[no-untyped-def]
    load_fbgemm()
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        BoundsCheckMode,
        EmbeddingLocation,
        PoolingMode,
    )
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import (
        IntNBitTableBatchedEmbeddingBagsCodegen,
    )

    return IntNBitTableBatchedEmbeddingBagsCodegen, SparseType, EmbeddingLocation, PoolingMode, BoundsCheckMode


def bag_offsets(lengths: Tensor, values: Tensor) -> Tensor:
    """The kernel's offsets for ``lengths``: ``[0, cumsum(lengths)]`` in the ids' dtype and device."""
    offsets = torch.zeros(lengths.numel() + 1, dtype=values.dtype, device=values.device)
    offsets[1:] = torch.cumsum(lengths, 0).to(values.dtype)
    return offsets


def first_id_error(values: Tensor, bounds: List[int], rows: List[int], names: List[str]) -> Optional[str]:
    """Range-check feature by feature (feature i's ids are ``values[bounds[i]:bounds[i + 1]]``): the first
    violation's message, or None."""
    for i in range(len(rows)):
        error = id_range_error(values[bounds[i] : bounds[i + 1]], rows[i], names[i])
        if error is not None:
            return error
    return None


def make_tbe(
    tables: List[Tuple[str, int, int, DataType]],
    feature_table_map: List[int],
    device: torch.device,
    row_alignment: Optional[int] = None,
) -> nn.Module:
    """One inference TBE over ``tables`` (name, rows, dim, data type): SUM pooling, fp32 output,
    FATAL bounds checks (WARNING/IGNORE would rewrite the caller's ids in place). Weights allocated."""
    TBE, SparseType, EmbeddingLocation, PoolingMode, BoundsCheckMode = _tbe_classes()
    location = EmbeddingLocation.HOST if device.type == "cpu" else EmbeddingLocation.DEVICE
    tbe = TBE(
        embedding_specs=[(name, rows, dim, SparseType(dtype.value), location) for name, rows, dim, dtype in tables],
        feature_table_map=feature_table_map,
        pooling_mode=PoolingMode.SUM,
        device=device,
        bounds_check_mode=BoundsCheckMode.FATAL,
        output_dtype=SparseType.FP32,
        row_alignment=row_alignment,
    )
    tbe.initialize_weights()
    return tbe
