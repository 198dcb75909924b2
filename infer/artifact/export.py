"""Export a quantized model as a self-describing TorchScript artifact.

An artifact is a folder: ``model.pt`` (``torch.jit.script``) and ``manifest.json`` (see
docs/artifact-format.md). Export writes into a temporary sibling folder and renames it into place, so an
interrupted export never leaves a half-written artifact where a good one was.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from infer import request_rules as rules
from infer.artifact.formats.torchscript import save_structure, script_model
from infer.artifact.kernels import Kernel, block_remaps_of, kernels_of, model_tbes
from infer.artifact.manifest import (
    FORMAT_VERSION,
    MANIFEST_FILE,
    MAPPED_FORMAT_VERSION,
    PLAN_FILE,
    FileEntry,
    Manifest,
    OnnxEntry,
    Pt2Entry,
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
from infer.dense_layout import PooledLayout, checked_layout
from infer.errors import ArtifactError, ConfigError
from infer.planner.types import ShardingPlan
from infer.storage import checksums
from infer.version import __version__

logger = logging.getLogger(__name__)


@contextmanager
def staged(out_dir: Path) -> Iterator[Path]:
    """A temporary sibling of ``out_dir`` to write an artifact into. When the block ends normally the staging
    folder (and every folder in it) is made world-readable and renamed into place, replacing ``out_dir``; when
    it raises, the staging folder is removed and ``out_dir`` is left as it was."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        yield staging
        for folder in [staging, *(path for path in staging.rglob("*") if path.is_dir())]:
            os.chmod(folder, 0o755)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def refuse_blocks(spec: Any, onnx: bool) -> None:
    """``ConfigError`` naming the first table held in precision blocks when the export asks for a form that does
    not serve blocks yet (ONNX), and the flag to drop. (pt2 serves them: ``BlockSplitCall``; a sharded model too,
    each block table table-wise on one device: ``infer.shard.builder.check_plan``.)"""
    if not spec.block_tables:
        return
    if onnx:
        raise ConfigError(
            f"table {spec.block_tables[0]!r} is held in precision blocks, which ONNX does not serve yet; export "
            "without --onnx, or with the table in one data type"
        )


def output_folder(out_dir: str | Path) -> Path:
    """The absolute artifact folder to write: new, empty, or an artifact (replaced); anything else is refused."""
    out_dir = Path(out_dir).absolute()
    if out_dir.exists() and (
        not out_dir.is_dir() or (any(out_dir.iterdir()) and not (out_dir / MANIFEST_FILE).exists())
    ):
        raise ArtifactError(
            f"{out_dir} exists and is not an embserve artifact; choose an empty or new folder", path=str(out_dir)
        )
    return out_dir


def export(
    model: torch.nn.Module,
    out_dir: str | Path,
    plan: ShardingPlan | None = None,
    onnx: bool = False,
    onnx_pooling: str | None = None,
    pt2: bool = False,
    weights: str = MAPPED,
) -> Path:
    """Script ``model`` (from ``infer.quantize``, or ``infer.shard_model`` with its ``plan``)
    and write the artifact to ``out_dir``; a plan is stored beside the model as ``plan.json``.

    ``onnx=True`` adds ``model.onnx`` (+ ``model.onnx.data``, and ``dense.onnx`` when there is a dense
    part): the same model as a standard ONNX graph for onnxruntime (``load(path, backend="onnxruntime")``);
    a sharded model becomes one graph. ``onnx_pooling`` picks a pooling design (``onnx_export.POOLINGS``).

    ``pt2=True`` adds ``model.pt2``: the lookups compiled by torch.export + AOTInductor for the model's
    device (``load(path, backend="pt2")``, and the C++ loader's pt2 backend); compiling takes about a minute.
    Unsharded models and table-wise, column-wise and replicated shards (row-wise: ``ConfigError``); a dense
    part is a second program in the same package. Tables in precision blocks are split inside the program, as
    model.pt splits them (ONNX refuses them: ``refuse_blocks``).

    A dense part that records the pooled layout it was trained on (``infer.from_torchrec``) is checked against
    the spec (``ConfigError`` naming the table and what differs: order, pooling, dim, columns) and the layout is
    written to the manifest (``dense.expects``).

    ``weights="mapped"`` (the default) writes each CPU weight buffer to a plain file beside ``model.pt``
    (``weights-<n>.bin``, tables page-aligned in the kernel's row layout), which both loaders map read-only;
    ``model.pt`` then keeps structure only (manifest ``format_version`` 3). ``"embedded"`` keeps every weight
    inside ``model.pt`` (``format_version`` 2).

    An existing artifact at ``out_dir`` is replaced; any other non-empty folder is left alone
    and ``ArtifactError`` is raised.
    """
    from infer.modules.collection import EmbserveModel

    if not isinstance(model, EmbserveModel):
        raise ConfigError(f"export takes the model returned by infer.quantize(), got {type(model).__name__}")
    check_weights_format(weights)
    refuse_blocks(model.spec, onnx)
    out_dir = output_folder(out_dir)
    dense_expects = checked_layout(model.spec, model.dense_arch if model.has_dense else None)
    if model.has_dense:
        check_dense_part(model)
    started = time.monotonic()
    scripted = script_model(model)
    kernels = kernels_of(model, plan)
    with staged(out_dir) as staging:
        weight_files: list[FileEntry] = []
        if weights == MAPPED:
            embedded, kernels = kernels, place_weights(kernels)
            weight_files = _write_weights(staging, model_tbes(model), embedded, kernels)
            strip_weights(model_tbes(scripted), kernels)
            mark_weights(scripted, attached=False)
        files = save_structure(staging, scripted, weight_files, plan)
        onnx_entry = None
        if onnx:
            onnx_entry = _export_onnx(model, staging, plan, onnx_pooling)
            names = [onnx_entry.model_file, *onnx_entry.data_files]
            names += [onnx_entry.dense_file] if onnx_entry.dense_file else []
            files.extend(FileEntry.of(staging, name) for name in names)
        pt2_entry: Pt2Entry | None = None
        if pt2:
            from infer.artifact.formats.pt2_export import export_pt2

            pt2_entry = export_pt2(model, staging, kernels)
            files.append(FileEntry.of(staging, pt2_entry.file))
        format_version = MAPPED_FORMAT_VERSION if weights == MAPPED else FORMAT_VERSION
        write_manifest(staging, model, plan, files, kernels, dense_expects, format_version, onnx_entry, pt2_entry)
    logger.debug("exported %s in %.1fs", out_dir, time.monotonic() - started)
    return out_dir


def write_manifest(
    staging: Path,
    model: Any,
    plan: ShardingPlan | None,
    files: list[FileEntry],
    kernels: list[Kernel],
    dense_expects: PooledLayout | None,
    format_version: int,
    onnx_entry: OnnxEntry | None = None,
    pt2_entry: Pt2Entry | None = None,
) -> None:
    from infer.artifact.fbgemm_libs import REQUIRED_LIBRARIES, fbgemm_library_dir, fbgemm_version

    remaps = block_remaps_of(model)
    manifest = Manifest(
        spec=model.spec,
        has_dense=bool(model.has_dense),
        devices=tuple(_model_devices(model)),
        embserve_version=__version__,
        torch_version=torch.__version__,
        fbgemm_version=fbgemm_version(),
        fbgemm_libraries=REQUIRED_LIBRARIES,
        fbgemm_library_dir=str(fbgemm_library_dir()),
        files=tuple(files),
        plan_file=PLAN_FILE if plan is not None else None,
        world_size=plan.topology.world_size if plan is not None else 1,
        kernels=tuple(kernels),
        onnx=onnx_entry,
        pt2=pt2_entry,
        dense_expects=dense_expects,
        format_version=format_version,
        block_remaps=tuple(RemapEntry.of(name, remaps[name]) for name in model.spec.block_tables),
    )
    (staging / MANIFEST_FILE).write_text(manifest.to_json(), encoding="utf-8")


def _write_weights(folder: Path, tbes: list[Any], embedded: list[Kernel], placed: list[Kernel]) -> list[FileEntry]:
    """Write the mapped kernels' weight files and return their entries (chunked for parallel verification)."""
    names = write_weight_files(folder, tbes, embedded, placed)
    return [FileEntry.of(folder, name, checksums.WEIGHTS_CHUNK_BYTES) for name in names]


# Two batch sizes: a dense part specialised to one batch size fails the second probe.
PROBE_BATCHES = (2, 3)


def check_dense_part(model: Any) -> None:
    """Call the model's dense part on probe batches of zeros; ``ConfigError`` unless it returns what ``predict``
    returns on every backend: float32 scores ``[batch]`` (``[batch, 1]`` is squeezed, see ``rules.scores_of``)."""
    spec = model.spec
    dense_arch = model.dense_arch
    assert isinstance(dense_arch, torch.nn.Module)
    device = next((t.device for t in (*dense_arch.parameters(), *dense_arch.buffers())), torch.device("cpu"))
    expected = f"(dense_features [B, {spec.num_dense_features}], pooled [B, {spec.output_dim}])"
    for batch in PROBE_BATCHES:
        dense = torch.zeros(batch, spec.num_dense_features, device=device)
        pooled = torch.zeros(batch, spec.output_dim, device=device)
        try:
            with torch.no_grad():
                out = dense_arch(dense, pooled)
        except Exception as err:  # noqa: BLE001 - a wrong signature fails in many ways
            lines = [line.strip() for line in str(err).splitlines() if line.strip()]
            raise ConfigError(
                f"the dense part cannot be called as {expected}: {lines[-1] if lines else type(err).__name__}; "
                "check num_dense_features in the spec and the module's input sizes"
            ) from None
        if not isinstance(out, torch.Tensor):
            raise ConfigError(rules.scores_error(type(out).__name__, batch))
        try:
            rules.scores_of(out, batch)
        except ValueError as err:
            raise ConfigError(str(err)) from None


def _export_onnx(model: torch.nn.Module, folder: Path, plan: ShardingPlan | None, pooling: str | None) -> OnnxEntry:
    from infer.artifact.formats import onnx_export

    started = time.monotonic()
    world_size = plan.topology.world_size if plan is not None else len(getattr(model.embeddings, "shards", [None]))
    written = onnx_export.export_onnx(model, folder, pooling or onnx_export.DEFAULT_POOLING, world_size)
    versions = onnx_export.onnx_versions()
    logger.debug("ONNX export in %.1fs", time.monotonic() - started)
    return OnnxEntry(
        model_file=written.model_file,
        data_files=written.data_files,
        dense_file=written.dense_file,
        opset=onnx_export.OPSET,
        ir_version=onnx_export.IR_VERSION,
        onnx_version=versions["onnx"] or "unknown",
        onnxruntime_version=versions["onnxruntime"],
        pooling=written.pooling,
        source_world_size=world_size,
    )


def _model_devices(model: torch.nn.Module) -> list[str]:
    """Devices of the model's kernels, in order of first appearance (``cuda:0`` before ``cuda:1``)."""
    seen: list[str] = []
    for buffer in model.buffers():
        name = str(buffer.device)
        if name not in seen:
            seen.append(name)
    return seen or ["cpu"]
