"""Export and load: manifest contents, fresh-process round trip, corruption, request validation."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from infer.artifact.export import export
from infer.artifact.load import load
from infer.artifact.manifest import FORMAT_VERSION, MAPPED_FORMAT_VERSION
from infer.config import DataType, ModelSpec, PoolingType, TableConfig
from infer.errors import ArtifactError, ArtifactErrorKind, ConfigError, RequestError
from infer.features import SparseFeatures
from infer.quant.quantize import dequantized_weights, quantize
from infer.reference import FloatEmbeddingBagCollection
from infer.weights import random_weights
from tests.conftest import TinyOverArch, mixed_spec, random_batch


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    spec = mixed_spec()
    torch.manual_seed(0)
    spec = spec.with_dense_arch(TinyOverArch(5, spec.output_dim), 5)
    weights = random_weights(spec, seed=11)
    model = quantize(spec, weights)
    path = export(model, tmp_path_factory.mktemp("art") / "artifact")
    return spec, weights, model, path


def _copy_artifact(src, dst):
    dst.mkdir()
    for item in src.iterdir():
        (dst / item.name).write_bytes(item.read_bytes())
    return dst


def test_manifest_describes_the_model(exported):
    spec, _, _, path = exported
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format_version"] == MAPPED_FORMAT_VERSION  # export's default: weights in weights-0.bin
    assert [t["name"] for t in manifest["tables"]] == [t.name for t in spec.tables]
    assert manifest["tables"][1] == {
        "name": "t_int4",
        "num_embeddings": 500,
        "embedding_dim": 32,
        "feature_names": ["f_int4"],
        "pooling": "mean",
        "data_type": "int4",
    }
    assert manifest["input_schema"]["feature_order"] == ["f_int8", "f_int8_b", "f_int4", "f_int2", "f_fp16", "f_fp32"]
    # column ranges follow the input feature order, a shared table giving each feature its own range
    columns = [(f["name"], f["column_start"], f["column_end"]) for f in manifest["features"]]
    assert columns == [
        ("f_int8", 0, 64),
        ("f_int8_b", 64, 128),
        ("f_int4", 128, 160),
        ("f_int2", 160, 176),
        ("f_fp16", 176, 184),
        ("f_fp32", 184, 196),
    ]
    assert manifest["output"]["shape"] == ["batch", 196]
    assert manifest["dense"] == {"present": True, "num_dense_features": 5}
    assert manifest["versions"]["torch"] == torch.__version__
    assert manifest["versions"]["fbgemm_gpu"].startswith("1.8")
    assert "fbgemm_gpu_tbe_inference.so" in manifest["fbgemm"]["libraries"]
    digest = hashlib.sha256((path / "model.pt").read_bytes()).hexdigest()
    assert manifest["files"]["model.pt"] == {"bytes": (path / "model.pt").stat().st_size, "sha256": digest}


def test_fresh_process_round_trip_is_bit_identical(exported, tmp_path):
    spec, _, model, path = exported
    batches = [
        random_batch(spec, 20, weighted=w, seed=s, id_dtype=d)
        for s, (w, d) in enumerate([(False, torch.int64), (True, torch.int64), (False, torch.int32)])
    ]
    dense = torch.randn(20, 5)
    torch.save({"batches": [(b.values, b.lengths, b.weights) for b in batches], "dense": dense}, tmp_path / "in.pt")
    script = textwrap.dedent(
        f"""
        import torch
        from infer.artifact.load import load
        from infer.features import SparseFeatures
        runtime = load({str(path)!r})
        data = torch.load({str(tmp_path / "in.pt")!r})
        keys = runtime.feature_names
        outs = [runtime.lookup(SparseFeatures(keys, v, l, w)) for v, l, w in data["batches"]]
        scores = runtime.predict(SparseFeatures(keys, *data["batches"][0]), data["dense"])
        torch.save({{"outs": outs, "scores": scores}}, {str(tmp_path / "out.pt")!r})
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True)
    result = torch.load(tmp_path / "out.pt")
    with torch.no_grad():
        for batch, out in zip(batches, result["outs"]):
            assert torch.equal(out, model(batch.values, batch.lengths, batch.weights))
        assert torch.equal(result["scores"], model.predict(dense, batches[0].values, batches[0].lengths, None))


def test_loaded_model_matches_the_reference_and_predicts(exported):
    spec, _, model, path = exported
    runtime = load(path)
    reference = FloatEmbeddingBagCollection(spec, dequantized_weights(spec, model))
    batch = random_batch(spec, 12, weighted=True, seed=7)
    pooled = runtime.lookup(batch)
    expected = reference(batch)
    assert float((pooled - expected).abs().max()) <= 1e-5 * max(float(expected.abs().max()), 1.0)
    dense = torch.randn(12, 5)
    scores = runtime.predict(batch, dense)
    with torch.no_grad():
        expected_scores = spec.dense_arch(dense, expected)
    assert scores.shape == (12,)
    assert torch.allclose(scores, expected_scores, atol=1e-4)
    # the dict form and a batch given in another feature order give the same result
    as_dict = batch.to_dict()
    shuffled = {k: as_dict[k] for k in reversed(list(as_dict))}
    weights = {}
    pos = 0
    for key in batch.keys:
        n = sum(len(bag) for bag in as_dict[key])
        flat = batch.weights[pos : pos + n].tolist()
        pos += n
        it = iter(flat)
        weights[key] = [[next(it) for _ in bag] for bag in as_dict[key]]
    reordered = SparseFeatures.from_dict(shuffled, {k: weights[k] for k in shuffled})
    assert torch.equal(runtime.lookup(reordered), pooled)


def test_flipped_byte_in_model_file_is_an_artifact_error(exported, tmp_path):
    path = _copy_artifact(exported[3], tmp_path / "copy")
    data = bytearray((path / "model.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (path / "model.pt").write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="model.pt.*sha256") as info:
        load(path)
    assert info.value.kind == ArtifactErrorKind.CHECKSUM


def test_truncated_model_file_is_an_artifact_error(exported, tmp_path):
    path = _copy_artifact(exported[3], tmp_path / "copy")
    data = (path / "model.pt").read_bytes()
    (path / "model.pt").write_bytes(data[: len(data) // 3])
    with pytest.raises(ArtifactError, match="model.pt.*truncated") as info:
        load(path)
    assert info.value.kind == ArtifactErrorKind.CHECKSUM


def test_missing_or_corrupt_manifest_is_an_artifact_error(exported, tmp_path):
    path = _copy_artifact(exported[3], tmp_path / "copy")
    text = (path / "manifest.json").read_text()
    (path / "manifest.json").write_text(text[: len(text) // 2])
    with pytest.raises(ArtifactError, match="manifest.json") as info:
        load(path)
    assert info.value.kind == ArtifactErrorKind.MANIFEST
    data = json.loads(text)
    data["format_version"] = max(FORMAT_VERSION, MAPPED_FORMAT_VERSION) + 1
    (path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="format_version"):
        load(path)
    del data["tables"]
    data["format_version"] = MAPPED_FORMAT_VERSION
    (path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="malformed") as info:
        load(path)
    assert info.value.kind == ArtifactErrorKind.MANIFEST
    (path / "manifest.json").unlink()
    with pytest.raises(ArtifactError, match="manifest.json") as info:
        load(path)
    assert info.value.kind == ArtifactErrorKind.MANIFEST


def test_garbage_model_with_matching_checksum_is_an_artifact_error(exported, tmp_path):
    """Even a file whose checksum matches (a manifest rewritten by hand) fails with ArtifactError, not torch's."""
    path = _copy_artifact(exported[3], tmp_path / "copy")
    garbage = b"not a torchscript archive" * 100
    (path / "model.pt").write_bytes(garbage)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["model.pt"] = {"bytes": len(garbage), "sha256": hashlib.sha256(garbage).hexdigest()}
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="model.pt") as info:
        load(path)
    assert info.value.kind == ArtifactErrorKind.MODEL


def test_missing_fbgemm_is_a_library_error(exported):
    """A process where fbgemm_gpu cannot be imported gets ArtifactError(kind=LIBRARY) naming the package."""
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["fbgemm_gpu"] = None  # what an interpreter without the package sees
        import infer
        try:
            infer.load({str(exported[3])!r})
        except infer.ArtifactError as err:
            print(err.kind.name, "fbgemm-gpu-cpu==1.8.0" in str(err))
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.stdout.split() == ["LIBRARY", "True"], result.stderr


def _bad_requests(spec: ModelSpec):
    good = random_batch(spec, 4, seed=1)
    keys, values, lengths = good.keys, good.values, good.lengths
    too_big = values.clone()
    too_big[0] = spec.features[0].num_embeddings
    negative = values.clone()
    negative[-1] = -1  # the kernel's own bounds check would accept -1 (a pruned row)
    neg_len = lengths.clone()
    neg_len[3] = -1
    short = lengths.clone()
    short[1] += 1
    return {
        "unknown feature": SparseFeatures(("nope",) + keys[1:], values, lengths),
        "missing feature": {k: [[0]] * 4 for k in keys[1:]},
        "negative length": SparseFeatures(keys, values, neg_len),
        "lengths do not sum to ids": SparseFeatures(keys, values, short),
        "id too large": SparseFeatures(keys, too_big, lengths),
        "negative id": SparseFeatures(keys, negative, lengths),
        "inconsistent batch": SparseFeatures(keys, values, lengths[:-1]),
        "ragged dict": {k: [[0]] * (4 if i else 3) for i, k in enumerate(keys)},
    }


def test_every_bad_request_raises_request_error_and_leaves_model_usable(exported):
    spec, _, model, path = exported
    runtime = load(path)
    good = random_batch(spec, 4, seed=1)
    expected = runtime.lookup(good)
    for name, request in _bad_requests(spec).items():
        before = [t.clone() for t in (request.values, request.lengths)] if isinstance(request, SparseFeatures) else None
        with pytest.raises(RequestError):
            runtime.lookup(request)
        if before is not None:
            assert torch.equal(before[0], request.values) and torch.equal(before[1], request.lengths), name
        assert torch.equal(runtime.lookup(good), expected), f"model changed after {name}"


def test_scripted_module_validates_on_its_own(exported):
    """C++ hosts call the scripted forward directly: it must reject bad input itself."""
    spec, _, _, path = exported
    module = load(path).module
    for name, request in _bad_requests(spec).items():
        if not isinstance(request, SparseFeatures) or name == "unknown feature":
            continue
        values, lengths = request.values.clone(), request.lengths.clone()
        with pytest.raises(torch.jit.Error, match="embserve.RequestError"):
            module(request.values, request.lengths, None)
        assert torch.equal(values, request.values) and torch.equal(lengths, request.lengths), name
    good = random_batch(spec, 4, seed=1)
    with pytest.raises(torch.jit.Error, match="weights"):
        module(good.values, good.lengths, torch.ones(good.values.numel() + 1))


def test_request_error_names_the_feature(exported):
    spec, _, _, path = exported
    runtime = load(path)
    bad = _bad_requests(spec)
    with pytest.raises(RequestError, match=r"f_int8.*\b1000\b"):
        runtime.lookup(bad["id too large"])
    with pytest.raises(RequestError, match="nope"):
        runtime.lookup(bad["unknown feature"])


def test_predict_rejects_bad_dense_input(exported):
    spec, _, _, path = exported
    runtime = load(path)
    batch = random_batch(spec, 3)
    with pytest.raises(RequestError, match="shape"):
        runtime.predict(batch, torch.randn(3, 4))
    with pytest.raises(RequestError, match="float32"):
        runtime.predict(batch, torch.randn(3, 5, dtype=torch.float64))


def test_lookup_only_model_has_no_predict(tmp_path):
    spec = ModelSpec((TableConfig("t", 10, 4, ("f",), PoolingType.MEAN, DataType.FP16),))
    runtime = load(export(quantize(spec, random_weights(spec)), tmp_path / "a"))
    assert runtime.lookup({"f": [[1, 2], []]}).shape == (2, 4)
    with pytest.raises(RequestError, match="no dense part"):
        runtime.predict({"f": [[1]]}, torch.zeros(1, 1))


def test_export_replaces_an_artifact_but_not_other_folders(tmp_path):
    spec = ModelSpec((TableConfig("t", 10, 4, ("f",)),))
    model = quantize(spec, random_weights(spec))
    target = export(model, tmp_path / "a")
    export(model, target)  # replacing an artifact is fine
    assert sorted(p.name for p in target.iterdir()) == ["manifest.json", "model.pt", "weights-0.bin"]
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(ArtifactError, match="not an embserve artifact"):
        export(model, other)
    assert (other / "notes.txt").read_text() == "keep me"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_unscriptable_dense_arch_is_a_config_error(tmp_path):
    class Unscriptable(torch.nn.Module):
        def forward(self, dense_features, pooled):
            return {"x": dense_features.sum(dim=1)}.get("x") if isinstance(pooled, torch.Tensor) else None

    spec = ModelSpec((TableConfig("t", 10, 4, ("f",)),), 2, Unscriptable())
    with pytest.raises(ConfigError, match="script"):
        export(quantize(spec, random_weights(spec)), tmp_path / "a")
