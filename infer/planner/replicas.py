"""Replicas of a multi-host plan: every host's shards are also held by the next ``replicas - 1`` hosts (a ring).

Host ``h`` of ``H`` holds the shards the plan puts on hosts ``h, h - 1, ..., h - R + 1`` (mod ``H``): its own
*slot* and the slots of the ``R - 1`` hosts before it, so every table lies on ``R`` distinct hosts and a lost
host's slot is served by the next live host of its ring. The planner places the shards of each slot in
``1 / R`` of every device's memory (``replica_topology``), so a host's ``R`` slots fit in its memory;
``place_replicas`` checks the real bytes per host and records ``replicas`` in the plan.
"""

from __future__ import annotations

import dataclasses

from infer.errors import PlanError, PlanErrorKind
from infer.planner.types import ShardingPlan, Topology
from infer.planner.utils import format_gb

FLAG = "--replicas"


def _check_count(replicas: int, hosts: int) -> None:
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise PlanError(f"{FLAG} must be a positive int, got {replicas!r}", PlanErrorKind.INVALID_TOPOLOGY)
    if replicas > hosts:
        raise PlanError(
            f"{FLAG} {replicas} needs at least {replicas} hosts (each table on {replicas} distinct hosts), the "
            f"topology has {hosts}: give {FLAG} {hosts} or less, or --hosts {replicas} or more",
            PlanErrorKind.INVALID_TOPOLOGY,
        )


def _hosts(topology: Topology) -> int:
    return topology.world_size // topology.local_world_size  # Topology fills in local_world_size (>= 1)


def replica_topology(topology: Topology, replicas: int) -> Topology:
    """The topology to plan one slot on: every device's memory divided by ``replicas`` (a host holds that many
    slots)."""
    _check_count(replicas, _hosts(topology))
    if replicas == 1:
        return topology
    return dataclasses.replace(
        topology,
        device_memory=tuple(m // replicas for m in topology.device_memory),
        host_memory=topology.host_memory // replicas,
    )


def held_slots(hosts: int, replicas: int, host: int) -> tuple[int, ...]:
    """The slots (plan hosts) whose shards ``host`` holds: its own first, then the ``replicas - 1`` before it."""
    return tuple((host - k) % hosts for k in range(replicas))


def slot_holders(hosts: int, replicas: int, slot: int) -> tuple[int, ...]:
    """The hosts that hold ``slot``'s shards, its own host first, then the ring order."""
    return tuple((slot + k) % hosts for k in range(replicas))


def host_bytes(plan: ShardingPlan, replicas: int) -> list[int]:
    """Device bytes per host of ``plan`` when each host holds its ``replicas`` slots."""
    local = plan.topology.local_world_size
    hosts = _hosts(plan.topology)
    per_slot = [0] * hosts
    for rank, storage in enumerate(plan.device_storage()):
        per_slot[rank // local] += storage.device
    return [sum(per_slot[s] for s in held_slots(hosts, replicas, h)) for h in range(hosts)]


def place_replicas(plan: ShardingPlan, replicas: int, capacity: Topology | None = None) -> ShardingPlan:
    """``plan`` with ``replicas`` recorded, after checking that every host's slots fit its memory (``capacity``:
    the topology with the hosts' real memory; default the plan's)."""
    topology = capacity or plan.topology
    hosts = _hosts(plan.topology)
    _check_count(replicas, hosts)
    local = topology.local_world_size
    for host, used in enumerate(host_bytes(plan, replicas)):
        available = sum(topology.device_memory[host * local : (host + 1) * local])
        if used > available:
            raise PlanError(
                f"host {host} would hold {format_gb(used)} with {FLAG} {replicas} (its shards and the replicas of "
                f"{replicas - 1} other hosts' shards), it has {format_gb(available)}: lower {FLAG}, add hosts "
                "(--hosts) or give each device more memory (--device-memory)",
                PlanErrorKind.INSUFFICIENT_MEMORY,
            )
    return dataclasses.replace(plan, replicas=replicas)
