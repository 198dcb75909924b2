"""Storage and cost of one shard, for inference (``is_inference=True``) or training.

Inference storage is exactly what fbgemm's inference TBE allocates for the shard's rows (row
size with scale/bias, row alignment, 128-byte table alignment), plus the batch's input and output
buffers; nothing for optimizer or gradients. Inference cost is the forward pass only: rows read /
memory bandwidth (a narrow row still costs a whole sector), ids shipped in, pooled outputs
shipped out at fp32, and the reduction of row-wise partial sums.
"""

from __future__ import annotations

from infer.config import DataType
from infer.planner import constants as C
from infer.planner.types import Placement, ShardContext, ShardingType, Storage
from infer.quant.rowwise import TABLE_ALIGNMENT, round_up, table_bytes, unpadded_row_bytes

INDEX_BYTES = 8  # int64 ids and offsets
OUTPUT_BYTES = 4  # fp32 pooled output
# shardings whose shards on one CPU host are views of one stored copy of the table (Topology.cpu_views)
VIEW_SHARDINGS = (
    ShardingType.REPLICATED,
    ShardingType.ROW_WISE,
    ShardingType.TABLE_ROW_WISE,
    ShardingType.COLUMN_WISE,
)


def _row_fraction(ctx: ShardContext) -> float:
    """Share of the table's ids this shard receives (uniform ids assumed)."""
    if ctx.sharding_type in (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE):
        return ctx.num_rows / ctx.table.num_embeddings
    return 1.0


def _ids(ctx: ShardContext) -> float:
    return ctx.batch_size * ctx.pooling_factor * _row_fraction(ctx)


def input_bytes(ctx: ShardContext) -> int:
    """Ids and offsets of one batch shipped to the shard."""
    num_features = len(ctx.table.feature_names)
    return int(_ids(ctx) + 0.5) * INDEX_BYTES + (ctx.batch_size * num_features + 1) * INDEX_BYTES


def output_bytes(ctx: ShardContext) -> int:
    """Pooled fp32 outputs of one batch shipped back from the shard."""
    return ctx.batch_size * ctx.num_cols * len(ctx.table.feature_names) * OUTPUT_BYTES


def io_bytes(ctx: ShardContext) -> int:
    """Input and output buffers of one batch on the shard's device."""
    return input_bytes(ctx) + output_bytes(ctx)


class InferenceStorageEstimator:
    """Bytes of a shard: quantized rows as the kernel stores them (``is_inference=True``), or the
    training footprint (fp32 weights, rowwise optimizer state, gradients) with ``is_inference=False``."""

    def __init__(self, is_inference: bool = True) -> None:
        self.is_inference = is_inference

    def storage(self, ctx: ShardContext) -> Storage:
        if self.is_inference:
            weights = table_bytes(ctx.num_rows, ctx.num_cols, ctx.data_type, ctx.topology.row_alignment)
            if ctx.table.blocks:  # whole on one device (table-wise): every block in its type, and the id remap
                from infer.planner.blocks import remap_bytes

                align = ctx.topology.row_alignment
                weights = sum(table_bytes(b.rows, ctx.num_cols, b.data_type, align) for b in ctx.table.blocks)
                weights += round_up(remap_bytes(ctx.table), TABLE_ALIGNMENT)
            elif ctx.sharding_type in VIEW_SHARDINGS and ctx.topology.cpu_views:
                # on one CPU host the shards of a replicated, row- or column-wise table are views of one stored
                # copy of the whole table (infer.shard.builder.shared_cpu_storage): each device accounts for its
                # share of that one copy (a column slice would count every row's scale and bias again)
                table = ctx.table
                whole = table_bytes(
                    table.num_embeddings, table.embedding_dim, ctx.data_type, ctx.topology.row_alignment
                )
                weights = round_up(-(-whole // ctx.num_shards), TABLE_ALIGNMENT)
            extra = 0
        else:
            weights = table_bytes(ctx.num_rows, ctx.num_cols, DataType.FP32, ctx.topology.row_alignment)
            optimizer = round_up(ctx.num_rows * C.TRAINING_OPTIMIZER_BYTES_PER_ROW, TABLE_ALIGNMENT)
            num_features = len(ctx.table.feature_names)
            output_grad = ctx.batch_size * ctx.num_cols * num_features * OUTPUT_BYTES
            sparse_grad = int(_ids(ctx)) * ctx.num_cols * OUTPUT_BYTES
            extra = optimizer + output_grad + sparse_grad
        io = io_bytes(ctx) + extra
        if ctx.placement == Placement.DEVICE:
            return Storage(device=weights + io, host=0)
        if ctx.placement == Placement.HOST:
            return Storage(device=io, host=weights)
        cache = round_up(int(weights * ctx.constraints.cache_load_factor), TABLE_ALIGNMENT)
        return Storage(device=io + cache, host=weights)


class InferencePerfEstimator:
    """Seconds per batch of a shard on its device: forward only (``is_inference=True``), or forward,
    backward and optimizer update (``is_inference=False``)."""

    def __init__(self, is_inference: bool = True, cache_hit_rate: float = C.DEFAULT_CACHE_HIT_RATE) -> None:
        self.is_inference = is_inference
        self.cache_hit_rate = cache_hit_rate

    def _lookup_bandwidth(self, ctx: ShardContext) -> float:
        topo = ctx.topology
        if ctx.placement == Placement.DEVICE or not topo.is_cuda:
            return topo.hbm_bandwidth
        if ctx.placement == Placement.HOST:
            return topo.host_to_device_bandwidth
        # harmonic mix: hits read device memory, misses cross to the host
        hit = self.cache_hit_rate
        return 1.0 / (hit / topo.hbm_bandwidth + (1.0 - hit) / topo.host_to_device_bandwidth)

    def cost(self, ctx: ShardContext) -> float:
        topo = ctx.topology
        granularity = C.CUDA_READ_GRANULARITY if topo.is_cuda else C.CPU_READ_GRANULARITY
        data_type = ctx.data_type if self.is_inference else DataType.FP32
        bytes_per_row = round_up(unpadded_row_bytes(ctx.num_cols, data_type), granularity)
        ids = _ids(ctx)
        lookup = ids * bytes_per_row / self._lookup_bandwidth(ctx)
        input_bw = topo.host_to_device_bandwidth if topo.is_cuda else topo.intra_host_bandwidth
        input_dist = ids * INDEX_BYTES / input_bw
        num_features = len(ctx.table.feature_names)
        output = ctx.batch_size * ctx.num_cols * num_features * OUTPUT_BYTES
        output_dist = output / topo.intra_host_bandwidth
        reduction = 0.0
        if ctx.sharding_type in (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE) and ctx.num_shards > 1:
            reduction = output / topo.hbm_bandwidth
        forward = lookup + input_dist + output_dist + reduction
        if self.is_inference:
            return forward
        # backward: gradients back to the shard, then read-modify-write of every touched fp32 row
        # plus its optimizer state
        grad_dist = output / topo.intra_host_bandwidth
        update = ids * (2 * bytes_per_row + 2 * C.TRAINING_OPTIMIZER_BYTES_PER_ROW) / self._lookup_bandwidth(ctx)
        return forward + grad_dist + update
