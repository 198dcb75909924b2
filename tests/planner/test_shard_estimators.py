"""Estimators against hand-computed numbers and against the TBE's real allocation."""

from __future__ import annotations

import pytest

from infer.config import DataType, TableConfig
from infer.planner.shard_estimators import InferencePerfEstimator, InferenceStorageEstimator
from infer.planner.types import (
    ComputeDevice,
    ParameterConstraints,
    Placement,
    ShardContext,
    ShardingType,
    Storage,
    Topology,
)

CUDA = Topology(8)
CPU = Topology(2, ComputeDevice.CPU)


def ctx(
    rows=1_000_000,
    dim=128,
    data_type=DataType.INT8,
    topology=CUDA,
    sharding=ShardingType.TABLE_WISE,
    placement=Placement.DEVICE,
    num_rows=None,
    num_cols=None,
    shards=1,
    batch=512,
    pooling=20.0,
    features=("f",),
):
    table = TableConfig("t", rows, dim, features, data_type=data_type)
    return ShardContext(
        table, data_type, ParameterConstraints(), topology, sharding, placement,
        num_rows or rows, num_cols or dim, shards, batch, pooling,
    )  # fmt: skip


def test_inference_storage_is_weights_plus_io_buffers():
    storage = InferenceStorageEstimator().storage(ctx(rows=1000, topology=CPU))
    ids = 512 * 20 * 8
    offsets = (512 + 1) * 8
    outputs = 512 * 128 * 4
    assert storage == Storage(device=132_096 + ids + offsets + outputs, host=0)


def test_host_placements_move_weights_to_host():
    io = 512 * 20 * 8 + 513 * 8 + 512 * 128 * 4
    weights = 1_000_000 * 144  # CUDA rows align to 16
    assert InferenceStorageEstimator().storage(ctx(placement=Placement.HOST)) == Storage(io, weights)
    cached = InferenceStorageEstimator().storage(ctx(placement=Placement.HOST_CACHED))
    cache = (int(weights * 0.2) + 127) // 128 * 128
    assert cached == Storage(io + cache, weights)


def test_training_storage_adds_fp32_weights_optimizer_and_gradients():
    c = ctx(rows=1000, topology=CPU)
    inference = InferenceStorageEstimator(is_inference=True).storage(c).device
    training = InferenceStorageEstimator(is_inference=False).storage(c).device
    fp32_weights = 1000 * 128 * 4  # already a multiple of 128
    optimizer = 4096  # one fp32 per row, 128-aligned
    gradients = 512 * 128 * 4 + 512 * 20 * 128 * 4
    assert training - inference == (fp32_weights - 132_096) + optimizer + gradients


def test_inference_cost_by_hand():
    # table-wise, INT8 D=128 on CUDA: 132-byte rows read as 160 (5 sectors of 32)
    ids = 512 * 20
    lookup = ids * 160 / 2000e9
    input_dist = ids * 8 / 25e9
    output = 512 * 128 * 4 / 300e9
    assert InferencePerfEstimator().cost(ctx()) == pytest.approx(lookup + input_dist + output, rel=1e-12)


def test_row_wise_shard_reads_its_share_and_pays_the_reduction():
    shard = ctx(sharding=ShardingType.ROW_WISE, num_rows=250_000, shards=4)
    ids = 512 * 20 / 4
    expected = ids * 160 / 2000e9 + ids * 8 / 25e9 + 512 * 128 * 4 / 300e9 + 512 * 128 * 4 / 2000e9
    assert InferencePerfEstimator().cost(shard) == pytest.approx(expected, rel=1e-12)


def test_narrow_rows_cost_a_whole_sector():
    perf = InferencePerfEstimator()
    # FP32 D=4 (16 bytes) and D=8 (32 bytes) both read one 32-byte sector per row; outputs differ
    narrow = perf.cost(ctx(dim=4, data_type=DataType.FP32))
    wide = perf.cost(ctx(dim=8, data_type=DataType.FP32))
    assert wide - narrow == pytest.approx(512 * 4 * 4 / 300e9, rel=1e-9)


def test_host_placement_reads_over_the_host_link():
    perf = InferencePerfEstimator()
    device = perf.cost(ctx())
    host = perf.cost(ctx(placement=Placement.HOST))
    ids = 512 * 20
    assert host - device == pytest.approx(ids * 160 / 25e9 - ids * 160 / 2000e9, rel=1e-9)
    cached = perf.cost(ctx(placement=Placement.HOST_CACHED))
    assert device < cached < host


def test_training_cost_adds_backward_and_update():
    c = ctx(data_type=DataType.FP32)
    inference = InferencePerfEstimator(is_inference=True).cost(c)
    training = InferencePerfEstimator(is_inference=False).cost(c)
    ids = 512 * 20
    grads = 512 * 128 * 4 / 300e9
    update = ids * (2 * 512 + 2 * 4) / 2000e9
    assert training - inference == pytest.approx(grads + update, rel=1e-9)


def test_cpu_costs_use_per_core_memory_bandwidth():
    c = ctx(topology=CPU, dim=64)
    ids = 512 * 20
    expected = ids * 128 / 4.5e9 + ids * 8 / 20e9 + 512 * 64 * 4 / 20e9  # 68-byte rows read as 2 lines of 64
    assert InferencePerfEstimator().cost(c) == pytest.approx(expected, rel=1e-12)
