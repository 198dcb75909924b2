"""Hardware defaults for planning, per compute device kind. Bandwidths in bytes/s, sizes in bytes."""

from __future__ import annotations

from infer.planner.utils import GB, MB  # noqa: F401 - re-exported: sizes below and callers' C.GB
from infer.quant.rowwise import CPU_ROW_ALIGNMENT, CUDA_ROW_ALIGNMENT, TABLE_ALIGNMENT  # noqa: F401 - re-exported

# CUDA hosts (H100-class): effective, not peak, figures.
CUDA_DEVICE_MEMORY = 80 * GB
CUDA_HOST_MEMORY = 1024 * GB
CUDA_HBM_BANDWIDTH = 2000e9
CUDA_DDR_BANDWIDTH = 100e9
CUDA_HOST_TO_DEVICE_BANDWIDTH = 25e9
CUDA_INTRA_HOST_BANDWIDTH = 300e9  # NVLink-class device-to-device

# CPU hosts: a "device" is one core running one TBE; memory is its share of DDR.
CPU_HOST_MEMORY = 256 * GB
CPU_DDR_BANDWIDTH_PER_CORE = 4.5e9  # one TBE core: ~25-31 M lookups/s of 192/128-byte rows (bench/lookup.py)
CPU_INTRA_HOST_BANDWIDTH = 20e9  # memcpy between shards of one process

# Memory is read in sectors: a narrow row still costs a whole sector.
CUDA_READ_GRANULARITY = 32
CPU_READ_GRANULARITY = 64

DEFAULT_BATCH_SIZE = 512
DEFAULT_POOLING_FACTOR = 20.0
DEFAULT_CACHE_LOAD_FACTOR = 0.2
DEFAULT_CACHE_HIT_RATE = 0.8
# Column-wise shards are multiples of this many columns.
DEFAULT_MIN_COLUMN_SHARD = 32
# Percentage of every device's memory held back for the runtime and fragmentation.
DEFAULT_RESERVED_PERCENT = 15.0
# Training estimates: rowwise-adagrad state is one fp32 per row; weights are fp32.
TRAINING_OPTIMIZER_BYTES_PER_ROW = 4
