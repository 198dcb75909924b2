"""Partitioners: memory caps, distinct devices, fixed replicas, determinism, and the exact MILP."""

from __future__ import annotations

import random

import pytest

from infer.config import DataType
from infer.errors import PlanError, PlanErrorKind
from infer.planner.partitioners import (
    ExactPartitioner,
    GreedyPartitioner,
    keep_features_together,
    partition_lower_bound,
)
from infer.planner.types import (
    PartitionResult,
    Placement,
    Proposal,
    ShardingOption,
    ShardingType,
    ShardSpec,
    Storage,
    Topology,
)


def option(
    table: str,
    costs: list[float],
    device_bytes: int | list[int] = 1,
    sharding_type: ShardingType = ShardingType.TABLE_WISE,
    host_bytes: int = 0,
    placement: Placement = Placement.DEVICE,
) -> ShardingOption:
    sizes = device_bytes if isinstance(device_bytes, list) else [device_bytes] * len(costs)
    shards = tuple(
        ShardSpec(i, 1, 0, 4, Storage(size, host_bytes), cost) for i, (cost, size) in enumerate(zip(costs, sizes))
    )
    return ShardingOption(table, sharding_type, placement, DataType.INT8, shards)


def table_wise(*costs: float) -> Proposal:
    return tuple(option(f"t{i}", [cost]) for i, cost in enumerate(costs))


def check_valid(result: PartitionResult, topology: Topology) -> None:
    """Every invariant a partition must keep, recomputed from the shards."""
    used = [0] * topology.world_size
    host_used = [0] * (topology.world_size // topology.local_world_size)
    loads = [0.0] * topology.world_size
    assert len(result.devices) == len(result.proposal)
    for opt, devices in zip(result.proposal, result.devices):
        assert len(devices) == opt.num_shards
        assert len(set(devices)) == len(devices), f"{opt.table}: two shards on one device"
        if opt.sharding_type == ShardingType.REPLICATED:
            assert devices == tuple(range(topology.world_size))
        if opt.sharding_type == ShardingType.TABLE_ROW_WISE:
            assert len({d // topology.local_world_size for d in devices}) == 1
        for shard, device in zip(opt.shards, devices):
            used[device] += shard.storage.device
            host_used[device // topology.local_world_size] += shard.storage.host
            loads[device] += shard.cost
    assert all(u <= cap for u, cap in zip(used, topology.device_memory))
    assert all(h <= topology.host_memory for h in host_used)
    assert [s.device for s in result.device_storage] == used
    assert result.device_costs == pytest.approx(loads)


# ---------------------------------------------------------------------------- lower bound
def test_lower_bound_is_average_or_largest_shard() -> None:
    proposal = (option("a", [3.0]), option("b", [2.0, 2.0], sharding_type=ShardingType.ROW_WISE), option("c", [1.0]))
    assert partition_lower_bound(proposal, 2) == 4.0  # (3 + 2 + 2 + 1) / 2
    assert partition_lower_bound(proposal, 4) == 3.0  # the 3.0 shard beats 8 / 4


# ---------------------------------------------------------------------------- greedy
def test_greedy_is_lpt_with_lowest_rank_on_ties() -> None:
    # 3 -> d0, 3 -> d1, 2 -> d0 (tie), 2 -> d1, 2 -> d0
    result = GreedyPartitioner().partition(table_wise(3, 3, 2, 2, 2), Topology(2, device_memory=(100,)))
    assert result.devices == ((0,), (1,), (0,), (1,), (0,))
    assert result.device_costs == (7.0, 5.0)
    assert result.bottleneck == 7.0


def test_shards_of_one_option_go_to_distinct_devices() -> None:
    # 20 takes d0; the three 5s must avoid each other, so the last one lands on d0 although it is the busiest
    proposal = (option("big", [20.0]), option("split", [5.0, 5.0, 5.0], sharding_type=ShardingType.ROW_WISE))
    topology = Topology(3, device_memory=(100,))
    result = GreedyPartitioner().partition(proposal, topology)
    assert sorted(result.devices[1]) == [0, 1, 2]
    assert result.device_costs == (25.0, 5.0, 5.0)
    check_valid(result, topology)


def test_replicated_copy_i_goes_to_device_i() -> None:
    topology = Topology(4, device_memory=(100,))
    proposal = (
        option("tw", [9.0]),
        option("rep", [1.0, 1.0, 1.0, 1.0], sharding_type=ShardingType.REPLICATED),
        option("tw2", [2.0]),
    )
    result = GreedyPartitioner().partition(proposal, topology)
    assert result.devices[1] == (0, 1, 2, 3)
    # the replicas come first (1 everywhere); then 9 -> d0, 2 -> d1
    assert result.device_costs == (10.0, 3.0, 1.0, 1.0)
    check_valid(result, topology)


def test_replicated_needs_one_copy_per_device() -> None:
    proposal = (option("rep", [1.0, 1.0], sharding_type=ShardingType.REPLICATED),)
    with pytest.raises(PlanError) as err:
        GreedyPartitioner().partition(proposal, Topology(4, device_memory=(100,)))
    assert err.value.kind == PlanErrorKind.INVALID_PLAN


def test_table_row_wise_shards_stay_on_one_host() -> None:
    topology = Topology(4, device_memory=(100,), local_world_size=2)
    proposal = (
        option("a", [6.0]),
        option("trw", [2.0, 2.0], sharding_type=ShardingType.TABLE_ROW_WISE),
        option("b", [1.0]),
    )
    result = GreedyPartitioner().partition(proposal, topology)
    # a -> d0; on host 0 the pair would lift d0 to 8, on host 1 (d2, d3) the peak is 2; then b -> d1
    assert result.devices == ((0,), (2, 3), (1,))
    check_valid(result, topology)


def test_memory_caps_are_never_exceeded() -> None:
    rng = random.Random(7)
    topology = Topology(4, device_memory=(1000,))
    for _ in range(50):
        proposal = []
        for t in range(12):
            if rng.random() < 0.3:
                count = rng.choice([2, 4])
                costs = [rng.uniform(1, 5)] * count
                proposal.append(option(f"t{t}", costs, rng.randint(10, 120), ShardingType.ROW_WISE))
            else:
                proposal.append(option(f"t{t}", [rng.uniform(1, 10)], rng.randint(50, 330)))
        try:
            result = GreedyPartitioner().partition(tuple(proposal), topology)
        except PlanError as err:
            assert err.kind == PlanErrorKind.INSUFFICIENT_MEMORY
            continue
        check_valid(result, topology)


def test_memory_first_retry_places_what_lpt_cannot() -> None:
    # cost, bytes on 2 devices of 10 bytes. LPT: A(10,7)->d0, B(9,3)->d1, C(2,3)->d1, then D(1,7) fits
    # nowhere. By bytes onto the freest device: A->d0, D->d1, B->d0 (tie), C->d1.
    proposal = (option("A", [10.0], 7), option("B", [9.0], 3), option("C", [2.0], 3), option("D", [1.0], 7))
    topology = Topology(2, device_memory=(10,))
    result = GreedyPartitioner().partition(proposal, topology)
    assert result.devices == ((0,), (0,), (1,), (1,))
    assert result.device_costs == (19.0, 3.0)
    check_valid(result, topology)


def test_insufficient_memory_names_the_table_and_every_device() -> None:
    gb = 1024**3
    proposal = (option("small_a", [1.0], 8 * gb), option("small_b", [1.0], 8 * gb), option("big", [1.0], 9 * gb))
    topology = Topology(2, device_memory=(10 * gb,))
    with pytest.raises(PlanError) as err:
        GreedyPartitioner().partition(proposal, topology)
    assert err.value.kind == PlanErrorKind.INSUFFICIENT_MEMORY
    message = str(err.value)
    # equal costs, so both passes go by bytes: big -> d0, small_a -> d1, and small_b fits on neither
    assert "table 'small_b'" in message
    assert "device 0: needs 17.0 GiB" in message and "device 1: needs 16.0 GiB" in message
    assert message.count("has 10.0 GiB") == 2


def test_host_memory_is_one_pool_per_host() -> None:
    host = Placement.HOST
    proposal = (
        option("a", [1.0], 1, host_bytes=6, placement=host),
        option("b", [1.0], 1, host_bytes=6, placement=host),
    )
    one_host = Topology(2, device_memory=(10,), host_memory=10)
    with pytest.raises(PlanError) as err:
        GreedyPartitioner().partition(proposal, one_host)
    assert err.value.kind == PlanErrorKind.INSUFFICIENT_MEMORY
    assert "host 0" in str(err.value)
    two_hosts = Topology(2, device_memory=(10,), host_memory=10, local_world_size=1)
    result = GreedyPartitioner().partition(proposal, two_hosts)
    assert result.devices == ((0,), (1,))
    assert [s.host for s in result.device_storage] == [6, 6]


def test_greedy_is_deterministic() -> None:
    rng = random.Random(3)
    proposal = tuple(option(f"t{i}", [rng.choice([1.0, 2.0, 3.0])], rng.randint(1, 9)) for i in range(40))
    topology = Topology(8, device_memory=(100,))
    first = GreedyPartitioner().partition(proposal, topology)
    partitioner = GreedyPartitioner()
    assert partitioner.partition(proposal, topology) == first
    assert partitioner.partition(proposal, topology) == first  # cached layouts change nothing


# ---------------------------------------------------------------------------- exact
def test_exact_beats_lpt_on_a_hand_checked_instance() -> None:
    proposal = table_wise(3, 3, 2, 2, 2)
    topology = Topology(2, device_memory=(100,))
    result = ExactPartitioner().partition(proposal, topology)
    # optimum: {3, 3} and {2, 2, 2}; LPT gives 7
    assert result.bottleneck == 6.0
    assert sorted(result.device_costs) == [6.0, 6.0]
    check_valid(result, topology)


def test_exact_finds_a_placement_greedy_cannot() -> None:
    # (cost, bytes) on 2 devices of 10 bytes; the bytes fit only as {6, 4} + {3, 2, 5}. LPT places 4/6 on
    # d0, 4/4 on d1, 3/5 on d1, 2/2 on d0 and then 1/3 fits nowhere; by bytes, 2/2 fits nowhere.
    proposal = (
        option("a", [1.0], 3),
        option("b", [2.0], 2),
        option("c", [3.0], 5),
        option("d", [4.0], 6),
        option("e", [4.0], 4),
    )
    topology = Topology(2, device_memory=(10,))
    with pytest.raises(PlanError):
        GreedyPartitioner().partition(proposal, topology)
    result = ExactPartitioner().partition(proposal, topology)
    assert sorted(result.device_costs) == [6.0, 8.0]
    check_valid(result, topology)


def test_exact_is_never_worse_than_greedy_and_deterministic() -> None:
    rng = random.Random(11)
    topology = Topology(3, device_memory=(40,))
    for _ in range(5):
        proposal = tuple(option(f"t{i}", [float(rng.randint(1, 9))], rng.randint(1, 8)) for i in range(7))
        proposal += (option("rw", [2.0, 2.0], 3, ShardingType.ROW_WISE),)
        proposal += (option("rep", [1.0, 1.0, 1.0], 2, ShardingType.REPLICATED),)
        greedy = GreedyPartitioner().partition(proposal, topology)
        exact = ExactPartitioner().partition(proposal, topology)
        check_valid(exact, topology)
        assert exact.bottleneck <= greedy.bottleneck
        assert exact.bottleneck >= partition_lower_bound(proposal, topology.world_size) - 1e-9
        assert ExactPartitioner().partition(proposal, topology) == exact


def test_exact_falls_back_when_too_large() -> None:
    proposal = table_wise(3, 3, 2, 2, 2)
    topology = Topology(2, device_memory=(100,))
    result = ExactPartitioner(max_variables=9).partition(proposal, topology)  # 5 shards x 2 devices = 10
    assert result == GreedyPartitioner().partition(proposal, topology)


def test_exact_keeps_greedy_memory_error_when_nothing_fits() -> None:
    proposal = table_wise(1, 1, 1)
    proposal = tuple(option(o.table, [1.0], 6) for o in proposal)
    with pytest.raises(PlanError) as err:
        ExactPartitioner().partition(proposal, Topology(2, device_memory=(10,)))
    assert err.value.kind == PlanErrorKind.INSUFFICIENT_MEMORY


def test_exact_keeps_table_row_wise_on_one_host() -> None:
    topology = Topology(4, device_memory=(100,), local_world_size=2)
    proposal = (
        option("a", [6.0]),
        option("trw", [2.0, 2.0], sharding_type=ShardingType.TABLE_ROW_WISE),
        option("b", [3.0]),
        option("c", [3.0]),
    )
    result = ExactPartitioner().partition(proposal, topology)
    check_valid(result, topology)
    assert result.bottleneck == 6.0  # a alone; every other device holds at most 3 + 2 or 2


@pytest.mark.slow
def test_greedy_partitions_a_thousand_tables_on_64_devices() -> None:
    """Correct and near the bound at scale; how fast it plans is bench/planner.py's job (no timing here)."""
    rng = random.Random(5)
    world = 64
    proposal = []
    for t in range(1000):
        if t % 10 == 0:
            proposal.append(option(f"t{t}", [rng.uniform(0.01, 0.1)] * world, 10, ShardingType.REPLICATED))
        elif t % 10 == 1:
            proposal.append(option(f"t{t}", [rng.uniform(0.5, 2)] * 8, 1000, ShardingType.ROW_WISE))
        else:
            proposal.append(option(f"t{t}", [rng.uniform(1, 10)], rng.randint(1000, 10_000)))
    topology = Topology(world, device_memory=(10**6,))
    result = GreedyPartitioner().partition(tuple(proposal), topology)
    check_valid(result, topology)
    assert result.bottleneck <= 1.05 * partition_lower_bound(result.proposal, world)


def loads(result: PartitionResult, world: int) -> list[float]:
    """Per-device cost recomputed from the assignment, independently of the partitioner's bookkeeping."""
    costs = [0.0] * world
    for option, devices in zip(result.proposal, result.devices):
        for shard, device in zip(option.shards, devices):
            costs[device] += shard.cost
    return costs


def test_identical_tables_are_grouped_per_device_without_changing_any_load() -> None:
    topology = Topology(2, device_memory=(100,))
    greedy = GreedyPartitioner().partition(table_wise(*[5.0] * 8), topology)
    assert [d[0] for d in greedy.devices] == [0, 1, 0, 1, 0, 1, 0, 1]  # LPT alternates equal tables
    grouped = keep_features_together(greedy)
    assert [d[0] for d in grouped.devices] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert loads(grouped, 2) == loads(greedy, 2) == list(grouped.device_costs)


def test_only_interchangeable_tables_change_devices() -> None:
    topology = Topology(3, device_memory=(100,))
    # t0, t2, t4 are identical; t1 (cost 7) and t3 (bigger) are not and keep their devices
    proposal = (
        option("t0", [2.0]),
        option("t1", [7.0]),
        option("t2", [2.0]),
        option("t3", [2.0], device_bytes=3),
        option("t4", [2.0]),
        option("cw", [1.0, 1.0], sharding_type=ShardingType.COLUMN_WISE),
    )
    greedy = GreedyPartitioner().partition(proposal, topology)
    grouped = keep_features_together(greedy)
    for index in (1, 3, 5):
        assert grouped.devices[index] == greedy.devices[index]
    same = [0, 2, 4]
    assert sorted(grouped.devices[i] for i in same) == sorted(greedy.devices[i] for i in same)
    assert [grouped.devices[i][0] for i in same] == sorted(greedy.devices[i][0] for i in same)
    assert loads(grouped, 3) == loads(greedy, 3)
    storage = [0] * 3
    for option_, devices in zip(grouped.proposal, grouped.devices):
        for shard, device in zip(option_.shards, devices):
            storage[device] += shard.storage.device
    assert storage == [s.device for s in grouped.device_storage]
