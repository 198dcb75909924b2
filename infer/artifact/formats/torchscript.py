"""The TorchScript back-end: ``model.pt`` (and a multi-host artifact's ``hosts/<h>/model.pt``) written by
``torch.jit.script`` + save, read by ``torch.jit.load``; a mapped artifact's kernels get their weights from the
weight files after the structure loads, and every kernel is checked against the manifest before any lookup."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from infer.artifact.kernel_attributes import PLACEMENT_HOST
from infer.artifact.kernels import Kernel, check_kernel, kernel_holders, model_tbes
from infer.artifact.manifest import (
    MANIFEST_FILE,
    MODEL_FILE,
    PLAN_FILE,
    FileEntry,
    Manifest,
    RemapEntry,
    remap_sha256,
)
from infer.artifact.mapped import attach_weights, check_no_saved_weights, mark_weights
from infer.artifact.pool_exit import drain_at_exit
from infer.artifact.structures import StructureCache
from infer.config import ModelSpec
from infer.errors import ArtifactError, ArtifactErrorKind, ConfigError
from infer.planner.types import ShardingPlan

MODEL = ArtifactErrorKind.MODEL


def script_model(model: torch.nn.Module) -> torch.jit.ScriptModule:
    drain_at_exit()  # a scripted model's forks must be over before Python finalizes (infer.artifact.pool_exit)
    try:
        return torch.jit.script(model)
    except Exception as err:  # noqa: BLE001 - TorchScript reports many error types
        raise ConfigError(f"the model (or its dense_arch) cannot be scripted with torch.jit.script: {err}") from None


def save_structure(
    staging: Path, scripted: torch.jit.ScriptModule, weight_files: list[FileEntry], plan: ShardingPlan | None
) -> list[FileEntry]:
    """Save ``model.pt`` (and ``plan.json``) into ``staging``; returns the artifact's file entries so far, in
    manifest order: the model, its weight files, the plan."""
    scripted.save(str(staging / MODEL_FILE))
    files = [FileEntry.of(staging, MODEL_FILE), *weight_files]
    if plan is not None:
        (staging / PLAN_FILE).write_text(plan.to_json(), encoding="utf-8")
        files.append(FileEntry.of(staging, PLAN_FILE))
    return files


def read_model(
    path: Path,
    devices: Sequence[str],
    mapping: Mapping[str, str],
    explain_failure: Callable[[], None] | None = None,
    structures: StructureCache | None = None,
) -> torch.jit.ScriptModule:
    """``torch.jit.load`` of ``path`` onto the mapped devices, in eval mode. A failed load first calls
    ``explain_failure`` (waiting for the checksums: a corrupted file explains it better than TorchScript).
    ``structures``: a cache of model structures (no tables inside) handing out a copy of an equal one loaded
    before, instead of loading it again (``infer.artifact.structures``)."""
    location = map_location(devices, mapping)
    drain_at_exit()  # a scripted model's forks must be over before Python finalizes (infer.artifact.pool_exit)
    try:
        if structures is not None:
            module = structures.load(path, location)
        else:
            module = torch.jit.load(str(path), map_location=location)
    except Exception as err:  # noqa: BLE001 - torch raises RuntimeError and others for a bad archive
        if explain_failure is not None:
            explain_failure()
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ArtifactError(
            f"{path} cannot be loaded by TorchScript: {first_line}", path=str(path), kind=MODEL
        ) from None
    module.eval()
    return module


def attach_mapped_weights(
    folder: Path,
    module: torch.jit.ScriptModule,
    manifest: Manifest,
    kernels: Sequence[Kernel] | None = None,
    model_file: str | None = None,
) -> None:
    """Hand every mapped kernel of a loaded model (of a mapped artifact) its buffer's view of its weight file;
    ``kernels``: the model's kernels in the manifest (default all; one host's for a host part), ``model_file``
    the file the model came from (default the manifest's): it must not carry the mapped weights itself."""
    if not manifest.mapped:
        return
    kernels = manifest.kernels if kernels is None else kernels
    try:
        tbes = model_tbes(module)
    except AttributeError:
        raise ArtifactError("the model has no embedding kernels where embserve puts them", kind=MODEL) from None
    if len(tbes) != len(kernels):
        raise ArtifactError(f"the model has {len(tbes)} kernels, {MANIFEST_FILE} lists {len(kernels)}", kind=MODEL)
    check_no_saved_weights(folder / (model_file or manifest.model_file), tbes, kernels)
    attach_weights(folder, tbes, kernels, manifest.file_bytes)
    mark_weights(module, attached=True)


def check_model_kernels(module: torch.jit.ScriptModule, kernels: Sequence[Kernel], source: Path) -> None:
    """Every TBE of the loaded model (read from ``source``) holds exactly what ``kernels`` (its kernels in the
    manifest) say, before any lookup."""
    holders = kernel_holders(module)
    if not all(hasattr(holder, "tbe") for holder in holders):
        raise ArtifactError(f"{source} has no embedding kernels where embserve puts them", kind=MODEL)
    if len(holders) != len(kernels):
        raise ArtifactError(f"{source} has {len(holders)} kernels, {MANIFEST_FILE} lists {len(kernels)}", kind=MODEL)
    for index, (holder, kernel) in enumerate(zip(holders, kernels)):
        check_kernel(holder, kernel, index)


def check_block_remaps(
    module: torch.jit.ScriptModule,
    remaps: Sequence[RemapEntry],
    source: Path,
    spec: ModelSpec | None = None,
    plan: ShardingPlan | None = None,
    layouts: Sequence[Any] | None = None,
) -> None:
    """The loaded model's id remaps are the manifest's (``block_remaps``: tables, rows, sha256) and each sends its
    table's ids one to one onto the blocks' rows (the blocks as ``spec``, the manifest's, states them), before any
    lookup; ``ArtifactError(kind=MODEL)`` naming the table. A sharded model (``plan``) holds each block table's
    remap on the one device that holds the table (table-wise), and every device's block split is the one its
    features imply (``infer.shard.builder.device_layouts``, or the given ``layouts``: one host's part of a multi-host
    plan, whose ``remaps`` are then the block tables that host holds)."""
    from infer.modules.collection import BlockSplit, remap_error, stored_remaps

    holders = kernel_holders(module) or [module.embeddings]
    sharded = hasattr(module.embeddings, "shards")
    splits: list[BlockSplit | None] = [None] * len(holders)
    if spec is not None and plan is not None:
        from infer.shard.builder import device_layouts

        splits = [layout.split for layout in (device_layouts(spec, plan) if layouts is None else layouts)]
    elif spec is not None:
        splits = [BlockSplit.of(spec)]
    held: dict[str, list[torch.Tensor]] = {}
    twice = False
    for holder in holders:
        names = list(getattr(holder, "block_table_names", []))
        if names and not hasattr(holder, "block_bounds"):
            # exported before the remap held positions (2026-11-27): its remap is in the earlier encoding
            raise ArtifactError(
                f"{source} holds precision blocks of tables {names} in the id remap form of an earlier embserve (no "
                "block_bounds); re-export the model with this version",
                path=str(source),
                kind=ArtifactErrorKind.MODEL,
            )
        for name, copies in zip(names, stored_remaps(holder) if names else []):
            twice = twice or name in held
            held[name] = list(copies)
    listed = [r.table for r in remaps]
    if set(held) != set(listed) or twice or len(held) != len(listed):
        raise ArtifactError(
            f"{source} holds id remaps of tables {list(held)}, {MANIFEST_FILE} lists {listed}; re-export the model",
            path=str(source),
            kind=ArtifactErrorKind.MODEL,
        )
    for index, (holder, split) in enumerate(zip(holders, splits)):
        # the ranges the remaps are read through first, as the C++ loader; a device of a sharded model exported
        # before block tables could be sharded has no split (it holds none)
        checked = hasattr(holder, "has_blocks") if sharded else bool(getattr(holder, "block_table_names", []))
        split_error = split.mismatch(holder) if split is not None and checked else None
        if split_error is not None:
            where = f" of kernel {index} (embeddings.shards.{index})" if sharded else ""
            raise ArtifactError(
                f"{source}: the block split{where}'s {split_error} disagrees with the manifest's tables; the model "
                "file is corrupted, re-export it",
                path=str(source),
                kind=ArtifactErrorKind.MODEL,
            )
    for entry in remaps:
        table = spec.table(entry.table) if spec is not None else None
        blocks = table.blocks if table is not None else ()
        starts = [sum(b.rows for b in blocks[:j]) for j in range(len(blocks))] or [0]
        problem = None if held[entry.table] else "is missing"
        for remap in held[entry.table]:  # a table read by several features holds its remap once per feature
            problem = problem or remap_error(remap, entry.rows, starts)
            if problem is None and remap.dtype != torch.int32:
                problem = f"is {remap.dtype}, not int32"
            if problem is None and remap_sha256(remap) != entry.sha256:
                problem = f"differs from the one {MANIFEST_FILE} lists (its sha256)"
        if problem is not None:
            raise ArtifactError(
                f"{source}: the id remap of table {entry.table!r} {problem}; the artifact is corrupted, re-export it",
                path=str(source),
                kind=ArtifactErrorKind.MODEL,
            )


def map_location(devices: Sequence[str], mapping: Mapping[str, str]) -> str | None:
    """``torch.jit.load`` moves every tensor to one device or none: the map must agree with that."""
    if not mapping:
        return None
    targets = sorted({mapping.get(d, d) for d in devices})
    if targets == sorted(set(devices)):
        return None
    if len(targets) != 1:
        raise ArtifactError(
            f"a device map must send every device to one device (TorchScript loads to one); got {dict(mapping)}",
            kind=MODEL,
        )
    return targets[0]


def remap_shard_devices(module: torch.jit.ScriptModule, mapping: Mapping[str, str]) -> None:
    """Point a sharded model's per-device routing at the mapped devices."""
    if not mapping:
        return
    embeddings = module.embeddings
    if hasattr(embeddings, "output_device"):
        embeddings.output_device = mapping.get(embeddings.output_device, embeddings.output_device)
    if hasattr(embeddings, "shards"):
        for shard in embeddings.shards.children():  # a loaded ModuleList has no Python __iter__ (torch 2.11)
            shard.device = mapping.get(shard.device, shard.device)
            _remap_kernel(shard, mapping)
    else:
        _remap_kernel(embeddings, mapping)  # the unsharded collection runs its kernel itself


def _remap_kernel(holder: torch.jit.ScriptModule, mapping: Mapping[str, str]) -> None:
    """Point a kernel's runner at its mapped device. A CUDA kernel mapped to the CPU keeps its rows (row alignment 16,
    which fbgemm's CPU op honours) but must say they are host memory: the CPU op refuses DEVICE placements
    ("Expected placement != PlacementType::DEVICE", seen on an H200 loading a CUDA artifact with cuda:0=cpu)."""
    if not hasattr(holder, "kernel_device"):
        return
    source = holder.kernel_device
    target = mapping.get(source, source)
    if torch.device(target).type == "cpu" and torch.device(source).type != "cpu":
        holder.tbe.weights_placements.fill_(PLACEMENT_HOST)
    holder.kernel_device = target
