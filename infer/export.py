"""Export a quantized model as a self-describing TorchScript artifact, and load it back.

An artifact is a folder: ``model.pt`` (``torch.jit.script``) and ``manifest.json`` (see the README's
"Artifact format"). Export writes into a temporary sibling folder and renames it into place, so an
interrupted export never leaves a half-written artifact where a good one was.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from infer.errors import ArtifactError, ConfigError
from infer.manifest import MANIFEST_FILE, MODEL_FILE, PLAN_FILE, FileEntry, Manifest
from infer.planner.types import ShardingPlan
from infer.runtime import Runtime
from infer.version import __version__

logger = logging.getLogger(__name__)


def export(model: torch.nn.Module, out_dir: str | Path, plan: ShardingPlan | None = None) -> Path:
    """Script ``model`` (from ``infer.quantize``, or ``infer.shard.builder.shard_model`` with its ``plan``)
    and write the artifact to ``out_dir``; a plan is stored beside the model as ``plan.json``.

    An existing artifact at ``out_dir`` is replaced; any other non-empty folder is left alone
    and ``ArtifactError`` is raised.
    """
    from infer.fbgemm_libs import REQUIRED_LIBRARIES, fbgemm_library_dir, fbgemm_version
    from infer.modules import EmbserveModel

    if not isinstance(model, EmbserveModel):
        raise ConfigError(f"export takes the model returned by infer.quantize(), got {type(model).__name__}")
    out_dir = Path(out_dir).absolute()
    if out_dir.exists() and (
        not out_dir.is_dir() or (any(out_dir.iterdir()) and not (out_dir / MANIFEST_FILE).exists())
    ):
        raise ArtifactError(
            f"{out_dir} exists and is not an embserve artifact; choose an empty or new folder", path=str(out_dir)
        )
    started = time.monotonic()
    try:
        scripted = torch.jit.script(model)
    except Exception as err:  # noqa: BLE001 - TorchScript reports many error types
        raise ConfigError(f"the model (or its dense_arch) cannot be scripted with torch.jit.script: {err}") from None
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        scripted.save(str(staging / MODEL_FILE))
        files = [FileEntry.of(staging, MODEL_FILE)]
        if plan is not None:
            (staging / PLAN_FILE).write_text(plan.to_json(), encoding="utf-8")
            files.append(FileEntry.of(staging, PLAN_FILE))
        devices = _model_devices(model)
        manifest = Manifest(
            spec=model.spec,
            has_dense=bool(model.has_dense),
            devices=tuple(devices),
            embserve_version=__version__,
            torch_version=torch.__version__,
            fbgemm_version=fbgemm_version(),
            fbgemm_libraries=REQUIRED_LIBRARIES,
            fbgemm_library_dir=str(fbgemm_library_dir()),
            files=tuple(files),
            plan_file=PLAN_FILE if plan is not None else None,
            world_size=plan.topology.world_size if plan is not None else 1,
        )
        (staging / MANIFEST_FILE).write_text(manifest.to_json(), encoding="utf-8")
        os.chmod(staging, 0o755)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.debug("exported %s in %.1fs", out_dir, time.monotonic() - started)
    return out_dir


def _model_devices(model: torch.nn.Module) -> list[str]:
    """Devices of the model's kernels, in order of first appearance (``cuda:0`` before ``cuda:1``)."""
    seen: list[str] = []
    for buffer in model.buffers():
        name = str(buffer.device)
        if name not in seen:
            seen.append(name)
    return seen or ["cpu"]


def load(
    artifact_dir: str | Path,
    device_map: Mapping[str, str] | None = None,
    intra_op_threads: int | None = None,
) -> Runtime:
    """Verify and load an artifact; returns a ``Runtime`` with ``lookup`` and ``predict``.

    ``device_map`` (e.g. ``{"cuda:0": "cpu", "cuda:1": "cpu"}``) moves an artifact built for other
    devices onto this host's; without it an artifact built for CUDA does not load on a CPU-only host.

    A model sharded over N CPU devices runs one kernel per core itself; torch's intra-op pool would
    only compete with it, so unless ``intra_op_threads`` says otherwise it is set (process-wide) to
    cores // N (at least 1). ``intra_op_threads=0`` leaves torch's setting alone.
    """
    from infer.fbgemm_libs import load_fbgemm

    folder = Path(artifact_dir)
    if not folder.is_dir():
        raise ArtifactError(f"{folder} is not a folder; pass the artifact folder written by export", path=str(folder))
    manifest = Manifest.read(folder)
    manifest.verify_files(folder)
    mapping = dict(device_map or {})
    targets = [mapping.get(d, d) for d in manifest.devices]
    missing = [d for d in targets if d.startswith("cuda") and not _cuda_device_exists(d)]
    if missing:
        raise ArtifactError(
            f"{folder} was exported for devices {list(manifest.devices)} and this host lacks {missing}; "
            "load it with a device map, e.g. load(path, device_map={'cuda:0': 'cpu'}) or "
            "`embserve run --device-map cuda:0=cpu`",
            path=str(folder / MANIFEST_FILE),
        )
    load_fbgemm()
    model_path = folder / manifest.model_file
    try:
        module = torch.jit.load(str(model_path), map_location=_map_location(manifest.devices, mapping))
    except Exception as err:  # noqa: BLE001 - torch raises RuntimeError and others for a bad archive
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ArtifactError(
            f"{model_path} cannot be loaded by TorchScript: {first_line}", path=str(model_path)
        ) from None
    module.eval()
    if mapping:
        _remap_shard_devices(module, mapping)
    _set_intra_op_threads(manifest, targets, intra_op_threads)
    return Runtime(folder, manifest, module)


def _set_intra_op_threads(manifest: Manifest, devices: Sequence[str], requested: int | None) -> None:
    if requested == 0:
        return
    threads = requested
    if threads is None:
        if manifest.world_size < 2 or any(d != "cpu" for d in devices):
            return
        threads = max(1, (os.cpu_count() or 1) // manifest.world_size)
    if torch.get_num_threads() != threads:
        logger.info("intra-op threads %d -> %d (%d CPU shards)", torch.get_num_threads(), threads, manifest.world_size)
        torch.set_num_threads(threads)


def _cuda_device_exists(name: str) -> bool:
    index = torch.device(name).index or 0
    return torch.cuda.is_available() and index < torch.cuda.device_count()


def _map_location(devices: Sequence[str], mapping: Mapping[str, str]) -> str | None:
    """``torch.jit.load`` moves every tensor to one device or none: the map must agree with that."""
    if not mapping:
        return None
    targets = sorted({mapping.get(d, d) for d in devices})
    if targets == sorted(set(devices)):
        return None
    if len(targets) != 1:
        raise ArtifactError(
            f"a device map must send every device to one device (TorchScript loads to one); got {dict(mapping)}"
        )
    return targets[0]


def _remap_shard_devices(module: torch.jit.ScriptModule, mapping: Mapping[str, str]) -> None:
    """Point a sharded model's per-device routing at the mapped devices."""
    embeddings = module.embeddings
    if hasattr(embeddings, "output_device"):
        embeddings.output_device = mapping.get(embeddings.output_device, embeddings.output_device)
    if hasattr(embeddings, "shards"):
        for shard in embeddings.shards:
            shard.device = mapping.get(shard.device, shard.device)
