"""Editing exported artifacts in tests: copy one, rewrite its manifest, re-hash a file after tampering."""

from __future__ import annotations

import hashlib
import json
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


def copy_artifact(artifact: Path, folder: Path) -> Path:
    copy = folder / "copy"
    shutil.copytree(artifact, copy)
    return copy


def damage_file(path: Path, damage: str) -> None:
    """``flipped_byte``: one bit of the middle byte flipped; ``truncated``: the last 4 KiB page cut off."""
    data = bytearray(path.read_bytes())
    if damage == "flipped_byte":
        data[len(data) // 2] ^= 0x01
    elif damage == "truncated":
        data = data[: len(data) - 4096]
    else:
        raise ValueError(f"unknown damage {damage!r}")
    path.write_bytes(bytes(data))


def edit_manifest(artifact: Path, edit: Callable[[dict[str, Any]], Any]) -> None:
    path = artifact / "manifest.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=2))


def shrink_table_in_manifest(artifact: Path, table: str, rows: int) -> None:
    """A hand edit of a table's row count in manifest.json (the table and its features), as a user makes one."""

    def edit(manifest: dict[str, Any]) -> None:
        for entry in manifest["tables"] + manifest["features"]:
            if entry.get("table", entry["name"]) == table:
                entry["num_embeddings"] = rows

    edit_manifest(artifact, edit)


def rehash(artifact: Path, name: str) -> None:
    """Make the manifest's size and sha256 of ``name`` match the file again (what a careless tool does)."""
    data = (artifact / name).read_bytes()
    edit_manifest(
        artifact, lambda m: m["files"].update({name: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}})
    )


def tamper_row_bucketing(artifact: Path, folder: Path, holder_path: str, attribute: str) -> Path:
    """A copy of a sharded artifact whose one-call row-wise bucketing attribute (on ``embeddings`` or
    ``embeddings.shards.<i>``) is changed and the model rehashed: what a tool editing model.pt would leave. A
    model that bucketizes nothing (one CPU host: row-wise shards are views) gains a block or a slot."""
    import torch

    copy = copy_artifact(artifact, folder)
    module = torch.jit.load(str(copy / "model.pt"))
    holder = module
    for name in holder_path.split("."):
        holder = getattr(holder, name)
    values = [list(v) if isinstance(v, list) else v for v in getattr(holder, attribute)]
    if not values:
        values = [[0, 1]]
    elif isinstance(values[0], list):
        values[0][1] += 1
    else:
        values = [v + 1 for v in values]
    setattr(holder, attribute, values)
    module.save(str(copy / "model.pt"))
    rehash(copy, "model.pt")
    return copy


def rewrite_zip_entry(model: Path, name: str, data: bytes) -> None:
    """Replace one entry of a zip archive (model.pt) with a valid CRC, as a tool that edits the archive would."""
    with zipfile.ZipFile(model) as source:
        entries = [(info, source.read(info.filename)) for info in source.infolist()]
    with zipfile.ZipFile(model, "w") as target:
        for info, content in entries:
            target.writestr(info, data if info.filename == name else content)


def save_weights_in_model(artifact: Path, folder: Path, model_file: str = "model.pt", kernel: int = 0) -> Path:
    """A copy of a mapped artifact whose ``model_file`` carries kernel ``kernel``'s weight buffer again (the bytes
    of its weight file, saved in ``weights_host``), rehashed: what a tool that re-saves a loaded model leaves."""
    import torch

    from infer.artifact.fbgemm_libs import load_fbgemm
    from infer.artifact.kernels import model_tbes

    load_fbgemm()
    copy = copy_artifact(artifact, folder)
    part = Path(model_file).parent.as_posix()  # "." or hosts/<h>, whose kernels' files lie in it
    own = [
        k["weights"]
        for k in json.loads((copy / "manifest.json").read_text())["kernels"]
        if "weights" in k and (part == "." or k["weights"]["file"].startswith(f"{part}/"))
    ]
    weights = own[kernel]
    data = (copy / weights["file"]).read_bytes()[weights["offset"] : weights["offset"] + weights["bytes"]]
    module = torch.jit.load(str(copy / model_file))
    model_tbes(module)[kernel].weights_host = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    module.save(str(copy / model_file))
    rehash(copy, model_file)
    return copy


def remap_entry(model_file: Path, lookup: Any) -> str:
    """The zip entry of model.pt holding the id remaps' bytes (``block_lookup``: every block feature's remap)."""
    wanted = lookup.numpy().astype("<i4").tobytes()
    with zipfile.ZipFile(model_file) as archive:
        for info in archive.infolist():
            if archive.read(info.filename) == wanted:
                return info.filename
    raise AssertionError("model.pt holds no entry with the remaps' bytes")


def edit_remap(copy: Path, model: Any, feature: int, edit: Callable[[Any], None], model_file: str = "model.pt") -> None:
    """Apply ``edit`` to the remap that ``feature`` (its index) reads, in the copy's ``model_file`` (``model`` holds
    ``embeddings.block_lookup``: the collection, or one device's shards)."""
    lookup = model.embeddings.block_lookup
    start, end = model.embeddings.block_lookup_offsets[feature : feature + 2].tolist()
    name = remap_entry(copy / model_file, lookup)
    data = np.frombuffer(bytearray(lookup.numpy().astype("<i4").tobytes()), dtype="<i4").copy()
    edit(data[start:end])
    rewrite_zip_entry(copy / model_file, name, data.tobytes())
