"""Which data types fbgemm's CUDA lookup kernel gets right on this GPU, found by a probe lookup against its CPU kernel.

On an H100 and an H200 (torch 2.11, fbgemm_gpu 1.6.0, CUDA 13) fbgemm's CUDA kernel returned rows of INT2 tables
that were garbage (up to 1e38, NaN) and changed from one call to the next, at every dimension, alone or beside other
types, while the same bytes gave the right rows on the CPU (bench/cuda_kernel_check.py). A model that answers
wrongly must not be built or loaded, and the fault is fbgemm's build, not the type: so a type is checked once per
device by a lookup of a small table through both kernels, and refused only where the two disagree (a fixed fbgemm
passes the probe and is used).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable

import torch

from infer.config import DataType

logger = logging.getLogger(__name__)

PROBE_ROWS = 64
PROBE_DIM = 32  # every type's row is whole bytes and 16-byte aligned at this dim
PROBE_BAGS = 16
# the CUDA and CPU kernels round differently (measured up to 1.1e-3 relative for INT8); a broken kernel is off by
# orders of magnitude
PROBE_TOLERANCE = 1e-2


def kernel_type_error(data_type: DataType, device: str) -> str | None:
    """Why fbgemm's kernel on ``device`` cannot hold ``data_type`` tables, or None when it can (always on the CPU)."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return None
    return _probe(data_type, str(torch.device(device)))


def check_kernel_types(data_types: Iterable[tuple[str, DataType]], device: str) -> None:
    """Refuse the first (table, type) whose type fbgemm's kernel on ``device`` gets wrong (``ConfigError`` naming
    the table, the type and the fixes)."""
    from infer.errors import ConfigError

    for table, data_type in data_types:
        error = kernel_type_error(data_type, device)
        if error is not None:
            raise ConfigError(
                f"table {table!r} is {data_type.value} on {device}, but {error}; store it as another type (the "
                + f"spec's data_type, e.g. {_nearest(data_type).value}) or place it on the CPU"
            )


def _nearest(data_type: DataType) -> DataType:
    return DataType.INT4 if data_type == DataType.INT2 else DataType.INT8


@functools.cache
def _probe(data_type: DataType, device: str) -> str | None:
    from infer.modules.tbe import bag_offsets, make_tbe
    from infer.quant.rowwise import quantize_rows

    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(PROBE_ROWS, PROBE_DIM, generator=generator)
    data, scales = quantize_rows(rows, data_type)
    lengths = torch.randint(0, 8, (PROBE_BAGS,), generator=generator, dtype=torch.int32)
    ids = torch.randint(0, PROBE_ROWS, (int(lengths.sum()),), generator=generator)
    outputs = []
    for where in ("cpu", device, device):
        tbe = make_tbe([("probe", PROBE_ROWS, PROBE_DIM, data_type)], [0], torch.device(where), 16)
        target_data, target_scales = tbe.split_embedding_weights()[0]  # type: ignore[operator]
        target_data.copy_(data)
        if scales is not None and target_scales is not None:
            target_scales.copy_(scales)
        with torch.no_grad():
            values = ids.to(where)
            outputs.append(tbe(values, bag_offsets(lengths.to(where), values)).cpu())
    expected, first, again = outputs
    finite = bool(torch.isfinite(first).all())
    close = finite and bool(torch.allclose(first, expected, rtol=PROBE_TOLERANCE, atol=PROBE_TOLERANCE))
    if close and torch.equal(first, again):
        return None
    import fbgemm_gpu

    worst = float((first - expected).abs().max()) if finite else float("nan")
    logger.warning("fbgemm's CUDA kernel on %s gets %s rows wrong (max difference %s)", device, data_type.value, worst)
    return (
        f"fbgemm's CUDA kernel gives wrong {data_type.value} rows on this GPU ({torch.cuda.get_device_name(device)}, "
        + f"fbgemm_gpu {getattr(fbgemm_gpu, '__version__', '?')}): a probe lookup differed from its CPU kernel's by "
        + f"{worst:.3g}{'' if torch.equal(first, again) else ' and changed from one call to the next'}"
    )
