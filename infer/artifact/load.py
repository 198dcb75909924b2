"""Load an exported artifact: verify its manifest and checksums, then the TorchScript model, into a ``Runtime``."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from infer.artifact.fbgemm_libs import load_fbgemm
from infer.artifact.kernels import Kernel, check_kernel, check_routing, expected_kernels, kernel_holders, model_tbes
from infer.artifact.manifest import MANIFEST_FILE, Manifest
from infer.artifact.mapped import attach_weights, check_no_saved_weights, mark_weights
from infer.artifact.runtime import Runtime
from infer.artifact.schema import parse_document, schema, validate
from infer.artifact.structures import StructureCache
from infer.artifact.verify import FULL, check_verify_mode
from infer.errors import ArtifactError, ArtifactErrorKind, ConfigError, EmbserveError
from infer.planner.types import ShardingPlan
from infer.shard.builder import check_plan

logger = logging.getLogger(__name__)

MODEL = ArtifactErrorKind.MODEL
BACKENDS = ("torchscript", "onnxruntime", "pt2")


def load(
    artifact_dir: str | Path,
    device_map: Mapping[str, str] | None = None,
    intra_op_threads: int | None = None,
    threads: int | None = None,
    backend: str = "torchscript",
    verify: str = FULL,
    structures: StructureCache | None = None,
) -> Runtime:
    """Verify and load an artifact; returns a ``Runtime`` with ``lookup`` and ``predict``.

    ``backend="onnxruntime"`` runs the artifact's ``model.onnx`` (exported with ``onnx=True``) on
    onnxruntime's CPU provider instead of ``model.pt``: same checks first, same API, same errors, and
    fbgemm is never imported. ``intra_op_threads`` then sets onnxruntime's threads (default: its own).

    ``backend="pt2"`` runs the artifact's ``model.pt2`` (exported with ``pt2=True``; AOTInductor) after loading
    fbgemm's operators: same checks first, same ``lookup`` (``predict`` needs the torchscript backend).

    ``device_map`` (e.g. ``{"cuda:0": "cpu", "cuda:1": "cpu"}``) moves an artifact built for other
    devices onto this host's; without it an artifact built for CUDA does not load on a CPU-only host.

    A model sharded over N CPU devices runs one kernel per core itself; torch's intra-op pool would
    only compete with it, so unless ``intra_op_threads`` says otherwise it is set (process-wide) to
    cores // N (at least 1). ``intra_op_threads=0`` leaves torch's setting alone.

    ``threads``: how many example ranges each CPU kernel may split a batch into, run in parallel on the
    same weights (bit-identical output); default the host's budget, cores // CPU kernels.

    ``verify="full"`` (the default) checks every file's sha256 before the model is returned (the chunks of
    large files hashed in parallel); ``verify="none"`` checks paths and sizes only, for an artifact already
    verified (by ``embserve inspect --verify``, or an earlier load). A mapped artifact's weight files
    (``export(..., weights="mapped")``) are mapped read-only, never copied: processes loading the same
    artifact share one copy of its weights in the page cache.

    ``structures`` (``infer.artifact.structures.StructureCache``): a mapped artifact's model file (no tables inside)
    whose structure was loaded before is a copy of it instead of another ``torch.jit.load`` (a server's
    repository swapping versions passes one); other artifacts load as without it.
    """
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; choose one of {list(BACKENDS)}")
    check_verify_mode(verify)
    started = time.perf_counter()
    folder = Path(artifact_dir)
    if not folder.is_dir():
        raise ArtifactError(f"{folder} is not a folder; pass the artifact folder written by export", path=str(folder))
    manifest = Manifest.read(folder)
    if manifest.host_parts:
        from infer.artifact.hosts import whole_load_refused

        raise whole_load_refused(folder, manifest)
    library_seconds = 0.0
    if backend in ("torchscript", "pt2"):
        # first: a child hashing the chunks while fbgemm's libraries import made the import ~3x slower (2 cores)
        libraries_started = time.perf_counter()
        load_fbgemm()
        library_seconds = time.perf_counter() - libraries_started
    # small files are checked now; the chunks of large ones are hashed meanwhile, in parallel with the load
    verification = manifest.start_verify(folder, overlap=backend in ("torchscript", "pt2"), verify=verify)
    plan = verify_plan(folder, manifest) if manifest.plan_file is not None else None
    if backend == "onnxruntime":
        if device_map:
            raise ConfigError("device_map applies to the torchscript backend; the ONNX graph runs on onnxruntime's CPU")
        from infer.artifact.onnx_runtime import load_onnx

        verification.wait()
        return _timed(load_onnx(folder, manifest, intra_op_threads or None), started)
    if backend == "pt2":
        if device_map:
            raise ConfigError("device_map applies to the torchscript backend; model.pt2 runs where it was compiled for")
        from infer.artifact.pt2_runtime import load_pt2

        try:
            runtime = load_pt2(folder, manifest)
        finally:
            verification.wait()  # a corrupted file explains a failed load best; a failed chunk drops the model
        return _timed(runtime, started, library_seconds)
    mapping = dict(device_map or {})
    targets = [mapping.get(d, d) for d in manifest.devices]
    missing = [d for d in targets if d.startswith("cuda") and not _cuda_device_exists(d)]
    if missing:
        raise ArtifactError(
            f"{folder} was exported for devices {list(manifest.devices)} and this host lacks {missing}; "
            "load it with a device map, e.g. load(path, device_map={'cuda:0': 'cpu'}) or "
            "`embserve run --device-map cuda:0=cpu`",
            path=str(folder / MANIFEST_FILE),
            kind=MODEL,
        )
    model_path = folder / manifest.model_file
    try:
        location = _map_location(manifest.devices, mapping)
        if structures is not None and _structure_only(manifest):  # a copy of an equal one loaded before
            module = structures.load(model_path, location)
        else:
            module = torch.jit.load(str(model_path), map_location=location)
    except Exception as err:  # noqa: BLE001 - torch raises RuntimeError and others for a bad archive
        verification.wait()  # a corrupted file explains a failed load better than TorchScript's message
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ArtifactError(
            f"{model_path} cannot be loaded by TorchScript: {first_line}", path=str(model_path), kind=MODEL
        ) from None
    try:
        attach_mapped_weights(folder, module, manifest)
    finally:
        verification.wait()  # a chunk that fails drops the loaded module with the error
    module.eval()
    _check_kernels(module, manifest, plan)
    if mapping:
        _remap_shard_devices(module, mapping)
    _set_intra_op_threads(manifest, targets, intra_op_threads)
    runtime = Runtime(folder, manifest, module)
    runtime.set_threads(threads if threads is not None else runtime.thread_budget())
    return _timed(runtime, started, library_seconds)


def _structure_only(manifest: Manifest) -> bool:
    """Whether ``model.pt`` holds no tables (every kernel's weights mapped from a file): only then is a copy of it
    cheap, and keeping one costs little (``infer.artifact.structures``)."""
    return manifest.mapped and all(k.weights is not None for k in manifest.kernels)


def attach_mapped_weights(
    folder: Path,
    module: torch.jit.ScriptModule,
    manifest: Manifest,
    kernels: Sequence[Kernel] | None = None,
    model_file: str | None = None,
) -> None:
    """Hand every mapped kernel of a loaded model (of a mapped artifact) its buffer's view of its weight file;
    ``kernels``: the model's kernels in the manifest (default all; one host's for a host part), ``model_file``
    the file the model came from (default the manifest's)."""
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
    attach_weights(folder, tbes, kernels, {e.name: e.bytes for e in manifest.files})
    mark_weights(module, attached=True)


def _timed(runtime: Runtime, started: float, library_seconds: float = 0.0) -> Runtime:
    """Record what the load read and verified, how long it took and how much of that was importing fbgemm's
    libraries (``embserve run`` prints the rate)."""
    runtime.load_bytes = sum(e.bytes for e in runtime.manifest.files)
    runtime.load_seconds = time.perf_counter() - started
    runtime.library_seconds = library_seconds
    return runtime


def verify_plan(folder: Path, manifest: Manifest) -> ShardingPlan:
    """Read ``plan.json`` (schema-checked) and check it against the manifest: the same tables and data types,
    shards that cover them, the same world size, and the kernels the manifest lists."""
    assert manifest.plan_file is not None
    path = folder / manifest.plan_file
    size = path.stat().st_size
    limit = schema()["limits"]["max_plan_bytes"]
    if size > limit:
        raise ArtifactError(f"{path} is {size} bytes, over the {limit}-byte cap", path=str(path))
    data = parse_document(path.read_bytes(), manifest.plan_file)
    validate(data, "plan", manifest.plan_file)
    try:
        plan = ShardingPlan.from_dict(data)
        check_plan(manifest.spec, plan)
    except EmbserveError as err:
        raise ArtifactError(f"{manifest.plan_file} does not fit the model: {err}", path=str(path)) from None
    if plan.topology.world_size != manifest.world_size:
        raise ArtifactError(
            f"{manifest.plan_file} plans {plan.topology.world_size} devices, {MANIFEST_FILE} says "
            f"sharding.world_size {manifest.world_size}",
            path=str(path),
        )
    expected = [k.layout() for k in manifest.laid_out(expected_kernels(manifest.spec, plan, manifest.devices), plan)]
    if [k.layout() for k in manifest.kernels] != expected:
        raise ArtifactError(
            f"{MANIFEST_FILE}: 'kernels' disagrees with {manifest.plan_file} (the shards each device holds)",
            path=str(path),
        )
    return plan


def _check_kernels(module: torch.jit.ScriptModule, manifest: Manifest, plan: ShardingPlan | None) -> None:
    """Every TBE of the loaded model holds exactly what the manifest's kernels say, and every device routes
    its features as the plan says, before any lookup."""
    holders = kernel_holders(module)
    if not all(hasattr(holder, "tbe") for holder in holders):
        raise ArtifactError("the model has no embedding kernels where embserve puts them", kind=MODEL)
    if len(holders) != len(manifest.kernels):
        raise ArtifactError(
            f"the model has {len(holders)} kernels, {MANIFEST_FILE} lists {len(manifest.kernels)}", kind=MODEL
        )
    for index, (holder, kernel) in enumerate(zip(holders, manifest.kernels)):
        check_kernel(holder, kernel, index)
    if plan is not None:
        check_routing(module, manifest.spec, plan)


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
            f"a device map must send every device to one device (TorchScript loads to one); got {dict(mapping)}",
            kind=MODEL,
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
