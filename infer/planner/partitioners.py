"""Place every shard of a proposal on a device: greedy LPT with a memory-first retry, or an exact MILP.

A partitioner never changes a proposal; it only chooses devices. Replicated options are fixed (copy
``i`` on device ``i``); every other shard may go to any device that has room and does not already
hold a shard of the same option. Table-row-wise shards stay on one host.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from infer.errors import PlanError, PlanErrorKind
from infer.planner.types import Partitioner, PartitionResult, Proposal, ShardingOption, ShardingType, Storage, Topology
from infer.planner.utils import format_bytes

logger = logging.getLogger(__name__)


def partition_lower_bound(proposal: Proposal, world_size: int) -> float:
    """No placement of ``proposal`` on ``world_size`` devices has a lower bottleneck than this."""
    total = 0.0
    largest = 0.0
    for option in proposal:
        for shard in option.shards:
            total += shard.cost
            largest = max(largest, shard.cost)
    return max(total / world_size, largest)


def global_lower_bound(options: Mapping[str, Sequence[ShardingOption]], world_size: int) -> float:
    """No plan's bottleneck can be below this: every table costs at least its cheapest option in total,
    spread perfectly, and at least its smallest achievable largest shard on one device."""
    total = sum(min(o.total_cost for o in opts) for opts in options.values())
    largest = max(min(o.max_shard_cost for o in opts) for opts in options.values())
    return max(total / world_size, largest)


# ---------------------------------------------------------------------------- option layouts
@dataclass(frozen=True)
class _Group:
    """Shards of one option with equal cost and device bytes: they are placed together, in shard order."""

    cost: float
    device_bytes: int
    shard_indices: tuple[int, ...]
    host_bytes: tuple[int, ...]


@dataclass(frozen=True)
class _Layout:
    """What the partitioner needs from an option, read once: reading shard attributes is the slow part."""

    replicated: bool
    one_host: bool  # table-row-wise: every shard on the devices of one host
    num_shards: int
    groups: tuple[_Group, ...]  # by cost desc, device bytes desc, first shard index
    costs: tuple[float, ...]
    device_bytes: tuple[int, ...]
    host_bytes: tuple[int, ...]


def _layout(option: ShardingOption) -> _Layout:
    costs = tuple(s.cost for s in option.shards)
    device_bytes = tuple(s.storage.device for s in option.shards)
    host_bytes = tuple(s.storage.host for s in option.shards)
    one_host = option.sharding_type == ShardingType.TABLE_ROW_WISE
    members: dict[tuple[float, int], list[int]] = {}
    for index, key in enumerate(zip(costs, device_bytes)):
        members.setdefault(key, []).append(index)
    if one_host:
        # the whole option is placed as one unit, at the position of its largest shard
        order = sorted(range(len(costs)), key=lambda i: (-costs[i], -device_bytes[i], i))
        groups = [_Group(costs[order[0]], device_bytes[order[0]], tuple(order), tuple(host_bytes[i] for i in order))]
    else:
        groups = [
            _Group(cost, dev, tuple(indices), tuple(host_bytes[i] for i in indices))
            for (cost, dev), indices in members.items()
        ]
        groups.sort(key=lambda g: (-g.cost, -g.device_bytes, g.shard_indices[0]))
    return _Layout(
        option.sharding_type == ShardingType.REPLICATED,
        one_host,
        len(costs),
        tuple(groups),
        costs,
        device_bytes,
        host_bytes,
    )


class _LayoutCache:
    """Layouts by option identity; proposers hand the same option objects to many partitions."""

    def __init__(self, max_entries: int = 200_000) -> None:
        self.max_entries = max_entries
        self._entries: dict[int, tuple[ShardingOption, _Layout]] = {}

    def get(self, option: ShardingOption) -> _Layout:
        entry = self._entries.get(id(option))
        if entry is not None and entry[0] is option:
            return entry[1]
        if len(self._entries) >= self.max_entries:
            self._entries.clear()
        layout = _layout(option)
        self._entries[id(option)] = (option, layout)
        return layout


# ---------------------------------------------------------------------------- placement state
class _NoRoom(Exception):
    """A shard found no device; carries the message of the PlanError to raise."""


class _Placement:
    """Loads and memory of every device while shards are being placed."""

    def __init__(self, proposal: Proposal, layouts: Sequence[_Layout], topology: Topology) -> None:
        self.proposal = proposal
        self.layouts = layouts
        self.topology = topology
        world = topology.world_size
        self.world = world
        self.local = topology.local_world_size
        self.caps = list(topology.device_memory)
        self.host_cap = topology.host_memory
        self.loads = [0.0] * world
        self.used = [0] * world
        self.host_by_device = [0] * world
        self.host_used = [0] * (world // self.local)
        self.devices: list[list[int]] = [[-1] * layout.num_shards for layout in layouts]

    def fits(self, device: int, device_bytes: int, host_bytes: int) -> bool:
        return (
            self.used[device] + device_bytes <= self.caps[device]
            and self.host_used[device // self.local] + host_bytes <= self.host_cap
        )

    def put(self, option_index: int, shard_index: int, device: int) -> None:
        layout = self.layouts[option_index]
        host_bytes = layout.host_bytes[shard_index]
        self.loads[device] += layout.costs[shard_index]
        self.used[device] += layout.device_bytes[shard_index]
        self.host_by_device[device] += host_bytes
        self.host_used[device // self.local] += host_bytes
        self.devices[option_index][shard_index] = device

    def place_replicated(self) -> None:
        for option_index, layout in enumerate(self.layouts):
            if not layout.replicated:
                continue
            if layout.num_shards != self.world:
                option = self.proposal[option_index]
                raise PlanError(
                    f"table {option.table!r}: a replicated option needs one copy per device "
                    f"({self.world}), it has {layout.num_shards}",
                    PlanErrorKind.INVALID_PLAN,
                )
            loads, used, caps = self.loads, self.used, self.caps
            for device, (cost, device_bytes, host_bytes) in enumerate(
                zip(layout.costs, layout.device_bytes, layout.host_bytes)
            ):
                if used[device] + device_bytes > caps[device] or (
                    host_bytes and self.host_used[device // self.local] + host_bytes > self.host_cap
                ):
                    raise _NoRoom(self.no_room_message(option_index, (device,), [device]))
                loads[device] += cost
                used[device] += device_bytes
                if host_bytes:
                    self.host_by_device[device] += host_bytes
                    self.host_used[device // self.local] += host_bytes
            self.devices[option_index] = list(range(self.world))

    def take(self, option_index: int, group: _Group, order: Sequence[int]) -> None:
        """Put ``group``'s shards on the first devices of ``order`` that fit and hold none of the option."""
        taken = set(self.devices[option_index])
        shard_indices, host_bytes, device_bytes = group.shard_indices, group.host_bytes, group.device_bytes
        count = len(shard_indices)
        loads, used, caps, local = self.loads, self.used, self.caps, self.local
        host_used, host_by_device, host_cap = self.host_used, self.host_by_device, self.host_cap
        devices = self.devices[option_index]
        cost = group.cost
        position = 0
        for device in order:
            if device in taken or used[device] + device_bytes > caps[device]:
                continue
            shard_host = host_bytes[position]
            if shard_host:
                if host_used[device // local] + shard_host > host_cap:
                    continue
                host_used[device // local] += shard_host
                host_by_device[device] += shard_host
            loads[device] += cost
            used[device] += device_bytes
            devices[shard_indices[position]] = device
            position += 1
            if position == count:
                return
        raise _NoRoom(self.no_room_message(option_index, shard_indices[position:], order))

    def take_one_host(self, option_index: int, group: _Group, by_memory: bool) -> None:
        """Table-row-wise: every shard on distinct devices of one host.

        Each host is tried (shards onto its least-loaded, or freest, devices with room); the host left
        with the lowest peak load (by_memory: the most free memory on its fullest device) wins.
        """
        local, loads, caps = self.local, self.loads, self.caps
        device_bytes = self.layouts[option_index].device_bytes
        costs = self.layouts[option_index].costs
        best: tuple[tuple[float, int], list[int]] | None = None
        for host in range(self.world // local):
            members = range(host * local, host * local + local)
            used = {d: self.used[d] for d in members}
            new_loads = {d: loads[d] for d in members}
            host_used = self.host_used[host]
            picked: list[int] = []
            for position, shard_index in enumerate(group.shard_indices):
                host_bytes = group.host_bytes[position]
                if host_used + host_bytes > self.host_cap:
                    break
                ranked = sorted((float(used[d] - caps[d]) if by_memory else new_loads[d], d) for d in members)
                for _, device in ranked:
                    if device not in picked and used[device] + device_bytes[shard_index] <= caps[device]:
                        picked.append(device)
                        used[device] += device_bytes[shard_index]
                        new_loads[device] += costs[shard_index]
                        host_used += host_bytes
                        break
                else:
                    break
            if len(picked) < len(group.shard_indices):
                continue
            score = (max(used[d] - caps[d] for d in members), host) if by_memory else (max(new_loads.values()), host)
            if best is None or score < best[0]:
                best = (score, picked)
        if best is None:
            raise _NoRoom(self.no_room_message(option_index, group.shard_indices, range(self.world), one_host=True))
        for shard_index, device in zip(group.shard_indices, best[1]):
            self.put(option_index, shard_index, device)

    def no_room_message(
        self, option_index: int, shard_indices: Sequence[int], devices: Sequence[int] | range, one_host: bool = False
    ) -> str:
        option = self.proposal[option_index]
        layout = self.layouts[option_index]
        first = shard_indices[0]
        need = layout.device_bytes[first]
        need_host = layout.host_bytes[first]
        reasons = []
        taken = self.devices[option_index]
        for device in sorted(devices):
            if device in taken and not layout.replicated:
                reasons.append(f"device {device}: already holds a shard of this table")
                continue
            host = device // self.local
            if self.used[device] + need > self.caps[device]:
                reasons.append(
                    f"device {device}: needs {format_bytes(self.used[device] + need)} "
                    f"({format_bytes(self.used[device])} placed + {format_bytes(need)}), "
                    f"has {format_bytes(self.caps[device])}"
                )
            elif self.host_used[host] + need_host > self.host_cap:
                reasons.append(
                    f"device {device}: host {host} needs {format_bytes(self.host_used[host] + need_host)} "
                    f"of host memory, has {format_bytes(self.host_cap)}"
                )
            elif one_host:
                reasons.append(f"device {device}: its host has too little room for all {layout.num_shards} shards")
        total_device = sum(sum(self.layouts[i].device_bytes) for i in range(len(self.layouts)))
        what = f"shard {first} of {layout.num_shards}" if layout.num_shards > 1 else "the table"
        host_part = f" and {format_bytes(need_host)} host memory" if need_host else ""
        return (
            f"table {option.table!r} ({option.sharding_type.value}, {option.placement.value}) does not fit: "
            f"{what} needs {format_bytes(need)} device memory{host_part}; "
            + "; ".join(reasons)
            + f". The proposal needs {format_bytes(total_device)} of device memory in all; the "
            f"{self.world} devices have {format_bytes(sum(self.caps))}. Add devices, allow HOST or HOST_CACHED "
            "placement, or use a smaller data type."
        )

    def result(self) -> PartitionResult:
        return PartitionResult(
            self.proposal,
            tuple(tuple(d) for d in self.devices),
            tuple(self.loads),
            tuple(Storage(u, h) for u, h in zip(self.used, self.host_by_device)),
        )


# ---------------------------------------------------------------------------- fixed
class FixedPartitioner:
    """Every table-wise option onto the device given for its table (the precision planner's joint choice of
    type and device); a device without room is ``PlanError(INSUFFICIENT_MEMORY)`` naming it and the table."""

    def __init__(self, devices: Mapping[str, int]) -> None:
        self.devices = dict(devices)

    def partition(self, proposal: Proposal, topology: Topology) -> PartitionResult:
        layouts = [_layout(option) for option in proposal]
        state = _Placement(proposal, layouts, topology)
        for option_index, (option, layout) in enumerate(zip(proposal, layouts)):
            device = self.devices.get(option.table)
            if device is None or layout.num_shards != 1 or not 0 <= device < topology.world_size:
                raise PlanError(
                    f"table {option.table!r}: no device in the fixed placement for its {option.sharding_type.value} "
                    f"option (device {device}, {layout.num_shards} shards, {topology.world_size} devices)",
                    PlanErrorKind.INVALID_PLAN,
                )
            if not state.fits(device, layout.device_bytes[0], layout.host_bytes[0]):
                raise PlanError(
                    f"table {option.table!r} ({format_bytes(layout.device_bytes[0])}) does not fit device {device}: "
                    f"{format_bytes(state.used[device])} of {format_bytes(state.caps[device])} used. Plan the data "
                    "types with this topology's device budgets (EmbeddingPlanner.device_budgets)",
                    PlanErrorKind.INSUFFICIENT_MEMORY,
                )
            state.put(option_index, 0, device)
        return state.result()


# ---------------------------------------------------------------------------- greedy
class GreedyPartitioner:
    """Longest processing time first: the costliest shard onto the least-loaded device with room.

    When that runs out of memory, it retries once placing the biggest shards first onto the device
    with the most free memory; when that fails too, it raises ``PlanError(INSUFFICIENT_MEMORY)``.
    """

    # a group this large is placed from one sort of the devices instead of heap pops
    _SORT_GROUP_SIZE = 8

    def __init__(self) -> None:
        self._layouts = _LayoutCache()

    def partition(self, proposal: Proposal, topology: Topology) -> PartitionResult:
        layouts = [self._layouts.get(option) for option in proposal]
        try:
            return self._by_cost(proposal, layouts, topology)
        except _NoRoom:
            pass
        try:
            return self._by_memory(proposal, layouts, topology)
        except _NoRoom as err:
            raise PlanError(str(err), PlanErrorKind.INSUFFICIENT_MEMORY) from None

    @staticmethod
    def _groups(layouts: Sequence[_Layout], by_memory: bool) -> list[tuple[float, float, int, int]]:
        items: list[tuple[float, float, int, int]] = []
        for option_index, layout in enumerate(layouts):
            if layout.replicated:
                continue
            for group_index, group in enumerate(layout.groups):
                if by_memory:
                    items.append((-group.device_bytes, -group.cost, option_index, group_index))
                else:
                    items.append((-group.cost, -group.device_bytes, option_index, group_index))
        items.sort()
        return items

    def _by_cost(self, proposal: Proposal, layouts: Sequence[_Layout], topology: Topology) -> PartitionResult:
        state = _Placement(proposal, layouts, topology)
        state.place_replicated()
        loads = state.loads
        heap: list[tuple[float, int]] = []
        stale = True  # the heap is rebuilt only when a small group needs it after a large one
        for _, _, option_index, group_index in self._groups(layouts, by_memory=False):
            layout = layouts[option_index]
            group = layout.groups[group_index]
            if layout.one_host:
                state.take_one_host(option_index, group, by_memory=False)
                stale = True
            elif len(group.shard_indices) >= self._SORT_GROUP_SIZE:
                state.take(option_index, group, sorted(range(state.world), key=loads.__getitem__))
                stale = True
            else:
                if stale:
                    heap = [(load, d) for d, load in enumerate(loads)]
                    heapq.heapify(heap)
                    stale = False
                self._take_from_heap(state, heap, option_index, group)
        return state.result()

    @staticmethod
    def _take_from_heap(state: _Placement, heap: list[tuple[float, int]], option_index: int, group: _Group) -> None:
        """Pop devices in (load, rank) order until every shard of ``group`` has one; push them all back."""
        taken = state.devices[option_index]
        popped: list[tuple[float, int]] = []
        placed = 0
        count = len(group.shard_indices)
        while heap and placed < count:
            entry = heapq.heappop(heap)
            popped.append(entry)
            device = entry[1]
            if device in taken or not state.fits(device, group.device_bytes, group.host_bytes[placed]):
                continue
            state.put(option_index, group.shard_indices[placed], device)
            placed += 1
        loads = state.loads
        for _, device in popped:
            heapq.heappush(heap, (loads[device], device))
        if placed < count:
            raise _NoRoom(state.no_room_message(option_index, group.shard_indices[placed:], range(state.world)))

    def _by_memory(self, proposal: Proposal, layouts: Sequence[_Layout], topology: Topology) -> PartitionResult:
        state = _Placement(proposal, layouts, topology)
        state.place_replicated()
        used, caps = state.used, state.caps

        def most_free(device: int) -> tuple[int, int]:
            return (used[device] - caps[device], device)

        for _, _, option_index, group_index in self._groups(layouts, by_memory=True):
            layout = layouts[option_index]
            group = layout.groups[group_index]
            if layout.one_host:
                state.take_one_host(option_index, group, by_memory=True)
            else:
                state.take(option_index, group, sorted(range(state.world), key=most_free))
        return state.result()


# ---------------------------------------------------------------------------- exact
class ExactPartitioner:
    """Minimum bottleneck by mixed-integer programming (``scipy.optimize.milp``, HiGHS).

    Solves only instances with at most ``max_variables`` shard-device pairs; larger ones, and ones
    HiGHS cannot solve within ``time_limit_s``, get ``fallback``'s placement. The result is never
    worse than the greedy placement, which is computed first. Deterministic unless the time limit
    cuts HiGHS short (its search does not otherwise depend on timing).
    """

    def __init__(
        self,
        time_limit_s: float = 5.0,
        max_variables: int = 4000,
        fallback: Partitioner | None = None,
    ) -> None:
        self.time_limit_s = time_limit_s
        self.max_variables = max_variables
        self.fallback: Partitioner = fallback if fallback is not None else GreedyPartitioner()
        self._layouts = _LayoutCache()

    def partition(self, proposal: Proposal, topology: Topology) -> PartitionResult:
        try:
            greedy: PartitionResult | None = self.fallback.partition(proposal, topology)
            greedy_error: PlanError | None = None
        except PlanError as err:
            if err.kind != PlanErrorKind.INSUFFICIENT_MEMORY:
                raise
            greedy, greedy_error = None, err
        layouts = [self._layouts.get(option) for option in proposal]
        free_shards = sum(layout.num_shards for layout in layouts if not layout.replicated)
        exact = None
        if 0 < free_shards and free_shards * topology.world_size <= self.max_variables:
            upper = greedy.bottleneck if greedy is not None else None
            exact = self._solve(proposal, layouts, topology, upper)
        if exact is not None and (greedy is None or exact.bottleneck < greedy.bottleneck):
            return exact
        if greedy is None:
            assert greedy_error is not None
            raise greedy_error
        return greedy

    def _solve(
        self, proposal: Proposal, layouts: Sequence[_Layout], topology: Topology, upper: float | None
    ) -> PartitionResult | None:
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_matrix

        world = topology.world_size
        local = topology.local_world_size
        num_hosts = world // local
        fixed = _Placement(proposal, layouts, topology)
        try:
            fixed.place_replicated()
        except _NoRoom:
            return None
        # the free shards, and one host choice per table-row-wise option
        shards = [(o, s) for o, layout in enumerate(layouts) if not layout.replicated for s in range(layout.num_shards)]
        one_host = [o for o, layout in enumerate(layouts) if layout.one_host and not layout.replicated]
        num_x = len(shards) * world
        z = num_x + len(one_host) * num_hosts
        num_vars = z + 1
        costs = np.array([layouts[o].costs[s] for o, s in shards])
        device_bytes = np.array([layouts[o].device_bytes[s] for o, s in shards], dtype=np.float64)
        host_bytes = np.array([layouts[o].host_bytes[s] for o, s in shards], dtype=np.float64)
        # scale to O(1) numbers: HiGHS tolerances are absolute, costs are microseconds
        cost_scale = max(float(costs.max()), max(fixed.loads), 1e-300)
        mem_scale = float(max(max(topology.device_memory), 1))
        host_scale = float(max(topology.host_memory, 1))

        rows: list[np.ndarray] = []
        cols: list[np.ndarray] = []
        vals: list[np.ndarray] = []
        lower: list[float] = []
        upper_rows: list[float] = []
        row = 0

        def add(r: np.ndarray, c: np.ndarray, v: np.ndarray) -> None:
            rows.append(r)
            cols.append(c)
            vals.append(v)

        shard_ids = np.arange(len(shards))
        devices = np.arange(world)
        x_index = shard_ids[:, None] * world + devices[None, :]  # [shard, device] -> variable
        # every shard on exactly one device
        add(np.repeat(row + shard_ids, world), x_index.ravel(), np.ones(num_x))
        lower += [1.0] * len(shards)
        upper_rows += [1.0] * len(shards)
        row += len(shards)
        # device cost <= z
        for d in range(world):
            add(np.full(len(shards) + 1, row + d), np.append(x_index[:, d], z), np.append(costs / cost_scale, -1.0))
        lower += [-np.inf] * world
        upper_rows += [-fixed.loads[d] / cost_scale for d in range(world)]
        row += world
        # device memory
        for d in range(world):
            add(np.full(len(shards), row + d), x_index[:, d], device_bytes / mem_scale)
        lower += [-np.inf] * world
        upper_rows += [(topology.device_memory[d] - fixed.used[d]) / mem_scale for d in range(world)]
        row += world
        # host memory pools
        if host_bytes.any():
            for h in range(num_hosts):
                block = x_index[:, h * local : (h + 1) * local]
                add(np.full(block.size, row + h), block.ravel(), np.repeat(host_bytes, local) / host_scale)
            lower += [-np.inf] * num_hosts
            upper_rows += [(topology.host_memory - fixed.host_used[h]) / host_scale for h in range(num_hosts)]
            row += num_hosts
        # the shards of one option on distinct devices
        position = 0
        for layout in layouts:
            if layout.replicated:
                continue
            count = layout.num_shards
            if count > 1:
                block = x_index[position : position + count]  # [count, world]
                add(np.repeat(row + devices, count), block.T.ravel(), np.ones(block.size))
                lower += [-np.inf] * world
                upper_rows += [1.0] * world
                row += world
            position += count
        # table-row-wise: one host per option, every shard on it
        for k, o in enumerate(one_host):
            y = num_x + k * num_hosts + np.arange(num_hosts)
            add(np.full(num_hosts, row), y, np.ones(num_hosts))
            lower.append(1.0)
            upper_rows.append(1.0)
            row += 1
            members = [i for i, (oi, _) in enumerate(shards) if oi == o]
            for i in members:
                # x[i, d] - y[o, host(d)] <= 0
                add(np.repeat(row + devices, 2), np.column_stack([x_index[i], y[devices // local]]).ravel(),
                    np.tile([1.0, -1.0], world))  # fmt: skip
                lower += [-np.inf] * world
                upper_rows += [0.0] * world
                row += world

        matrix = coo_matrix(
            (np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(row, num_vars)
        ).tocsr()
        objective = np.zeros(num_vars)
        objective[z] = 1.0
        integrality = np.ones(num_vars)
        integrality[z] = 0
        var_lower = np.zeros(num_vars)
        var_upper = np.ones(num_vars)
        var_lower[z] = partition_lower_bound(proposal, world) / cost_scale * (1 - 1e-9)
        var_upper[z] = np.inf if upper is None else upper / cost_scale * (1 + 1e-9)
        outcome = milp(
            objective,
            integrality=integrality,
            bounds=Bounds(var_lower, var_upper),
            constraints=LinearConstraint(matrix, np.array(lower), np.array(upper_rows)),
            options={"time_limit": self.time_limit_s, "presolve": True},
        )
        if outcome.x is None:
            logger.debug("exact partition found no solution: %s", outcome.message)
            return None
        chosen = np.asarray(outcome.x[:num_x]).reshape(len(shards), world).argmax(axis=1)
        state = fixed
        for (o, s), device in zip(shards, chosen.tolist()):
            layout = layouts[o]
            if device in state.devices[o] or not state.fits(device, layout.device_bytes[s], layout.host_bytes[s]):
                return None  # a tolerance-sized violation: keep the greedy placement
            state.put(o, s, device)
        for o in one_host:
            if len({d // local for d in state.devices[o]}) != 1:
                return None
        return state.result()


def keep_features_together(result: PartitionResult) -> PartitionResult:
    """Hand out the devices of identical whole-table options in table order; every load stays the same.

    Identical options (same type, placement, data type and shards, hence the same storage and cost)
    are interchangeable, so swapping their devices changes no device's memory or cost. Giving the
    devices out in table order keeps each device's features consecutive in a request: the sharded
    model then reads them as one slice of the ids and writes them as one block of the output
    instead of gathering and scattering feature by feature (W128 on 2 CPU devices: 8 equal tables
    go 0-3 / 4-7 instead of alternating).
    """
    groups: dict[tuple[object, ...], list[int]] = {}
    for index, option in enumerate(result.proposal):
        if option.num_shards == 1:
            key = (option.sharding_type, option.placement, option.data_type, option.shards)
            groups.setdefault(key, []).append(index)
    devices = list(result.devices)
    for members in groups.values():
        for index, device in zip(members, sorted(devices[i][0] for i in members)):
            devices[index] = (device,)
    return PartitionResult(result.proposal, tuple(devices), result.device_costs, result.device_storage)
