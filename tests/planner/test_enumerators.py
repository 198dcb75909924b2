"""The enumerator: splits add up, constraints are honoured."""

from __future__ import annotations

import pytest

from infer.config import DataType, ModelSpec, TableConfig
from infer.errors import PlanError, PlanErrorKind
from infer.planner.enumerators import EmbeddingEnumerator, even_blocks
from infer.planner.types import ComputeDevice, ParameterConstraints, Placement, ShardingType, Topology

SPEC = ModelSpec(
    (
        TableConfig("big", 1_000_003, 256, ("a", "b")),
        TableConfig("small", 10, 32, ("c",)),
    )
)


def test_even_blocks():
    assert even_blocks(10, 3) == [(0, 4), (4, 3), (7, 3)]
    assert even_blocks(256, 3, 32) == [(0, 96), (96, 96), (192, 64)]


def test_row_and_column_splits_cover_the_table():
    options = EmbeddingEnumerator().enumerate(SPEC, Topology(8), {})
    seen = set()
    for option in options["big"]:
        seen.add(option.sharding_type)
        if option.sharding_type == ShardingType.ROW_WISE:
            assert sum(s.num_rows for s in option.shards) == 1_000_003
            offsets = [s.row_offset for s in option.shards]
            assert offsets == sorted(offsets) and offsets[0] == 0
            assert all(s.num_cols == 256 for s in option.shards)
        if option.sharding_type == ShardingType.COLUMN_WISE:
            assert sum(s.num_cols for s in option.shards) == 256
            assert all(s.num_cols % 32 == 0 for s in option.shards)
        if option.sharding_type == ShardingType.REPLICATED:
            assert option.num_shards == 8 and option.placement == Placement.DEVICE
            assert all(s.num_rows == 1_000_003 for s in option.shards)
    # one host: table-row-wise is row-wise, so it is not offered
    assert seen == {ShardingType.TABLE_WISE, ShardingType.ROW_WISE, ShardingType.COLUMN_WISE, ShardingType.REPLICATED}
    counts = sorted(o.num_shards for o in options["big"] if o.sharding_type == ShardingType.ROW_WISE)
    assert counts == [2, 2, 2, 4, 4, 4, 8, 8, 8]  # x3 placements on CUDA
    # a 10-row table cannot be cut into more than 10 row blocks
    topo = Topology(16)
    small = EmbeddingEnumerator().enumerate(SPEC, topo, {})["small"]
    assert max(o.num_shards for o in small if o.sharding_type == ShardingType.ROW_WISE) == 10


def test_constraints_are_honoured():
    constraints = {
        "big": ParameterConstraints(
            sharding_types=(ShardingType.ROW_WISE, ShardingType.COLUMN_WISE),
            placements=(Placement.DEVICE,),
            min_shards=4,
            max_shards=4,
            data_type=DataType.INT4,
            pooling_factors=(5.0, 7.0),
        )
    }
    options = EmbeddingEnumerator().enumerate(SPEC, Topology(8), constraints)["big"]
    assert {(o.sharding_type, o.num_shards, o.placement, o.data_type) for o in options} == {
        (ShardingType.ROW_WISE, 4, Placement.DEVICE, DataType.INT4),
        (ShardingType.COLUMN_WISE, 4, Placement.DEVICE, DataType.INT4),
    }


def test_cpu_offers_device_memory_only():
    options = EmbeddingEnumerator().enumerate(SPEC, Topology(4, ComputeDevice.CPU), {})
    assert {o.placement for opts in options.values() for o in opts} == {Placement.DEVICE}


def test_table_row_wise_on_several_hosts_spans_one_host():
    topo = Topology(8, local_world_size=4)
    options = EmbeddingEnumerator().enumerate(SPEC, topo, {})["big"]
    twrw = [o for o in options if o.sharding_type == ShardingType.TABLE_ROW_WISE]
    assert twrw and all(o.num_shards == 4 for o in twrw)


def test_impossible_constraints_raise_plan_errors():
    with pytest.raises(PlanError) as info:
        EmbeddingEnumerator().enumerate(SPEC, Topology(2), {"nosuch": ParameterConstraints()})
    assert info.value.kind == PlanErrorKind.INVALID_CONSTRAINT
    only_replicated = {"small": ParameterConstraints(sharding_types=(ShardingType.REPLICATED,))}
    with pytest.raises(PlanError, match="'small'") as info:
        EmbeddingEnumerator().enumerate(SPEC, Topology(1), only_replicated)
    assert info.value.kind == PlanErrorKind.INVALID_CONSTRAINT
    with pytest.raises(PlanError) as info:
        ParameterConstraints(min_shards=4, max_shards=2)
    assert info.value.kind == PlanErrorKind.INVALID_CONSTRAINT
    with pytest.raises(PlanError, match="pooling factors"):
        EmbeddingEnumerator().enumerate(SPEC, Topology(2), {"big": ParameterConstraints(pooling_factors=(1, 2, 3))})


def test_a_table_in_precision_blocks_is_offered_table_wise_only_and_sized_by_its_blocks():
    """Its id remap and blocks are one kernel's (issue 43): no row-, column-wise or replicated option; its bytes are
    every block's in its type plus the remap (4 bytes per row per feature); constraints that forbid table_wise are
    refused naming it."""
    from infer.quant.rowwise import TABLE_ALIGNMENT, round_up, table_bytes

    blocked = TableConfig("blocked", 4096, 64, ("a", "b"), blocks=((256, "int8"), (3840, "int4")))
    spec = ModelSpec((blocked, TableConfig("plain", 4096, 64, ("c",))))
    topology = Topology(4, ComputeDevice.CPU, mapped_capacity=0)
    options = EmbeddingEnumerator().enumerate(spec, topology, {})
    assert {o.sharding_type for o in options["blocked"]} == {ShardingType.TABLE_WISE}
    assert len({o.sharding_type for o in options["plain"]}) > 1
    blocks = table_bytes(256, 64, DataType.INT8, 1) + table_bytes(3840, 64, DataType.INT4, 1)
    remap = round_up(4 * 4096 * 2, TABLE_ALIGNMENT)
    (option,) = options["blocked"]
    one_type = ModelSpec((TableConfig("blocked", 4096, 64, ("a", "b"), data_type="int4"),))
    whole = EmbeddingEnumerator().enumerate(one_type, topology, {})["blocked"]
    plain = next(o for o in whole if o.sharding_type == ShardingType.TABLE_WISE)
    weights = table_bytes(4096, 64, DataType.INT4, 1)
    assert option.shards[0].storage.device - plain.shards[0].storage.device == blocks + remap - weights
    with pytest.raises(PlanError, match="'blocked' is held in precision blocks.*table_wise") as caught:
        EmbeddingEnumerator().enumerate(spec, topology, {"blocked": ParameterConstraints(sharding_types=("row_wise",))})
    assert caught.value.kind == PlanErrorKind.INVALID_CONSTRAINT
