"""Proposers: one option per table in table order, the greedy search's moves, the DP's memory budget."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest

from infer.config import DataType, ModelSpec, PoolingType, TableConfig
from infer.errors import PlanError
from infer.planner.enumerators import EmbeddingEnumerator
from infer.planner.partitioners import GreedyPartitioner
from infer.planner.proposers import DynamicProgrammingProposer, GreedyProposer, UniformProposer
from infer.planner.types import (
    PartitionResult,
    Placement,
    Proposal,
    Proposer,
    ShardingOption,
    ShardingType,
    ShardSpec,
    Storage,
    Topology,
)

TW, RW, REP = ShardingType.TABLE_WISE, ShardingType.ROW_WISE, ShardingType.REPLICATED


def option(
    table: str,
    costs: list[float],
    device_bytes: int = 1,
    sharding_type: ShardingType = TW,
    placement: Placement = Placement.DEVICE,
    host_bytes: int = 0,
) -> ShardingOption:
    storage = Storage(device_bytes, host_bytes)
    shards = tuple(ShardSpec(i, 1, 0, 4, storage, cost) for i, cost in enumerate(costs))
    return ShardingOption(table, sharding_type, placement, DataType.INT8, shards)


def run(
    proposer: Proposer, options: Mapping[str, Sequence[ShardingOption]], topology: Topology
) -> list[tuple[Proposal, PartitionResult | None]]:
    """Drive a proposer the way the planner does; every proposal with its partition (None: did not fit)."""
    partitioner = GreedyPartitioner()
    proposer.load(options, topology)
    seen = []
    while (proposal := proposer.propose()) is not None:
        try:
            result: PartitionResult | None = partitioner.partition(proposal, topology)
        except PlanError:
            result = None
        proposer.feedback(proposal, result)
        seen.append((proposal, result))
        assert len(seen) < 1000, "the proposer does not stop"
    return seen


def enumerated_options() -> tuple[dict[str, list[ShardingOption]], Topology]:
    spec = ModelSpec(
        (
            TableConfig("users", 200_000, 128, ("user_id",), PoolingType.SUM, DataType.INT8),
            TableConfig("items", 50_000, 64, ("item_id", "item_history"), PoolingType.SUM, DataType.INT8),
            TableConfig("tiny", 100, 32, ("country",), PoolingType.MEAN, DataType.INT8),
        )
    )
    topology = Topology(4, device_memory=(1024**3,))
    return EmbeddingEnumerator(batch_size=128).enumerate(spec, topology, {}), topology


@pytest.mark.parametrize("make", [UniformProposer, GreedyProposer, DynamicProgrammingProposer])
def test_every_proposal_has_one_option_per_table_in_table_order(make: type) -> None:
    options, topology = enumerated_options()
    seen = run(make(), options, topology)
    assert seen
    for proposal, _ in seen:
        assert [o.table for o in proposal] == ["users", "items", "tiny"]
        for name, chosen in zip(options, proposal):
            assert any(chosen is o for o in options[name])


@pytest.mark.parametrize("make", [UniformProposer, GreedyProposer, DynamicProgrammingProposer])
def test_proposers_are_deterministic(make: type) -> None:
    options, topology = enumerated_options()
    first = [p for p, _ in run(make(), options, topology)]
    again = [p for p, _ in run(make(), options, topology)]
    assert first == again


# ---------------------------------------------------------------------------- uniform
def test_uniform_proposes_each_type_with_the_cheapest_option_of_it() -> None:
    options = {
        "a": [option("a", [4.0]), option("a", [2.5, 2.5], sharding_type=RW), option("a", [1.5] * 4, sharding_type=RW)],
        "b": [option("b", [3.0]), option("b", [8.0], placement=Placement.HOST)],
    }
    seen = run(UniformProposer(), options, Topology(4, device_memory=(100,)))
    proposals = [p for p, _ in seen]
    # table-wise: a's only TW option, b's cheaper TW (3.0 < 8.0); row-wise: a's 4-way split (1.5 per
    # shard), b has no row-wise option and takes its cheapest overall
    assert proposals == [
        (options["a"][0], options["b"][0]),
        (options["a"][2], options["b"][0]),
    ]


# ---------------------------------------------------------------------------- greedy
def dominant_table_options() -> dict[str, list[ShardingOption]]:
    return {
        "big": [
            option("big", [10.0]),
            option("big", [5.5, 5.5], sharding_type=RW),
            option("big", [3.0] * 4, sharding_type=RW),
        ],
        "s1": [option("s1", [1.0])],
        "s2": [option("s2", [1.0])],
        "s3": [option("s3", [1.0])],
    }


def test_greedy_splits_the_dominant_table() -> None:
    options = dominant_table_options()
    seen = run(GreedyProposer(), options, Topology(4, device_memory=(100,)))
    bottlenecks = [r.bottleneck for _, r in seen if r is not None]
    # all table-wise: big alone on a device (10). Then big -> 2 row blocks (the cheaper split, total 11):
    # 5.5, 5.5, 1 + 1, 1. Then 4 row blocks: 3 + 1, 3 + 1, 3 + 1, 3 (optimal: 15 over 4 devices, 3-pieces).
    assert bottlenecks == [10.0, 5.5, 4.0]
    assert [p[0] for p, _ in seen] == options["big"]


def test_greedy_first_proposal_is_cheapest_total_cost() -> None:
    options = {
        "a": [option("a", [1.0, 1.0], 5, RW), option("a", [2.0], 5), option("a", [2.0], 3, placement=Placement.HOST)],
    }
    proposer = GreedyProposer()
    proposer.load(options, Topology(2, device_memory=(100,)))
    # total 2.0 everywhere; fewer device bytes wins (3 < 5)
    assert proposer.propose() == (options["a"][2],)


def test_greedy_moves_the_largest_table_to_less_memory_when_nothing_fits() -> None:
    host = Placement.HOST
    options = {
        "a": [option("a", [1.0], 80), option("a", [5.0], 10, placement=host)],
        "b": [option("b", [1.0], 50), option("b", [5.0], 10, placement=host)],
    }
    seen = run(GreedyProposer(), options, Topology(1, device_memory=(100,)))
    # 80 + 50 > 100: a (the larger) goes to host memory; 10 + 50 fits and there is nothing to split
    assert [p for p, _ in seen] == [(options["a"][0], options["b"][0]), (options["a"][1], options["b"][0])]
    assert seen[0][1] is None and seen[1][1] is not None


def test_greedy_reverts_a_move_that_does_not_fit() -> None:
    options = {
        "big": [
            option("big", [10.0], 10),
            option("big", [5.5, 5.5], 1, RW, Placement.HOST, host_bytes=60),  # 120 > 100 of host memory
            option("big", [6.0, 6.0], 10, RW),
        ],
        "other": [option("other", [2.0], 50)],
    }
    topology = Topology(2, device_memory=(100,), host_memory=100)
    seen = run(GreedyProposer(), options, topology)
    # table-wise: 10 | 2. The cheaper split (total 11) goes to host memory and does not fit: reverted.
    # The device split does: 6 + 2 | 6. Nothing lower is left for big (the host split was tried).
    assert [p[0] for p, _ in seen] == [options["big"][0], options["big"][1], options["big"][2]]
    assert [r.bottleneck if r else None for _, r in seen] == [10.0, None, 8.0]


# ---------------------------------------------------------------------------- dynamic programming
def memory_options() -> dict[str, list[ShardingOption]]:
    host = Placement.HOST
    return {
        "a": [option("a", [1.0], 60), option("a", [3.0], 10, placement=host)],
        "b": [option("b", [1.0], 60), option("b", [3.0], 10, placement=host)],
    }


@pytest.mark.parametrize(("memory", "cheapest"), [(25, 6.0), (75, 4.0), (130, 2.0)])
def test_dp_respects_the_budget_and_gets_cheaper_with_more_memory(memory: int, cheapest: float) -> None:
    proposer = DynamicProgrammingProposer()
    proposer.load(memory_options(), Topology(1, device_memory=(memory,)))
    proposals = []
    while (proposal := proposer.propose()) is not None:
        proposals.append(proposal)
        proposer.feedback(proposal, None)
    assert proposals
    for proposal in proposals:
        assert sum(o.total_storage.device for o in proposal) <= memory
    totals = [sum(o.total_cost for o in p) for p in proposals]
    assert totals[0] == cheapest
    assert totals == sorted(totals)
    assert len(set(proposals)) == len(proposals)


def test_dp_proposes_every_memory_level_cheapest_first() -> None:
    proposer = DynamicProgrammingProposer()
    options = memory_options()
    proposer.load(options, Topology(1, device_memory=(130,)))
    totals = []
    while (proposal := proposer.propose()) is not None:
        totals.append(sum(o.total_cost for o in proposal))
        proposer.feedback(proposal, None)
    assert totals == [2.0, 4.0, 6.0]  # both on device (120 B), one (70 B), none (20 B)


def test_dp_cost_never_rises_with_the_budget_on_real_options() -> None:
    options, topology = enumerated_options()
    previous = float("inf")
    for memory in (2 * 1024**2, 8 * 1024**2, 64 * 1024**2, 1024**3):
        proposer = DynamicProgrammingProposer()
        smaller = topology.with_device_memory([memory] * topology.world_size)
        proposer.load(options, smaller)
        proposal = proposer.propose()
        assert proposal is not None
        assert sum(o.total_storage.device for o in proposal) <= memory * topology.world_size
        total = sum(o.total_cost for o in proposal)
        assert total <= previous * (1 + 1e-12)
        previous = total
