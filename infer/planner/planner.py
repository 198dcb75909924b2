"""The inference planner: enumerate options, propose, partition, keep the best plan."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace

from infer.config import ModelSpec
from infer.errors import PlanError, PlanErrorKind
from infer.planner import constants as C
from infer.planner.access import AccessSample
from infer.planner.enumerators import EmbeddingEnumerator
from infer.planner.memory_tiers import assign_tiers
from infer.planner.partitioners import (
    ExactPartitioner,
    FixedPartitioner,
    GreedyPartitioner,
    global_lower_bound,
    keep_features_together,
    partition_lower_bound,
)
from infer.planner.precision import DeviceBudgets, PrecisionPlan, apply_precision
from infer.planner.proposers import DynamicProgrammingProposer, GreedyProposer, UniformProposer
from infer.planner.shard_estimators import InferencePerfEstimator, InferenceStorageEstimator
from infer.planner.storage_reservations import HeuristicalStorageReservation
from infer.planner.types import (
    Enumerator,
    ParameterConstraints,
    Partitioner,
    PartitionResult,
    Placement,
    Proposal,
    Proposer,
    Shard,
    ShardingOption,
    ShardingPlan,
    ShardingType,
    StorageReservation,
    TablePlan,
    Topology,
)
from infer.planner.utils import format_gb
from infer.quant.rowwise import table_bytes

logger = logging.getLogger(__name__)

# a device's mapped share when the mapped capacity is unbounded: larger than any table set, small enough for JSON
_UNBOUNDED_SHARE = 1 << 49


def _device_bytes(option: ShardingOption) -> int:
    return option.total_storage.device


class EmbeddingPlanner:
    """Plans tables onto the devices of one host for inference (``is_inference=False``: training estimates).

    Stages are injected; the defaults are the enumerator with inference estimators, a 15 % reservation,
    the greedy, uniform and dynamic-programming proposers and the greedy partitioner.
    """

    def __init__(
        self,
        topology: Topology,
        batch_size: int = C.DEFAULT_BATCH_SIZE,
        *,
        is_inference: bool = True,
        enumerator: Enumerator | None = None,
        storage_reservation: StorageReservation | None = None,
        proposers: Sequence[Proposer] | None = None,
        partitioner: Partitioner | None = None,
    ) -> None:
        self.topology = topology
        self.batch_size = batch_size
        self.is_inference = is_inference
        self.enumerator = enumerator or EmbeddingEnumerator(
            batch_size, InferenceStorageEstimator(is_inference), InferencePerfEstimator(is_inference)
        )
        self.storage_reservation = storage_reservation or HeuristicalStorageReservation(batch_size=batch_size)
        defaults: list[Proposer] = [GreedyProposer(), UniformProposer(), DynamicProgrammingProposer()]
        self.proposers: list[Proposer] = list(proposers) if proposers is not None else defaults
        self.partitioner = partitioner or GreedyPartitioner()
        # The winning proposal is placed once more exactly, when it is small enough for the solver.
        self.final_partitioner: Partitioner | None = (
            ExactPartitioner(time_limit_s=2.0, max_variables=1500) if partitioner is None else None
        )

    def plan(
        self,
        spec: ModelSpec,
        constraints: Mapping[str, ParameterConstraints] | None = None,
        sample: AccessSample | None = None,
        precision: PrecisionPlan | None = None,
    ) -> ShardingPlan:
        """Plan ``spec``; ``sample`` (ids per feature from requests) ranks CPU shards for the resident tier;
        ``precision`` (``precision.plan_precision``) gives every table's data type, recorded with its reasons."""
        started = time.monotonic()
        constraints = constraints or {}
        if precision is not None:
            spec = apply_precision(spec, precision)
        topology = self.storage_reservation.reserve(self.topology, spec)
        options = self.enumerator.enumerate(spec, topology, constraints)
        names = [t.name for t in spec.tables]
        ordered = {name: options[name] for name in names}
        placed = precision.devices() if precision is not None else None
        try:
            if placed is not None:  # the precision planner chose each table's device with its type
                proposal = tuple(self._table_wise(name, ordered[name]) for name in names)
                best = FixedPartitioner(placed).partition(proposal, topology)
                best_source, evaluated = "precision (types and devices jointly)", 1
            else:
                best, best_source, evaluated = self._search(ordered, topology)
        except PlanError as err:
            paging = self.is_inference and topology.pages_weights and placed is None
            if err.kind != PlanErrorKind.INSUFFICIENT_MEMORY or not paging:
                raise
            # the tables exceed RAM: place them within RAM plus mapped capacity; tiers say what is paged
            best, best_source, evaluated = self._search_paged(ordered, topology)
        best = keep_features_together(best)
        lower_bound = global_lower_bound(ordered, topology.world_size)
        seconds = time.monotonic() - started
        logger.info(
            "planned %d tables on %d devices in %.2fs: bottleneck %.3g s, lower bound %.3g s (%s, %d proposals)",
            len(names), topology.world_size, seconds, best.bottleneck, lower_bound, best_source, evaluated,
        )  # fmt: skip
        plan = self._to_plan(best, topology, lower_bound, best_source, evaluated, seconds)
        if precision is not None:
            plan = replace(plan, planner={**plan.planner, "precision": precision.to_dict()})
        if not self.is_inference or topology.is_cuda:
            return plan
        tables, tier_stats = assign_tiers(
            plan.tables, spec, constraints, sum(topology.device_memory), topology.mapped_capacity, sample,
            topology.cpu_views,
        )  # fmt: skip
        return replace(plan, tables=tables, planner={**plan.planner, "memory_tiers": tier_stats})

    def device_budgets(
        self, spec: ModelSpec, constraints: Mapping[str, ParameterConstraints] | None = None
    ) -> DeviceBudgets:
        """What each device may hold for the precision planner's joint choice of type and device: its memory after
        the reservation (on CPU its resident share of RAM), and per table its batch buffers there (table-wise)."""
        topology = self.storage_reservation.reserve(self.topology, spec)
        options = self.enumerator.enumerate(spec, topology, constraints or {})
        overheads = []
        for table in spec.tables:
            option = self._table_wise(table.name, options[table.name])
            weights = table_bytes(table.num_embeddings, table.embedding_dim, option.data_type, topology.row_alignment)
            overheads.append((table.name, option.shards[0].storage.device - weights))
        return DeviceBudgets(tuple(topology.device_memory), tuple(overheads))

    @staticmethod
    def _table_wise(table: str, options: Sequence[ShardingOption]) -> ShardingOption:
        for option in options:
            if option.sharding_type == ShardingType.TABLE_WISE and option.placement == Placement.DEVICE:
                return option
        raise PlanError(
            f"table {table!r}: choosing data types with devices needs a table-wise option in device memory; allow "
            "table_wise and device in its constraints, or plan the types without device budgets",
            PlanErrorKind.INVALID_CONSTRAINT,
        )

    def _search(
        self, ordered: Mapping[str, Sequence[ShardingOption]], topology: Topology
    ) -> tuple[PartitionResult, str, int]:
        """The best partition of any proposal (then placed exactly when small), or the host fallback's."""
        best: PartitionResult | None = None
        best_source = ""
        evaluated = 0
        for proposer in self.proposers:
            proposer.load(ordered, topology)
            while (proposal := proposer.propose()) is not None:
                result = self._try(proposal, topology)
                evaluated += 1
                proposer.feedback(proposal, result)
                if result is not None and (best is None or _better(result, best)):
                    best, best_source = result, type(proposer).__name__
        if best is None:
            best = self._host_fallback(ordered, topology)
            best_source = "host_fallback"
            evaluated += 1
        bound = partition_lower_bound(best.proposal, topology.world_size)
        if self.final_partitioner is not None and best.bottleneck > bound * (1 + 1e-3):
            exact = self.final_partitioner.partition(best.proposal, topology)
            if exact.bottleneck < best.bottleneck * (1 - 1e-9):
                best, best_source = exact, f"{best_source}+exact"
        return best, best_source, evaluated

    def _search_paged(
        self, ordered: Mapping[str, Sequence[ShardingOption]], resident: Topology
    ) -> tuple[PartitionResult, str, int]:
        """Place the tables on devices whose memory is their RAM share plus their share of the mapped capacity."""
        local = resident.local_world_size
        mapped = resident.mapped_capacity
        share = _UNBOUNDED_SHARE if mapped is None else mapped // local
        paged = resident.with_device_memory([cap + share for cap in resident.device_memory])
        try:
            best, source, evaluated = self._search(ordered, paged)
        except PlanError as err:
            if err.kind != PlanErrorKind.INSUFFICIENT_MEMORY:
                raise
            need = sum(min(_device_bytes(o) for o in opts) for opts in ordered.values())
            raise PlanError(
                f"the tables do not fit even paged: they need {format_gb(need)} in their leanest placement; the "
                f"resident budget (RAM, after reservation) is {format_gb(sum(resident.device_memory))} and the "
                f"mapped capacity {format_gb(mapped or 0)} per host. Free disk where the artifact goes "
                "(--mapped-capacity), add RAM, or use a smaller data type (--dtype int4, or --memory-budget)",
                PlanErrorKind.INSUFFICIENT_MEMORY,
            ) from None
        logger.info("the tables exceed RAM: placed with mapped capacity; the plan's tiers say which are paged")
        return best, f"{source}+paged", evaluated

    def _try(self, proposal: Proposal, topology: Topology) -> PartitionResult | None:
        try:
            return self.partitioner.partition(proposal, topology)
        except PlanError as err:
            if err.kind == PlanErrorKind.INSUFFICIENT_MEMORY:
                return None
            raise

    def _host_fallback(self, options: Mapping[str, Sequence[ShardingOption]], topology: Topology) -> PartitionResult:
        """Move the largest tables to their least-device-memory option (host memory on CUDA) until the plan fits."""
        cheapest = {
            n: min(opts, key=lambda o: (o.total_cost, _device_bytes(o), o.num_shards)) for n, opts in options.items()
        }
        leanest = {n: min(opts, key=lambda o: (_device_bytes(o), o.total_cost)) for n, opts in options.items()}
        by_size = sorted(options, key=lambda n: (-_device_bytes(cheapest[n]), n))
        names = list(options)

        def attempt(moved: int) -> PartitionResult | None:
            chosen = set(by_size[:moved])
            proposal = tuple(leanest[n] if n in chosen else cheapest[n] for n in names)
            return self._try(proposal, topology)

        everything = attempt(len(names))
        if everything is None:
            raise PlanError(self._insufficient_memory_message(leanest, topology), PlanErrorKind.INSUFFICIENT_MEMORY)
        low, high, result = 0, len(names), everything  # fewest tables moved that still fits
        while low < high:
            middle = (low + high) // 2
            found = attempt(middle)
            if found is not None:
                high, result = middle, found
            else:
                low = middle + 1
        logger.warning("device memory is short: %d largest table(s) placed in host memory", high)
        return result

    def _insufficient_memory_message(self, leanest: Mapping[str, ShardingOption], topology: Topology) -> str:
        need_device = sum(_device_bytes(o) for o in leanest.values())
        need_host = sum(o.total_storage.host for o in leanest.values())
        largest = max(leanest.values(), key=lambda o: max(s.storage.device for s in o.shards))
        largest_shard = max(s.storage.device for s in largest.shards)
        per_device = ", ".join(f"device {d}: {format_gb(m)}" for d, m in enumerate(topology.device_memory))
        host = f"; host memory needed {format_gb(need_host)}, available {format_gb(topology.host_memory)}"
        return (
            f"the tables do not fit: even in their leanest placement they need {format_gb(need_device)} of device "
            f"memory ({format_gb(need_device / topology.world_size)} per device; largest shard: table "
            f"{largest.table!r}, {format_gb(largest_shard)}) "
            f"and devices have (after reservation) {per_device}{host if need_host else ''}. "
            "Add devices, give them more memory, or use a smaller data type (--dtype int4)"
        )

    def _to_plan(
        self,
        result: PartitionResult,
        reserved: Topology,
        lower_bound: float,
        source: str,
        evaluated: int,
        seconds: float,
    ) -> ShardingPlan:
        tables = []
        for option, devices in zip(result.proposal, result.devices):
            shards = tuple(
                Shard(
                    device,
                    s.row_offset,
                    s.num_rows,
                    s.col_offset,
                    s.num_cols,
                    s.storage.device,
                    s.storage.host,
                    s.cost,
                    s.input_bytes,
                    s.output_bytes,
                )  # fmt: skip
                for s, device in zip(option.shards, devices)
            )
            tables.append(TablePlan(option.table, option.sharding_type, option.placement, option.data_type, shards))
        return ShardingPlan(
            tuple(tables),
            self.topology,
            self.batch_size,
            result.bottleneck,
            lower_bound,
            self.is_inference,
            {
                "proposer": source,
                "proposals_evaluated": evaluated,
                "seconds": round(seconds, 4),
                "partition_lower_bound": partition_lower_bound(result.proposal, reserved.world_size),
                "usable_device_memory": list(reserved.device_memory),
                **({"topology_source": self.topology.source} if self.topology.source else {}),
            },
        )


def _better(candidate: PartitionResult, best: PartitionResult) -> bool:
    """Lower bottleneck wins; near-ties (0.1 %) go to less device memory, for headroom."""
    if candidate.bottleneck < best.bottleneck * (1 - 1e-3):
        return True
    if candidate.bottleneck > best.bottleneck * (1 + 1e-3):
        return False
    return sum(s.device for s in candidate.device_storage) < sum(s.device for s in best.device_storage)


def plan_for_inference(
    spec: ModelSpec,
    topology: Topology,
    constraints: Mapping[str, ParameterConstraints] | None = None,
    batch_size: int = C.DEFAULT_BATCH_SIZE,
    sample: AccessSample | None = None,
) -> ShardingPlan:
    """Plan ``spec`` onto ``topology`` with the default stages."""
    return EmbeddingPlanner(topology, batch_size).plan(spec, constraints, sample)
