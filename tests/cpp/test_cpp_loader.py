"""The C++ loader (cpp_loader/) against the Python runtime: same outputs, typed errors, threads."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from infer.artifact.cpp_io import read_responses, write_requests
from infer.artifact.load import load
from infer.features import SparseFeatures
from tests.conftest import mixed_spec, random_batch


def run(embserve_run: Path, *args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(embserve_run), *map(str, args)], capture_output=True, text=True, timeout=300)


def parity_requests() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    spec = mixed_spec()
    requests = []
    for seed, (id_dtype, weighted, batch) in enumerate(
        [
            (torch.int64, False, 16),
            (torch.int32, False, 16),
            (torch.int64, True, 8),
            (torch.int32, True, 8),
            (torch.int64, False, 1),
            (torch.int32, True, 33),
        ]
    ):
        b = random_batch(spec, batch_size=batch, weighted=weighted, seed=seed, id_dtype=id_dtype)
        requests.append((b.values, b.lengths, b.weights))
    return requests


@pytest.mark.parametrize(
    ("kind", "entry"),
    [("unsharded", "checked"), ("sharded", "checked"), ("unsharded", "unchecked"), ("sharded", "unchecked")]
    + [("embedded_unsharded", "unchecked")],
)
def test_outputs_equal_python(
    kind, entry, embserve_run, unsharded_artifact, embedded_unsharded_artifact, sharded_artifact, tmp_path
):
    """Model::lookup, and Model::lookup_unchecked after Model::validate (``--unchecked``: the entry embserve-server
    runs after its own checks), answer as the Python runtime does, bit for bit. An unsharded CPU model's
    lookup_unchecked runs fbgemm's op directly (no TorchScript interpreter): it answers bit for bit as the
    interpreter does ($EMBSERVE_FORCE_TORCHSCRIPT=1) and as Python; a sharded model keeps the interpreter."""
    artifact = {"unsharded": unsharded_artifact, "embedded_unsharded": embedded_unsharded_artifact}.get(
        kind, sharded_artifact
    )
    requests = parity_requests()
    write_requests(tmp_path / "requests.bin", requests)
    runtime = load(artifact)
    expected = [runtime.lookup(SparseFeatures(runtime.feature_names, v, n, w)) for v, n, w in requests]
    paths = ["direct", "torchscript"] if entry == "unchecked" and kind != "sharded" else ["default"]
    for path in paths:
        flags = ["--unchecked"] if entry == "unchecked" else []
        env = {**os.environ, "EMBSERVE_FORCE_TORCHSCRIPT": "1" if path == "torchscript" else "0"}
        out = tmp_path / f"out-{path}.bin"
        result = subprocess.run(
            [str(embserve_run), str(artifact), "--requests", str(tmp_path / "requests.bin"), "--out", str(out), *flags],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr
        if entry == "unchecked":
            taken = "torchscript" if kind == "sharded" else path
            assert f"lookup_unchecked: {taken}" in result.stdout
        responses = read_responses(out)
        assert len(responses) == len(requests)
        for want, response in zip(expected, responses):
            assert response.ok, response.message
            assert response.output is not None and response.output.dtype == torch.float32
            assert torch.equal(response.output, want)


def test_bad_requests_are_typed_errors_and_the_process_goes_on(embserve_run, unsharded_artifact, tmp_path):
    spec = mixed_spec()
    good = random_batch(spec, batch_size=4, seed=1)
    out_of_range = good.values.clone()
    first_int4 = int(good.lengths.view(len(spec.features), 4)[:2].sum())  # f_int4 is the third feature, 500 rows
    assert int(good.lengths.view(len(spec.features), 4)[2].sum()) > 0
    out_of_range[first_int4] = 500
    negative = good.lengths.clone()
    negative[1] = -1
    requests = [
        (good.values, good.lengths, None),
        (out_of_range, good.lengths, None),
        (good.values, negative, None),
        (good.values, good.lengths[:-1], None),
        (good.values, good.lengths, torch.ones(3)),
        (good.values.to(torch.float32), good.lengths, None),
        (good.values.to(torch.int32), good.lengths, None),
    ]
    write_requests(tmp_path / "requests.bin", requests)
    result = run(embserve_run, unsharded_artifact, "--requests", tmp_path / "requests.bin", "--out", tmp_path / "o")
    assert result.returncode == 1, result.stderr  # any failed request: status 1, every record still written
    assert len(result.stderr.splitlines()) == 5 and "frame #" not in result.stderr
    responses = read_responses(tmp_path / "o")
    expected = load(unsharded_artifact).lookup(SparseFeatures(spec.feature_names, good.values, good.lengths))
    assert [r.ok for r in responses] == [True, False, False, False, False, False, True]
    assert torch.equal(responses[0].output, expected) and torch.equal(responses[6].output, expected)
    assert {r.error_type for r in responses if not r.ok} == {"RequestError"}
    assert "feature 'f_int4': id 500 is out of range [0, 500)" in (responses[1].message or "")
    assert "feature 'f_int8': bag 1 has negative length -1" in (responses[2].message or "")
    assert "not a multiple of the 6 features" in (responses[3].message or "")
    assert "weights" in (responses[4].message or "")
    assert "values must be a 1-D int64 or int32" in (responses[5].message or "")
    assert "request 1: RequestError: feature 'f_int4'" in result.stderr


def copy_artifact(artifact: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(artifact, copy)
    return copy


def edit_manifest(artifact: Path, edit) -> None:  # type: ignore[no-untyped-def]
    path = artifact / "manifest.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=2))


def test_missing_fbgemm_library_is_named(embserve_run, unsharded_artifact, tmp_path):
    artifact = copy_artifact(unsharded_artifact, tmp_path)
    edit_manifest(artifact, lambda d: d["fbgemm"]["libraries"].insert(2, "fbgemm_gpu_not_there.so"))
    empty = tmp_path / "empty"
    empty.mkdir()
    result = run(embserve_run, artifact, "--library-dir", empty)
    assert result.returncode == 1
    assert "LibraryError: fbgemm library fbgemm_gpu_not_there.so not found" in result.stderr
    assert str(empty) in result.stderr  # the searched folders are listed


def test_without_fbgemm_libraries_the_unknown_type_is_named(embserve_run, unsharded_artifact, tmp_path):
    artifact = copy_artifact(unsharded_artifact, tmp_path)
    edit_manifest(artifact, lambda d: d["fbgemm"].update(libraries=[]))
    result = run(embserve_run, artifact)
    assert result.returncode == 1
    assert "ModelError" in result.stderr and "model.pt cannot be loaded by TorchScript" in result.stderr
    assert "AtomicCounter" in result.stderr or "fbgemm" in result.stderr


def test_corrupted_model_fails_its_checksum(embserve_run, unsharded_artifact, tmp_path):
    artifact = copy_artifact(unsharded_artifact, tmp_path)
    model = artifact / "model.pt"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0xFF
    model.write_bytes(bytes(data))
    result = run(embserve_run, artifact)
    assert result.returncode == 1
    assert "ChecksumError" in result.stderr and "model.pt fails its sha256 check" in result.stderr
    model.write_bytes(bytes(data[:-10]))
    result = run(embserve_run, artifact)
    assert "ChecksumError" in result.stderr and "truncated" in result.stderr


def test_manifest_format_version_is_checked(embserve_run, unsharded_artifact, tmp_path):
    artifact = copy_artifact(unsharded_artifact, tmp_path)
    edit_manifest(artifact, lambda d: d.update(format_version=4))
    result = run(embserve_run, artifact)
    assert result.returncode == 1 and "ManifestError" in result.stderr and "format_version 4" in result.stderr
    assert "reads versions 2 and 3" in result.stderr
    (artifact / "manifest.json").write_text("{not json")
    result = run(embserve_run, artifact)
    assert result.returncode == 1 and "ManifestError" in result.stderr and "not valid JSON" in result.stderr


def test_library_dir_env_var_is_searched(embserve_run, unsharded_artifact, tmp_path):
    import infer.artifact.fbgemm_libs

    artifact = copy_artifact(unsharded_artifact, tmp_path)
    edit_manifest(artifact, lambda d: d["fbgemm"].update(build_dir=str(tmp_path / "gone")))
    (tmp_path / "libs").symlink_to(infer.artifact.fbgemm_libs.fbgemm_library_dir(), target_is_directory=True)
    env = {"EMBSERVE_FBGEMM_LIB_DIR": str(tmp_path / "libs"), "PATH": "/usr/bin:/bin"}
    result = subprocess.run([str(embserve_run), str(artifact)], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert f"{tmp_path / 'libs'}/fbgemm_gpu_tbe_common.so" in result.stdout


@pytest.mark.parametrize("kind", ["unsharded", "sharded"])
def test_two_threads_share_a_model(kind, cpp_build, unsharded_artifact, sharded_artifact):
    artifact = unsharded_artifact if kind == "unsharded" else sharded_artifact
    result = subprocess.run(
        [str(cpp_build / "embserve_thread_test"), str(artifact), "2", "60"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("ok 2 threads")


def test_bench_prints_one_json_line(embserve_run, unsharded_artifact, tmp_path):
    spec = mixed_spec()
    b = random_batch(spec, batch_size=1, seed=2)
    write_requests(tmp_path / "r.bin", [(b.values, b.lengths, None)])
    result = run(embserve_run, unsharded_artifact, "--requests", tmp_path / "r.bin", "--bench", 50)
    assert result.returncode == 0, result.stderr
    line = json.loads(result.stdout.strip().splitlines()[-1])
    assert line["calls"] == 50 and line["mean_us"] > 0 and line["lookups_per_s"] > 0


@pytest.mark.parametrize("kind", ["unsharded", "sharded"])
def test_batch_parallel_kernels_are_bit_identical(kind, embserve_run, unsharded_artifact, sharded_artifact, tmp_path):
    """A batch large enough to split over two example ranges per CPU kernel gives the single call's output."""
    artifact = unsharded_artifact if kind == "unsharded" else sharded_artifact
    b = random_batch(mixed_spec(), batch_size=1024, max_len=40, seed=9, weighted=True)  # ~100k ids: 2 ranges
    write_requests(tmp_path / "r.bin", [(b.values, b.lengths, b.weights)])
    outputs = []
    for threads in (1, 2):
        out = tmp_path / f"o{threads}.bin"
        result = run(
            embserve_run, artifact, "--requests", tmp_path / "r.bin", "--out", out, "--kernel-threads", threads
        )
        assert result.returncode == 0, result.stderr
        outputs.append(read_responses(out)[0].output)
    expected = load(artifact, threads=1).lookup(
        SparseFeatures(mixed_spec().feature_names, b.values, b.lengths, b.weights)
    )
    assert torch.equal(outputs[0], expected) and torch.equal(outputs[1], expected)


def test_an_artifact_with_onnx_loads_and_answers(embserve_run, onnx_artifact, tmp_path):
    """The manifest's optional onnx section passes the schema and its files are checksummed; lookups as Python."""
    b = random_batch(mixed_spec(), batch_size=4, seed=1)
    write_requests(tmp_path / "r.bin", [(b.values, b.lengths, None)])
    result = run(embserve_run, onnx_artifact, "--requests", tmp_path / "r.bin", "--out", tmp_path / "o.bin")
    assert result.returncode == 0, result.stderr
    expected = load(onnx_artifact).lookup(SparseFeatures(mixed_spec().feature_names, b.values, b.lengths))
    assert torch.equal(read_responses(tmp_path / "o.bin")[0].output, expected)
