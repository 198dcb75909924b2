"""Fuzzed manifests: whatever the bytes, reading one is a manifest or an ArtifactError (kind MANIFEST or
CHECKSUM), never another exception — and a manifest that reads loads or fails as an ArtifactError."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infer.artifact.export import export
from infer.artifact.load import load
from infer.artifact.manifest import Manifest
from infer.artifact.schema import parse_document
from infer.errors import ArtifactError
from infer.quant.quantize import quantize
from infer.weights import random_weights
from tests.conftest import mixed_spec

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> tuple[Path, dict[str, Any]]:
    spec = mixed_spec()
    path = export(quantize(spec, random_weights(spec, seed=3)), tmp_path_factory.mktemp("fuzz") / "a")
    return path, json.loads((path / "manifest.json").read_text())


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            out += _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value[:3]):
            out += _paths(item, (*prefix, index))
    return out


def _mutate(document: Any, path: tuple[Any, ...], action: str, replacement: Any) -> Any:
    if not path:
        return replacement
    parent = document
    for step in path[:-1]:
        parent = parent[step]
    last = path[-1]
    if action == "delete" and isinstance(parent, dict):
        del parent[last]
    elif action == "extra" and isinstance(parent, dict):
        parent["unexpected_key"] = replacement
    else:
        parent[last] = replacement
    return document


def _read(data: bytes) -> Manifest:
    return Manifest.from_dict(parse_document(data, "manifest.json"))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_manifests_are_manifests_or_artifact_errors(good, data):
    _, manifest = good
    paths = _paths(manifest)
    path = data.draw(st.sampled_from(paths))
    action = data.draw(st.sampled_from(["replace", "delete", "extra"]))
    replacement = data.draw(JSON)
    mutated = _mutate(json.loads(json.dumps(manifest)), path, action, replacement)
    try:
        _read(json.dumps(mutated).encode())
    except ArtifactError:
        pass


@settings(max_examples=200, deadline=None)
@given(raw=st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_arbitrary_bytes_are_artifact_errors(raw):
    with pytest.raises(ArtifactError):
        _read(raw)


@pytest.mark.parametrize(
    "text",
    [
        "[" * 100_000 + "]" * 100_000,
        '{"a": ' * 50_000 + "1" + "}" * 50_000,
        "\ufeff{}",
        '{"format": "embserve-artifact", "format_version": 2, "format_version": 2}',
        '{"format": "embserve-artifact", "format_version": NaN}',
        '{"format": "embserve-artifact", "format_version": 1e400}',
    ],
    ids=["deep_array", "deep_object", "bom", "duplicate_key", "nan", "huge_number"],
)
def test_hostile_documents_are_rejected_before_parsing_deeply(text):
    with pytest.raises(ArtifactError):
        _read(text.encode())


def test_a_mutated_manifest_that_reads_still_loads_or_fails_cleanly(good, tmp_path):
    """Values the schema accepts but that contradict the model (sizes, names) end as ArtifactError at load."""
    path, manifest = good
    edits = [
        lambda m: m["tables"][0].update(num_embeddings=m["tables"][0]["num_embeddings"] + 1),
        lambda m: m["devices"].__setitem__(0, "cuda:0"),
        lambda m: m["kernels"][0].update(row_alignment=16),
        lambda m: m["sharding"].update(world_size=2),
        lambda m: m["dense"].update(present=True),
        lambda m: m["files"]["model.pt"].update(bytes=1),
    ]
    for index, edit in enumerate(edits):
        copy = tmp_path / f"c{index}"
        copy.mkdir()
        (copy / "model.pt").write_bytes((path / "model.pt").read_bytes())
        mutated = json.loads(json.dumps(manifest))
        edit(mutated)
        (copy / "manifest.json").write_text(json.dumps(mutated))
        with pytest.raises(ArtifactError):
            load(copy)
