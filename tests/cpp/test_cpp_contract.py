"""The call contract and ``predict`` in the C++ loader, on both backends (TorchScript model.pt, AOTInductor model.pt2).

Every documented dtype combination of values (int64, int32), lengths (int32, int64) and weights (float32 or none)
goes through ``embserve_run`` as lookups and as predicts (request file version 2), and must equal the independent
fp32 reference: ``F.embedding_bag`` on the tables as the quantized model stores them
(``FloatEmbeddingBagCollection``), and the dense part applied to that pooled output. Predict must also equal
Python's ``infer.load(dir).predict``. Undocumented dtypes, through the library API (``embserve_contract_check``)
and through request files, must be refused with a ``RequestError`` naming the tensor, its dtype and the accepted
ones; the expected sentences are written here by hand from ``infer/request_rules.py``'s wording.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from infer.artifact.cpp_io import read_responses, write_requests
from infer.artifact.load import load
from infer.features import SparseFeatures
from infer.quant.quantize import dequantized_weights
from infer.reference import FloatEmbeddingBagCollection
from tests.conftest import random_batch
from tests.cpp.conftest import DENSE_INPUTS, DenseArtifact
from tests.support.artifacts import copy_artifact, edit_manifest

pytestmark = pytest.mark.slow  # compiles a pt2 package (two programs) once per session

BACKENDS = ("torchscript", "pt2")
BATCH = 6
# Every documented combination: (values dtype, lengths dtype, weighted)
COMBOS = tuple(
    (values, lengths, weighted)
    for values in (torch.int64, torch.int32)
    for lengths in (torch.int32, torch.int64)
    for weighted in (True, False)
)
ACCEPTED = {
    "values": {"int64", "int32"},
    "lengths": {"int32", "int64"},
    "weights": {"float32"},
    "dense_features": {"float32"},
}
RULES = {  # request_rules.IDS_DTYPE, LENGTHS_DTYPE, WEIGHTS_DTYPE, DENSE_DTYPE (+ the dense shape)
    "values": "values must be a 1-D int64 or int32 tensor of ids",
    "lengths": "lengths must be a 1-D int32 (or int64) tensor",
    "weights": "weights must be a 1-D float32 tensor with one weight per id",
    "dense_features": "dense_features must be float32 [batch, num_dense_features]",
}
NO_DENSE_PART = "this model has no dense part; use lookup, not predict"


def run(binary: Path, *args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(binary), *map(str, args)], capture_output=True, text=True, timeout=600)


def reference(artifact: DenseArtifact, batch: SparseFeatures, dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 pooled embeddings and scores ``[B]``: embedding_bag on the dequantized tables, then the dense part."""
    pooled = FloatEmbeddingBagCollection(artifact.spec, dequantized_weights(artifact.spec, artifact.model))(batch)
    assert artifact.spec.dense_arch is not None
    with torch.no_grad():
        scores = artifact.spec.dense_arch(dense, pooled).reshape(-1)
    return pooled, scores


def combo_requests(batch: SparseFeatures) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    assert batch.weights is not None
    return [
        (batch.values.to(values), batch.lengths.to(lengths), batch.weights if weighted else None)
        for values, lengths, weighted in COMBOS
    ]


@pytest.mark.parametrize("entry", ["checked", "unchecked"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_documented_dtype_equals_the_reference(backend, entry, embserve_run, dense_pt2_artifact, tmp_path):
    """Lookups and predicts, each documented combination, through embserve_run: equal to the fp32 reference
    (within 1e-5) and to Python's runtime on the same backend; predict returns float32 [B]. ``unchecked``: through
    Model::lookup_unchecked / lookup_and_predict_unchecked after Model::validate (embserve-server's entries)."""
    artifact = dense_pt2_artifact
    batch = random_batch(artifact.spec, BATCH, max_len=5, weighted=True, seed=3)
    unweighted = SparseFeatures(batch.keys, batch.values, batch.lengths)
    dense = torch.randn(BATCH, DENSE_INPUTS, generator=torch.Generator().manual_seed(4))
    want = {True: reference(artifact, batch, dense), False: reference(artifact, unweighted, dense)}
    requests = combo_requests(batch)
    # the same requests twice: as lookups (no dense features), then as predicts
    write_requests(tmp_path / "r.bin", requests * 2, [None] * len(requests) + [dense] * len(requests))
    flags = ["--unchecked"] if entry == "unchecked" else []
    result = run(
        embserve_run,
        artifact.path,
        "--backend",
        backend,
        "--requests",
        tmp_path / "r.bin",
        "--out",
        tmp_path / "o.bin",
        *flags,
    )
    assert result.returncode == 0, result.stderr
    responses = read_responses(tmp_path / "o.bin")
    assert len(responses) == 2 * len(COMBOS)
    python = load(artifact.path, backend=backend)
    for i, (values, lengths, weighted) in enumerate(COMBOS):
        case = (str(values), str(lengths), weighted)
        pooled, scores = responses[i].output, responses[len(COMBOS) + i].output
        assert pooled is not None and scores is not None, (
            case,
            responses[i].message,
            responses[len(COMBOS) + i].message,
        )
        assert pooled.dtype == torch.float32 and pooled.shape == (BATCH, artifact.spec.output_dim), case
        assert scores.dtype == torch.float32 and scores.shape == (BATCH,), (case, scores.shape)
        torch.testing.assert_close(pooled, want[weighted][0], rtol=1e-5, atol=1e-5, msg=str(case))
        torch.testing.assert_close(scores, want[weighted][1], rtol=1e-5, atol=1e-5, msg=str(case))
        features = batch if weighted else unweighted
        # Python's predict: [B] by the contract (a [B, 1] dense part squeezed); flattened for runtimes not there yet
        assert torch.equal(scores, python.predict(features, dense).reshape(-1)), case
        assert torch.equal(pooled, python.lookup(features)), case


def contract_lines(binary: Path, artifact: Path, backend: str) -> dict[tuple[str, str, str], str]:
    result = run(binary, artifact, backend)
    assert result.returncode == 0, result.stderr
    lines = {}
    for line in result.stdout.splitlines():
        parts = line.split(" ", 3)  # method tensor dtype outcome; "method undefined_weights_as_absent same|differ"
        lines[(parts[0], parts[1], parts[2])] = parts[3] if len(parts) == 4 else ""
    return lines


@pytest.mark.parametrize("backend", BACKENDS)
def test_undocumented_dtypes_are_refused_by_the_library(backend, cpp_build, dense_pt2_artifact):
    """Every tensor cast to each of ten dtypes, through Model::lookup and Model::predict: the documented dtypes
    answer, every other is a RequestError naming the tensor, its dtype and shape, and the accepted dtypes."""
    num_features = len(dense_pt2_artifact.spec.features)
    shapes = {"dense_features": f"[2, {DENSE_INPUTS}]"}
    lines = contract_lines(cpp_build / "embserve_contract_check", dense_pt2_artifact.path, backend)
    checked = 0
    for method in ("lookup", "predict"):
        for tensor, rule in RULES.items():
            if tensor == "dense_features" and method == "lookup":
                continue
            shape = shapes.get(tensor, f"[{2 * num_features}]")
            for dtype in (
                "float32",
                "float64",
                "float16",
                "bfloat16",
                "int64",
                "int32",
                "int16",
                "int8",
                "uint8",
                "bool",
            ):
                got = lines[(method, tensor, dtype)]
                if dtype in ACCEPTED[tensor]:
                    assert got == "ok", (method, tensor, dtype, got)
                else:
                    assert got == f"RequestError: {rule}, got {dtype} {shape}", (method, tensor, dtype, got)
                checked += 1
        # an undefined weights tensor is absent weights, as std::nullopt
        assert lines[(method, "undefined_weights_as_absent", "same")] == ""
    assert checked == 2 * 3 * 10 + 10


@pytest.mark.parametrize("backend", BACKENDS)
def test_refusals_through_request_files(backend, embserve_run, dense_pt2_artifact, tmp_path):
    """The undocumented dtypes a request file can hold, and a dense shape that does not fit: RequestErrors, each
    naming its tensor; the good request after them is answered."""
    artifact = dense_pt2_artifact
    b = random_batch(artifact.spec, 2, max_len=3, weighted=True, seed=5)
    assert b.weights is not None
    dense = torch.zeros(2, DENSE_INPUTS)
    n, f = b.values.numel(), b.lengths.numel()
    cases = [
        ((b.values.float(), b.lengths, None), dense, f"{RULES['values']}, got float32 [{n}]"),
        ((b.values, b.lengths.float(), None), None, f"{RULES['lengths']}, got float32 [{f}]"),
        ((b.values, b.lengths, b.weights.to(torch.int64)), None, f"{RULES['weights']}, got int64 [{n}]"),
        ((b.values, b.lengths, b.weights.to(torch.int32)), dense, f"{RULES['weights']}, got int32 [{n}]"),
        (
            (b.values, b.lengths, None),
            dense.to(torch.int64),
            f"{RULES['dense_features']}, got int64 [2, {DENSE_INPUTS}]",
        ),
        (
            (b.values, b.lengths, None),
            dense.to(torch.int32),
            f"{RULES['dense_features']}, got int32 [2, {DENSE_INPUTS}]",
        ),
        (
            (b.values, b.lengths, None),
            torch.zeros(2, DENSE_INPUTS + 1),
            f"dense_features must have shape [2, {DENSE_INPUTS}], got [2, {DENSE_INPUTS + 1}]",
        ),
        (
            (b.values, b.lengths, None),
            torch.zeros(2 * DENSE_INPUTS),
            f"dense_features must have shape [2, {DENSE_INPUTS}], got [{2 * DENSE_INPUTS}]",
        ),
    ]
    requests = [request for request, _, _ in cases] + [(b.values, b.lengths, b.weights)]
    write_requests(tmp_path / "r.bin", requests, [d for _, d, _ in cases] + [dense])
    result = run(
        embserve_run, artifact.path, "--backend", backend, "--requests", tmp_path / "r.bin", "--out", tmp_path / "o.bin"
    )
    assert result.returncode == 1, result.stderr  # some requests failed, each answered with its error record
    responses = read_responses(tmp_path / "o.bin")
    for (_, _, message), response in zip(cases, responses):
        assert response.error_type == "RequestError" and response.message == message, (message, response)
    assert responses[-1].output is not None and responses[-1].output.shape == (2,)
    torch.testing.assert_close(responses[-1].output, reference(artifact, b, dense)[1], rtol=1e-5, atol=1e-5)


def test_predict_without_a_dense_part_is_a_request_error(embserve_run, unsharded_artifact, tmp_path):
    """A model without a dense part: predict is refused with Python's sentence; lookups in the same file answer."""
    spec = load(unsharded_artifact).spec
    b = random_batch(spec, 2, seed=6)
    write_requests(tmp_path / "r.bin", [(b.values, b.lengths, None)] * 2, [torch.zeros(2, 1), None])
    result = run(embserve_run, unsharded_artifact, "--requests", tmp_path / "r.bin", "--out", tmp_path / "o.bin")
    assert result.returncode == 1, result.stderr
    refused, answered = read_responses(tmp_path / "o.bin")
    assert (refused.error_type, refused.message) == ("RequestError", NO_DENSE_PART)
    assert answered.output is not None and answered.output.shape == (2, spec.output_dim)


def test_pt2_without_its_dense_program_is_a_model_error(embserve_run, dense_pt2_artifact, tmp_path):
    """A package holding the lookups only (pt2.dense_program null) for a model with a dense part: predict on the pt2
    backend is a ModelError naming the missing program and the fix; lookups still answer."""
    artifact = copy_artifact(dense_pt2_artifact.path, tmp_path)
    edit_manifest(artifact, lambda data: data["pt2"].update(dense_program=None))
    b = random_batch(dense_pt2_artifact.spec, 2, seed=7)
    write_requests(tmp_path / "r.bin", [(b.values, b.lengths, None)] * 2, [torch.zeros(2, DENSE_INPUTS), None])
    result = run(
        embserve_run, artifact, "--backend", "pt2", "--requests", tmp_path / "r.bin", "--out", tmp_path / "o.bin"
    )
    assert result.returncode == 1, result.stderr
    refused, answered = read_responses(tmp_path / "o.bin")
    assert refused.error_type == "ModelError", refused
    assert "pt2.dense_program is not set" in (refused.message or "") and "TorchScript backend" in (
        refused.message or ""
    )
    assert answered.output is not None and answered.output.shape == (2, dense_pt2_artifact.spec.output_dim)


@pytest.mark.parametrize("backend", BACKENDS)
def test_threads_share_predict(backend, cpp_build, dense_pt2_artifact):
    """Four threads on one model alternate lookups and predicts; each equals the single-thread answer."""
    result = run(cpp_build / "embserve_thread_test", dense_pt2_artifact.path, 4, 40, backend)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("ok 4 threads") and "predicts match a single-thread predict" in result.stdout
