"""``model.pt2`` (torch.export + AOTInductor): lookups ``torch.equal`` the TorchScript artifact, errors typed.

The reference is always the TorchScript artifact loaded from the same export (``infer.load(path)``), never
the program under test. Compiling takes up to a minute per model, so each model is compiled once per
session (two compiles, tests/support/pt2_models.py: unsharded with a dense part, exported through the CLI with the
dense part scripted, and column-wise + replicated + table-wise over 4 CPU devices; the C++ loader's tests and
test_pt2_weights run both, test_pt2_contract the first); the export logs a progress line.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from infer.artifact.export import export
from infer.artifact.formats.pt2_export import export_program, program_device
from infer.artifact.formats.pt2_program import lookup_program
from infer.artifact.formats.pt2_runtime import Pt2Module
from infer.artifact.load import load
from infer.config import ModelSpec
from infer.errors import ArtifactError, ArtifactErrorKind, ConfigError, RequestError
from infer.features import SparseFeatures
from infer.planner.types import ComputeDevice, ShardingType
from infer.quant.quantize import quantize
from infer.shard.builder import shard_model
from infer.shard.plans import make_plan
from infer.weights import random_weights
from server.client import EmbserveClient
from server.launch import spawn_server
from tests.conftest import random_batch
from tests.support.artifacts import copy_artifact, edit_manifest
from tests.support.bad_requests import BAD_REQUESTS, CORPUS_SPEC
from tests.support.pt2_models import NUM_DENSE, PT2_KINDS, compiled_pt2, pt2_spec

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session", params=PT2_KINDS)
def compiled(request, tmp_path_factory):
    """(name, spec, artifact path, TorchScript runtime, pt2 runtime); compiled once per session (shared with the
    C++ loader's pt2 tests: tests/support/pt2_models.py)."""
    logging.getLogger("infer.artifact.formats.pt2_export").info("tests: compiling a pt2 model (about a minute)")
    spec, path = compiled_pt2(tmp_path_factory, request.param)
    return request.param, spec, path, load(path), load(path, backend="pt2")


def _batches(spec: ModelSpec) -> list[tuple[str, SparseFeatures]]:
    features = len(spec.features)
    no_ids = torch.zeros(0, dtype=torch.int64)
    return [
        ("b1", random_batch(spec, 1, max_len=9, seed=1)),
        ("b1_weighted", random_batch(spec, 1, max_len=9, weighted=True, seed=2)),
        ("b4096", random_batch(spec, 4096, max_len=12, seed=3)),
        ("b4096_weighted", random_batch(spec, 4096, max_len=12, weighted=True, seed=4)),
        ("b4096_int32_ids", random_batch(spec, 4096, max_len=12, seed=5, id_dtype=torch.int32)),
        ("b33_int32_ids_weighted", random_batch(spec, 33, weighted=True, seed=6, id_dtype=torch.int32)),
        ("all_bags_empty", SparseFeatures(spec.feature_names, no_ids, torch.zeros(3 * features, dtype=torch.int32))),
        (
            "int64_lengths",
            SparseFeatures.from_tensors(
                spec.feature_names, *_int64_lengths(random_batch(spec, 7, weighted=True, seed=7))
            ),
        ),
    ]


def _int64_lengths(batch: SparseFeatures) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    return batch.values, batch.lengths.to(torch.int64), batch.weights


def test_lookups_equal_the_torchscript_artifact(compiled):
    name, spec, _, scripted, pt2 = compiled
    assert pt2.backend == "pt2"
    for case, batch in _batches(spec):
        expected = scripted.lookup(batch)
        got = pt2.lookup(batch)
        assert got.dtype == torch.float32 and got.shape == expected.shape, (name, case)
        assert torch.equal(got, expected), (name, case, float((got - expected).abs().max()))
    # the server's path: the module called with plain tensors, no weights
    batch = random_batch(spec, 64, seed=8)
    assert torch.equal(pt2.module(batch.values, batch.lengths, None), scripted.lookup(batch))


def test_ones_weights_equal_an_unweighted_lookup(compiled):
    """The contract's promise to callers (C++ passes ones when a request has no weights): SUM and MEAN
    features alike, against TorchScript's unweighted kernel call."""
    _, spec, _, scripted, pt2 = compiled
    batch = random_batch(spec, 500, max_len=20, seed=9)
    ones = SparseFeatures(spec.feature_names, batch.values, batch.lengths, torch.ones(batch.values.numel()))
    assert torch.equal(pt2.lookup(ones), scripted.lookup(batch))
    assert torch.equal(scripted.lookup(ones), scripted.lookup(batch))


def test_the_program_itself_matches_at_other_batch_sizes(compiled):
    """The compiled program called directly (what the C++ loader does): int64 inputs, ones weights."""
    _, spec, _, scripted, pt2 = compiled
    for size in (1, 2, 3, 100):
        batch = random_batch(spec, size, seed=size)
        ids, lengths = batch.values.to(torch.int64), batch.lengths.to(torch.int64)
        got = pt2.module.program(ids, lengths, torch.ones(ids.numel()))
        assert torch.equal(got, scripted.lookup(batch)), size


def test_predictions_match_the_torchscript_artifact(compiled):
    """The dense program after the lookup program (the unsharded model has a dense part)."""
    name, spec, _, scripted, pt2 = compiled
    if name != "unsharded":
        assert not pt2.has_dense
        with pytest.raises(RequestError, match="no dense part"):
            pt2.predict(random_batch(spec, 2), torch.zeros(2, 0))
        return
    assert pt2.has_dense
    generator = torch.Generator().manual_seed(9)
    for case, batch in _batches(spec):
        dense = torch.randn(batch.batch_size, NUM_DENSE, generator=generator)
        expected = scripted.predict(batch, dense)
        got = pt2.predict(batch, dense)
        assert got.shape == expected.shape == (batch.batch_size,), case
        assert torch.equal(got, expected), (case, float((got - expected).abs().max()))
    shapes = rf"dense_features must have shape \[3, {NUM_DENSE}\], got \[2, {NUM_DENSE}\]"
    with pytest.raises(RequestError, match=shapes):
        pt2.module.predict(torch.zeros(2, NUM_DENSE), *_int64_lengths(random_batch(spec, 3))[:2])
    with pytest.raises(RequestError, match="float32"):
        pt2.module.predict(torch.zeros(3, NUM_DENSE, dtype=torch.float64), *_int64_lengths(random_batch(spec, 3))[:2])


def test_manifest_lists_model_pt2(compiled):
    name, _, path, _, pt2 = compiled
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format_version"] == 3  # export's default (mapped): model.pt2 reads the weight files too
    assert manifest["pt2"] == {
        "file": "model.pt2",
        "torch_version": torch.__version__,
        "device": "cpu",
        "inputs": ["values:int64", "lengths:int64", "weights:float32"],
        **({"dense_program": "dense"} if name == "unsharded" else {}),
        "tables": "weight_files",
    }
    assert manifest["files"]["model.pt2"]["bytes"] == (path / "model.pt2").stat().st_size
    assert len(manifest["files"]["model.pt2"]["sha256"]) == 64
    assert pt2.manifest.pt2 is not None and pt2.manifest.pt2.file == "model.pt2"


def test_bad_requests_give_the_torchscript_messages(compiled):
    """Each malformed variant of a good batch: the pt2 module's message (the shared Python rules) is the
    TorchScript model's own in-script check's, word for word."""
    _, spec, _, scripted, pt2 = compiled
    good = random_batch(spec, 4, seed=10)
    values, lengths = good.values, good.lengths
    last = spec.features[-1]
    too_big, negative, neg_len = values.clone(), values.clone(), lengths.clone()
    too_big[-1] = last.num_embeddings
    negative[0] = -1  # fbgemm's own bounds check would accept -1 (a pruned row)
    neg_len[5] = -1
    cases = [
        (too_big, lengths, None),
        (negative, lengths, None),
        (values, neg_len, None),
        (values[:-1], lengths, None),
        (values, lengths[:-1], None),
        (values, lengths, torch.ones(values.numel() - 1)),
    ]
    for case_values, case_lengths, weights in cases:
        with pytest.raises(RequestError) as reference:
            scripted._call(scripted.module.forward, case_values, case_lengths, weights)
        with pytest.raises(RequestError) as raised:
            pt2.module(case_values, case_lengths, weights)
        assert str(reference.value) in str(raised.value)  # the Python rules may add where the id sits
    # a dtype the program does not take: both refuse it (each in its own wording)
    with pytest.raises(RequestError, match="int64 or int32"):
        pt2.module(values.to(torch.float32), lengths, None)


def test_fbgemm_bounds_check_stays_inside_the_program(compiled):
    """The last line: the compiled program called without the loader's checks raises instead of reading
    past a table."""
    _, spec, _, _, pt2 = compiled
    batch = random_batch(spec, 4, seed=11)
    ids = batch.values.to(torch.int64).clone()
    ids[-1] = 10**6
    with pytest.raises(RuntimeError):
        pt2.module.program(ids, batch.lengths.to(torch.int64), torch.ones(ids.numel()))


class _NeverCalled:
    def boxed_run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        raise AssertionError("a bad request reached the compiled program")


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=repr)
def test_bad_request_corpus_never_reaches_the_program(case):
    """The shared corpus against the pt2 module's validation (CORPUS_SPEC, no compile needed: no bad
    request may reach the program)."""
    module = Pt2Module(_NeverCalled(), CORPUS_SPEC)
    values, lengths = case.values.clone(), case.lengths.clone()
    with pytest.raises(RequestError) as raised:
        module(values, lengths, case.weights)
    assert case.fragment in str(raised.value)
    assert torch.equal(values, case.values) and torch.equal(lengths, case.lengths)


# ------------------------------------------------------------------------------------ typed errors
@pytest.fixture(scope="module")
def plain_artifact(tmp_path_factory):
    model = quantize(CORPUS_SPEC, random_weights(CORPUS_SPEC, seed=1))
    return export(model, tmp_path_factory.mktemp("plain") / "a")


def test_artifact_without_pt2_names_the_fix(plain_artifact):
    with pytest.raises(ArtifactError, match="--pt2") as raised:
        load(plain_artifact, backend="pt2")
    assert raised.value.kind == ArtifactErrorKind.MODEL
    with pytest.raises(ConfigError, match="device_map"):
        load(plain_artifact, backend="pt2", device_map={"cuda:0": "cpu"})


def test_manifest_pt2_section_is_checked(plain_artifact, tmp_path):
    path = copy_artifact(plain_artifact, tmp_path)
    edit_manifest(path, lambda m: m.update(pt2={"file": "model.pt2", "torch_version": "x", "device": "cpu"}))
    with pytest.raises(ArtifactError, match="lacks the key 'inputs'") as raised:
        load(path, backend="pt2")
    assert raised.value.kind == ArtifactErrorKind.MANIFEST
    entry = {"file": "model.pt2", "torch_version": "x", "device": "cpu", "inputs": ["values:int64"] * 3}
    edit_manifest(path, lambda m: m.update(pt2=entry))
    with pytest.raises(ArtifactError, match="no checksum for model.pt2") as raised:
        load(path, backend="pt2")
    assert raised.value.kind == ArtifactErrorKind.CHECKSUM


def test_other_torch_version_is_a_model_error(compiled, tmp_path):
    name, _, path, _, _ = compiled
    if name != "unsharded":
        return
    copy = copy_artifact(path, tmp_path)
    # manifest.json carries no checksum of itself: a rewritten version passes the file checks
    edit_manifest(copy, lambda m: m["pt2"].update(torch_version="2.12.1+cpu"))
    with pytest.raises(ArtifactError) as raised:
        load(copy, backend="pt2")
    assert raised.value.kind == ArtifactErrorKind.MODEL
    assert "2.12.1+cpu" in str(raised.value) and torch.__version__ in str(raised.value)
    assert load(copy).lookup(random_batch(pt2_spec(), 2)).shape == (2, pt2_spec().output_dim)  # model.pt still loads


def test_corrupted_model_pt2_fails_its_checksum(compiled, tmp_path):
    name, _, path, _, _ = compiled
    if name != "unsharded":
        return
    copy = copy_artifact(path, tmp_path)
    blob = bytearray((copy / "model.pt2").read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    (copy / "model.pt2").write_bytes(bytes(blob))
    with pytest.raises(ArtifactError, match="model.pt2 fails its sha256") as raised:
        load(copy, backend="pt2")
    assert raised.value.kind == ArtifactErrorKind.CHECKSUM


def test_missing_fbgemm_is_a_library_error(compiled):
    name, _, path, _, _ = compiled
    if name != "unsharded":
        return
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["fbgemm_gpu"] = None  # what an interpreter without the package sees
        import infer
        try:
            infer.load({str(path)!r}, backend="pt2")
        except infer.ArtifactError as err:
            print(err.kind.name, "fbgemm-gpu-cpu==1.8.0" in str(err))
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.stdout.split() == ["LIBRARY", "True"], result.stderr


# ------------------------------------------------------------------------------ what the program takes
def _sharded(spec: ModelSpec, layout, compute_device=ComputeDevice.CPU):  # type: ignore[no-untyped-def]
    """The model sharded by ``layout`` over 2 devices (a CUDA plan's devices mapped to this host's CPU)."""
    plan = make_plan(spec, 2, layout, compute_device=compute_device)
    device_map = {"cuda:0": "cpu", "cuda:1": "cpu"} if compute_device == ComputeDevice.CUDA else None
    return shard_model(quantize(spec, random_weights(spec, seed=43)), plan, device_map=device_map), plan


def test_exported_program_matches_before_compiling(tmp_path):
    """The torch.export program itself (before AOTInductor) equals the TorchScript artifact: column-wise,
    row-wise (on one CPU host both are views of the whole table, read for a share of the batch) and replicated
    tables on two devices."""
    spec = pt2_spec()
    layout = {
        "t_int8": (ShardingType.COLUMN_WISE, (0, 1)),
        "t_int4": (ShardingType.REPLICATED, (0, 1)),
        "t_int2": (ShardingType.ROW_WISE, (0, 1)),
    }
    model, plan = _sharded(spec, layout)
    scripted = load(export(model, tmp_path / "cw", plan=plan))
    exported = export_program(lookup_program(model), len(spec.features), "cpu").module()
    for size, weighted in ((1, False), (300, True)):
        batch = random_batch(spec, size, weighted=weighted, seed=size)
        weights = batch.weights if batch.weights is not None else torch.ones(batch.values.numel())
        got = exported(batch.values, batch.lengths.to(torch.int64), weights)
        assert torch.equal(got, scripted.lookup(batch)), size


@pytest.mark.parametrize("kind", [ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE])
def test_row_wise_is_refused_naming_the_table(kind, tmp_path):
    """Row blocks (a CUDA plan's: on one CPU host row-wise shards are views, which the program reads)."""
    spec = pt2_spec()
    model, plan = _sharded(spec, {"t_int4": (kind, (0, 1))}, ComputeDevice.CUDA)
    with pytest.raises(ConfigError, match="table 't_int4' is sharded row-wise.*export without --pt2"):
        export(model, tmp_path / "a", plan=plan, pt2=True)
    assert not (tmp_path / "a").exists()


def test_a_program_spans_one_device():
    holder = torch.nn.Module()
    holder.register_buffer("a", torch.zeros(1))
    holder.register_buffer("b", torch.zeros(1, device="meta"))
    with pytest.raises(ConfigError, match=r"devices \['cpu', 'meta'\]"):
        program_device(holder)


# ------------------------------------------------------------------------------------- CLI, server
def test_cli_inspect_and_run_with_the_pt2_backend(compiled):
    name, _, path, _, _ = compiled
    if name != "unsharded":
        return
    inspect = subprocess.run(
        [sys.executable, "-m", "infer.cli", "inspect", str(path)], capture_output=True, text=True, timeout=120
    )
    assert inspect.returncode == 0, inspect.stderr
    expected = "pt2          model.pt2 (AOTInductor, lookups + dense; tables from the weight files), torch"
    assert f"{expected} {torch.__version__}, cpu" in inspect.stdout
    command = [sys.executable, "-m", "infer.cli", "run", str(path), "--backend", "pt2", "--iterations", "2"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "(checksums verified, pt2)" in run.stdout


def test_serve_with_the_pt2_backend(compiled):
    name, spec, path, scripted, _ = compiled
    if name != "mixed_sharding":
        return
    server, port = spawn_server(path, "--python", "--backend", "pt2", "--forward-threads", "1")
    try:
        batch = random_batch(spec, 12, weighted=True, seed=4)
        with EmbserveClient(f"127.0.0.1:{port}") as client:
            pooled = client.lookup(batch)
            with pytest.raises(Exception, match="out of range") as raised:
                client.lookup({name: [[0]] for name in spec.feature_names} | {"f_int2": [[300]]})
            assert "INVALID_ARGUMENT" in str(raised.value)
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=60)
    assert code == 0
    assert torch.equal(pooled, scripted.lookup(batch))
