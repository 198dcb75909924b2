"""The C++ loader on mapped artifacts (format_version 3, weight files beside model.pt): lookups and predicts equal
Python's load of the same artifact and the embedded artifact bit for bit (and the fp32 reference); a flipped byte,
a truncated weight file, a wrong size or a disagreeing ``weights`` entry is the error kind Python gives, naming the
file (and chunk); the files are mapped once each, without write permission, and never written."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from infer.artifact.cpp_io import read_responses, write_requests
from infer.artifact.load import load
from infer.errors import ArtifactError, ArtifactErrorKind
from infer.features import SparseFeatures
from infer.quant.quantize import dequantized_weights, quantize
from infer.reference import FloatEmbeddingBagCollection
from infer.weights import random_weights
from tests.artifact.test_mapped import CHUNK, NUM_DENSE, PAGE, PLANS, _export_both
from tests.conftest import TinyOverArch, mixed_spec, random_batch
from tests.cpp.support import assert_clean_failure, run
from tests.support.artifacts import copy_artifact, edit_manifest

KIND_NAMES = {
    ArtifactErrorKind.MANIFEST: "ManifestError",
    ArtifactErrorKind.CHECKSUM: "ChecksumError",
    ArtifactErrorKind.MODEL: "ModelError",
}


@pytest.fixture(scope="module")
def quantized():
    spec = mixed_spec()
    torch.manual_seed(1)
    spec = spec.with_dense_arch(TinyOverArch(NUM_DENSE, spec.output_dim), NUM_DENSE)
    return spec, quantize(spec, random_weights(spec, seed=27))


@pytest.fixture(scope="module", params=list(PLANS))
def pair(request, quantized, tmp_path_factory):
    """(plan name, embedded artifact, mapped artifact) of one model; weight files in 4 KiB chunks."""
    spec, model = quantized
    embedded, mapped, _ = _export_both(spec, model, PLANS[request.param], tmp_path_factory.mktemp("cppmap"))
    return request.param, embedded, mapped


@pytest.fixture(scope="module")
def unsharded(quantized, tmp_path_factory) -> Path:
    spec, model = quantized
    return _export_both(spec, model, None, tmp_path_factory.mktemp("cppmap_unsharded"))[1]


@pytest.fixture(scope="module")
def maps_check(cpp_build: Path) -> Path:
    return cpp_build / "embserve_maps_check"


def _requests(spec: Any) -> tuple[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]], list[Any]]:
    """Lookups (int64 and int32 ids, weighted or not, a batch of 1) and predicts, with their dense features."""
    requests, dense = [], []
    for seed, (id_dtype, weighted, batch, predict) in enumerate(
        [
            (torch.int64, False, 16, False),
            (torch.int32, True, 9, False),
            (torch.int64, False, 1, False),
            (torch.int64, True, 13, True),
            (torch.int32, False, 4, True),
        ]
    ):
        b = random_batch(spec, batch_size=batch, max_len=7, weighted=weighted, seed=seed, id_dtype=id_dtype)
        requests.append((b.values, b.lengths, b.weights))
        dense.append(torch.randn(batch, NUM_DENSE, generator=torch.Generator().manual_seed(seed)) if predict else None)
    return requests, dense


def _cpp_outputs(embserve_run: Path, artifact: Path, requests_file: Path, out: Path, *flags: str) -> list[torch.Tensor]:
    result = run(embserve_run, artifact, "--requests", requests_file, "--out", out, *flags)
    assert result.returncode == 0, result.stderr[-2000:]
    responses = read_responses(out)
    assert all(r.ok for r in responses), [r.message for r in responses]
    return [r.output for r in responses]  # type: ignore[misc]


def test_cpp_lookups_and_predicts_equal_python_and_the_embedded_artifact(quantized, pair, embserve_run, tmp_path):
    spec, model = quantized
    kind, embedded, mapped = pair
    assert json.loads((mapped / "manifest.json").read_text())["format_version"] == 3
    requests, dense = _requests(spec)
    write_requests(tmp_path / "r.bin", requests, dense)
    from_mapped = _cpp_outputs(embserve_run, mapped, tmp_path / "r.bin", tmp_path / "m.bin")
    from_mapped_unverified = _cpp_outputs(
        embserve_run, mapped, tmp_path / "r.bin", tmp_path / "n.bin", "--verify", "none"
    )
    from_embedded = _cpp_outputs(embserve_run, embedded, tmp_path / "r.bin", tmp_path / "e.bin")
    runtime = load(mapped)
    reference = FloatEmbeddingBagCollection(spec, dequantized_weights(spec, model))
    for (values, lengths, weights), features, got, unverified, embedded_out in zip(
        requests, dense, from_mapped, from_mapped_unverified, from_embedded
    ):
        batch = SparseFeatures(spec.feature_names, values, lengths, weights)
        expected = runtime.lookup(batch) if features is None else runtime.predict(batch, features)
        assert torch.equal(got, expected), kind
        assert torch.equal(unverified, expected) and torch.equal(embedded_out, expected), kind
        pooled = reference(batch)
        with torch.no_grad():
            fp32 = pooled if features is None else spec.dense_arch(features, pooled)
        torch.testing.assert_close(got, fp32, rtol=1e-5, atol=1e-5)


def _maps(maps_check: Path, artifact: Path, verify: str) -> list[tuple[str, str]]:
    """(permissions, file) of every mapping of an artifact file in a C++ process that loaded it."""
    result = run(maps_check, artifact, verify)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]
    lines = [line.split(maxsplit=6) for line in result.stdout.splitlines() if line.startswith("map: ")]
    return [(fields[2], fields[6]) for fields in lines]


@pytest.mark.parametrize("verify", ["full", "none"])
def test_weight_files_are_mapped_once_without_write_permission_from_a_read_only_folder(
    pair, maps_check, embserve_run, tmp_path, verify
):
    kind, _, mapped = pair
    artifact = copy_artifact(mapped, tmp_path)
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in artifact.iterdir()}
    for path in [*artifact.iterdir(), artifact]:
        path.chmod(path.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    try:
        maps = _maps(maps_check, artifact, verify)
        names = {k["weights"]["file"] for k in json.loads((artifact / "manifest.json").read_text())["kernels"]}
        # each weight file mapped once (CPU replicas view one mapping), readable, never writable
        assert sorted(Path(file).name for _, file in maps) == sorted(names), (kind, maps)
        assert all(perms[0] == "r" and perms[1] == "-" for perms, _ in maps), maps
        b = random_batch(mixed_spec(), batch_size=8, seed=3)
        write_requests(tmp_path / "r.bin", [(b.values, b.lengths, None)])
        result = run(embserve_run, artifact, "--requests", tmp_path / "r.bin", "--out", tmp_path / "o.bin")
        assert result.returncode == 0, result.stderr[-2000:]
        assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in artifact.iterdir()} == before
    finally:
        for path in [artifact, *artifact.iterdir()]:
            path.chmod(path.stat().st_mode | stat.S_IWUSR)


def _python_verdict(artifact: Path, verify: str) -> str:
    try:
        load(artifact, verify=verify)
    except ArtifactError as err:
        return f"{KIND_NAMES[err.kind]}: {err}"
    return "ok"


def _cpp_verdicts(cpp_build: Path, folders: list[Path]) -> list[str]:
    result = subprocess.run(
        [str(cpp_build / "embserve_manifest_check"), "--load", *map(str, folders)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.splitlines()


def _flip(offset: int) -> Callable[[Path], None]:
    def flip(artifact: Path) -> None:
        path = artifact / "weights-0.bin"
        data = bytearray(path.read_bytes())
        data[offset] ^= 0x5A
        path.write_bytes(bytes(data))

    return flip


def _truncate(artifact: Path) -> None:
    path = artifact / "weights-0.bin"
    os.truncate(path, path.stat().st_size - PAGE)


def _grow_in_manifest(artifact: Path) -> None:
    size = (artifact / "weights-0.bin").stat().st_size
    edit_manifest(artifact, lambda d: d["files"]["weights-0.bin"].update(bytes=size + PAGE))


def _kernel_edit(edit: Callable[[dict[str, Any]], Any]) -> Callable[[Path], None]:
    return lambda artifact: edit_manifest(artifact, lambda d: edit(d["kernels"][0]))


# (case, tamper, fragment every verdict names, C++ kind with --verify full, with --verify none)
CASES: list[tuple[str, Callable[[Path], None], str, str, str]] = [
    (
        "flipped_byte",
        _flip(3 * CHUNK + 17),
        f"weights-0.bin fails its sha256 check in bytes {3 * CHUNK}-{4 * CHUNK - 1} (chunk 3 of ",
        "ChecksumError",
        "ok",
    ),
    ("truncated", _truncate, "weights-0.bin is ", "ChecksumError", "ChecksumError"),
    ("wrong_size", _grow_in_manifest, "weights-0.bin is ", "ChecksumError", "ChecksumError"),
    (
        "entry_bytes",
        _kernel_edit(lambda k: k["weights"].update(bytes=k["weights"]["bytes"] - 1)),
        "'kernels' disagrees with 'tables'",
        "ManifestError",
        "ManifestError",
    ),
    (
        "entry_offset_past_end",
        _kernel_edit(lambda k: k["weights"].update(offset=PAGE)),
        "do not lie page-aligned inside weights-0.bin",
        "ManifestError",
        "ManifestError",
    ),
    (
        "entry_offset_unaligned",
        _kernel_edit(lambda k: k["weights"].update(offset=1)),
        "do not lie page-aligned inside weights-0.bin",
        "ManifestError",
        "ManifestError",
    ),
    (
        "entry_table_offsets",
        _kernel_edit(lambda k: k["weights"].update(table_offsets=[o + 128 for o in k["weights"]["table_offsets"]])),
        "'kernels' disagrees with 'tables'",
        "ManifestError",
        "ManifestError",
    ),
    (
        "entry_unlisted_file",
        _kernel_edit(lambda k: k["weights"].update(file="weights-7.bin")),
        "has no checksum for weights-7.bin",
        "ChecksumError",
        "ChecksumError",
    ),
    (
        "entry_both_keys",
        _kernel_edit(lambda k: k.update(shared_storage={"bytes": 1, "table_offsets": [0]})),
        "has both 'weights' and 'shared_storage'",
        "ManifestError",
        "ManifestError",
    ),
    (
        "entry_missing",
        _kernel_edit(lambda k: k.pop("weights")),
        "format_version 3 keeps each CPU kernel's weights",
        "ManifestError",
        "ManifestError",
    ),
    (
        "format_version_2",
        lambda artifact: edit_manifest(artifact, lambda d: d.update(format_version=2)),
        "needs format_version 3",
        "ManifestError",
        "ManifestError",
    ),
]


@pytest.mark.parametrize("verify", ["full", "none"])
def test_a_bad_weight_file_or_entry_is_the_error_python_gives(unsharded, cpp_build, embserve_run, tmp_path, verify):
    folders = []
    for name, tamper, _, _, _ in CASES:
        folder = copy_artifact(unsharded, tmp_path / name)
        tamper(folder)
        folders.append(folder)
    for (name, _, fragment, full_kind, none_kind), folder in zip(CASES, folders):
        expected = full_kind if verify == "full" else none_kind
        python = _python_verdict(folder, verify)
        assert python.split(":")[0] == expected, (name, python)
        if expected == "ok":  # --verify none checks sizes only: a flipped byte loads (and answers), as in Python
            assert run(embserve_run, folder, "--verify", verify).returncode == 0, name
        else:
            assert fragment in python, (name, python)
            flags = ("--verify", verify)
            line = assert_clean_failure(run(embserve_run, folder, *flags), f"embserve_run: {expected}: ", fragment)
            assert str(folder / "manifest.json") in line or str(folder / "weights-0.bin") in line, line
    if verify == "full":  # every load of a bad one in one C++ process too: the same verdicts as Python's
        cpp = _cpp_verdicts(cpp_build, folders)
        assert [v.split(":")[0] for v in cpp] == [c[3] for c in CASES], cpp


def test_a_weights_entry_that_disagrees_with_the_derived_layout_is_refused_by_both(pair, cpp_build, tmp_path):
    """A table moved to another offset inside its weight file disagrees with the layout both loaders derive from
    the spec (and the plan, when sharded): refused by both, whatever the plan."""
    kind, _, mapped = pair
    artifact = copy_artifact(mapped, tmp_path)
    edit_manifest(artifact, lambda d: d["kernels"][-1]["weights"]["table_offsets"].__setitem__(0, 128))
    python = _python_verdict(artifact, "none")
    (cpp,) = _cpp_verdicts(cpp_build, [artifact])
    assert python.startswith("ManifestError") and cpp.startswith("ManifestError"), (python, cpp)
    if kind != "unsharded":
        assert "disagree" in python and "'kernels' disagree with the plan" in cpp


def test_bench_prints_the_load_time_and_rate(unsharded, embserve_run, tmp_path):
    b = random_batch(mixed_spec(), batch_size=2, seed=4)
    write_requests(tmp_path / "r.bin", [(b.values, b.lengths, None)])
    listed = sum(e["bytes"] for e in json.loads((unsharded / "manifest.json").read_text())["files"].values())
    for verify in ("full", "none"):
        result = run(embserve_run, unsharded, "--requests", tmp_path / "r.bin", "--bench", 3, "--verify", verify)
        assert result.returncode == 0, result.stderr
        line = json.loads(result.stdout.strip().splitlines()[-1])
        assert line["verify"] == verify and line["load_bytes"] == listed
        assert line["load_s"] > 0 and line["load_gb_per_s"] > 0
    assert run(embserve_run, unsharded, "--verify", "some").returncode == 2
