"""Value types and stage interfaces of the inference planner.

Everything here is frozen: stages return new values instead of mutating options, so a plan can be
compared, hashed, written to JSON and read back. Stage interfaces are ``Protocol``s; the planner
takes instances, and the defaults live beside each role (enumerators.py, shard_estimators.py, ...).
"""

from __future__ import annotations

import enum
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from infer.config import DataType, ModelSpec, TableConfig
from infer.errors import PlanError, PlanErrorKind
from infer.planner import constants as C


class ShardingType(enum.Enum):
    TABLE_WISE = "table_wise"  # the whole table on one device
    ROW_WISE = "row_wise"  # even row blocks over k devices; partial sums reduced
    COLUMN_WISE = "column_wise"  # column slices over k devices; slices concatenated
    TABLE_ROW_WISE = "table_row_wise"  # row blocks over the devices of one host
    REPLICATED = "replicated"  # a full copy on every device; the batch is split


class Placement(enum.Enum):
    DEVICE = "device"  # device memory (HBM; a CPU shard's share of DDR)
    HOST = "host"  # host memory read by the device (UVM)
    HOST_CACHED = "host_cached"  # host memory with a device-memory cache


class ComputeDevice(enum.Enum):
    CPU = "cpu"
    CUDA = "cuda"


class MemoryTier(enum.Enum):
    """Where a CPU shard's weights are expected to live while serving from a mapped artifact."""

    RESIDENT = "resident"  # in RAM: its pages stay in the page cache (device memory on CUDA)
    PAGED = "paged"  # in the mapped file: pages are read from disk when touched, and may be evicted


@dataclass(frozen=True)
class Topology:
    """The devices of one serving host: how many, what memory, what bandwidths."""

    world_size: int
    compute_device: ComputeDevice = ComputeDevice.CUDA
    device_memory: tuple[int, ...] = ()  # per device; () -> the kind's default for every device
    host_memory: int = 0  # host DDR available to HOST/HOST_CACHED placements; 0 -> default
    local_world_size: int = 0  # devices per host; 0 -> world_size (one host)
    hbm_bandwidth: float = 0.0  # device memory read bandwidth; 0 -> default
    ddr_bandwidth: float = 0.0
    host_to_device_bandwidth: float = 0.0
    intra_host_bandwidth: float = 0.0
    # CPU only: bytes of weights the host may keep in mapped (file-backed) files beyond its RAM, which is the
    # resident budget (``device_memory``, each CPU device's share). None: unbounded; 0: no mapped tier (every
    # table must fit in RAM, as with weights inside model.pt)
    mapped_capacity: int | None = None
    # where the compute device and memory came from (flags, this host, a kind's default); not part of the JSON
    # form: the planner copies it into the plan's stats
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise PlanError(
                f"world_size must be a positive int, got {self.world_size!r}", PlanErrorKind.INVALID_TOPOLOGY
            )
        device = (
            ComputeDevice(self.compute_device)
            if not isinstance(self.compute_device, ComputeDevice)
            else self.compute_device
        )
        object.__setattr__(self, "compute_device", device)
        cuda = device == ComputeDevice.CUDA
        memory = tuple(int(m) for m in self.device_memory)
        if not memory:
            memory, where = _default_device_memory(cuda, self.world_size)
            object.__setattr__(self, "source", "; ".join(filter(None, (self.source, where))))
        elif len(memory) == 1:
            memory = memory * self.world_size
        if len(memory) != self.world_size or any(m < 0 for m in memory):
            raise PlanError(
                f"device_memory needs one non-negative size per device ({self.world_size}), got {len(memory)}",
                PlanErrorKind.INVALID_TOPOLOGY,
            )
        object.__setattr__(self, "device_memory", memory)
        defaults = {
            "host_memory": C.CUDA_HOST_MEMORY if cuda else 0,
            "local_world_size": self.world_size,
            "hbm_bandwidth": C.CUDA_HBM_BANDWIDTH if cuda else C.CPU_DDR_BANDWIDTH_PER_CORE,
            "ddr_bandwidth": C.CUDA_DDR_BANDWIDTH if cuda else C.CPU_DDR_BANDWIDTH_PER_CORE,
            "host_to_device_bandwidth": C.CUDA_HOST_TO_DEVICE_BANDWIDTH if cuda else C.CPU_INTRA_HOST_BANDWIDTH,
            "intra_host_bandwidth": C.CUDA_INTRA_HOST_BANDWIDTH if cuda else C.CPU_INTRA_HOST_BANDWIDTH,
        }
        for name, fallback in defaults.items():
            value = getattr(self, name)
            if value < 0:
                raise PlanError(f"topology {name} must be >= 0, got {value}", PlanErrorKind.INVALID_TOPOLOGY)
            if not value:
                object.__setattr__(self, name, type(fallback)(fallback))
        if self.mapped_capacity is not None and (
            isinstance(self.mapped_capacity, bool)
            or not isinstance(self.mapped_capacity, int)
            or self.mapped_capacity < 0
        ):
            raise PlanError(
                f"mapped_capacity must be None (unbounded) or bytes >= 0, got {self.mapped_capacity!r}",
                PlanErrorKind.INVALID_TOPOLOGY,
            )
        if self.world_size % self.local_world_size != 0:
            raise PlanError(
                f"world_size {self.world_size} is not a multiple of local_world_size {self.local_world_size}",
                PlanErrorKind.INVALID_TOPOLOGY,
            )

    @property
    def is_cuda(self) -> bool:
        return self.compute_device == ComputeDevice.CUDA

    @property
    def cpu_views(self) -> bool:
        """Whether the devices are CPU cores of one host, sharing one memory: a table's replicas and its row- and
        column-wise shards are then views of one stored copy of the table (``infer.shard.builder.cpu_views``),
        so the table costs one copy however it is split."""
        return not self.is_cuda and self.local_world_size >= self.world_size

    @property
    def pages_weights(self) -> bool:
        """Whether tables beyond the resident budget may be served paged from mapped files (CPU only)."""
        return not self.is_cuda and self.mapped_capacity != 0

    @property
    def row_alignment(self) -> int:
        return C.CUDA_ROW_ALIGNMENT if self.is_cuda else C.CPU_ROW_ALIGNMENT

    def device_name(self, rank: int) -> str:
        return f"cuda:{rank % self.local_world_size}" if self.is_cuda else f"cpu:{rank}"

    def with_device_memory(self, memory: Sequence[int]) -> Topology:
        data = self.to_dict()
        data["device_memory"] = list(memory)
        return Topology.from_dict(data)

    @classmethod
    def detect(
        cls,
        world_size: int | None = None,
        compute_device: ComputeDevice | str | None = None,
        device_memory: int | None = None,
        host_memory: int = 0,
        local_world_size: int = 0,
        mapped_capacity: tuple[int | None, str] | None = None,
    ) -> Topology:
        """This host, unless told otherwise: CUDA when it has a CUDA device (each device's own memory), else CPU
        (one shard per core; the host's RAM divided among them). ``mapped_capacity`` is (bytes or None for
        unbounded, where the figure came from). ``source`` says where each number came from."""
        import torch

        cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if compute_device is None:
            device = ComputeDevice.CUDA if cuda_count else ComputeDevice.CPU
            told = f"{device.value} (this host {'has CUDA' if cuda_count else 'has no CUDA device'})"
        else:
            device = ComputeDevice(compute_device)
            told = f"{device.value} (given)"
        cuda = device == ComputeDevice.CUDA
        size = world_size or (cuda_count if cuda and cuda_count else (os.cpu_count() or 1))
        notes = [f"compute device {told}"]
        memory: tuple[int, ...] = ()
        if device_memory:
            memory = (int(device_memory),) * size
            notes.append(f"device memory {_gb(device_memory)} each (given)")
        elif cuda and cuda_count:
            measured = tuple(torch.cuda.get_device_properties(i).total_memory for i in range(cuda_count))
            memory = (measured * size)[:size]
            notes.append(f"device memory {', '.join(_gb(m) for m in memory)} (this host's CUDA devices)")
        if cuda and not host_memory:
            host_memory, where = host_ram_bytes()
            notes.append(f"host memory {_gb(host_memory)} ({where})")
        mapped, mapped_where = mapped_capacity if mapped_capacity is not None else (None, "")
        if not cuda:
            notes.append(
                f"mapped capacity {'unbounded' if mapped is None else _gb(mapped)} ({mapped_where or 'default'})"
            )
        return cls(
            size,
            device,
            memory,
            host_memory=host_memory,
            local_world_size=local_world_size,
            mapped_capacity=mapped,
            source="; ".join(notes),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "compute_device": self.compute_device.value,
            "device_memory": list(self.device_memory),
            "host_memory": self.host_memory,
            "local_world_size": self.local_world_size,
            "hbm_bandwidth": self.hbm_bandwidth,
            "ddr_bandwidth": self.ddr_bandwidth,
            "host_to_device_bandwidth": self.host_to_device_bandwidth,
            "intra_host_bandwidth": self.intra_host_bandwidth,
            "mapped_capacity": self.mapped_capacity,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Topology:
        values = dict(data)
        values["compute_device"] = ComputeDevice(values.get("compute_device", "cuda"))
        values["device_memory"] = tuple(values.get("device_memory", ()))
        return cls(**values)


def require_devices_here(topology: Topology, source: str) -> None:
    """Building a model for ``topology`` needs its devices on this host: a CUDA topology on a host with fewer
    CUDA devices is a ``PlanError(kind=INVALID_TOPOLOGY)`` naming the devices and the fix."""
    if not topology.is_cuda:
        return
    import torch

    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if available >= topology.local_world_size:
        return
    devices = list(dict.fromkeys(topology.device_name(rank) for rank in range(topology.world_size)))
    here = f"{available} CUDA device(s)" if available else "no CUDA device"
    raise PlanError(
        f"{source} places tables on {devices}, but this host has {here}; re-plan for this host's CPU "
        "(`embserve plan ... --compute-device cpu`, or `--device cpu`), or export on a host with those devices "
        "(the CUDA artifact can then be loaded on CPU with `embserve run --device-map cuda:0=cpu,...`)",
        PlanErrorKind.INVALID_TOPOLOGY,
    )


def host_ram_bytes() -> tuple[int, str]:
    """This host's RAM and where the figure came from: MemTotal in /proc/meminfo, else os.sysconf, else the
    CPU default (``constants.CPU_HOST_MEMORY``). Total, not available: a plan should not change with the load."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024, "this host's RAM: MemTotal in /proc/meminfo"
    except (OSError, ValueError, IndexError):
        pass
    try:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        if pages > 0 and page_size > 0:
            return pages * page_size, "this host's RAM: os.sysconf"
    except (OSError, ValueError, AttributeError):
        pass
    return C.CPU_HOST_MEMORY, f"assumed {_gb(C.CPU_HOST_MEMORY)}: this host's RAM could not be read"


def free_disk_bytes(path: str | os.PathLike[str]) -> tuple[int, str]:
    """Free bytes on the file system that holds ``path`` (or its nearest existing parent), and where the figure
    came from: the default mapped capacity of a CPU plan whose artifact will be written there."""
    import shutil
    from pathlib import Path

    folder = Path(path).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    return free, f"free disk of {str(folder)!r}"


def _default_device_memory(cuda: bool, world_size: int) -> tuple[tuple[int, ...], str]:
    """Memory per device when none is given: a CUDA device of the kind's size (the target host's GPUs are not
    this host's: ``Topology.detect`` measures them), a CPU device its share of this host's RAM."""
    if cuda:
        return (C.CUDA_DEVICE_MEMORY,) * world_size, (
            f"device memory {_gb(C.CUDA_DEVICE_MEMORY)} each (the default for cuda; give the real size)"
        )
    ram, where = host_ram_bytes()
    share = ram // world_size
    return (share,) * world_size, f"device memory {_gb(share)} each = {_gb(ram)} ({where}) / {world_size} CPU devices"


def _gb(size: int) -> str:
    return f"{size / C.GB:.2f} GiB"


@dataclass(frozen=True)
class ParameterConstraints:
    """What the planner may do with one table, and what its traffic looks like."""

    sharding_types: tuple[ShardingType, ...] = tuple(ShardingType)
    placements: tuple[Placement, ...] = (Placement.DEVICE, Placement.HOST, Placement.HOST_CACHED)
    pooling_factors: tuple[float, ...] = (C.DEFAULT_POOLING_FACTOR,)  # mean ids per bag, per feature
    batch_size: int | None = None  # None -> the planner's batch size
    min_shards: int = 1
    max_shards: int | None = None
    data_type: DataType | None = None  # None -> the table's data_type (or the precision planner's choice)
    # the precision planner's floor: choose no less precise a type than this (fp32 > fp16 > int8 > int4 > int2)
    min_data_type: DataType | None = None
    cache_load_factor: float = C.DEFAULT_CACHE_LOAD_FACTOR
    min_column_shard: int = C.DEFAULT_MIN_COLUMN_SHARD

    def __post_init__(self) -> None:
        object.__setattr__(self, "sharding_types", tuple(ShardingType(s) for s in self.sharding_types))
        object.__setattr__(self, "placements", tuple(Placement(p) for p in self.placements))
        object.__setattr__(self, "pooling_factors", tuple(float(p) for p in self.pooling_factors))
        if self.data_type is not None:
            object.__setattr__(self, "data_type", DataType.parse(self.data_type))
        if self.min_data_type is not None:
            object.__setattr__(self, "min_data_type", DataType.parse(self.min_data_type))
        problems = []
        if not self.sharding_types:
            problems.append("sharding_types is empty")
        if not self.placements:
            problems.append("placements is empty")
        if not self.pooling_factors or any(p < 0 for p in self.pooling_factors):
            problems.append("pooling_factors must be non-negative, one per feature")
        if self.batch_size is not None and self.batch_size < 1:
            problems.append(f"batch_size {self.batch_size} < 1")
        if self.min_shards < 1 or (self.max_shards is not None and self.max_shards < self.min_shards):
            problems.append(f"shard counts min={self.min_shards} max={self.max_shards} are inconsistent")
        if not 0 < self.cache_load_factor <= 1:
            problems.append(f"cache_load_factor {self.cache_load_factor} is not in (0, 1]")
        if self.min_column_shard < 4 or self.min_column_shard % 4:
            problems.append(f"min_column_shard {self.min_column_shard} must be a positive multiple of 4")
        if problems:
            raise PlanError("invalid constraints: " + "; ".join(problems), PlanErrorKind.INVALID_CONSTRAINT)

    def pooling_factor(self, table: TableConfig) -> float:
        """Expected ids per example over all of the table's features."""
        factors = self.pooling_factors
        if len(factors) == 1:
            return factors[0] * len(table.feature_names)
        if len(factors) != len(table.feature_names):
            raise PlanError(
                f"table {table.name!r}: {len(factors)} pooling factors for {len(table.feature_names)} features",
                PlanErrorKind.INVALID_CONSTRAINT,
            )
        return sum(factors)

    def to_dict(self) -> dict[str, Any]:
        return {
            "sharding_types": [s.value for s in self.sharding_types],
            "placements": [p.value for p in self.placements],
            "pooling_factors": list(self.pooling_factors),
            "batch_size": self.batch_size,
            "min_shards": self.min_shards,
            "max_shards": self.max_shards,
            "data_type": self.data_type.value if self.data_type else None,
            "min_data_type": self.min_data_type.value if self.min_data_type else None,
            "cache_load_factor": self.cache_load_factor,
            "min_column_shard": self.min_column_shard,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], table: str = "?") -> ParameterConstraints:
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise PlanError(
                f"constraints for table {table!r}: unknown keys {sorted(unknown)}; known keys are {sorted(known)}",
                PlanErrorKind.INVALID_CONSTRAINT,
            )
        try:
            return cls(**dict(data))
        except (ValueError, TypeError) as err:
            raise PlanError(f"constraints for table {table!r}: {err}", PlanErrorKind.INVALID_CONSTRAINT) from None


def load_constraints(path: str | os.PathLike[str], spec: ModelSpec) -> dict[str, ParameterConstraints]:
    """Read ``{table_name: {constraint: value}}`` JSON; unknown table names are an error."""
    try:
        with open(path) as handle:
            data = json.load(handle)
    except (OSError, json.JSONDecodeError) as err:
        raise PlanError(f"cannot read constraints {str(path)!r}: {err}", PlanErrorKind.INVALID_CONSTRAINT) from None
    if not isinstance(data, dict):
        raise PlanError("a constraints file is a JSON object {table_name: {...}}", PlanErrorKind.INVALID_CONSTRAINT)
    names = {t.name for t in spec.tables}
    unknown = sorted(set(data) - names)
    if unknown:
        raise PlanError(
            f"constraints name unknown table(s) {unknown}; the spec has {sorted(names)}",
            PlanErrorKind.INVALID_CONSTRAINT,
        )
    return {name: ParameterConstraints.from_dict(value, name) for name, value in data.items()}


@dataclass(frozen=True)
class Storage:
    """Bytes a shard needs in device memory and in host memory."""

    device: int = 0
    host: int = 0

    def __add__(self, other: Storage) -> Storage:
        return Storage(self.device + other.device, self.host + other.host)


@dataclass(frozen=True)
class ShardSpec:
    """One shard of a sharding option, before it is given a device."""

    row_offset: int
    num_rows: int
    col_offset: int
    num_cols: int
    storage: Storage
    cost: float  # estimated seconds per batch on its device
    input_bytes: int = 0  # ids + offsets shipped to the shard per batch
    output_bytes: int = 0  # pooled fp32 outputs shipped back per batch


@dataclass(frozen=True)
class ShardingOption:
    """One way to shard one table: the type, the placement and every shard's size, storage and cost."""

    table: str
    sharding_type: ShardingType
    placement: Placement
    data_type: DataType
    shards: tuple[ShardSpec, ...]

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    @property
    def total_cost(self) -> float:
        return sum(s.cost for s in self.shards)

    @property
    def max_shard_cost(self) -> float:
        return max(s.cost for s in self.shards)

    @property
    def total_storage(self) -> Storage:
        total = Storage()
        for shard in self.shards:
            total = total + shard.storage
        return total


# One option per table, in the spec's table order.
Proposal = tuple[ShardingOption, ...]


@dataclass(frozen=True)
class ShardContext:
    """Everything an estimator needs to price one shard."""

    table: TableConfig
    data_type: DataType
    constraints: ParameterConstraints
    topology: Topology
    sharding_type: ShardingType
    placement: Placement
    num_rows: int
    num_cols: int
    num_shards: int  # shards of this option (row blocks, column slices or replicas)
    batch_size: int  # examples this shard serves (a replica serves its share of the batch)
    pooling_factor: float  # ids per example over the table's features


@dataclass(frozen=True)
class PartitionResult:
    """A proposal placed on devices: which devices each option's shards went to, and the loads."""

    proposal: Proposal
    devices: tuple[tuple[int, ...], ...]  # per option, the device of each shard
    device_costs: tuple[float, ...]
    device_storage: tuple[Storage, ...]

    @property
    def bottleneck(self) -> float:
        return max(self.device_costs)


@dataclass(frozen=True)
class Shard:
    """A placed shard of a plan."""

    device: int
    row_offset: int
    num_rows: int
    col_offset: int
    num_cols: int
    device_bytes: int
    host_bytes: int
    cost: float
    input_bytes: int = 0
    output_bytes: int = 0
    tier: MemoryTier = MemoryTier.RESIDENT

    def __post_init__(self) -> None:
        object.__setattr__(self, "tier", MemoryTier(self.tier))

    @property
    def weight_bytes(self) -> int:
        """The shard's weights: its device bytes less the batch's input and output buffers."""
        return self.device_bytes - self.input_bytes - self.output_bytes


@dataclass(frozen=True)
class TablePlan:
    table: str
    sharding_type: ShardingType
    placement: Placement
    data_type: DataType
    shards: tuple[Shard, ...]


@dataclass(frozen=True)
class ShardingPlan:
    """Where every table goes. Same inputs give the same plan; JSON round-trips exactly."""

    tables: tuple[TablePlan, ...]
    topology: Topology
    batch_size: int
    bottleneck_cost: float
    lower_bound: float
    is_inference: bool = True
    planner: Mapping[str, Any] = field(default_factory=dict, compare=False)
    # multi-host: every host's shards are also held by the next replicas - 1 hosts (``infer.planner.replicas``)
    replicas: int = 1

    def table(self, name: str) -> TablePlan:
        for plan in self.tables:
            if plan.table == name:
                return plan
        raise PlanError(f"the plan has no table {name!r}", PlanErrorKind.INVALID_PLAN)

    def device_costs(self) -> list[float]:
        costs = [0.0] * self.topology.world_size
        for plan in self.tables:
            for shard in plan.shards:
                costs[shard.device] += shard.cost
        return costs

    def device_storage(self) -> list[Storage]:
        storage = [Storage()] * self.topology.world_size
        for plan in self.tables:
            for shard in plan.shards:
                storage[shard.device] = storage[shard.device] + Storage(shard.device_bytes, shard.host_bytes)
        return storage

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "embserve-plan",
            "version": 1,
            "is_inference": self.is_inference,
            "batch_size": self.batch_size,
            "bottleneck_cost": self.bottleneck_cost,
            "lower_bound": self.lower_bound,
            "topology": self.topology.to_dict(),
            "planner": dict(self.planner),
            **({"replicas": self.replicas} if self.replicas > 1 else {}),
            "tables": [
                {
                    "table": t.table,
                    "sharding_type": t.sharding_type.value,
                    "placement": t.placement.value,
                    "data_type": t.data_type.value,
                    "shards": [
                        {
                            "device": s.device,
                            "row_offset": s.row_offset,
                            "num_rows": s.num_rows,
                            "col_offset": s.col_offset,
                            "num_cols": s.num_cols,
                            "device_bytes": s.device_bytes,
                            "host_bytes": s.host_bytes,
                            "cost": s.cost,
                            "input_bytes": s.input_bytes,
                            "output_bytes": s.output_bytes,
                            "tier": s.tier.value,
                        }
                        for s in t.shards
                    ],
                }
                for t in self.tables
            ],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ShardingPlan:
        try:
            if data.get("format") != "embserve-plan" or data.get("version") != 1:
                raise PlanError("not an embserve plan (format 'embserve-plan', version 1)", PlanErrorKind.INVALID_PLAN)
            tables = tuple(
                TablePlan(
                    t["table"],
                    ShardingType(t["sharding_type"]),
                    Placement(t["placement"]),
                    DataType(t["data_type"]),
                    tuple(Shard(**s) for s in t["shards"]),
                )
                for t in data["tables"]
            )
            return cls(
                tables,
                Topology.from_dict(data["topology"]),
                int(data["batch_size"]),
                float(data["bottleneck_cost"]),
                float(data["lower_bound"]),
                bool(data["is_inference"]),
                dict(data.get("planner", {})),
                int(data.get("replicas", 1)),
            )
        except PlanError:
            raise
        except (KeyError, TypeError, ValueError) as err:
            raise PlanError(f"malformed plan: {type(err).__name__}: {err}", PlanErrorKind.INVALID_PLAN) from None

    @classmethod
    def from_json(cls, text: str) -> ShardingPlan:
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as err:
            raise PlanError(f"plan is not valid JSON: {err}", PlanErrorKind.INVALID_PLAN) from None


# ---------------------------------------------------------------------------- stage interfaces
class StorageEstimator(Protocol):
    def storage(self, ctx: ShardContext) -> Storage: ...


class PerfEstimator(Protocol):
    def cost(self, ctx: ShardContext) -> float: ...


class Enumerator(Protocol):
    def enumerate(
        self, spec: ModelSpec, topology: Topology, constraints: Mapping[str, ParameterConstraints]
    ) -> dict[str, list[ShardingOption]]:
        """Every allowed option per table name, with storage and cost filled in."""
        ...


class StorageReservation(Protocol):
    def reserve(self, topology: Topology, spec: ModelSpec) -> Topology:
        """The topology with the memory the plan may use (caps reduced by what is held back)."""
        ...


class Proposer(Protocol):
    def load(self, options: Mapping[str, Sequence[ShardingOption]], topology: Topology) -> None: ...

    def propose(self) -> Proposal | None:
        """The next proposal to try, or None when this proposer has nothing more."""
        ...

    def feedback(self, proposal: Proposal, result: PartitionResult | None) -> None:
        """How the last proposal partitioned (None: it did not fit)."""
        ...


class Partitioner(Protocol):
    def partition(self, proposal: Proposal, topology: Topology) -> PartitionResult:
        """Place every shard on a device; raise PlanError(INSUFFICIENT_MEMORY) when it cannot fit."""
        ...
