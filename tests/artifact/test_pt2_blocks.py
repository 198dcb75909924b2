"""``model.pt2`` of a model with tables in precision blocks (pt2_program.BlockSplitCall): the program splits a
request by block with the scripted model's fbgemm operators and adds the levels in its order, so its lookups
``torch.equal`` the TorchScript artifact of the same export (the reference, never the program under test), and both
equal fp32 ``embedding_bag`` over the table dequantized block by block; the remaps compiled in are checked against
the manifest's ``block_remaps``; ONNX still refuses blocks, naming --onnx. One compile (tests/support/pt2_models.py
``blocks_pt2``, shared with the C++ loader's test)."""

from __future__ import annotations

import pytest
import torch

from infer.artifact.export import export
from infer.artifact.formats.pt2_program import BLOCK_REMAPS_KEY, read_block_remaps
from infer.artifact.load import load
from infer.errors import ArtifactError, ArtifactErrorKind, ConfigError
from infer.quant.quantize import quantize
from tests.modules.test_blocks import any_ids, batch_of, random_request, reference, reference_tables
from tests.support.artifacts import copy_artifact, edit_manifest
from tests.support.pt2_models import blocks_pt2

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):  # type: ignore[no-untyped-def]
    built = blocks_pt2(tmp_path_factory)
    return built, load(built.path), load(built.path, backend="pt2")


def _from(orders, hot: bool):  # type: ignore[no-untyped-def]
    """Ids of a block table drawn from its precise blocks only (``hot``) or its cold block only."""

    def pick(table, n, generator):  # type: ignore[no-untyped-def]
        if not table.blocks:
            return any_ids(table, n, generator)
        cold_start = table.num_embeddings - table.blocks[-1].rows
        ids = orders[table.name][:cold_start] if hot else orders[table.name][cold_start:]
        return ids[torch.randint(0, ids.numel(), (n,), generator=generator)]

    return pick


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("which", ["any", "all_hot", "all_cold", "empty_bags", "batch_1"])
def test_pt2_lookups_equal_the_torchscript_artifact_and_fp32(compiled, which, weighted):
    built, scripted, pt2 = compiled
    spec, orders = built.spec, built.orders
    assert pt2.backend == "pt2" and spec.block_tables == ("blocked", "two")
    batch = 1 if which == "batch_1" else 19
    if which == "empty_bags":
        features = len(spec.features)
        values, lengths, weights = batch_of(spec, [[]] * features, [[0] * batch] * features, weighted, 1)
    else:
        pick = {"all_hot": _from(orders, hot=True), "all_cold": _from(orders, hot=False)}.get(which, any_ids)
        values, lengths, weights = random_request(spec, batch, pick, 7, weighted)
    expected = scripted.module(values, lengths, weights)
    got = pt2.module(values, lengths, weights)
    assert torch.equal(got, expected), (which, float((got - expected).abs().max()))
    # the program as the C++ loader calls it: int64 inputs, ones for a request without weights
    ones = weights if weights is not None else torch.ones(values.numel())
    assert torch.equal(pt2.module.program(values, lengths.to(torch.int64), ones), expected)
    tables = reference_tables(spec, built.weights, orders)
    torch.testing.assert_close(got, reference(spec, tables, values, lengths, weights), rtol=1e-5, atol=1e-5)


def test_the_package_names_the_remaps_of_the_manifest(compiled):
    built, _, pt2 = compiled
    manifest = pt2.manifest
    compiled_in = read_block_remaps(pt2.module.lookup.get_metadata()[BLOCK_REMAPS_KEY])
    assert compiled_in == {entry.table: entry.sha256 for entry in manifest.block_remaps}
    assert set(compiled_in) == {"blocked", "two"}


@pytest.mark.parametrize(
    "edit, message, kind",
    [
        (
            lambda m: m["block_remaps"]["two"].update(sha256="0" * 64),
            r"model.pt2 was compiled with remap sha256 [0-9a-f]{16}\.\.\. for table 'two'.*sha256 0{16}",
            ArtifactErrorKind.MODEL,
        ),
        # the manifest's own checks come first, for every backend
        (
            lambda m: m["block_remaps"].pop("two"),
            "table 'two' is held in blocks but has no remap",
            ArtifactErrorKind.MANIFEST,
        ),
    ],
    ids=["sha256", "missing"],
)
def test_a_manifest_remap_that_disagrees_with_model_pt2_is_refused(compiled, tmp_path, edit, message, kind):
    built, _, _ = compiled
    copy = copy_artifact(built.path, tmp_path)
    edit_manifest(copy, edit)
    with pytest.raises(ArtifactError, match=message) as caught:
        load(copy, backend="pt2")
    assert caught.value.kind == kind


def test_onnx_still_refuses_blocks_naming_the_flag(compiled, tmp_path):
    built, _, _ = compiled
    model = quantize(built.spec, built.weights, block_orders=built.orders)
    with pytest.raises(ConfigError, match="'blocked'.*precision blocks.*ONNX.*--onnx"):
        export(model, tmp_path / "out", onnx=True)
    assert not (tmp_path / "out").exists()
