"""The C++ loader's Pt2 backend (model.pt2, AOTInductor) against the Python TorchScript artifact: same outputs bit
for bit, the same request errors, typed load errors. Each model.pt2 is compiled once per session (export(...,
pt2=True), about a minute each on this machine kind: the unsharded and 4-device pt2_spec models, shared with
tests/artifact/test_pt2.py, and the bad-request corpus's model with its tables inside, shared with
tests/artifact/test_pt2_weights.py)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from infer.artifact.cpp_io import read_responses, write_requests
from infer.artifact.load import load
from infer.config import ModelSpec
from infer.features import SparseFeatures
from tests.conftest import random_batch
from tests.cpp.support import assert_clean_failure, run
from tests.support.artifacts import copy_artifact, damage_file, edit_manifest, rehash
from tests.support.bad_requests import BAD_REQUESTS
from tests.support.pt2_models import PT2_SEED, embedded_pt2, pt2_spec

Request = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


@pytest.fixture(params=["unsharded", "sharded"])
def any_pt2_artifact(request: pytest.FixtureRequest) -> Path:
    name = "pt2_artifact" if request.param == "unsharded" else "sharded_pt2_artifact"
    return request.getfixturevalue(name)  # type: ignore[no-any-return]


def torchscript_outputs(artifact: Path, requests: list[Request]) -> list[torch.Tensor]:
    """The reference: the Python runtime running the artifact's TorchScript model.pt."""
    runtime = load(artifact)
    return [runtime.lookup(SparseFeatures(runtime.feature_names, v, n, w)) for v, n, w in requests]


def run_requests(
    embserve_run: Path, artifact: Path, requests: list[Request], folder: Path, *options: object
) -> tuple[subprocess.CompletedProcess[str], list]:  # type: ignore[type-arg]
    write_requests(folder / "requests.bin", requests)
    result = run(
        embserve_run,
        artifact,
        "--backend",
        "pt2",
        "--requests",
        folder / "requests.bin",
        "--out",
        folder / "o.bin",
        *options,
    )
    return result, read_responses(folder / "o.bin") if (folder / "o.bin").exists() else []


def parity_requests(batch: int, spec: ModelSpec | None = None) -> list[Request]:
    """Unweighted and weighted, int64 and int32 ids, for ``spec`` (default ``pt2_spec()``)."""
    requests: list[Request] = []
    for seed, (id_dtype, weighted) in enumerate(
        [(torch.int64, False), (torch.int32, False), (torch.int64, True), (torch.int32, True)]
    ):
        b = random_batch(
            spec or pt2_spec(), batch_size=batch, max_len=8, weighted=weighted, seed=seed + batch, id_dtype=id_dtype
        )
        requests.append((b.values, b.lengths, b.weights))
    return requests


@pytest.mark.parametrize("batch", [1, 16, 4096])
def test_pt2_outputs_equal_torchscript(batch, embserve_run, any_pt2_artifact, tmp_path):
    """INT8/INT4/INT2/FP16/FP32 tables, SUM and MEAN, weighted and not, int32 and int64 ids, unsharded and over 4
    devices (column-wise, replicated, table-wise): torch.equal to the TorchScript model."""
    requests = parity_requests(batch)
    result, responses = run_requests(embserve_run, any_pt2_artifact, requests, tmp_path)
    assert result.returncode == 0, result.stderr
    for response, expected in zip(responses, torchscript_outputs(any_pt2_artifact, requests), strict=True):
        assert response.ok, response.message
        assert response.output is not None and response.output.dtype == torch.float32
        assert response.output.shape == expected.shape
        assert torch.equal(response.output, expected)


@pytest.mark.parametrize("kernel_threads", [1, 2, 3])
def test_pt2_split_batches_are_bit_identical(kernel_threads, embserve_run, any_pt2_artifact, tmp_path):
    """A batch cut into example ranges run on threads gives the TorchScript model's rows exactly."""
    b = random_batch(pt2_spec(), batch_size=1024, max_len=40, seed=9, weighted=True)  # ~120k ids: 3 ranges
    requests: list[Request] = [(b.values, b.lengths, b.weights), (b.values.to(torch.int32), b.lengths, None)]
    result, responses = run_requests(
        embserve_run,
        any_pt2_artifact,
        requests,
        tmp_path,
        "--kernel-threads",
        kernel_threads,
        "--threads",
        kernel_threads,
    )
    assert result.returncode == 0, result.stderr
    for response, expected in zip(responses, torchscript_outputs(any_pt2_artifact, requests), strict=True):
        assert response.output is not None and torch.equal(response.output, expected)


def test_pt2_edge_batches(embserve_run, any_pt2_artifact, tmp_path):
    """No ids at all, one id, and an empty batch: the same answers as the TorchScript model."""
    pt2_artifact = any_pt2_artifact
    features = len(pt2_spec().features)
    one = torch.zeros(features * 2, dtype=torch.int32)
    one[4] = 1  # feature 2 (f_int4, MEAN), example 0: a single id
    requests: list[Request] = [
        (torch.zeros(0, dtype=torch.int64), torch.zeros(features * 3, dtype=torch.int32), None),
        (torch.tensor([7]), one, None),
        (torch.tensor([7]), one, torch.tensor([0.5])),
        (torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int32), None),
    ]
    result, responses = run_requests(embserve_run, pt2_artifact, requests, tmp_path)
    assert result.returncode == 0, result.stderr
    for response, expected in zip(responses, torchscript_outputs(pt2_artifact, requests), strict=True):
        assert response.output is not None and response.output.shape == expected.shape
        assert torch.equal(response.output, expected)


def test_pt2_bad_request_corpus(embserve_run, corpus_pt2_artifact, tmp_path):
    """Every case of the shared corpus is a RequestError carrying its fragment; a good request after them all is
    answered as the TorchScript model answers it."""
    good: Request = (torch.tensor([1, 2, 3, 4]), torch.tensor([1, 1, 1, 1], dtype=torch.int32), None)
    requests: list[Request] = [(case.values, case.lengths, case.weights) for case in BAD_REQUESTS]
    result, responses = run_requests(embserve_run, corpus_pt2_artifact, [*requests, good], tmp_path)
    assert result.returncode == 1  # some requests failed; every record is still written
    assert len(responses) == len(BAD_REQUESTS) + 1
    for case, response in zip(BAD_REQUESTS, responses):
        assert not response.ok and response.error_type == "RequestError", (case.name, response)
        assert case.fragment in (response.message or ""), (case.name, response.message)
    assert responses[-1].output is not None
    assert torch.equal(responses[-1].output, torchscript_outputs(corpus_pt2_artifact, [good])[0])


def test_pt2_threads_share_a_model(cpp_build, any_pt2_artifact):
    """Several threads on one Pt2 model; every output equals the TorchScript backend's in the same process."""
    result = subprocess.run(
        [str(cpp_build / "embserve_thread_test"), str(any_pt2_artifact), "4", "60", "pt2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("ok 4 threads") and "pt2 backend vs torchscript" in result.stdout


def test_without_a_pt2_entry_the_fix_is_named(embserve_run, unsharded_artifact):
    result = run(embserve_run, unsharded_artifact, "--backend", "pt2")
    line = assert_clean_failure(result, "ManifestError", "has no 'pt2' entry", "embserve export --pt2")
    assert "manifest.json" in line


def test_another_torch_version_is_a_model_error_naming_both(embserve_run, pt2_artifact, tmp_path):
    artifact = copy_artifact(pt2_artifact, tmp_path)
    edit_manifest(artifact, lambda m: m["pt2"].update(torch_version="2.12.1+cpu"))
    runtime = ".".join(torch.__version__.split("+")[0].split(".")[:3])
    line = assert_clean_failure(run(embserve_run, artifact, "--backend", "pt2"), "ModelError", "model.pt2")
    assert "2.12.1+cpu" in line and f"libtorch {runtime}" in line and "embserve export --pt2" in line
    # the TorchScript backend of the same artifact is not affected
    assert run(embserve_run, artifact).returncode == 0
    edit_manifest(artifact, lambda m: m["pt2"].update(torch_version="nightly"))
    assert_clean_failure(
        run(embserve_run, artifact, "--backend", "pt2"), "ModelError", "'nightly' is not a torch version"
    )


def test_a_missing_fbgemm_library_is_named(embserve_run, pt2_artifact, tmp_path):
    artifact = copy_artifact(pt2_artifact, tmp_path)
    edit_manifest(artifact, lambda m: m["fbgemm"]["libraries"].insert(0, "fbgemm_gpu_not_there.so"))
    empty = tmp_path / "empty"
    empty.mkdir()
    line = assert_clean_failure(
        run(embserve_run, artifact, "--backend", "pt2", "--library-dir", empty),
        "LibraryError",
        "fbgemm library fbgemm_gpu_not_there.so not found",
    )
    assert str(empty) in line


def test_without_fbgemm_libraries_the_operator_is_named(embserve_run, pt2_artifact, tmp_path):
    """No fbgemm library loaded: the package's extern call to fbgemm's lookup op cannot resolve (pytorch#147065)."""
    artifact = copy_artifact(pt2_artifact, tmp_path)
    edit_manifest(artifact, lambda m: m["fbgemm"].update(libraries=[]))
    line = assert_clean_failure(
        run(embserve_run, artifact, "--backend", "pt2"), "ModelError", "model.pt2 cannot be loaded by AOTInductor"
    )
    assert "fbgemm" in line


def test_a_corrupted_pt2_fails_its_checksum(embserve_run, pt2_artifact, tmp_path):
    artifact = copy_artifact(pt2_artifact, tmp_path)
    data = bytearray((artifact / "model.pt2").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (artifact / "model.pt2").write_bytes(bytes(data))
    assert_clean_failure(run(embserve_run, artifact, "--backend", "pt2"), "ChecksumError", "model.pt2 fails its sha256")
    # re-hashed, the damage reaches AOTInductor: still a typed error, never a crash
    rehash(artifact, "model.pt2")
    result = run(embserve_run, artifact, "--backend", "pt2")
    assert result.returncode in (0, 1), result.stderr  # a flipped byte in weights may still load; no signal


def test_manifest_check_accepts_pt2_and_wants_its_checksum(cpp_build, pt2_artifact, tmp_path):
    check = cpp_build / "embserve_manifest_check"
    artifact = copy_artifact(pt2_artifact, tmp_path)
    edit_manifest(artifact, lambda m: m["files"].pop("model.pt2"))
    result = run(check, pt2_artifact, artifact)
    assert result.stdout.splitlines() == [
        "ok",
        f"ChecksumError: {artifact / 'manifest.json'} has no checksum for model.pt2",
    ]
    edit_manifest(artifact, lambda m: m["pt2"].update(extra=1))
    assert "ManifestError" in run(check, artifact).stdout


def test_bench_names_the_backend(embserve_run, pt2_artifact, tmp_path):
    b = random_batch(pt2_spec(), batch_size=1, seed=2)
    write_requests(tmp_path / "r.bin", [(b.values, b.lengths, None)])
    result = run(embserve_run, pt2_artifact, "--backend", "pt2", "--requests", tmp_path / "r.bin", "--bench", 50)
    assert result.returncode == 0, result.stderr
    line = json.loads(result.stdout.strip().splitlines()[-1])
    assert line["backend"] == "pt2" and line["calls"] == 50 and line["lookups_per_s"] > 0


def test_pt2_takes_its_tables_from_the_weight_files_and_matches_fp32(embserve_run, any_pt2_artifact, tmp_path):
    """model.pt2 of a mapped artifact holds no tables (its metadata names the constants the loader hands the
    mapped buffers to); the C++ program's lookups equal fp32 ``F.embedding_bag`` on the dequantized tables."""
    from infer.artifact.manifest import Manifest
    from infer.quant.quantize import quantize
    from infer.weights import random_weights
    from tests.support.call_contract import Reference, assert_matches

    manifest = Manifest.read(any_pt2_artifact)
    assert manifest.mapped and all(k.weights is not None for k in manifest.kernels)
    spec = pt2_spec()
    reference = Reference(spec, quantize(spec, random_weights(spec, seed=PT2_SEED)))
    requests = parity_requests(64)
    result, responses = run_requests(embserve_run, any_pt2_artifact, requests, tmp_path)
    assert result.returncode == 0, result.stderr
    for response, (values, lengths, weights) in zip(responses, requests, strict=True):
        assert response.ok, response.message
        assert_matches(response.output, reference.pooled(SparseFeatures(spec.feature_names, values, lengths, weights)))


@pytest.mark.parametrize("damage", ["flipped_byte", "truncated"])
def test_a_damaged_weight_file_is_a_checksum_error_for_pt2(embserve_run, pt2_artifact, tmp_path, damage):
    """Verified (sizes before mapping, then chunks) before the program gets the mapped weights: ChecksumError
    naming the file, never a program run on them."""
    artifact = copy_artifact(pt2_artifact, tmp_path)
    damage_file(artifact / "weights-0.bin", damage)
    assert_clean_failure(run(embserve_run, artifact, "--backend", "pt2"), "ChecksumError", "weights-0.bin")


def test_a_pt2_package_from_another_export_is_a_model_error(embserve_run, pt2_artifact, sharded_pt2_artifact, tmp_path):
    """model.pt2 compiled for other weight buffers (re-hashed into the manifest) is refused naming model.pt2 and
    the fix, never run over buffers it was not compiled for. (The sharded manifest with the unsharded package:
    that one has a dense program too, which the sharded manifest does not name.)"""
    artifact = copy_artifact(sharded_pt2_artifact, tmp_path)
    (artifact / "model.pt2").write_bytes((pt2_artifact / "model.pt2").read_bytes())
    rehash(artifact, "model.pt2")
    assert_clean_failure(run(embserve_run, artifact, "--backend", "pt2"), "ModelError", "model.pt2", "re-export")


def test_an_embedded_pt2_keeps_its_tables_and_matches_fp32(embserve_run, tmp_path_factory, tmp_path):
    """An artifact without weight files (``weights="embedded"``, as every model.pt2 was before) compiles its tables
    into model.pt2: the C++ loader runs it as it is, no mapping handed over, and it equals the fp32 reference
    (the corpus's model, compiled once with tests/artifact/test_pt2_weights.py's and test_pt2_bad_request_corpus's)."""
    from infer.quant.quantize import quantize
    from infer.weights import random_weights
    from tests.support.call_contract import Reference, assert_matches

    spec, artifact = embedded_pt2(tmp_path_factory)
    model = quantize(spec, random_weights(spec, seed=PT2_SEED))
    assert not list(artifact.glob("weights-*.bin"))
    requests = parity_requests(16, spec)
    result, responses = run_requests(embserve_run, artifact, requests, tmp_path)
    assert result.returncode == 0, result.stderr
    reference = Reference(spec, model)
    for response, (values, lengths, weights) in zip(responses, requests, strict=True):
        assert response.ok, response.message
        assert_matches(response.output, reference.pooled(SparseFeatures(spec.feature_names, values, lengths, weights)))


def test_a_manifest_that_says_the_package_holds_the_tables_is_a_model_error(embserve_run, pt2_artifact, tmp_path):
    """A mapped export's manifest says pt2.tables "weight_files"; one edited to say otherwise (or written before
    the key) beside a package that lacks its tables is refused, never run on the package's stand-ins."""
    artifact = copy_artifact(pt2_artifact, tmp_path)
    edit_manifest(artifact, lambda m: m["pt2"].pop("tables"))
    assert_clean_failure(run(embserve_run, artifact, "--backend", "pt2"), "ModelError", "model.pt2", "pt2.tables")


def test_a_bare_aoti_model_package_loader_throws_naming_embserve_loaders(pt2_artifact, cpp_build):
    """A mapped artifact's model.pt2 run by a bare C++ AOTIModelPackageLoader (no embserve loader to hand it the
    weight files; cpp_loader/tests/bare_pt2_check.cpp) throws a std::exception whose what() names embserve's
    loaders, never returns the stand-ins' NaN."""
    from infer.artifact.fbgemm_libs import required_library_paths

    features = len(load(pt2_artifact).feature_names)
    bare = cpp_build / "embserve_bare_pt2_check"
    result = run(bare, pt2_artifact / "model.pt2", features, *required_library_paths())
    assert result.returncode == 1, (result.returncode, result.stdout[-2000:], result.stderr[-2000:])
    assert result.stdout.startswith("threw: "), result.stdout
    assert "embserve::Model::load" in result.stdout and "infer.load(folder, backend='pt2')" in result.stdout
