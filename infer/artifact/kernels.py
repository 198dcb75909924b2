"""The kernels of an exported model: what each TBE holds, recorded in the manifest at export and checked
against the loaded model's buffers before its first lookup.

A TBE's small metadata tensors (offsets, dims, row counts, types) steer raw memory reads; a byte flipped
in them (and the checksum rewritten) would otherwise crash the process at the first lookup. The loader
derives what every kernel must hold from the manifest's tables (and the plan, when sharded), compares
that with the manifest's ``kernels``, then compares each loaded TBE's tensors with it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from infer.artifact.kernel_attributes import attribute_error, check_attributes, kernel_attributes
from infer.artifact.kernel_types import Kernel, KernelTable
from infer.config import DataType, ModelSpec
from infer.errors import ArtifactError, ArtifactErrorKind
from infer.modules.collection import kernel_features, tbe_tables
from infer.modules.sharded import DeviceShards, device_buckets, row_buckets
from infer.planner.types import ShardingPlan
from infer.quant.rowwise import CPU_ROW_ALIGNMENT, CUDA_ROW_ALIGNMENT, TABLE_ALIGNMENT, table_bytes
from infer.shard.builder import SharedStorage, device_layouts, plan_devices, shared_cpu_storage


def _alignment(device: str) -> int:
    return CPU_ROW_ALIGNMENT if device == "cpu" else CUDA_ROW_ALIGNMENT


def expected_kernels(spec: ModelSpec, plan: ShardingPlan | None, devices: tuple[str, ...]) -> list[Kernel]:
    """The kernels ``spec`` (sharded by ``plan``) is built with: one for an unsharded model, else one per
    device of the plan that holds a shard."""
    if plan is None:
        device = devices[0]
        index = {t.name: i for i, t in enumerate(spec.tables)}
        tables = tuple(KernelTable(b.rows, t.embedding_dim, b.data_type) for t in spec.tables for b in t.stored_blocks)
        kernel_tables = tbe_tables(spec)
        features = spec.features
        feature_table_map = tuple(kernel_tables[index[features[f].table]][j] for f, j in kernel_features(spec))
        return [Kernel(0, device, _alignment(device), tables, feature_table_map)]
    names = plan_devices(plan)
    layouts = device_layouts(spec, plan)
    placed = shared_cpu_storage(plan, layouts, names, [t.name for t in spec.tables])
    shared: list[SharedStorage | None] = list(placed) if placed is not None else [None] * len(layouts)
    return [
        Kernel(
            layout.rank,
            names[layout.rank],
            _alignment(names[layout.rank]),
            tuple(KernelTable(rows, cols, dtype) for _, rows, cols, dtype in layout.tables),
            layout.feature_table_map,
            storage,
        )
        for layout, storage in zip(layouts, shared)
    ]


def kernels_of(model: Any, plan: ShardingPlan | None) -> list[Kernel]:
    """The kernels of an eager exported model, read from its TBEs (what export records)."""
    tbes = model_tbes(model)
    ranks = [k.rank for k in expected_kernels(model.spec, plan, ("cpu",))]
    if len(ranks) != len(tbes):  # pragma: no cover - shard_model builds one TBE per device holding shards
        raise ArtifactError(f"the model has {len(tbes)} kernels but its plan places shards on {len(ranks)} devices")
    return kernels_from_tbes(ranks, tbes)


def kernels_from_tbes(ranks: list[int], tbes: list[Any]) -> list[Kernel]:
    """The kernels of eager TBEs serving plan ranks ``ranks`` (one each, in order)."""
    kernels = []
    buffers = [tbe.weights_host.data_ptr() for tbe in tbes if tbe.weights_host.numel() > 0]
    for rank, tbe in zip(ranks, tbes):
        tables = tuple(
            KernelTable(int(rows), int(dim), DataType(weight_type.name.lower()))
            for _, rows, dim, weight_type, _ in tbe.embedding_specs
        )
        device = str(tbe.current_device)
        kernel = Kernel(rank, device, int(tbe.row_alignment), tables, tuple(tbe.feature_table_map))
        offsets, total = kernel.table_offsets()
        physical = [int(offset) for offset in tbe.weights_physical_offsets]
        numel = int(tbe.weights_host.numel())
        if numel > 0 and (physical != offsets or numel != total or buffers.count(tbe.weights_host.data_ptr()) > 1):
            kernel = dataclasses.replace(kernel, shared=SharedStorage(numel, tuple(physical)))
        kernels.append(kernel)
    return kernels


def kernel_holders(module: Any) -> list[Any]:
    """The module around every kernel (the unsharded collection, or each device's shards), in kernel order;
    none for a model without TBE kernels (another backend)."""
    embeddings = getattr(module, "embeddings", None)
    if embeddings is None:
        return []
    if hasattr(embeddings, "shards"):
        return [shard for _, shard in embeddings.shards.named_children()]
    return [embeddings]


def model_tbes(module: Any) -> list[Any]:
    """The TBE of every kernel of a (scripted or eager) exported model, in kernel order."""
    return [holder.tbe for holder in kernel_holders(module)]


def block_remaps_of(module: Any) -> dict[str, Any]:
    """Each block table's stored id remap (``collection.stored_remaps``, its first feature's copy) as the kernel
    holder that holds the table keeps it: the unsharded collection, or the one device holding it table-wise."""
    from infer.modules.collection import stored_remaps

    remaps: dict[str, Any] = {}
    for holder in kernel_holders(module):
        if getattr(holder, "has_blocks", False):
            for name, held in zip(holder.block_table_names, stored_remaps(holder)):
                remaps[name] = held[0]
    return remaps


ROUTING = ("lf_feature", "lf_kind", "lf_lo", "lf_hi", "lf_out_col", "lf_dim")


def check_routing(module: Any, spec: ModelSpec, plan: ShardingPlan, layouts: list[Any] | None = None) -> None:
    """Each device of a sharded model reads the features, row blocks, replica slices and output columns the
    plan implies (``device_layouts``, or the given ``layouts``: one host's part of a multi-host plan), and the
    collection bucketizes row-wise ids as those imply; routing steers slicing and copies, so it is checked
    like the kernels."""
    layouts = device_layouts(spec, plan) if layouts is None else layouts
    holders = kernel_holders(module)
    for index, (holder, layout) in enumerate(zip(holders, layouts)):
        for position, name in enumerate(ROUTING):
            expected = [feature[position] for feature in layout.features]
            found = list(getattr(holder, name, []))
            if found != expected:
                raise _fail(index, f"its routing {name} is {found[:8]}, the plan implies {expected[:8]}")
        _check_derived_routing(holder, layout, spec, index)
    _check_row_buckets(module.embeddings, holders, spec, layouts)


# What DeviceShards derives from its routing (local columns, id limits, row blocks, copies): each steers a slice,
# a copy or an id check, so each must be what the plan's routing gives (as the C++ loader's check_routing).
DERIVED_ROUTING = (
    "lf_local_col",
    "lf_rows",
    "lf_name",
    "has_partials",
    "row_block_entries",
    "row_block_lo",
    "row_block_hi",
    "contiguous_input",
    "min_rows",
    "copy_src",
    "copy_dst",
    "copy_width",
)


def _check_derived_routing(holder: Any, layout: Any, spec: ModelSpec, index: int) -> None:
    """The holder's derived routing equals a fresh ``DeviceShards`` built from the plan's routing (no kernel)."""
    features = spec.features
    reference = DeviceShards(
        torch.nn.Module(),
        "cpu",
        [list(feature) for feature in layout.features],
        [f.num_embeddings for f in features],
        [f.name for f in features],
    )
    for name in DERIVED_ROUTING:
        found = getattr(holder, name, None)
        if (list(found) if isinstance(found, list) else found) != getattr(reference, name):
            raise _fail(index, f"its routing {name} disagrees with the plan")


def _check_row_buckets(collection: Any, holders: list[Any], spec: ModelSpec, layouts: list[Any]) -> None:
    """The collection's one-call row-wise bucketizing (``sharded.row_buckets``) is the one the routing implies."""
    if not holders:  # a host without shards
        return
    routings = [[tuple(feature[:4]) for feature in layout.features] for layout in layouts]
    buckets = None if bool(collection.partial) else row_buckets(routings, [f.num_embeddings for f in spec.features])
    features = list(buckets.features) if buckets is not None else []
    rows = [spec.features[f].num_embeddings for f in features]
    expected = {
        "bucketized": buckets is not None,
        "rw_features": features,
        "rw_positions": [list(p) for p in buckets.positions] if buckets is not None else [],
        "rw_block_sizes": list(buckets.block_sizes) if buckets is not None else [],
        "rw_even_blocks": buckets is not None and buckets.even,
        "rw_rows": rows,
        "rw_min_rows": min(rows) if rows else 0,
    }
    for name, value in expected.items():
        found = getattr(collection, name, None)
        if (list(found) if isinstance(found, list) else found) != value:
            raise ArtifactError(
                f"the model's row-wise bucketing {name} disagrees with the plan; the model file is corrupted, "
                "re-export it",
                kind=ArtifactErrorKind.MODEL,
            )
    for index, (holder, routing) in enumerate(zip(holders, routings)):
        bucket, count, slots = device_buckets(buckets, index, routing)
        if (holder.bucket, holder.rw_feature_count, list(holder.rw_slot)) != (bucket, count, slots):
            raise _fail(index, "its row-wise bucket routing disagrees with the plan")


def _fail(index: int, what: str) -> ArtifactError:
    return attribute_error(f"the model's kernel {index}", what)


def check_kernel(holder: Any, kernel: Kernel, index: int) -> None:
    """Raise ``ArtifactError(kind=MODEL)`` unless the kernel ``holder`` runs (``holder.tbe``) and the holder's own
    slicing attributes are exactly what ``kernel`` implies: every attribute of ``kernel_attributes.json``."""
    starts, total = kernel.table_offsets()
    for t, (start, table) in enumerate(zip(starts, kernel.tables)):
        if (
            start % TABLE_ALIGNMENT
            or start + table_bytes(table.rows, table.dim, table.data_type, kernel.row_alignment) > total
        ):
            raise _fail(index, f"table {t} at byte {start} does not fit the {total}-byte weight buffer")
    listed = kernel_attributes()
    check_attributes(holder.tbe, listed.tbe, kernel, f"the model's kernel {index}")
    if hasattr(holder, listed.holder_present_if):  # absent: exported before batch-parallel kernels (one call)
        check_attributes(holder, listed.holder, kernel, f"the model's kernel {index} (its runner)")


def check_device_kernels(kernels: Sequence[Kernel], mapping: Mapping[str, str], folder: object) -> None:
    """Refuse an artifact that would put tables on a GPU whose fbgemm kernel gets their data type wrong
    (``infer.modules.cuda_probe``), before any of it is read."""
    from infer.modules.cuda_probe import kernel_type_error

    for kernel in kernels:
        device = mapping.get(kernel.device, kernel.device)
        for data_type in sorted({t.data_type for t in kernel.tables}, key=lambda d: d.value):
            error = kernel_type_error(data_type, device)
            if error is not None:
                raise ArtifactError(
                    f"{folder}: the artifact places {data_type.value} tables on {device}, but {error}; re-export "
                    + "those tables as another type (e.g. int4), or load the model on the CPU "
                    + f"(device_map={{'{device}': 'cpu'}}; `embserve run --device-map {device}=cpu`)",
                    kind=ArtifactErrorKind.MODEL,
                )
