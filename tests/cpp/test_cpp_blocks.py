"""Tables held in precision blocks (issue 43) in the C++ loader: embserve_run answers as the Python runtime, bit for
bit (the scripted model remaps and splits by block; the direct kernel call stays off); a remap in model.pt that
disagrees with the manifest, a flipped byte in it and a tampered block split are typed errors, as in Python."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from infer.artifact.cpp_io import read_responses, write_requests
from infer.artifact.export import export
from infer.artifact.load import load
from infer.config import PoolingType
from infer.errors import ArtifactError, ArtifactErrorKind
from infer.features import SparseFeatures
from infer.quant.blocks import rank_rows
from infer.quant.quantize import quantize
from infer.weights import random_weights
from tests.cpp.support import assert_same_as_one_folder_run, load_each
from tests.modules.test_blocks import any_ids, block_spec, cold_ids, hot_ids, random_request
from tests.support.artifacts import copy_artifact, edit_manifest, edit_remap, rehash


def _blocked(pooling: PoolingType, folder: Path, weights: str):  # type: ignore[no-untyped-def]
    spec = block_spec(pooling)
    generator = torch.Generator().manual_seed(11)
    orders = {
        t.name: rank_rows(t.num_embeddings, torch.randint(0, 30, (300,), generator=generator).numpy())
        for t in spec.tables
        if t.blocks
    }
    model = quantize(spec, random_weights(spec, seed=6), block_orders=orders)
    return spec, model, orders, export(model, folder, weights=weights)


@pytest.fixture(scope="module")
def mean_mapped(tmp_path_factory):  # type: ignore[no-untyped-def]
    return _blocked(PoolingType.MEAN, tmp_path_factory.mktemp("cpp-blocks") / "mean", "mapped")


def _requests(spec, orders):  # type: ignore[no-untyped-def]
    """Any ids, every id hot, every id cold; weighted and not; int64 and int32 ids; every fifth bag empty; a batch of
    one empty bag per feature."""
    requests = []
    for seed, (pick, weighted, batch, ids) in enumerate(
        [
            (any_ids, False, 17, torch.int64),
            (any_ids, True, 9, torch.int32),
            (hot_ids(orders), True, 8, torch.int64),
            (cold_ids(orders), False, 8, torch.int32),
            (any_ids, False, 1, torch.int64),
        ]
    ):
        values, lengths, weights = random_request(spec, batch, pick, seed, weighted)
        requests.append((values.to(ids), lengths, weights))
    empty = torch.zeros(len(spec.features), dtype=torch.int64)
    requests.append((torch.zeros(0, dtype=torch.int64), empty, None))
    return requests


@pytest.mark.parametrize("pooling, weights", [(PoolingType.SUM, "embedded"), (PoolingType.MEAN, "mapped")])
def test_block_artifact_answers_as_python(pooling, weights, embserve_run, mean_mapped, tmp_path):
    """Model::lookup and Model::lookup_unchecked (the server's entry) answer as infer.load(...).lookup, bit for bit;
    lookup_unchecked keeps the TorchScript path (the direct kernel call does not remap)."""
    if (pooling, weights) == (PoolingType.MEAN, "mapped"):
        spec, _, orders, artifact = mean_mapped
    else:
        spec, _, orders, artifact = _blocked(pooling, tmp_path / "a", weights)
    assert load(artifact).spec.block_tables == ("blocked", "two")
    _answers_as_python(embserve_run, artifact, _requests(spec, orders), tmp_path)


def _answers_as_python(embserve_run: Path, artifact: Path, requests: list, tmp_path: Path) -> None:
    """``embserve_run`` on ``requests``, checked (Model::lookup) and ``--unchecked`` (the server's entry, which
    keeps the TorchScript path for blocks: the direct kernel call does not remap), answers bit for bit as
    ``infer.load(artifact).lookup``."""
    write_requests(tmp_path / "requests.bin", requests)
    runtime = load(artifact)
    expected = [runtime.lookup(SparseFeatures(runtime.feature_names, v, n, w)) for v, n, w in requests]
    for flags in ([], ["--unchecked"]):
        out = tmp_path / f"out{len(flags)}.bin"
        result = subprocess.run(
            [str(embserve_run), str(artifact), "--requests", str(tmp_path / "requests.bin"), "--out", str(out), *flags],
            capture_output=True,
            text=True,
            env={**os.environ, "EMBSERVE_FORCE_TORCHSCRIPT": "0"},
            timeout=300,
        )
        assert result.returncode == 0, result.stderr
        if flags:
            assert "lookup_unchecked: torchscript" in result.stdout
        responses = read_responses(out)
        assert len(responses) == len(requests)
        for want, response in zip(expected, responses, strict=True):
            assert response.ok, response.message
            assert response.output is not None and torch.equal(response.output, want)


def _python_error(artifact: Path) -> ArtifactError:
    with pytest.raises(ArtifactError) as caught:
        load(artifact)
    return caught.value


def test_remaps_that_disagree_with_the_manifest_are_typed_errors_in_both_loaders(mean_mapped, embserve_run, tmp_path):
    """A flipped byte in a remap fails model.pt's checksums (the rewritten zip's size or sha256); rehashed, the
    remap's own checks name the table as Python's loader does (same kind, same words): a value outside the rows, two
    ids on one row, a permutation other than the manifest's (its sha256), the manifest's sha256 changed."""
    _, model, _, artifact = mean_mapped

    def flipped(data: np.ndarray) -> None:
        data.view(np.uint8)[5] ^= 0x01

    def outside(data: np.ndarray) -> None:
        data[3] = len(data)

    def twice(data: np.ndarray) -> None:
        data[1] = data[0]

    def swapped(data: np.ndarray) -> None:  # still a permutation: only the sha256 tells
        data[[0, 1]] = data[[1, 0]]

    cases = {
        "flipped": (1, flipped, False),
        "flipped_rehashed": (1, flipped, True),
        "outside": (3, outside, True),
        "twice": (0, twice, True),
        "swapped": (3, swapped, True),
    }
    folders = {}
    for name, (feature, edit, rehashed) in cases.items():
        folders[name] = copy_artifact(artifact, tmp_path / name)
        edit_remap(folders[name], model, feature, edit)
        if rehashed:
            rehash(folders[name], "model.pt")
    folders["manifest_sha256"] = copy_artifact(artifact, tmp_path / "manifest_sha256")
    edit_manifest(folders["manifest_sha256"], lambda m: m["block_remaps"]["blocked"].update(sha256="0" * 64))
    outcomes = load_each(embserve_run, list(folders.values()))
    words = {
        "flipped": "model.pt",
        "flipped_rehashed": "the id remap of table 'blocked' ",
        "outside": "the id remap of table 'two' names a row outside the table's blocks",
        "twice": "the id remap of table 'blocked' gives two ids the same rank",
        "swapped": "the id remap of table 'two' differs from the one manifest.json lists (its sha256)",
        "manifest_sha256": "the id remap of table 'blocked' differs from the one manifest.json lists (its sha256)",
    }
    for name, folder in folders.items():
        python = _python_error(folder)
        outcome = outcomes[folder]
        if name == "flipped":
            assert python.kind is ArtifactErrorKind.CHECKSUM
            assert outcome.startswith("ChecksumError: ") and words[name] in outcome, outcome
            continue
        assert python.kind is ArtifactErrorKind.MODEL
        assert words[name] in str(python), str(python)
        assert outcome == f"ModelError: {python}", (outcome, str(python))
    assert_same_as_one_folder_run(embserve_run, folders["swapped"], outcomes[folders["swapped"]])


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda m: m["block_remaps"]["blocked"].update(rows=199), "'blocked'] has 199 ranks but table 'blocked' has"),
        (lambda m: m["block_remaps"].pop("two"), "table 'two' is held in blocks but has no remap"),
        (lambda m: m["tables"][0]["blocks"][0].update(rows=13), "blocks hold 201 rows but the table has 200"),
        (lambda m: m["kernels"][0]["tables"][1].update(data_type="int8"), "kernels[0].tables[1]"),
    ],
    ids=["remap_rows", "remap_missing", "block_rows", "kernel_block_type"],
)
def test_a_manifest_whose_blocks_disagree_is_a_manifest_error_in_both_loaders(
    mean_mapped, embserve_run, tmp_path, edit, words
):
    copy = copy_artifact(mean_mapped[3], tmp_path / "copy")
    edit_manifest(copy, edit)
    python = _python_error(copy)
    assert python.kind is ArtifactErrorKind.MANIFEST
    outcome = load_each(embserve_run, [copy])[copy]
    assert outcome.startswith("ManifestError: ") and words in outcome, outcome


def test_a_tampered_block_split_is_a_model_error(mean_mapped, embserve_run, tmp_path):
    """What cuts a request by block (each feature's blocks' bounds, the levels) is held against the manifest's
    tables before the first lookup, by both loaders: a model.pt edited and rehashed is refused naming the
    attribute."""
    artifact = mean_mapped[3]

    def bounds(embeddings) -> None:  # type: ignore[no-untyped-def]
        held = [b.clone() for b in embeddings.block_bounds]
        held[0][1] += 1
        embeddings.block_bounds = held

    def levels(embeddings) -> None:  # type: ignore[no-untyped-def]
        embeddings.block_levels = embeddings.block_levels + 1

    folders = {}
    for name, edit in {"block_bounds": bounds, "block_levels": levels}.items():
        copy = copy_artifact(artifact, tmp_path / name)
        module = torch.jit.load(str(copy / "model.pt"))
        edit(module.embeddings)
        module.save(str(copy / "model.pt"))
        rehash(copy, "model.pt")
        folders[name] = copy
    outcomes = load_each(embserve_run, list(folders.values()))
    for name, folder in folders.items():
        assert outcomes[folder].startswith(f"ModelError: {folder / 'model.pt'}: embeddings: "), outcomes[folder]
        assert name in outcomes[folder]
        python = _python_error(folder)
        assert python.kind is ArtifactErrorKind.MODEL and f"the block split's {name} disagrees" in str(python)


@pytest.fixture(scope="module")
def blocks_pt2_artifact(tmp_path_factory):  # type: ignore[no-untyped-def]
    from tests.support.pt2_models import blocks_pt2

    return blocks_pt2(tmp_path_factory)  # compiled once per session, shared with tests/artifact/test_pt2_blocks.py


@pytest.mark.slow
def test_pt2_block_artifact_answers_as_torchscript(blocks_pt2_artifact, embserve_run, tmp_path):
    """``--backend pt2`` on a block model's model.pt2 (the split inside the program) answers as the Python
    TorchScript runtime bit for bit, its batches cut into example ranges on threads or not; a manifest remap sha256
    that is not the one compiled into model.pt2 is a ModelError in Python's words."""
    from tests.cpp.test_cpp_pt2 import run_requests

    built = blocks_pt2_artifact
    requests = _requests(built.spec, built.orders)
    requests.append(random_request(built.spec, 700, any_ids, 9, True))  # ~7k ids: cut into ranges below
    runtime = load(built.path)
    expected = [runtime.lookup(SparseFeatures(runtime.feature_names, v, n, w)) for v, n, w in requests]
    for threads in (1, 3):
        result, responses = run_requests(
            embserve_run, built.path, requests, tmp_path, "--kernel-threads", threads, "--threads", threads
        )
        assert result.returncode == 0, result.stderr
        assert len(responses) == len(requests)
        for want, response in zip(expected, responses, strict=True):
            assert response.ok, response.message
            assert response.output is not None and torch.equal(response.output, want)
    copy = copy_artifact(built.path, tmp_path / "sha256")
    edit_manifest(copy, lambda m: m["block_remaps"]["two"].update(sha256="0" * 64))
    with pytest.raises(ArtifactError) as caught:
        load(copy, backend="pt2")
    assert caught.value.kind is ArtifactErrorKind.MODEL
    assert load_each(embserve_run, [copy], "--backend", "pt2")[copy] == f"ModelError: {caught.value}"


@pytest.fixture(scope="module")
def sharded_blocks(tmp_path_factory):  # type: ignore[no-untyped-def]
    """A block table table-wise on device 1 of two CPU devices, a plain one on device 0 (tests/shard)."""
    from infer.shard.builder import shard_model
    from infer.shard.plans import make_plan
    from tests.shard.test_block_shards import PLACED, _quantized

    spec, model, _, orders = _quantized(PoolingType.MEAN)
    plan = make_plan(spec, 2, PLACED)
    return spec, orders, export(shard_model(model, plan), tmp_path_factory.mktemp("cpp-block-shards") / "a", plan=plan)


@pytest.mark.parametrize("layout", ["table_wise", "beside_views"])
def test_a_sharded_block_artifact_answers_as_python(sharded_blocks, embserve_run, tmp_path, layout):
    """The C++ loader serves a sharded artifact whose block table lies on one device: bit for bit Python's answers
    (any, hot and cold ids, weighted, empty bags, an empty request; checked and unchecked). ``beside_views``: the
    plain table row-wise (one CPU host: views of it on both devices, one buffer shared by the kernels, embedded in
    model.pt), the block table's blocks placed in that buffer too."""
    spec, orders, artifact = sharded_blocks
    if layout == "beside_views":
        from infer.planner.types import ShardingType
        from infer.shard.builder import shard_model
        from infer.shard.plans import make_plan
        from tests.shard.test_block_shards import _quantized

        spec, model, _, orders = _quantized(PoolingType.MEAN)
        plan = make_plan(
            spec, 2, {"plain": (ShardingType.ROW_WISE, (0, 1)), "blocked": (ShardingType.TABLE_WISE, (1,))}
        )
        artifact = export(shard_model(model, plan), tmp_path / "views", plan=plan, weights="embedded")
    _answers_as_python(embserve_run, artifact, _requests(spec, orders), tmp_path)


def test_tampered_shard_remaps_splits_and_plans_are_typed_errors_in_both_loaders(
    sharded_blocks, embserve_run, tmp_path
):
    """A remap edited in a shard of model.pt (rehashed) names the table in both loaders' words; a device's block
    split edited is a ModelError naming the attribute; a plan edited to shard the block table row-wise is refused
    by both."""
    from types import SimpleNamespace

    artifact = sharded_blocks[2]
    shard = getattr(torch.jit.load(str(artifact / "model.pt")).embeddings.shards, "1")

    def swapped(data: np.ndarray) -> None:  # still a permutation: only the sha256 tells
        data[[0, 1]] = data[[1, 0]]

    def twice(data: np.ndarray) -> None:
        data[1] = data[0]

    folders = {}
    for name, edit in {"swapped": swapped, "twice": twice}.items():
        folders[name] = copy_artifact(artifact, tmp_path / name)
        edit_remap(folders[name], SimpleNamespace(embeddings=shard), 1, edit)
        rehash(folders[name], "model.pt")
    folders["levels"] = copy_artifact(artifact, tmp_path / "levels")
    module = torch.jit.load(str(folders["levels"] / "model.pt"))
    device = getattr(module.embeddings.shards, "1")
    device.block_levels = device.block_levels + 1
    module.save(str(folders["levels"] / "model.pt"))
    rehash(folders["levels"], "model.pt")
    folders["row_wise"] = copy_artifact(artifact, tmp_path / "row_wise")
    plan_file = folders["row_wise"] / "plan.json"
    plan = plan_file.read_text().replace('"sharding_type": "table_wise"', '"sharding_type": "row_wise"')
    plan_file.write_text(plan)
    rehash(folders["row_wise"], "plan.json")
    outcomes = load_each(embserve_run, list(folders.values()))
    words = {
        "swapped": "the id remap of table 'blocked' differs from the one manifest.json lists (its sha256)",
        "twice": "the id remap of table 'blocked' gives two ids the same rank",
    }
    for name, folder in folders.items():
        python = _python_error(folder)
        outcome = outcomes[folder]
        if name in words:
            assert python.kind is ArtifactErrorKind.MODEL and words[name] in str(python), str(python)
            assert outcome == f"ModelError: {python}", (outcome, str(python))
        elif name == "levels":
            assert python.kind is ArtifactErrorKind.MODEL and "block_levels" in str(python), str(python)
            assert outcome.startswith(f"ModelError: {folder / 'model.pt'}: embeddings.shards.1: "), outcome
            assert "block_levels" in outcome, outcome
        else:
            refusal = "row-wise/column-wise sharding of a table in precision blocks is not supported"
            assert refusal in str(python), str(python)
            assert outcome.startswith("ManifestError: ") and refusal in outcome, outcome
