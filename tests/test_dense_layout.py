"""The pooled layout a dense part was trained on (issue 24): recorded by ``from_torchrec`` on a real TorchRec DLRM,
written to the manifest (``dense.expects``), and a spec in another table order or with another pooling refused
at export, on the command line and in Python, naming the table."""

from __future__ import annotations

import json

import pytest
import torch
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import PoolingType as TorchRecPooling

import infer
from infer.cli import main
from infer.config import ModelSpec, PoolingType, TableConfig
from infer.errors import ArtifactError, ArtifactErrorKind, ConfigError
from infer.interop.torchrec import from_torchrec
from tests.interop.torchrec_models import float_ebc

NUM_DENSE = 5


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A TorchRec DLRM over the six test tables (one shared by two features, 'category' MEAN), its state dict,
    its dense part as a TorchScript file, and the spec the model itself gives."""
    folder = tmp_path_factory.mktemp("layout")
    torch.manual_seed(0)
    dlrm = DLRM(
        embedding_bag_collection=float_ebc(seed=0),
        dense_in_features=NUM_DENSE,
        dense_arch_layer_sizes=[32, 16],
        over_arch_layer_sizes=[16, 1],
    ).eval()
    torch.save(dlrm.state_dict(), folder / "model.pt")
    imported = from_torchrec(dlrm)
    torch.jit.save(torch.jit.script(imported.dense_arch), str(folder / "dense.pt"))
    (folder / "spec.json").write_text(imported.spec.to_json())
    return dlrm, imported, folder


def _torchrec_layout(dlrm: torch.nn.Module) -> list[dict]:
    """The pooled columns TorchRec's DLRM feeds its interaction: its sparse arch's feature order, each feature
    ``D`` columns wide, pooled as its table's config says (read from torchrec, not from embserve)."""
    ebc = dlrm.sparse_arch.embedding_bag_collection
    table_of = {f: cfg for cfg in ebc.embedding_bag_configs() for f in cfg.feature_names}
    pooling = {TorchRecPooling.SUM: "sum", TorchRecPooling.MEAN: "mean"}
    width = dlrm.sparse_arch.D
    return [
        {
            "name": name,
            "table": table_of[name].name,
            "pooling": pooling[table_of[name].pooling],
            "column_start": i * width,
            "column_end": (i + 1) * width,
        }
        for i, name in enumerate(dlrm.sparse_arch.sparse_feature_names)
    ]


def _reordered(spec: ModelSpec) -> ModelSpec:
    """The same tables with 'user' and 'item' swapped: same shapes and output width, other columns."""
    tables = list(spec.tables)
    tables[0], tables[1] = tables[1], tables[0]
    assert [t.name for t in tables[:2]] == ["item", "user"]
    return ModelSpec(tuple(tables), spec.num_dense_features)


def _repooled(spec: ModelSpec) -> ModelSpec:
    """The same spec with the MEAN table 'category' pooled SUM (what `embserve spec` writes for every table)."""
    tables = tuple(
        TableConfig(t.name, t.num_embeddings, t.embedding_dim, t.feature_names, PoolingType.SUM, t.data_type)
        for t in spec.tables
    )
    assert spec.table("category").pooling == PoolingType.MEAN
    return ModelSpec(tables, spec.num_dense_features)


def _export_args(folder, spec_file, out) -> list[str]:
    return ["export", "--from-torchrec", str(folder / "model.pt"), "--spec", str(spec_file), "--out", str(out)]


def test_the_manifest_records_the_layout_the_dlrm_was_trained_on(trained, tmp_path):
    dlrm, imported, folder = trained
    expected = _torchrec_layout(dlrm)
    out = tmp_path / "cli"
    assert main([*_export_args(folder, folder / "spec.json", out), "--dense-arch", str(folder / "dense.pt")]) == 0
    assert json.loads((out / "manifest.json").read_text())["dense"]["expects"] == {"features": expected}
    api = infer.export(imported.quantize(), tmp_path / "api")
    assert json.loads((api / "manifest.json").read_text())["dense"]["expects"] == {"features": expected}
    assert infer.load(api).manifest.dense_expects == imported.dense_layout
    # a user's own dense module records nothing: nothing to check, and the manifest claims nothing
    spec = _reordered(imported.spec)
    own = infer.quantize(spec.with_dense_arch(_OwnOverArch(spec.output_dim), NUM_DENSE), imported.weights)
    assert "expects" not in json.loads((infer.export(own, tmp_path / "own") / "manifest.json").read_text())["dense"]


class _OwnOverArch(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(NUM_DENSE + width, 1)

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.cat([dense, pooled], dim=1)).squeeze(1)


def test_a_spec_in_another_table_order_is_refused_naming_the_tables(trained, tmp_path, capsys):
    _, imported, folder = trained
    (tmp_path / "spec.json").write_text(_reordered(imported.spec).to_json())
    out = tmp_path / "a"
    assert main([*_export_args(folder, tmp_path / "spec.json", out), "--dense-arch", str(folder / "dense.pt")]) == 2
    message = capsys.readouterr().err
    assert "dense.pt" in message and "order" in message
    assert "tables ['user', 'item'," in message and "the spec lists ['item', 'user'," in message
    assert "feature 'user_id' (table 'user') is read from columns 0:16, the spec puts it at 32:48" in message
    assert not out.exists()
    model = infer.quantize(_reordered(imported.spec).with_dense_arch(imported.dense_arch, NUM_DENSE), imported.weights)
    with pytest.raises(ConfigError, match=r"order: .*feature 'user_id' \(table 'user'\)"):
        infer.export(model, tmp_path / "api")
    assert not (tmp_path / "api").exists()


def test_a_spec_with_another_pooling_is_refused_naming_the_table(trained, tmp_path, capsys):
    _, imported, folder = trained
    (tmp_path / "spec.json").write_text(_repooled(imported.spec).to_json())
    out = tmp_path / "a"
    assert main([*_export_args(folder, tmp_path / "spec.json", out), "--dense-arch", str(folder / "dense.pt")]) == 2
    message = capsys.readouterr().err
    assert "table 'category' is pooled mean in the trained model, sum in the spec" in message
    assert "category(mean): category_id" in message  # the fix: the spec to write
    assert not out.exists()
    model = infer.quantize(_repooled(imported.spec).with_dense_arch(imported.dense_arch, NUM_DENSE), imported.weights)
    with pytest.raises(ConfigError, match="table 'category' is pooled mean in the trained model, sum in the spec"):
        infer.export(model, tmp_path / "api")


def test_loaders_check_the_recorded_layout_against_the_features(trained, tmp_path):
    _, imported, _ = trained
    good = infer.export(imported.quantize(), tmp_path / "good")
    manifest = json.loads((good / "manifest.json").read_text())

    def read_with(change) -> ArtifactError:
        data = json.loads(json.dumps(manifest))
        change(data)
        (good / "manifest.json").write_text(json.dumps(data))
        with pytest.raises(ArtifactError) as info:
            infer.load(good)
        assert info.value.kind == ArtifactErrorKind.MANIFEST
        return info.value

    def swap_pooling(data):
        entry = next(f for f in data["dense"]["expects"]["features"] if f["table"] == "category")
        entry["pooling"] = "sum"

    assert "table 'category' is pooled sum in the trained model, mean in the spec" in str(read_with(swap_pooling))

    def swap_order(data):
        features = data["dense"]["expects"]["features"]
        features[0]["column_start"], features[1]["column_start"] = features[1]["column_start"], 0
        features[0]["column_end"], features[1]["column_end"] = features[1]["column_end"], 16

    assert "dense.expects disagrees with 'features'" in str(read_with(swap_order))

    def no_dense(data):
        data["dense"]["present"] = False

    assert "dense.expects is set but dense.present is false" in str(read_with(no_dense))
