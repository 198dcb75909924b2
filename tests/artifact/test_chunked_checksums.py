"""Per-chunk sha256 of large files (infer/storage/checksums.py): written at export, verified at load in parallel.

The artifacts here are small, so the chunk size and the size from which files get chunks are lowered for
the export; every test runs both ways of hashing at load: a child interpreter overlapping ``torch.jit.load``
and this process's thread pool.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch

from infer.artifact.export import export
from infer.artifact.load import load
from infer.artifact.manifest import Manifest
from infer.cli import main
from infer.errors import ArtifactError, ArtifactErrorKind
from infer.quant.quantize import quantize
from infer.storage import checksums as verify
from infer.weights import random_weights
from tests.conftest import mixed_spec, random_batch
from tests.support.artifacts import copy_artifact, edit_manifest

CHUNK = 4096


@pytest.fixture(scope="module")
def chunked(tmp_path_factory) -> Path:
    spec = mixed_spec()
    model = quantize(spec, random_weights(spec, seed=41))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(verify, "CHUNK_BYTES", CHUNK)
        patch.setattr(verify, "CHUNKED_MIN_BYTES", 0)
        # the embedded format: its large model.pt is what a child interpreter hashes while torch.jit.load reads it
        return export(model, tmp_path_factory.mktemp("chunked") / "artifact", weights="embedded")


@pytest.fixture(params=["child", "threads"])
def hasher(request, monkeypatch) -> str:
    """Which hasher the load uses: a child interpreter (at any size here) or this process's threads."""
    monkeypatch.setattr(verify, "SUBPROCESS_MIN_BYTES", 0)
    monkeypatch.setattr(verify, "USE_SUBPROCESS", request.param == "child")
    return str(request.param)


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x5A
    path.write_bytes(bytes(data))


def test_export_writes_the_digest_of_every_chunk(chunked):
    files = json.loads((chunked / "manifest.json").read_text())["files"]
    assert files, files
    for name, entry in files.items():
        data = (chunked / name).read_bytes()
        assert entry["bytes"] == len(data) and entry["sha256"] == hashlib.sha256(data).hexdigest()
        chunks = entry["chunks"]
        assert chunks["bytes"] == CHUNK
        expected = [hashlib.sha256(data[i : i + CHUNK]).hexdigest() for i in range(0, len(data), CHUNK)]
        assert chunks["sha256"] == expected and len(expected) > 10


def test_files_below_the_threshold_get_no_chunks(tmp_path):
    spec = mixed_spec()
    path = export(quantize(spec, random_weights(spec, seed=2)), tmp_path / "small")
    assert all("chunks" not in e for e in json.loads((path / "manifest.json").read_text())["files"].values())


def test_a_chunked_artifact_loads_and_runs(chunked, hasher):
    runtime = load(chunked)
    reference = load(chunked)  # independent of the hasher: the same module twice gives the same rows
    batch = random_batch(runtime.spec, 8, max_len=5, weighted=False, seed=1)
    assert torch.equal(runtime.lookup(batch), reference.lookup(batch))
    assert runtime.load_bytes == sum(e.bytes for e in runtime.manifest.files) and runtime.load_seconds > 0


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_flipped_byte_fails_the_load_naming_its_chunk(chunked, hasher, tmp_path, where):
    copy = copy_artifact(chunked, tmp_path)
    model = copy / "model.pt"
    size = model.stat().st_size
    count = -(-size // CHUNK)
    index = {"first": 0, "middle": count // 2, "last": count - 1}[where]
    first = index * CHUNK
    last = min(size, first + CHUNK) - 1
    _flip(model, (first + last) // 2)
    with pytest.raises(ArtifactError) as info:
        load(copy)
    assert info.value.kind == ArtifactErrorKind.CHECKSUM
    message = str(info.value)
    assert str(model) in message and f"in bytes {first}-{last} " in message, message
    assert re.search(
        r"fails its sha256 check in bytes \d+-\d+ \(chunk \d+ of \d+: [0-9a-f]{12}… != [0-9a-f]{12}…\)", message
    )
    with pytest.raises(ArtifactError, match=f"in bytes {first}-{last} "):  # inspect --verify and hosts use this
        Manifest.read(copy).verify_files(copy)


@pytest.mark.parametrize("change", ["truncated", "extended"])
def test_a_truncated_or_extended_file_fails_before_hashing(chunked, hasher, tmp_path, change):
    copy = copy_artifact(chunked, tmp_path)
    model = copy / "model.pt"
    data = model.read_bytes()
    model.write_bytes(data[:-100] if change == "truncated" else data + b"\0" * CHUNK)
    with pytest.raises(ArtifactError, match="the file is truncated or corrupted") as info:
        load(copy)
    assert info.value.kind == ArtifactErrorKind.CHECKSUM


def test_chunk_digests_that_do_not_cover_the_file_fail_the_load(chunked, hasher, tmp_path):
    copy = copy_artifact(chunked, tmp_path)
    edit_manifest(copy, lambda m: m["files"]["model.pt"]["chunks"]["sha256"].pop())
    Manifest.read(copy)  # the schema allows it (as the C++ loader, which reads no chunks) ...
    with pytest.raises(ArtifactError, match="chunk digests for .* the manifest is corrupted") as info:
        load(copy)  # ... the Python verification does not
    assert info.value.kind == ArtifactErrorKind.CHECKSUM


@pytest.mark.parametrize("edit", ["bytes", "digest"])
def test_schema_rejects_bad_chunks(chunked, tmp_path, edit):
    copy = copy_artifact(chunked, tmp_path)

    def tamper(manifest):  # type: ignore[no-untyped-def]
        chunks = manifest["files"]["model.pt"]["chunks"]
        if edit == "bytes":
            chunks["bytes"] = 100
        else:
            chunks["sha256"][1] = "xyz"

    edit_manifest(copy, tamper)
    fragment = "chunks.bytes must be at least 4096" if edit == "bytes" else "chunks.sha256[1] must be 64 lowercase"
    with pytest.raises(ArtifactError, match=re.escape(fragment)) as info:
        load(copy)
    assert info.value.kind == ArtifactErrorKind.MANIFEST


def test_an_artifact_without_chunks_still_loads_and_is_checked_whole(chunked, tmp_path):
    copy = copy_artifact(chunked, tmp_path)
    edit_manifest(copy, lambda m: [e.pop("chunks") for e in m["files"].values()])
    assert load(copy).manifest.file("model.pt").chunks is None
    _flip(copy / "model.pt", 5000)
    with pytest.raises(ArtifactError, match=r"fails its sha256 check \(") as info:
        load(copy)
    assert info.value.kind == ArtifactErrorKind.CHECKSUM


@pytest.mark.parametrize("failure", ["no_interpreter", "child_fails"])
def test_a_hasher_that_cannot_run_never_passes_a_file_unread(chunked, tmp_path, monkeypatch, failure):
    monkeypatch.setattr(verify, "SUBPROCESS_MIN_BYTES", 0)
    if failure == "no_interpreter":
        monkeypatch.setattr(verify.sys, "executable", str(tmp_path / "no-python"))
    else:
        monkeypatch.setattr(verify, "_HASHER_SOURCE", "import sys; print('[]'); sys.exit(3)")
    copy = copy_artifact(chunked, tmp_path)
    load(copy)
    _flip(copy / "model.pt", CHUNK * 3 + 7)
    with pytest.raises(ArtifactError, match=f"in bytes {CHUNK * 3}-{CHUNK * 4 - 1} "):
        load(copy)


def test_cli_reports_the_rate(chunked, capsys):
    assert main(["inspect", str(chunked), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "chunk digests)" in out
    assert re.search(r"checksums verified: 1 files, [\d.]+ GB in [\d.]+s, [\d.]+ GB/s", out), out
    assert main(["run", str(chunked), "--batch-size", "4"]) == 0
    assert re.search(r"load rate: [\d.]+ GB in [\d.]+s, [\d.]+ GB/s, checksums included", capsys.readouterr().out)
