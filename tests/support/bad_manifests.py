"""The shared corpus of malformed manifests (issue 11, item 5): every loader must reject each one cleanly.

Each case turns a good manifest (its parsed dict, or its raw text) into the bytes of a bad one, and
names the fragment every loader's message contains (the key path, or the problem). The Python loader
raises ``ArtifactError(kind=MANIFEST)``; the C++ loader (``embserve_run ARTIFACT``) exits 1 with one
line naming ``ManifestError``. Tests: tests/cpp/test_bad_manifests.py (both loaders).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Edit = Callable[[dict[str, Any]], Any]


@dataclass(frozen=True)
class BadManifest:
    name: str
    fragment: str  # in the message of every loader
    edit: Edit | None = None  # applied to the parsed good manifest, then written as JSON
    raw: Callable[[str], bytes] | None = None  # applied to the good manifest's text

    def render(self, good_text: str) -> bytes:
        if self.raw is not None:
            return self.raw(good_text)
        data = json.loads(good_text)
        assert self.edit is not None
        self.edit(data)
        return json.dumps(data, indent=2).encode("utf-8")


def _set(path: str, value: Any) -> Edit:
    """Set a dotted path ("tables.0.name") to ``value``."""

    def edit(data: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = data
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return edit


def _delete(path: str) -> Edit:
    def edit(data: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = data
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        del node[last]

    return edit


def _replace_first(old_prefix: str, new: str) -> Callable[[str], bytes]:
    """Replace the first `"key": value` whose text starts with ``old_prefix`` (up to the comma) with ``new``."""

    def raw(text: str) -> bytes:
        start = text.index(old_prefix)
        end = min(i for i in (text.find(",", start), text.find("\n", start)) if i >= 0)
        return (text[:start] + new + text[end:]).encode("utf-8")

    return raw


def _rename_model_file(name: str) -> Edit:
    def edit(data: dict[str, Any]) -> None:
        data["files"][name] = data["files"].pop(data["model_file"])
        data["model_file"] = name

    return edit


def _deep(depth: int) -> Callable[[str], bytes]:
    return lambda text: ('{"format": "embserve-artifact", "x": ' + "[" * depth + "]" * depth + "}").encode()


def _model_chunks(chunks: Any) -> Edit:
    """Give the model file's entry a ``chunks`` value (per-chunk sha256; the C++ loader reads none but checks
    the schema)."""

    def edit(data: dict[str, Any]) -> None:
        data["files"][data["model_file"]]["chunks"] = chunks

    return edit


def _kernel_rows_off(data: dict[str, Any]) -> None:
    data["kernels"][0]["tables"][0]["rows"] += 1


BAD_MANIFESTS: tuple[BadManifest, ...] = (
    BadManifest("deep_nesting_100k", "nests 100001 levels deep", raw=_deep(100_000)),
    BadManifest("deep_nesting_33", "nests 33 levels deep", raw=_deep(32)),
    BadManifest("model_file_list", "model_file must be a string", _set("model_file", ["model.pt"])),
    BadManifest("model_file_object", "model_file must be a string", _set("model_file", {"name": "model.pt"})),
    BadManifest("features_string", "features must be an array", _set("features", "f_int8")),
    BadManifest("features_null", "features must not be null", _set("features", None)),
    BadManifest("features_item_int", "features[0] must be an object", _set("features.0", 7)),
    BadManifest("devices_0_not_string", "devices[0] must be a string", _set("devices.0", 0)),
    BadManifest("devices_string", "devices must be an array", _set("devices", "cpu")),
    BadManifest("table_without_name", "tables[0] lacks the key 'name'", _delete("tables.0.name")),
    BadManifest(
        "feature_without_column_start", "features[0] lacks the key 'column_start'", _delete("features.0.column_start")
    ),
    BadManifest(
        "rows_1e400", "tables[0].num_embeddings", raw=_replace_first('"num_embeddings"', '"num_embeddings": 1e400')
    ),
    BadManifest("bytes_1e400", "bytes", raw=_replace_first('"bytes"', '"bytes": 1e400')),
    BadManifest("nan", "not valid JSON", raw=_replace_first('"format_version"', '"format_version": NaN')),
    BadManifest("format_version_2_pow_32_plus_1", "format_version 4294967297", _set("format_version", 4294967297)),
    BadManifest("format_version_float", "format_version must be an integer", _set("format_version", 2.0)),
    BadManifest("format_version_string", "format_version", _set("format_version", "2")),
    BadManifest("byte_order_mark", "byte-order mark", raw=lambda text: b"\xef\xbb\xbf" + text.encode()),
    BadManifest(
        "not_utf8", "UTF-8", raw=lambda text: text.replace('"sum"', '"s\udcffm"', 1).encode("utf-8", "surrogateescape")
    ),
    BadManifest("top_level_array", "is not a JSON object", raw=lambda text: b"[]"),
    BadManifest(
        "duplicate_key", "appears twice", raw=lambda text: text.replace("{", '{\n  "model_file": "a.pt",', 1).encode()
    ),
    BadManifest("nul_in_model_file", "model_file must be a plain file name", _rename_model_file("model\x00.pt")),
    BadManifest("separator_in_model_file", "model_file must be a plain file name", _rename_model_file("../model.pt")),
    BadManifest(
        "nul_in_files_key",
        "files key must be a plain file name",
        _set("files.a\x00b", {"bytes": 1, "sha256": "0" * 64}),
    ),
    BadManifest("unknown_key", "unknown key 'extra'", _set("extra", 1)),
    BadManifest(
        "tables_disagree_with_features", "'features' disagrees with 'tables'", _set("tables.0.num_embeddings", 999)
    ),
    BadManifest("table_data_type_unknown", "tables[0].data_type must be one of", _set("tables.0.data_type", "int3")),
    BadManifest(
        "dim_not_multiple_of_4", "tables[0].embedding_dim must be a multiple of 4", _set("tables.0.embedding_dim", 6)
    ),
    BadManifest("tables_missing", "lacks the key 'tables'", _delete("tables")),
    BadManifest(
        "dense_present_without_inputs",
        "dense.num_dense_features",
        _set("dense", {"present": True, "num_dense_features": 0}),
    ),
    BadManifest("dense_2_pow_31", "dense.num_dense_features must be at most", _set("dense.num_dense_features", 2**31)),
    BadManifest("dense_wrong_type", "dense.present must be true or false", _set("dense.present", "yes")),
    BadManifest("world_size_zero", "sharding.world_size must be at least 1", _set("sharding.world_size", 0)),
    BadManifest("world_size_2_pow_31", "sharding.world_size must be at most", _set("sharding.world_size", 2**31)),
    BadManifest("world_size_without_plan", "sharding.plan_file is null", _set("sharding.world_size", 2)),
    BadManifest(
        "feature_order_differs", "input_schema.feature_order", lambda d: d["input_schema"]["feature_order"].reverse()
    ),
    BadManifest(
        "sha256_upper_case",
        "sha256 must be 64 lowercase hex digits",
        lambda d: [e.update(sha256=e["sha256"].upper()) for e in d["files"].values()],
    ),
    BadManifest(
        "control_character_in_version",
        "versions.torch must not hold control characters",
        _set("versions.torch", "2.13\n"),
    ),
    BadManifest("name_too_long", "tables[0].name is 300 bytes long", _set("tables.0.name", "t" * 300)),
    BadManifest("kernel_disagrees_with_tables", "kernels", _kernel_rows_off),
    BadManifest("chunks_not_object", "chunks must be an object", _model_chunks([])),
    BadManifest(
        "chunks_bytes_too_small", "chunks.bytes must be at least 4096", _model_chunks({"bytes": 100, "sha256": []})
    ),
    BadManifest(
        "chunks_digest_not_hex",
        "chunks.sha256[0] must be 64 lowercase hex digits",
        _model_chunks({"bytes": 4096, "sha256": ["xyz"]}),
    ),
    BadManifest("chunks_without_digests", "chunks lacks the key 'sha256'", _model_chunks({"bytes": 4096})),
    BadManifest("chunks_unknown_key", "unknown key 'crc32'", _model_chunks({"bytes": 4096, "sha256": [], "crc32": 1})),
)
