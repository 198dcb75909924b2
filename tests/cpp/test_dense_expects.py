"""The manifest's optional ``dense.expects`` (the pooled layout a dense part was trained on, issue 24) in the C++
loader: a manifest that carries it is accepted, and a malformed one is a ManifestError, as in Python."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from infer.artifact.manifest import Manifest
from infer.errors import ArtifactError, ArtifactErrorKind


class _OverArch(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3 + width, 1)

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.cat([dense, pooled], dim=1)).squeeze(1)


@pytest.fixture(scope="module")
def dense_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """mixed_spec with a dense part that records the spec's pooled layout, so the manifest has dense.expects."""
    from infer.artifact.export import export
    from infer.dense_layout import PooledLayout, record_layout
    from infer.quant.quantize import quantize
    from infer.weights import random_weights
    from tests.conftest import mixed_spec

    spec = mixed_spec()
    torch.manual_seed(0)
    dense = _OverArch(spec.output_dim)
    record_layout(dense, PooledLayout.of_spec(spec))
    model = quantize(spec.with_dense_arch(dense, 3), random_weights(spec, seed=3))
    return export(model, tmp_path_factory.mktemp("cpp") / "dense_expects")


def _check(cpp_build: Path, folders: list[Path]) -> list[str]:
    result = subprocess.run(
        [str(cpp_build / "embserve_manifest_check"), *map(str, folders)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.splitlines()


def _variant(artifact: Path, root: Path, name: str, change: Callable[[list[dict]], object]) -> Path:
    folder = root / name
    folder.mkdir()
    for other in artifact.iterdir():
        if other.name != "manifest.json":
            (folder / other.name).symlink_to(other)
    data = json.loads((artifact / "manifest.json").read_text())
    change(data["dense"]["expects"]["features"])
    (folder / "manifest.json").write_text(json.dumps(data))
    return folder


def test_cpp_accepts_dense_expects_and_rejects_a_malformed_one(cpp_build, dense_artifact, tmp_path):
    features = json.loads((dense_artifact / "manifest.json").read_text())["dense"]["expects"]["features"]
    assert len(features) >= 2 and {"name", "table", "pooling", "column_start", "column_end"} == set(features[0])
    malformed = {
        "pooling_max": lambda f: f[0].update(pooling="max"),
        "unknown_key": lambda f: f[0].update(dim=4),
        "no_column_end": lambda f: f[0].pop("column_end"),
        "negative_start": lambda f: f[0].update(column_start=-1),
    }
    folders = [dense_artifact] + [_variant(dense_artifact, tmp_path, n, c) for n, c in malformed.items()]
    verdicts = _check(cpp_build, folders)
    assert verdicts[0] == "ok", verdicts[0]
    for folder, line in zip(folders[1:], verdicts[1:]):
        assert line.startswith("ManifestError: ") and "dense.expects.features" in line, (folder.name, line)
        with pytest.raises(ArtifactError) as info:
            Manifest.read(folder)
        assert info.value.kind == ArtifactErrorKind.MANIFEST


def _swap_first_two(features: list[dict]) -> None:
    """Two features' entries swap places, each keeping its columns: the dense part's order differs."""
    features[0], features[1] = features[1], features[0]


def _other_pooling(features: list[dict]) -> None:
    features[-1]["pooling"] = "mean" if features[-1]["pooling"] == "sum" else "sum"


DISAGREEING: dict[str, Callable[[list[dict]], object]] = {
    "order": _swap_first_two,
    "pooling": _other_pooling,
    "columns": lambda f: f[0].update(column_end=f[0]["column_end"] - 1),
    "feature_name": lambda f: f[0].update(name="renamed"),
    "table": lambda f: f[0].update(table=f[-1]["table"]),
    "missing_feature": lambda f: f.pop(),
    "extra_feature": lambda f: f.append(dict(f[-1], name="extra")),
}


def test_cpp_and_python_refuse_a_dense_expects_that_disagrees_with_features(cpp_build, dense_artifact, tmp_path):
    """The cross-check of dense.expects against 'features' (the layout the dense part was trained on vs the one
    the artifact serves) is the same in both loaders: each disagreement is a manifest error naming dense.expects
    from both; the exported (agreeing) manifest is accepted by both, and so is a manifest without dense.expects."""
    folders = [dense_artifact] + [_variant(dense_artifact, tmp_path, n, c) for n, c in DISAGREEING.items()]
    without = tmp_path / "without_expects"
    shutil.copytree(dense_artifact, without)
    data = json.loads((without / "manifest.json").read_text())
    del data["dense"]["expects"]
    (without / "manifest.json").write_text(json.dumps(data))
    not_present = tmp_path / "not_present"
    shutil.copytree(dense_artifact, not_present)
    data = json.loads((not_present / "manifest.json").read_text())
    data["dense"]["present"] = False
    (not_present / "manifest.json").write_text(json.dumps(data))
    verdicts = _check(cpp_build, [*folders, without, not_present])
    assert verdicts[0] == "ok" and verdicts[-2] == "ok", (verdicts[0], verdicts[-2])
    Manifest.read(dense_artifact)
    Manifest.read(without)
    for folder, line in zip([*folders[1:], not_present], [*verdicts[1:-2], verdicts[-1]]):
        assert line.startswith("ManifestError: ") and "dense.expects" in line, (folder.name, line)
        with pytest.raises(ArtifactError) as info:
            Manifest.read(folder)
        assert info.value.kind == ArtifactErrorKind.MANIFEST and "dense.expects" in str(info.value), folder.name
        if folder.name != "not_present":
            assert "dense.expects disagrees with 'features'" in line, line
            assert "dense.expects disagrees with 'features'" in str(info.value), str(info.value)
