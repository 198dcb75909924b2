"""``--replicas R`` in a multi-host plan (``infer.planner.replicas``): every table on R distinct hosts, each
host's memory counting the replicas it holds, typed errors naming the flag, and the plan's JSON keeping R."""

from __future__ import annotations

import dataclasses

import pytest

from infer.errors import PlanError, PlanErrorKind
from infer.planner.planner import EmbeddingPlanner
from infer.planner.replicas import held_slots, host_bytes, place_replicas, replica_topology
from infer.planner.types import ComputeDevice, ShardingPlan, Topology
from tests.conftest import mixed_spec

GB = 1 << 30


def _hosts_topology(hosts: int, memory: int = 4 * GB) -> Topology:
    return Topology(hosts, ComputeDevice.CPU, device_memory=(memory,), local_world_size=1)


def _host_of_each_table(plan: ShardingPlan, replicas: int) -> dict[str, set[int]]:
    """Table -> the hosts holding some shard of it, counted by hand from the shards' devices and the ring."""
    hosts = plan.topology.world_size
    holders: dict[str, set[int]] = {}
    for table in plan.tables:
        for shard in table.shards:
            for host in range(hosts):
                if shard.device in held_slots(hosts, replicas, host):
                    holders.setdefault(table.table, set()).add(host)
    return holders


@pytest.mark.parametrize("hosts, replicas", [(3, 2), (4, 2), (3, 3)])
def test_every_table_lies_on_replicas_distinct_hosts(hosts, replicas):
    spec = mixed_spec()
    topology = _hosts_topology(hosts)
    plan = place_replicas(EmbeddingPlanner(replica_topology(topology, replicas)).plan(spec), replicas, topology)
    assert plan.replicas == replicas
    for table, holders in _host_of_each_table(plan, replicas).items():
        devices = {s.device for s in plan.table(table).shards}
        assert len(holders) >= replicas, (table, holders)
        for device in devices:  # each shard's own host and the next replicas - 1 hosts of the ring
            assert {(device + k) % hosts for k in range(replicas)} <= holders
    assert ShardingPlan.from_json(plan.to_json()).replicas == replicas


def test_more_replicas_than_hosts_is_refused_naming_the_flag():
    with pytest.raises(PlanError) as refused:
        replica_topology(_hosts_topology(2), 3)
    assert refused.value.kind == PlanErrorKind.INVALID_TOPOLOGY
    assert "--replicas 3" in str(refused.value) and "--replicas 2 or less" in str(refused.value)


def test_host_memory_counts_the_replicas_it_holds():
    """3 hosts: the tables fit one copy but not two per host; the planner plans each copy in half of the memory
    and refuses with INSUFFICIENT_MEMORY when a host cannot hold its slot and its neighbour's."""
    spec = mixed_spec()
    one_copy = EmbeddingPlanner(_hosts_topology(3)).plan(spec)
    storage = [s.device for s in one_copy.device_storage()]
    per_host = [storage[h] + storage[(h - 1) % 3] for h in range(3)]  # by hand: own slot + the previous host's
    assert host_bytes(one_copy, 2) == per_host
    tight = _hosts_topology(3, memory=max(per_host) - 1)
    with pytest.raises(PlanError) as refused:
        place_replicas(dataclasses.replace(one_copy, topology=tight), 2)
    assert refused.value.kind == PlanErrorKind.INSUFFICIENT_MEMORY
    assert "--replicas 2" in str(refused.value) and "host " in str(refused.value)
    roomy = dataclasses.replace(one_copy, topology=_hosts_topology(3, memory=max(per_host)))
    assert place_replicas(roomy, 2).replicas == 2
