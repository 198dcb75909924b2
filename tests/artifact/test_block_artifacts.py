"""Artifacts of tables held in precision blocks: the id remap recorded in the manifest (its sha256) and held by the
model file; both weight formats load and serve what the eager model serves; a remap that disagrees with the manifest
or a flipped byte in it is a typed ``ArtifactError``; the forms that do not serve blocks yet (ONNX,
sharding) refuse them by name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from infer.artifact.export import export
from infer.artifact.load import load
from infer.config import PoolingType
from infer.errors import ArtifactError, ArtifactErrorKind, ConfigError
from infer.quant.blocks import rank_rows
from infer.quant.quantize import quantize
from infer.weights import random_weights
from tests.modules.test_blocks import any_ids, block_spec, random_request, reference, reference_tables
from tests.support.artifacts import copy_artifact, edit_manifest, edit_remap, rehash


@pytest.fixture(scope="module")
def blocked(tmp_path_factory):  # type: ignore[no-untyped-def]
    spec = block_spec(PoolingType.MEAN)
    weights = random_weights(spec, seed=5)
    generator = torch.Generator().manual_seed(8)
    orders = {
        t.name: rank_rows(t.num_embeddings, torch.randint(0, t.num_embeddings, (300,), generator=generator).numpy())
        for t in spec.tables
        if t.blocks
    }
    model = quantize(spec, weights, block_orders=orders)
    folder = tmp_path_factory.mktemp("blocks")
    artifacts = {w: export(model, folder / w, weights=w) for w in ("mapped", "embedded")}
    return spec, model, reference_tables(spec, weights, orders), artifacts


@pytest.mark.parametrize("weights", ["mapped", "embedded"])
def test_block_artifact_serves_the_eager_model(blocked, weights):
    spec, model, tables, artifacts = blocked
    runtime = load(artifacts[weights])
    assert runtime.spec.block_tables == ("blocked", "two")
    assert runtime.spec.table("blocked").blocks == spec.table("blocked").blocks
    for seed, weighted in enumerate([False, True]):
        values, lengths, bag_weights = random_request(spec, 17, any_ids, seed, weighted)
        served = runtime.module(values, lengths.to(torch.int32), bag_weights)
        assert torch.equal(served, model(values, lengths, bag_weights))
        torch.testing.assert_close(served, reference(spec, tables, values, lengths, bag_weights), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("feature, table", [(0, "blocked"), (1, "blocked"), (3, "two")])
def test_a_flipped_byte_in_the_remap_is_caught(blocked, tmp_path, feature, table):
    _, model, _, artifacts = blocked
    copy = copy_artifact(artifacts["mapped"], tmp_path)

    def flip(data: np.ndarray) -> None:
        data.view(np.uint8)[5] ^= 0x01

    edit_remap(copy, model, feature, flip)
    with pytest.raises(ArtifactError) as caught:
        load(copy)
    assert caught.value.kind == ArtifactErrorKind.CHECKSUM
    rehash(copy, "model.pt")  # the file checksum rewritten: the remap's own checks still catch it
    with pytest.raises(ArtifactError, match=f"remap of table '{table}'") as caught:
        load(copy)
    assert caught.value.kind == ArtifactErrorKind.MODEL


def test_a_permuted_remap_that_disagrees_with_the_manifest_is_refused(blocked, tmp_path):
    _, model, _, artifacts = blocked
    copy = copy_artifact(artifacts["embedded"], tmp_path)

    def swap(data: np.ndarray) -> None:  # still one to one onto the blocks' rows: only the sha256 tells
        data[[0, 1]] = data[[1, 0]]

    edit_remap(copy, model, 3, swap)
    rehash(copy, "model.pt")
    with pytest.raises(ArtifactError, match="remap of table 'two'.*sha256") as caught:
        load(copy)
    assert caught.value.kind == ArtifactErrorKind.MODEL


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m["block_remaps"]["blocked"].update(rows=199), "'blocked'.*199 ranks.*200 rows"),
        (lambda m: m["block_remaps"].pop("two"), "table 'two' is held in blocks but has no remap"),
        (lambda m: m["block_remaps"].update(plain=m["block_remaps"]["two"]), "names 'plain'"),
        (lambda m: m["block_remaps"]["two"].update(dtype="int64"), "dtype"),
    ],
    ids=["rows", "missing", "extra", "dtype"],
)
def test_a_manifest_remap_that_disagrees_with_the_tables_is_refused(blocked, tmp_path, edit, message):
    copy = copy_artifact(blocked[3]["embedded"], tmp_path)
    edit_manifest(copy, edit)
    with pytest.raises(ArtifactError, match=message) as caught:
        load(copy)
    assert caught.value.kind == ArtifactErrorKind.MANIFEST


def test_a_changed_remap_sha256_in_the_manifest_is_refused(blocked, tmp_path):
    copy = copy_artifact(blocked[3]["mapped"], tmp_path)
    edit_manifest(copy, lambda m: m["block_remaps"]["blocked"].update(sha256="0" * 64))
    with pytest.raises(ArtifactError, match="remap of table 'blocked'") as caught:
        load(copy)
    assert caught.value.kind == ArtifactErrorKind.MODEL


def test_onnx_refuses_blocks_by_name(blocked, tmp_path):
    """(pt2 serves blocks: tests/artifact/test_pt2_blocks.py.)"""
    model = blocked[1]
    with pytest.raises(ConfigError, match="'blocked'.*precision blocks.*--onnx"):
        export(model, tmp_path / "out", onnx=True)
    assert not (tmp_path / "out").exists()


def test_a_model_with_the_earlier_remap_form_is_refused():
    """A block model exported before the remap held positions has no ``block_bounds``: refused before its remap is
    read in the wrong form, naming the tables and the fix."""
    from types import SimpleNamespace

    from infer.artifact.formats.torchscript import check_block_remaps

    earlier = SimpleNamespace(embeddings=SimpleNamespace(block_table_names=["blocked"]))
    with pytest.raises(ArtifactError, match=r"tables \['blocked'\].*earlier embserve.*re-export") as caught:
        check_block_remaps(earlier, [], Path("model.pt"))  # type: ignore[arg-type]
    assert caught.value.kind == ArtifactErrorKind.MODEL
