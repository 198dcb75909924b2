"""The artifact manifest: what an exported model is, what it needs, and checksums of its files.

The format is specified in docs/artifact-format.md and enforced by ``schema.json`` (the same
file the C++ loader embeds); readers check the schema, the cross-field rules below, sizes and sha256
checksums before any tensor is touched.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infer.artifact.kernels import Kernel, expected_kernels
from infer.artifact.schema import is_host_file, parse_document, validate
from infer.config import ModelSpec
from infer.dense_layout import PooledLayout
from infer.errors import ArtifactError, ArtifactErrorKind, ConfigError
from infer.planner.types import ShardingPlan
from infer.storage.checksums import (
    FULL,
    NONE,
    ChunkedFile,
    Chunks,
    PendingVerification,
    check_verify_mode,
    file_digests,
)
from infer.storage.layout import PAGE_BYTES

FORMAT_NAME = "embserve-artifact"
FORMAT_VERSION = 2  # 2: the manifest lists the model's kernels; every weight inside model.pt (both loaders read it)
MAPPED_FORMAT_VERSION = 3  # 3: each CPU kernel's weights in a file of their own, mapped (the Python loader reads it)
READABLE_FORMAT_VERSIONS = (FORMAT_VERSION, MAPPED_FORMAT_VERSION)
MANIFEST_FILE = "manifest.json"
MODEL_FILE = "model.pt"
PLAN_FILE = "plan.json"
# the files only an artifact holds at its top (besides weights-<n>.bin): a folder with one of them and no manifest
# is an artifact that lost its manifest, not a repository of artifacts nor an unrelated folder
ARTIFACT_FILES = (MODEL_FILE, "model.pt2", "model.onnx", PLAN_FILE)
MAX_MANIFEST_BYTES = 16 * 1024 * 1024
_CHUNK = 1 << 20
CHECKSUM = ArtifactErrorKind.CHECKSUM


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def artifact_files(folder: Path) -> list[str]:
    """The files of ``folder`` that only an artifact holds (``ARTIFACT_FILES``, ``weights-<n>.bin``), by name."""
    found = [name for name in ARTIFACT_FILES if (folder / name).is_file()]
    return found + sorted(p.name for p in folder.glob("weights-*.bin") if p.is_file())


def missing_manifest(folder: Path) -> str:
    """The refusal of a folder without ``manifest.json`` (the C++ loader's words too): where it was looked for,
    and, when the folder holds an artifact's other files, that it is an artifact whose manifest is gone."""
    path = folder / MANIFEST_FILE
    held = artifact_files(folder)
    if not held:
        return f"{path} is missing; {folder} is not an embserve artifact"
    root = folder.parent.parent
    if folder.parent.name == "hosts" and folder.name.isdigit() and (root / MANIFEST_FILE).is_file():
        return f"{path} is missing: {folder} is host {folder.name}'s part of the multi-host artifact {root}: serve that"
    shown = ", ".join(held[:4]) + (f" and {len(held) - 4} more" if len(held) > 4 else "")
    return (
        f"{path} is missing: {folder} holds an artifact's files ({shown}) but not its manifest, which export "
        f"writes last; the export did not finish or {MANIFEST_FILE} was removed: re-export the artifact"
    )


@dataclass(frozen=True)
class FileEntry:
    name: str
    bytes: int
    sha256: str
    chunks: Chunks | None = None  # per-chunk sha256 of a large file (infer.storage.checksums), verified in parallel

    @classmethod
    def of(cls, folder: Path, name: str, chunk_bytes: int | None = None) -> FileEntry:
        path = folder / name
        whole, chunks = file_digests(path, chunk_bytes)
        return cls(name, path.stat().st_size, whole, chunks)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"bytes": self.bytes, "sha256": self.sha256}
        if self.chunks is not None:
            data["chunks"] = self.chunks.to_dict()
        return data

    @classmethod
    def from_dict(cls, name: str, data: Mapping[str, Any]) -> FileEntry:
        chunks = Chunks.from_dict(data["chunks"]) if "chunks" in data else None
        return cls(name, data["bytes"], data["sha256"], chunks)


@dataclass(frozen=True)
class OnnxEntry:
    """The ONNX form of the model in the artifact (``export(..., onnx=True)``); see
    ``infer.artifact.formats.onnx_export``."""

    model_file: str
    data_files: tuple[str, ...]
    dense_file: str | None
    opset: int
    ir_version: int
    onnx_version: str
    onnxruntime_version: str | None
    pooling: str
    source_world_size: int = 1

    def to_dict(self) -> dict[str, Any]:
        shards = self.source_world_size
        return {
            "model_file": self.model_file,
            "data_files": list(self.data_files),
            "dense_file": self.dense_file,
            "opset": self.opset,
            "ir_version": self.ir_version,
            "versions": {"onnx": self.onnx_version, "onnxruntime": self.onnxruntime_version},
            "pooling": self.pooling,
            "inputs": {
                "values": {"dtype": ["int64"], "shape": ["num_ids"]},
                "lengths": {"dtype": ["int32"], "shape": ["num_features * batch"], "layout": "feature-major"},
                "weights": {"dtype": ["float32"], "shape": ["num_ids"], "optional": True},
                "dense_features": (
                    {"dtype": ["float32"], "shape": ["batch", "num_dense_features"]} if self.dense_file else None
                ),
            },
            "outputs": ["embeddings", "scores"] if self.dense_file else ["embeddings"],
            "sharding": {
                "source_world_size": shards,
                "one_graph": True,
                "note": (
                    f"the {shards}-device sharded model is exported as one graph: ONNX has no devices"
                    if shards > 1
                    else "unsharded"
                ),
            },
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> OnnxEntry:
        return cls(
            model_file=str(data["model_file"]),
            data_files=tuple(str(name) for name in data["data_files"]),
            dense_file=data.get("dense_file"),
            opset=int(data["opset"]),
            ir_version=int(data["ir_version"]),
            onnx_version=str(data["versions"]["onnx"]),
            onnxruntime_version=data["versions"].get("onnxruntime"),
            pooling=str(data["pooling"]),
            source_world_size=int(data.get("sharding", {}).get("source_world_size", 1)),
        )


PT2_FILE = "model.pt2"
PT2_INPUTS = ("values:int64", "lengths:int64", "weights:float32")
PT2_TABLES_IN_PACKAGE = "package"  # Pt2Entry.tables: constants inside model.pt2
PT2_TABLES_IN_WEIGHT_FILES = "weight_files"  # Pt2Entry.tables: the mapped weight files, handed over at load


@dataclass(frozen=True)
class Pt2Entry:
    """The AOTInductor package of the model's lookups (``export(..., pt2=True)``); see
    ``infer.artifact.formats.pt2_export``.

    ``torch_version``: the torch that compiled it (the package's code runs only under that version);
    ``device``: where its kernels run; ``inputs``: its program's positional inputs, ``name:dtype``;
    ``dense_program``: the package's second program, the dense part ``(dense_features, pooled) -> scores``
    (None: lookups only); ``tables``: where the program's tables are, ``"package"`` (constants inside model.pt2;
    also what an entry without the key means) or ``"weight_files"`` (a mapped artifact's: the loaders hand the
    program the mapped buffers its metadata names, ``infer.artifact.formats.pt2_program.WEIGHT_CONSTANTS_KEY``;
    a loader that does not know the key refuses the manifest rather than run the program without its tables)."""

    file: str
    torch_version: str
    device: str
    inputs: tuple[str, ...] = PT2_INPUTS
    dense_program: str | None = None
    tables: str = PT2_TABLES_IN_PACKAGE

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "file": self.file,
            "torch_version": self.torch_version,
            "device": self.device,
            "inputs": list(self.inputs),
        }
        if self.dense_program is not None:  # only then: a lookups-only entry keeps the four keys
            data["dense_program"] = self.dense_program
        if self.tables != PT2_TABLES_IN_PACKAGE:  # only then: an older entry means the package
            data["tables"] = self.tables
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Pt2Entry:
        return cls(
            str(data["file"]),
            str(data["torch_version"]),
            str(data["device"]),
            tuple(data["inputs"]),
            data.get("dense_program"),
            str(data.get("tables", PT2_TABLES_IN_PACKAGE)),
        )


@dataclass(frozen=True)
class RemapEntry:
    """A block table's id remap (id -> position in its blocks, int32, ``rows`` of them: ``collection.encode_remap``)
    as the model file holds it: the sha256 of
    its bytes, which the loader compares with the loaded model's before the first lookup."""

    table: str
    rows: int
    sha256: str

    @classmethod
    def of(cls, table: str, remap: Any) -> RemapEntry:
        return cls(table, int(remap.numel()), remap_sha256(remap))

    def to_dict(self) -> dict[str, Any]:
        return {"rows": self.rows, "dtype": "int32", "sha256": self.sha256}


def remap_sha256(remap: Any) -> str:
    """sha256 of an id remap's bytes: int32, little-endian, in id order."""
    import numpy as np
    import torch

    data = remap.detach().to("cpu", torch.int32).contiguous().numpy().astype("<i4", copy=False)
    return hashlib.sha256(np.ascontiguousarray(data).tobytes()).hexdigest()


@dataclass(frozen=True)
class Manifest:
    spec: ModelSpec
    has_dense: bool
    devices: tuple[str, ...]
    embserve_version: str
    torch_version: str
    fbgemm_version: str
    fbgemm_libraries: tuple[str, ...]
    fbgemm_library_dir: str
    files: tuple[FileEntry, ...]
    format_version: int = FORMAT_VERSION
    model_file: str = MODEL_FILE
    plan_file: str | None = None  # the ShardingPlan the model was sharded with, when it is sharded
    world_size: int = 1
    kernels: tuple[Kernel, ...] = ()  # every TBE of the model, in model order
    onnx: OnnxEntry | None = None  # present when the artifact carries model.onnx
    pt2: Pt2Entry | None = None  # present when the artifact carries model.pt2
    # a multi-host artifact (infer.artifact.hosts): one model file per host, hosts/<h>/model.pt; () otherwise
    host_parts: tuple[str, ...] = ()
    devices_per_host: int = 0
    # the pooled layout the dense part was built against (infer.dense_layout), when it records one
    dense_expects: PooledLayout | None = None
    # the id remap of every table held in precision blocks (``TableConfig.blocks``), in table order
    block_remaps: tuple[RemapEntry, ...] = ()

    @property
    def num_hosts(self) -> int:
        return max(1, len(self.host_parts))

    @property
    def mapped(self) -> bool:
        """Its CPU kernels' weights lie in weight files beside ``model.pt`` (``infer.artifact.mapped``)."""
        return self.format_version == MAPPED_FORMAT_VERSION

    @property
    def file_bytes(self) -> dict[str, int]:
        """Each listed file's size in bytes, by name."""
        return {e.name: e.bytes for e in self.files}

    def file(self, name: str) -> FileEntry:
        for entry in self.files:
            if entry.name == name:
                return entry
        raise ArtifactError(f"manifest lists no file {name!r}", path=name)

    def to_dict(self) -> dict[str, Any]:
        spec = self.spec
        data: dict[str, Any] = {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "model_file": self.model_file,
            "tables": [t.to_dict() for t in spec.tables],
            "features": [
                {
                    "name": f.name,
                    "table": f.table,
                    "num_embeddings": f.num_embeddings,
                    "embedding_dim": f.embedding_dim,
                    "pooling": f.pooling.value,
                    "column_start": f.column_start,
                    "column_end": f.column_end,
                }
                for f in spec.features
            ],
            "input_schema": {
                "feature_order": list(spec.feature_names),
                "values": {"dtype": ["int64", "int32"], "shape": ["num_ids"]},
                "lengths": {"dtype": ["int32"], "shape": ["num_features * batch"], "layout": "feature-major"},
                "weights": {"dtype": ["float32"], "shape": ["num_ids"], "optional": True},
                "dense_features": (
                    {"dtype": ["float32"], "shape": ["batch", spec.num_dense_features]} if self.has_dense else None
                ),
            },
            "output": {"dtype": "float32", "shape": ["batch", spec.output_dim]},
            "dense": {
                "present": self.has_dense,
                "num_dense_features": spec.num_dense_features,
                **({"expects": self.dense_expects.to_dict()} if self.dense_expects is not None else {}),
            },
            "devices": list(self.devices),
            "sharding": {"plan_file": self.plan_file, "world_size": self.world_size},
            "kernels": [k.to_dict() for k in self.kernels],
            "versions": {
                "embserve": self.embserve_version,
                "torch": self.torch_version,
                "fbgemm_gpu": self.fbgemm_version,
            },
            "fbgemm": {"libraries": list(self.fbgemm_libraries), "build_dir": self.fbgemm_library_dir},
            "files": {e.name: e.to_dict() for e in self.files},
            **({"onnx": self.onnx.to_dict()} if self.onnx is not None else {}),
            **({"pt2": self.pt2.to_dict()} if self.pt2 is not None else {}),
        }
        if self.block_remaps:  # only then: a manifest without blocks stays what every loader already reads
            data["block_remaps"] = {r.table: r.to_dict() for r in self.block_remaps}
        if self.host_parts:  # only then: a one-host manifest stays what every loader already reads
            data["hosts"] = {
                "count": len(self.host_parts),
                "devices_per_host": self.devices_per_host,
                "parts": list(self.host_parts),
            }
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, data: Any) -> Manifest:
        """A manifest from parsed JSON: format and version first (their own messages), then the schema,
        then the rules that tie keys together. Every failure is ``ArtifactError(kind=MANIFEST)``."""
        if not isinstance(data, dict):
            raise ArtifactError(f"{MANIFEST_FILE} is not a JSON object", path=MANIFEST_FILE)
        if data.get("format") != FORMAT_NAME:
            format_name = str(data.get("format"))[:64]
            raise ArtifactError(
                f"{MANIFEST_FILE} is not an embserve manifest (format={format_name!r})", path=MANIFEST_FILE
            )
        version = data.get("format_version")
        if version not in READABLE_FORMAT_VERSIONS:
            raise ArtifactError(
                f"{MANIFEST_FILE} has format_version {str(version)[:32]}; this embserve reads versions "
                f"{list(READABLE_FORMAT_VERSIONS)}. Re-export the model with this embserve version",
                path=MANIFEST_FILE,
            )
        validate(data, "manifest", MANIFEST_FILE)
        dense = data["dense"]
        try:
            spec = ModelSpec.from_dict({"tables": data["tables"], "num_dense_features": dense["num_dense_features"]})
        except ConfigError as err:
            raise ArtifactError(f"{MANIFEST_FILE}: tables: {err}", path=MANIFEST_FILE) from None
        manifest = cls(
            spec=spec,
            has_dense=dense["present"],
            devices=tuple(data["devices"]),
            embserve_version=data["versions"]["embserve"],
            torch_version=data["versions"]["torch"],
            fbgemm_version=data["versions"]["fbgemm_gpu"],
            fbgemm_libraries=tuple(data["fbgemm"]["libraries"]),
            fbgemm_library_dir=data["fbgemm"]["build_dir"],
            files=tuple(FileEntry.from_dict(n, e) for n, e in data["files"].items()),
            format_version=version,
            model_file=data["model_file"],
            plan_file=data["sharding"]["plan_file"],
            world_size=data["sharding"]["world_size"],
            kernels=tuple(Kernel.from_dict(k) for k in data["kernels"]),
            onnx=OnnxEntry.from_dict(data["onnx"]) if data.get("onnx") is not None else None,
            pt2=Pt2Entry.from_dict(data["pt2"]) if "pt2" in data else None,
            host_parts=tuple(data["hosts"]["parts"]) if "hosts" in data else (),
            devices_per_host=data["hosts"]["devices_per_host"] if "hosts" in data else 0,
            dense_expects=PooledLayout.from_dict(dense["expects"]) if "expects" in dense else None,
            block_remaps=tuple(
                RemapEntry(name, entry["rows"], entry["sha256"]) for name, entry in data.get("block_remaps", {}).items()
            ),
        )
        manifest._check_consistency(data)
        return manifest

    def _check_consistency(self, data: Mapping[str, Any]) -> None:
        """The rules the schema cannot say: keys that must agree with each other."""
        spec = self.spec

        def fail(message: str) -> ArtifactError:
            return ArtifactError(f"{MANIFEST_FILE}: {message}", path=MANIFEST_FILE)

        derived = [
            (f.name, f.table, f.num_embeddings, f.embedding_dim, f.pooling.value, f.column_start, f.column_end)
            for f in spec.features
        ]
        listed = [
            (
                f["name"],
                f["table"],
                f["num_embeddings"],
                f["embedding_dim"],
                f["pooling"],
                f["column_start"],
                f["column_end"],
            )
            for f in data["features"]
        ]
        if listed != derived:
            raise fail("'features' disagrees with 'tables' (names, order, sizes or columns)")
        if tuple(data["input_schema"]["feature_order"]) != spec.feature_names:
            raise fail("input_schema.feature_order disagrees with 'features'")
        if data["output"]["shape"][-1:] != [spec.output_dim]:
            raise fail(f"output.shape must end with the output dim {spec.output_dim}")
        if self.has_dense and spec.num_dense_features < 1:
            raise fail("dense.present needs dense.num_dense_features >= 1")
        if self.dense_expects is not None:
            if not self.has_dense:
                raise fail("dense.expects is set but dense.present is false")
            problems = self.dense_expects.mismatches(spec)
            if problems:
                raise fail(f"dense.expects disagrees with 'features': {'; '.join(problems)}")
        names = {e.name for e in self.files}
        if self.model_file not in names:
            raise ArtifactError(
                f"{MANIFEST_FILE} has no checksum for {self.model_file}", path=self.model_file, kind=CHECKSUM
            )
        if self.world_size > 1 and self.plan_file is None:
            raise fail(f"sharding.world_size is {self.world_size} but sharding.plan_file is null")
        if self.plan_file is not None and self.plan_file not in names:
            raise ArtifactError(
                f"{MANIFEST_FILE} has no checksum for {self.plan_file}", path=self.plan_file, kind=CHECKSUM
            )
        if self.onnx is not None:
            onnx_files = [self.onnx.model_file, *self.onnx.data_files]
            onnx_files += [self.onnx.dense_file] if self.onnx.dense_file is not None else []
            for name in onnx_files:
                if name not in names:
                    raise ArtifactError(f"{MANIFEST_FILE} has no checksum for {name}", path=name, kind=CHECKSUM)
            if (self.onnx.dense_file is not None) != self.has_dense:
                raise fail("onnx.dense_file must be set exactly when dense.present is true")
        if self.pt2 is not None and self.pt2.file not in names:
            raise ArtifactError(
                f"{MANIFEST_FILE} has no checksum for {self.pt2.file}", path=self.pt2.file, kind=CHECKSUM
            )
        if self.host_parts:
            self._check_hosts(data, names)
        self._check_weight_files(data)
        self._check_block_remaps(fail)
        if self.plan_file is None:
            devices = (self.kernels[0].device,) if self.kernels else self.devices
            expected = [k.layout() for k in self.laid_out(expected_kernels(spec, None, devices), None)]
            if [k.layout() for k in self.kernels] != expected:
                raise fail("'kernels' disagrees with 'tables' (an unsharded model has one kernel holding every table)")

    def _check_block_remaps(self, fail: Any) -> None:
        """One remap per block table, in table order, as many ranks as the table has rows."""
        spec = self.spec
        listed = [r.table for r in self.block_remaps]
        if listed != list(spec.block_tables):
            missing = [t for t in spec.block_tables if t not in listed]
            extra = [t for t in listed if t not in spec.block_tables]
            which = (
                f"table {missing[0]!r} is held in blocks but has no remap"
                if missing
                else (
                    f"block_remaps names {extra[0]!r}, which 'tables' does not hold in blocks"
                    if extra
                    else "block_remaps is not in table order"
                )
            )
            raise fail(f"{which}; block_remaps disagrees with 'tables'")
        for remap in self.block_remaps:
            rows = spec.table(remap.table).num_embeddings
            if remap.rows != rows:
                raise fail(
                    f"block_remaps[{remap.table!r}] has {remap.rows} ranks but table {remap.table!r} has {rows} rows; "
                    "block_remaps disagrees with 'tables'"
                )

    def _check_weight_files(self, data: Mapping[str, Any]) -> None:
        """Version 3 keeps every CPU kernel's weights in a listed file, inside it; version 2 none."""
        sizes = self.file_bytes
        for index, (kernel, raw) in enumerate(zip(self.kernels, data["kernels"])):
            where = f"{MANIFEST_FILE}: kernels[{index}]"
            if "weights" in raw and "shared_storage" in raw:
                raise ArtifactError(f"{where} has both 'weights' and 'shared_storage'", path=MANIFEST_FILE)
            if not self.mapped:
                if kernel.weights is not None:
                    raise ArtifactError(
                        f"{where}.weights needs format_version {MAPPED_FORMAT_VERSION} (this manifest says "
                        f"{self.format_version}); the manifest is corrupted",
                        path=MANIFEST_FILE,
                    )
                continue
            if (kernel.weights is None) != (kernel.device != "cpu"):
                raise ArtifactError(
                    f"{where}: format_version {MAPPED_FORMAT_VERSION} keeps each CPU kernel's weights (and only "
                    "theirs) in a weight file ('weights'); the manifest is corrupted",
                    path=MANIFEST_FILE,
                )
            if kernel.weights is None or kernel.shared is None:
                continue
            name, first, size = kernel.weights.file, kernel.weights.offset, kernel.shared.total_bytes
            if name not in sizes:
                raise ArtifactError(f"{MANIFEST_FILE} has no checksum for {name}", path=name, kind=CHECKSUM)
            if first % PAGE_BYTES or first + size > sizes[name]:
                raise ArtifactError(
                    f"{where}.weights: bytes {first}..{first + size} do not lie page-aligned inside {name} "
                    f"({sizes[name]} bytes); the manifest is corrupted",
                    path=MANIFEST_FILE,
                )

    def laid_out(self, kernels: list[Kernel], plan: ShardingPlan | None) -> list[Kernel]:
        """The kernels a model of this manifest's format holds: ``kernels`` (``expected_kernels``) with, in a
        mapped artifact, every CPU weight buffer page-aligned in its weight file."""
        if not self.mapped:
            return kernels
        from infer.artifact.mapped import place_host_weights, place_weights

        if not self.host_parts:
            return place_weights(kernels)
        from infer.shard.hosts import host_of_rank

        assert plan is not None
        return place_host_weights(kernels, lambda rank: host_of_rank(plan, rank), self.num_hosts)

    def _check_hosts(self, data: Mapping[str, Any], names: set[str]) -> None:
        count = data["hosts"]["count"]
        if len(self.host_parts) != count:
            raise ArtifactError(
                f"{MANIFEST_FILE}: hosts.count is {count} but hosts.parts lists {len(self.host_parts)}",
                path=MANIFEST_FILE,
            )
        for host, part in enumerate(self.host_parts):
            if not part.startswith(f"hosts/{host}/"):
                raise ArtifactError(
                    f"{MANIFEST_FILE}: hosts.parts[{host}] is {part!r}; host {host}'s part lies under hosts/{host}/",
                    path=MANIFEST_FILE,
                )
            if part not in names:
                raise ArtifactError(f"{MANIFEST_FILE} has no checksum for {part}", path=part, kind=CHECKSUM)
        if self.model_file != self.host_parts[0]:
            raise ArtifactError(
                f"{MANIFEST_FILE}: model_file of a multi-host artifact is host 0's part {self.host_parts[0]!r}",
                path=MANIFEST_FILE,
            )
        if self.plan_file is None or self.world_size != count * self.devices_per_host:
            raise ArtifactError(
                f"{MANIFEST_FILE}: {count} hosts x {self.devices_per_host} devices need a plan of "
                f"{count * self.devices_per_host} devices (sharding.world_size is {self.world_size})",
                path=MANIFEST_FILE,
            )

    def host_files(self, host: int) -> tuple[str, ...]:
        """The files host ``host`` reads: the shared ones (plan) and its own part, not the other hosts' parts."""
        own = f"hosts/{host}/"
        return tuple(e.name for e in self.files if "/" not in e.name or e.name.startswith(own))

    @classmethod
    def read(cls, folder: Path) -> Manifest:
        path = folder / MANIFEST_FILE
        if not path.is_file():
            raise ArtifactError(missing_manifest(folder), path=str(path))
        size = path.stat().st_size
        if size > MAX_MANIFEST_BYTES:
            raise ArtifactError(f"{path} is {size} bytes, over the {MAX_MANIFEST_BYTES}-byte cap", path=str(path))
        return cls.from_dict(parse_document(path.read_bytes(), str(path)))

    def verify_files(self, folder: Path, only: tuple[str, ...] | None = None, verify: str = FULL) -> None:
        """Check every listed file's (or the ``only`` ones') size and sha256; raise ``ArtifactError`` naming the
        first bad one (and, for a file with chunk digests, the bad byte range). ``verify="none"``: sizes only."""
        self.start_verify(folder, only, verify=verify).wait()

    def start_verify(
        self, folder: Path, only: tuple[str, ...] | None = None, overlap: bool = False, verify: str = FULL
    ) -> PendingVerification:
        """Check paths and sizes and the sha256 of every file without chunk digests now; return the chunk
        hashing of the others, whose ``wait()`` raises like ``verify_files``. ``overlap=True``: start it now, so
        that the caller's own work runs meanwhile: in this process's threads for a mapped artifact (its
        ``model.pt`` is small), else in a child process (``torch.jit.load`` holds the GIL while it unpacks the
        weights). ``verify="none"`` checks paths and sizes only (a file of the wrong size is still refused
        before anything maps it)."""
        check_verify_mode(verify)
        if self.model_file not in {e.name for e in self.files}:
            raise ArtifactError(
                f"{MANIFEST_FILE} has no checksum for {self.model_file}", path=self.model_file, kind=CHECKSUM
            )
        chunked = []
        for entry in self.files:
            if only is not None and entry.name not in only:
                continue
            path = folder / entry.name
            if Path(entry.name).name != entry.name and not is_host_file(entry.name):
                raise ArtifactError(
                    f"{MANIFEST_FILE} lists a file outside the artifact: {entry.name!r}", path=entry.name, kind=CHECKSUM
                )
            if not path.is_file():
                raise ArtifactError(f"{path} is missing from the artifact", path=str(path), kind=CHECKSUM)
            size = path.stat().st_size
            if size != entry.bytes:
                raise ArtifactError(
                    f"{path} is {size} bytes but the manifest says {entry.bytes}; the file is truncated or corrupted",
                    path=str(path),
                    kind=CHECKSUM,
                )
            if entry.chunks is not None:
                # checked here, not in from_dict: the C++ loader reads no chunks and must give the same verdicts
                expected = entry.chunks.count_for(size)
                if len(entry.chunks.sha256) != expected:
                    raise ArtifactError(
                        f"{MANIFEST_FILE} lists {len(entry.chunks.sha256)} chunk digests for {path}, whose "
                        f"{size} bytes make {expected} chunks of {entry.chunks.bytes}; the manifest is corrupted",
                        path=str(path),
                        kind=CHECKSUM,
                    )
                chunked.append(ChunkedFile(path, size, entry.chunks))
                continue
            if verify == NONE:
                continue
            digest = sha256_file(path)
            if digest != entry.sha256:
                raise ArtifactError(
                    f"{path} fails its sha256 check ({digest[:12]}… != {entry.sha256[:12]}…); the file is corrupted",
                    path=str(path),
                    kind=CHECKSUM,
                )
        if verify == NONE:
            return PendingVerification([], overlap=False)
        return PendingVerification(chunked, overlap, in_threads=self.mapped)
