"""The two loaders enforce one schema and one set of cross-checks: seeded random mutations of manifest.json
and plan.json get the same verdict from the C++ loader (``embserve::check_manifest``) and the Python one
(``Manifest.read`` then ``verify_plan``): accepted, a manifest error, or a checksum error."""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path
from typing import Any

import pytest

from infer.artifact.load import verify_plan
from infer.artifact.manifest import Manifest
from infer.errors import ArtifactError, ArtifactErrorKind
from infer.storage import checksums as verify

SEED = 23
MUTANTS = 400  # per artifact kind; all in one C++ process, a few seconds
VALUES: list[Any] = [
    None, True, 0, 1, -1, 2, 3, 4, 6, 16, 2**31, 2**50, 2**63, 2**64, 1.5, 4.0, 1e30, "", "x", "cpu", "cuda:0",
    "int8", "int4", "fp16", "sum", "row_wise", "table_wise", "plan.json", "model.pt", "a/b", "a\x00b", "é" * 200,
    [], [1], {}, {"k": 1},
]  # fmt: skip


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path of a JSON value, containers included."""
    found = [prefix] if prefix else []
    if isinstance(node, dict):
        for key, value in node.items():
            found += _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found += _paths(value, (*prefix, index))
    return found


def _mutate(document: Any, rng: random.Random) -> Any:
    data = json.loads(json.dumps(document))
    *parents, last = rng.choice(_paths(data))
    node: Any = data
    for part in parents:
        node = node[part]
    action = rng.random()
    if action < 0.15 and isinstance(node, dict):
        del node[last]
    elif action < 0.25 and isinstance(node, dict):
        node[rng.choice(["extra", "name", "dtype", "rows"])] = rng.choice(VALUES)
    elif action < 0.5 and isinstance(node[last], int) and not isinstance(node[last], bool):
        node[last] += rng.choice([-1, 1, 4, -4, 1 << 31])
    elif action < 0.6 and isinstance(node, list) and len(node) > 1:
        node.reverse()
    else:
        node[last] = rng.choice(VALUES)
    return data


def _python_verdict(folder: Path) -> str:
    try:
        manifest = Manifest.read(folder)
        if manifest.plan_file is not None:
            verify_plan(folder, manifest)
    except ArtifactError as err:
        return {ArtifactErrorKind.MANIFEST: "ManifestError", ArtifactErrorKind.CHECKSUM: "ChecksumError"}.get(
            err.kind, err.kind.name
        )
    return "ok"


def _mutants(artifact: Path, root: Path, rng: random.Random, count: int) -> list[Path]:
    manifest = json.loads((artifact / "manifest.json").read_text())
    plan_path = artifact / "plan.json"
    plan = json.loads(plan_path.read_text()) if plan_path.is_file() else None
    folders = []
    for i in range(count):
        folder = root / f"m{i:03d}"
        folder.mkdir(parents=True)
        for other in artifact.iterdir():  # model.pt, model.onnx, ...: listed files exist
            if other.name not in ("manifest.json", "plan.json"):
                (folder / other.name).symlink_to(other)
        mutate_plan = plan is not None and rng.random() < 0.4
        (folder / "manifest.json").write_text(json.dumps(manifest if mutate_plan else _mutate(manifest, rng)))
        if plan is not None:
            (folder / "plan.json").write_text(json.dumps(_mutate(plan, rng) if mutate_plan else plan))
        folders.append(folder)
    return folders


@pytest.fixture(scope="module")
def chunked_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An artifact whose model file lists per-chunk sha256 (small chunks, so mutations land in the list)."""
    from infer.artifact.export import export
    from infer.quant.quantize import quantize
    from infer.weights import random_weights
    from tests.conftest import mixed_spec

    spec = mixed_spec()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(verify, "CHUNK_BYTES", 1 << 14)
        patch.setattr(verify, "CHUNKED_MIN_BYTES", 0)
        return export(quantize(spec, random_weights(spec, seed=3)), tmp_path_factory.mktemp("cpp") / "chunked")


def test_cpp_and_python_give_the_same_verdicts(
    cpp_build, unsharded_artifact, sharded_artifact, onnx_artifact, chunked_artifact, tmp_path
):
    rng = random.Random(SEED)
    folders = _mutants(unsharded_artifact, tmp_path / "unsharded", rng, MUTANTS)
    folders += _mutants(sharded_artifact, tmp_path / "sharded", rng, MUTANTS)
    folders += _mutants(onnx_artifact, tmp_path / "onnx", rng, MUTANTS // 2)
    folders += _mutants(chunked_artifact, tmp_path / "chunked", rng, MUTANTS // 2)
    result = subprocess.run(
        [str(cpp_build / "embserve_manifest_check"), *map(str, folders)],
        capture_output=True,
        text=True,
        errors="replace",
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert len(lines) == len(folders)
    disagreements = []
    verdicts: dict[str, int] = {}
    for folder, line in zip(folders, lines):
        cpp = line.split(":", 1)[0]
        python = _python_verdict(folder)
        verdicts[python] = verdicts.get(python, 0) + 1
        if cpp != python:
            disagreements.append(f"{folder.parent.name}/{folder.name}: C++ {line[:300]!r}; Python {python}")
    assert not disagreements, f"{len(disagreements)} disagreements:\n" + "\n".join(disagreements[:20])
    assert verdicts.get("ok", 0) > 10 and verdicts.get("ManifestError", 0) > 100, verdicts


def test_cpp_loader_loads_a_chunked_artifact_and_checks_the_whole_file(embserve_run, chunked_artifact, tmp_path):
    """Chunk digests are for the Python loader; the C++ loader accepts them and keeps checking whole files."""
    from tests.cpp.support import assert_clean_failure, run
    from tests.support.artifacts import copy_artifact

    assert run(embserve_run, chunked_artifact).returncode == 0
    copy = copy_artifact(chunked_artifact, tmp_path)
    data = bytearray((copy / "model.pt").read_bytes())
    data[len(data) // 2] ^= 0x5A
    (copy / "model.pt").write_bytes(bytes(data))
    assert_clean_failure(run(embserve_run, copy), "embserve_run: ChecksumError: ")


def test_pt2_entries_get_the_same_verdicts(cpp_build, pt2_artifact, tmp_path):
    """Mutations inside the manifest's `pt2` entry and of model.pt2's checksum entry: same verdict from both."""
    rng = random.Random(SEED + 1)
    manifest = json.loads((pt2_artifact / "manifest.json").read_text())
    folders = []
    for i in range(120):
        folder = tmp_path / f"p{i:03d}"
        folder.mkdir()
        for other in pt2_artifact.iterdir():
            if other.name != "manifest.json":
                (folder / other.name).symlink_to(other)
        data = json.loads(json.dumps(manifest))
        if i % 10 == 0:
            del data["files"]["model.pt2"]
        elif i % 10 == 1:
            data["pt2"]["file"] = "other.pt2"
        else:
            data["pt2"] = _mutate(data["pt2"], rng)
        (folder / "manifest.json").write_text(json.dumps(data))
        folders.append(folder)
    result = subprocess.run(
        [str(cpp_build / "embserve_manifest_check"), *map(str, folders)], capture_output=True, text=True, timeout=300
    )
    lines = result.stdout.splitlines()
    assert result.returncode == 0 and len(lines) == len(folders), result.stderr[-2000:]
    verdicts = [(line.split(":", 1)[0], _python_verdict(folder), line) for folder, line in zip(folders, lines)]
    disagreements = [f"{cpp} vs Python {python}: {line[:300]}" for cpp, python, line in verdicts if cpp != python]
    assert not disagreements, "\n".join(disagreements[:20])
    kinds = {python for _, python, _ in verdicts}
    assert {"ok", "ManifestError", "ChecksumError"} <= kinds, kinds
