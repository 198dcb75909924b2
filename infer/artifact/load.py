"""Load an exported artifact: verify its manifest and checksums, then the TorchScript model, into a ``Runtime``."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from infer.artifact.backends import BACKENDS
from infer.artifact.fbgemm_libs import load_fbgemm, load_operators
from infer.artifact.formats import torchscript
from infer.artifact.kernels import check_device_kernels, check_routing, expected_kernels
from infer.artifact.manifest import MANIFEST_FILE, Manifest
from infer.artifact.paged import check_prefetch_mode, page_model, prefetch_wanted
from infer.artifact.runtime import PhaseClock, Runtime
from infer.artifact.schema import parse_document, schema, validate
from infer.artifact.structures import StructureCache
from infer.errors import ArtifactError, ArtifactErrorKind, ConfigError, EmbserveError
from infer.planner.types import ShardingPlan
from infer.shard.builder import check_plan
from infer.storage.checksums import FULL, check_verify_mode

logger = logging.getLogger(__name__)

MODEL = ArtifactErrorKind.MODEL


def load(
    artifact_dir: str | Path,
    device_map: Mapping[str, str] | None = None,
    intra_op_threads: int | None = None,
    threads: int | None = None,
    backend: str = "torchscript",
    verify: str = FULL,
    structures: StructureCache | None = None,
    prefetch: str = "auto",
    hot_rows: Mapping[str, Any] | None = None,
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
    Serving larger than RAM (a mapped artifact, torchscript backend; ``infer.artifact.paged``): ``prefetch="on"``
    reads each batch's missing pages ahead of the kernel, many in flight (``MADV_WILLNEED``; the mappings are
    advised ``MADV_RANDOM``); ``"auto"`` (the default) turns it on when the plan puts a shard in the paged tier,
    ``"off"`` never. ``hot_rows`` (table name -> row ids, e.g. ``choose_hot_rows`` of a sample of requests) keeps
    those rows in a resident cache in front of the mapped tables.
    """
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; choose one of {list(BACKENDS)}")
    check_prefetch_mode(prefetch)
    if hot_rows and backend != "torchscript":
        raise ConfigError(f"hot_rows applies to the torchscript backend, not {backend!r}")
    check_verify_mode(verify)
    clock = PhaseClock()
    folder = Path(artifact_dir)
    if not folder.is_dir():
        raise ArtifactError(f"{folder} is not a folder; pass the artifact folder written by export", path=str(folder))
    manifest = Manifest.read(folder)
    if manifest.host_parts:
        raise whole_load_refused(folder, manifest)
    clock.mark("manifest")
    if backend in ("torchscript", "pt2"):
        # first: a child hashing the chunks while fbgemm's libraries import made the import ~3x slower (2 cores)
        # a TorchScript model needs fbgemm's operators only; pt2's loader uses the package's Python side too
        load_operators() if backend == "torchscript" else load_fbgemm()
        clock.mark("libraries")
    # small files are checked now; the chunks of large ones are hashed meanwhile, in parallel with the load
    verification = manifest.start_verify(folder, overlap=backend in ("torchscript", "pt2"), verify=verify)
    clock.mark("small files")
    plan = verify_plan(folder, manifest) if manifest.plan_file is not None else None
    clock.mark("plan")
    if backend == "onnxruntime":
        if device_map:
            raise ConfigError("device_map applies to the torchscript backend; the ONNX graph runs on onnxruntime's CPU")
        from infer.artifact.formats.onnx_runtime import load_onnx

        verification.wait()
        return _timed(load_onnx(folder, manifest, intra_op_threads or None), clock)
    if backend == "pt2":
        if device_map:
            raise ConfigError("device_map applies to the torchscript backend; model.pt2 runs where it was compiled for")
        from infer.artifact.formats.pt2_runtime import load_pt2

        check_device_kernels(manifest.kernels, {}, folder)
        try:
            runtime = load_pt2(folder, manifest, verification.wait)  # waits before handing over the mapped weights
        finally:
            verification.wait()  # a corrupted file explains a failed load best (a second wait hashes nothing)
        return _timed(runtime, clock)
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
    check_device_kernels(manifest.kernels, mapping, folder)
    model_path = folder / manifest.model_file
    cache = structures if structures is not None and _structure_only(manifest) else None
    module = torchscript.read_model(model_path, manifest.devices, mapping, verification.wait, cache)
    clock.mark("model")
    try:
        torchscript.attach_mapped_weights(folder, module, manifest)
        clock.mark("weights")
    finally:
        verification.wait()  # a chunk that fails drops the loaded module with the error
        clock.mark("checksums")  # what was left to hash once the model was read
    torchscript.check_model_kernels(module, manifest.kernels, model_path)
    if plan is not None:
        check_routing(module, manifest.spec, plan)
    torchscript.check_block_remaps(module, manifest.block_remaps, model_path, manifest.spec, plan)
    torchscript.remap_shard_devices(module, mapping)
    _set_intra_op_threads(manifest, targets, intra_op_threads)
    paged = prefetch_wanted(prefetch, manifest.mapped, plan)
    runtime = Runtime(folder, manifest, page_model(module, manifest.spec, manifest.kernels, paged, hot_rows))
    runtime.set_threads(threads if threads is not None else runtime.thread_budget())
    clock.mark("checks")
    return _timed(runtime, clock)


def _structure_only(manifest: Manifest) -> bool:
    """Whether ``model.pt`` holds no tables (every kernel's weights mapped from a file): only then is a copy of it
    cheap, and keeping one costs little (``infer.artifact.structures``)."""
    return manifest.mapped and all(k.weights is not None for k in manifest.kernels)


def _timed(runtime: Runtime, clock: PhaseClock) -> Runtime:
    """Record what the load read and verified, how long it took, in which phases, and how much of that was
    loading fbgemm's libraries (``embserve run`` prints the rate, a repository logs the phases)."""
    clock.mark("runtime")
    runtime.load_bytes = sum(e.bytes for e in runtime.manifest.files)
    runtime.load_seconds = clock.total
    runtime.load_phases = dict(clock.seconds)
    runtime.library_seconds = clock.seconds.get("libraries", 0.0)
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
        raise ArtifactError(
            f"{manifest.plan_file} does not fit the tables of {MANIFEST_FILE}: {err}; export wrote both (and the "
            "weight files) for the same tables, so one of them was edited since: restore it or re-export the artifact",
            path=str(path),
        ) from None
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


def whole_load_refused(folder: Path, manifest: Manifest) -> ArtifactError:
    """A multi-host artifact is served by one process per host, never loaded whole."""
    hosts = manifest.num_hosts
    return ArtifactError(
        f"{folder} is a multi-host artifact ({hosts} hosts x {manifest.devices_per_host} devices): no single "
        f"process loads it whole. Serve it on {hosts} hosts with `torchrun --nnodes {hosts} --nproc-per-node 1 "
        f"--rdzv-endpoint HOST0:PORT -m infer.cli serve {folder}` (the same command on every host), or load one "
        "host's part with infer.artifact.hosts.load_host_part(path, host)",
        path=str(folder / MANIFEST_FILE),
        kind=MODEL,
    )
