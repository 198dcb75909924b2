"""Multi-host artifacts: one folder, one manifest and plan, and one part per host (``hosts/<h>/model.pt``).

Each part holds only its host's shards (``infer.shard.hosts.shard_host``) and is checksummed in the shared
manifest; host 0's part also holds the dense part. A host verifies and loads the shared files and its own part
only, so its memory is its shards plus the fixed cost of a process with torch and fbgemm. Serving the parts
together is ``server.group.leader``'s job (torchrun, one process per host).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from infer.artifact.export import output_folder, staged
from infer.artifact.fbgemm_libs import load_operators
from infer.artifact.formats import torchscript
from infer.artifact.kernels import block_remaps_of, check_routing, kernels_from_tbes, model_tbes
from infer.artifact.load import verify_plan
from infer.artifact.manifest import (
    FORMAT_VERSION,
    MANIFEST_FILE,
    MAPPED_FORMAT_VERSION,
    PLAN_FILE,
    FileEntry,
    Manifest,
    RemapEntry,
)
from infer.artifact.mapped import (
    MAPPED,
    check_weights_format,
    mark_weights,
    place_weights,
    strip_weights,
    write_weight_files,
)
from infer.dense_layout import checked_layout
from infer.errors import ArtifactError, ArtifactErrorKind, ConfigError
from infer.planner.types import ShardingPlan
from infer.storage import checksums
from infer.storage.checksums import FULL
from infer.version import __version__

logger = logging.getLogger(__name__)

HOST_MODEL_FILE = "model.pt"
MODEL = ArtifactErrorKind.MODEL


def host_part_file(host: int) -> str:
    return f"hosts/{host}/{HOST_MODEL_FILE}"


def export_hosts(model: torch.nn.Module, out_dir: str | Path, plan: ShardingPlan, weights: str = MAPPED) -> Path:
    """Shard ``model`` (from ``infer.quantize``) by ``plan`` (a topology of several hosts: ``world_size`` =
    hosts x ``local_world_size``) and write a multi-host artifact to ``out_dir``: ``manifest.json``,
    ``plan.json`` and ``hosts/<h>/model.pt`` per host (``weights="mapped"``: and its CPU weight buffers in
    ``hosts/<h>/weights-<n>.bin``, as ``export``). Replaces an existing artifact like ``export``."""
    from infer.artifact.fbgemm_libs import REQUIRED_LIBRARIES, fbgemm_library_dir, fbgemm_version
    from infer.modules.collection import EmbserveModel
    from infer.shard.hosts import host_layouts, local_device, num_hosts, shard_host

    if not isinstance(model, EmbserveModel):
        raise ConfigError(f"export_hosts takes the model returned by infer.quantize(), got {type(model).__name__}")
    hosts = num_hosts(plan)
    if hosts < 2:
        raise ConfigError(
            f"the plan's topology is one host ({plan.topology.world_size} devices); export it with infer.export, "
            "or plan for several hosts (Topology(world_size=H*G, local_world_size=G))"
        )
    check_weights_format(weights)
    out_dir = output_folder(out_dir)
    dense_expects = checked_layout(model.spec, model.dense_arch if model.has_dense else None)
    started = time.monotonic()
    with staged(out_dir) as staging:
        files = []
        kernels = []
        remaps: dict[str, torch.Tensor] = {}
        for host in range(hosts):
            part = shard_host(model, plan, host)  # type: ignore[arg-type]
            remaps.update(block_remaps_of(part))  # each block table's, from the one host holding it
            try:
                scripted = torch.jit.script(part)
            except Exception as err:  # noqa: BLE001 - TorchScript reports many error types
                raise ConfigError(f"host {host}'s part cannot be scripted with torch.jit.script: {err}") from None
            (staging / "hosts" / str(host)).mkdir(parents=True)
            ranks = [layout.rank for layout in host_layouts(model.spec, plan, host)]
            host_kernels = kernels_from_tbes(ranks, model_tbes(part))
            weight_files = []
            if weights == MAPPED:
                embedded, host_kernels = host_kernels, place_weights(host_kernels, f"hosts/{host}/")
                names = write_weight_files(staging, model_tbes(part), embedded, host_kernels)
                weight_files = [FileEntry.of(staging, name, checksums.WEIGHTS_CHUNK_BYTES) for name in names]
                strip_weights(model_tbes(scripted), host_kernels)
                mark_weights(scripted, attached=False)
            scripted.save(str(staging / host_part_file(host)))
            files.append(FileEntry.of(staging, host_part_file(host)))
            files.extend(weight_files)
            kernels.extend(host_kernels)
            del part, scripted
        (staging / PLAN_FILE).write_text(plan.to_json(), encoding="utf-8")
        files.append(FileEntry.of(staging, PLAN_FILE))
        local = plan.topology.local_world_size
        manifest = Manifest(
            spec=model.spec,
            has_dense=bool(model.has_dense),
            devices=tuple(dict.fromkeys(local_device(plan, rank) for rank in range(local))),
            embserve_version=__version__,
            torch_version=torch.__version__,
            fbgemm_version=fbgemm_version(),
            fbgemm_libraries=REQUIRED_LIBRARIES,
            fbgemm_library_dir=str(fbgemm_library_dir()),
            files=tuple(files),
            model_file=host_part_file(0),
            plan_file=PLAN_FILE,
            world_size=plan.topology.world_size,
            kernels=tuple(kernels),
            host_parts=tuple(host_part_file(h) for h in range(hosts)),
            devices_per_host=local,
            dense_expects=dense_expects,
            format_version=MAPPED_FORMAT_VERSION if weights == MAPPED else FORMAT_VERSION,
            block_remaps=tuple(RemapEntry.of(name, remaps[name]) for name in model.spec.block_tables),
        )
        (staging / MANIFEST_FILE).write_text(manifest.to_json(), encoding="utf-8")
    logger.debug("exported %s (%d hosts) in %.1fs", out_dir, hosts, time.monotonic() - started)
    return out_dir


@dataclass(frozen=True)
class HostPart:
    """One host's loaded part: ``module(values, lengths, weights)`` is its partial output (see
    ``infer.shard.hosts``); on host 0 ``module.dense_arch`` is the dense part."""

    path: Path
    manifest: Manifest
    plan: ShardingPlan
    host: int
    module: torch.jit.ScriptModule

    @property
    def num_hosts(self) -> int:
        return self.manifest.num_hosts

    @property
    def part_bytes(self) -> int:
        return self.manifest.file(self.manifest.host_parts[self.host]).bytes


def load_host_part(
    artifact_dir: str | Path,
    host: int,
    device_map: Mapping[str, str] | None = None,
    intra_op_threads: int | None = None,
    verify: str = FULL,
) -> HostPart:
    """Verify the manifest, the plan and host ``host``'s part (sizes, sha256, kernels) and load that part only.

    Threads as ``infer.load``: a part of N CPU devices runs one kernel per core itself, so unless
    ``intra_op_threads`` says otherwise torch's intra-op pool is set (process-wide) to cores // N;
    ``intra_op_threads=0`` leaves it alone. ``verify`` as ``infer.load``'s."""
    from infer.shard.hosts import host_layouts, host_of_rank, num_hosts

    folder = Path(artifact_dir)
    if not folder.is_dir():
        raise ArtifactError(f"{folder} is not a folder; pass the artifact folder written by export", path=str(folder))
    manifest = Manifest.read(folder)
    if not manifest.host_parts:
        raise ArtifactError(
            f"{folder} is a one-host artifact; load it whole with infer.load(path) (or `embserve serve`)",
            path=str(folder / MANIFEST_FILE),
            kind=MODEL,
        )
    hosts = manifest.num_hosts
    if not 0 <= host < hosts:
        raise ArtifactError(f"host {host} is outside the artifact's {hosts} hosts (0..{hosts - 1})", kind=MODEL)
    manifest.verify_files(folder, only=manifest.host_files(host), verify=verify)
    plan = verify_plan(folder, manifest)
    if num_hosts(plan) != hosts or plan.topology.local_world_size != manifest.devices_per_host:
        raise ArtifactError(
            f"{PLAN_FILE} plans {num_hosts(plan)} hosts x {plan.topology.local_world_size} devices, {MANIFEST_FILE} "
            f"says {hosts} x {manifest.devices_per_host}",
            path=str(folder / PLAN_FILE),
        )
    mapping = dict(device_map or {})
    load_operators()
    part_path = folder / manifest.host_parts[host]
    module = torchscript.read_model(part_path, manifest.devices, mapping)
    expected = [k for k in manifest.kernels if host_of_rank(plan, k.rank) == host]
    torchscript.attach_mapped_weights(folder, module, manifest, expected, manifest.host_parts[host])
    torchscript.check_model_kernels(module, expected, part_path)
    layouts = host_layouts(manifest.spec, plan, host)
    check_routing(module, manifest.spec, plan, layouts)
    held = {name for layout in layouts for name in layout.split.block_table_names}  # this host's block tables
    own = [r for r in manifest.block_remaps if r.table in held]
    torchscript.check_block_remaps(module, own, part_path, manifest.spec, plan, layouts)
    torchscript.remap_shard_devices(module, mapping)
    targets = [mapping.get(d, d) for d in manifest.devices]
    threads = intra_op_threads
    if threads is None and all(d == "cpu" for d in targets):
        threads = max(1, (os.cpu_count() or 1) // manifest.devices_per_host)
    if threads and torch.get_num_threads() != threads:
        logger.info("intra-op threads %d -> %d", torch.get_num_threads(), threads)
        torch.set_num_threads(threads)
    logger.info("host %d: loaded %s (%d kernels)", host, part_path, len(expected))
    return HostPart(folder, manifest, plan, host, module)


def load_dense_arch(artifact_dir: str | Path, verify: str = FULL) -> torch.nn.Module | None:
    """The dense part of a multi-host artifact (it lives in host 0's part), for a front end on another host;
    None when the model has none. Host 0's ``model.pt`` is verified and loaded without attaching its weight
    files (mapped artifacts keep no weights in it; an embedded one loads host 0's tables too, then drops them)."""
    folder = Path(artifact_dir)
    manifest = Manifest.read(folder)
    if not manifest.has_dense:
        return None
    name = manifest.host_parts[0]
    manifest.verify_files(folder, only=(name,), verify=verify)
    load_operators()
    module = torchscript.read_model(folder / name, manifest.devices, {})
    dense: torch.nn.Module = module.dense_arch
    dense.eval()
    return dense
