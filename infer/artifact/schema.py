"""The artifact schema, enforced: ``schema.json`` (manifest.json and plan.json) read by a small validator.

The C++ loader embeds the same ``schema.json`` and implements the same rules (``cpp_loader/src/schema.cpp``),
so both loaders accept and reject the same documents. Before parsing, a document is checked for a
byte-order mark and for nesting deeper than ``limits.max_depth`` (a deep document would exhaust the
parser's stack); JSON constants (NaN, Infinity) and duplicate keys are rejected while parsing.
Every violation is an ``ArtifactError(kind=MANIFEST)`` naming the file and the key path.
"""

from __future__ import annotations

import json
import math
import re
from functools import cache
from importlib import resources
from typing import Any

from infer.errors import ArtifactError, ArtifactErrorKind

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
_DEVICE = re.compile(r"cpu|cuda:[0-9]{1,4}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
# An echoed value is cut to this many characters in messages.
_ECHO = 64


@cache
def schema() -> dict[str, Any]:
    text = resources.files("infer.artifact").joinpath("schema.json").read_text(encoding="utf-8")
    loaded: dict[str, Any] = json.loads(text)
    return loaded


def _fail(document: str, path: str, message: str) -> ArtifactError:
    where = path or "the document"
    return ArtifactError(f"{document} is malformed: {where} {message}", path=document, kind=ArtifactErrorKind.MANIFEST)


def _echo(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= _ECHO else f"{text[:_ECHO]}…({len(text)} chars)"


def nesting_depth(text: str) -> int:
    """Deepest nesting of objects and arrays in a JSON text (brackets inside strings do not count)."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {_echo(key)} appears twice in one object")
        out[key] = value
    return out


def parse_document(data: bytes, document: str) -> Any:
    """Bytes of a manifest or plan -> JSON value: UTF-8 without BOM, bounded depth, no NaN/duplicate keys."""
    if data.startswith(b"\xef\xbb\xbf"):
        raise _fail(document, "", "starts with a byte-order mark; write plain UTF-8")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise _fail(document, "", f"is not UTF-8 ({err.reason} at byte {err.start})") from None
    limit = schema()["limits"]["max_depth"]
    depth = nesting_depth(text)
    if depth > limit:
        raise _fail(document, "", f"nests {depth} levels deep, over the limit of {limit}; the file is corrupted")
    try:
        return json.loads(text, parse_constant=_no_constants, object_pairs_hook=_no_duplicates)
    except (json.JSONDecodeError, ValueError) as err:
        raise _fail(document, "", f"is not valid JSON ({_echo(str(err))[1:-1]}); the file is corrupted") from None


def validate(value: Any, which: str, document: str) -> None:
    """Check a parsed document against ``schema.json``'s ``which`` ("manifest" or "plan")."""
    root = schema()
    _check(value, root[which], root["definitions"], "", document)


def _resolve(rule: dict[str, Any], definitions: dict[str, Any]) -> dict[str, Any]:
    if "ref" not in rule:
        return rule
    merged = dict(definitions[rule["ref"]])
    merged.update({k: v for k, v in rule.items() if k != "ref"})
    return merged


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(value: Any, rule: dict[str, Any], definitions: dict[str, Any], path: str, document: str) -> None:
    rule = _resolve(rule, definitions)
    if value is None:
        if rule.get("nullable"):
            return
        raise _fail(document, path, f"must not be null (expected {rule['type']})")
    kind = rule["type"]
    if kind == "scalar":
        kind = "string" if isinstance(value, str) else "integer"
    if kind == "any":
        return
    if kind == "object":
        if not isinstance(value, dict):
            raise _fail(document, path, f"must be an object, got {_echo(value)}")
        properties = rule["properties"]
        unknown = [k for k in value if k not in properties]
        if unknown:
            raise _fail(document, path, f"has unknown key {_echo(unknown[0])}; known keys: {sorted(properties)}")
        for key in rule.get("required", []):
            if key not in value:
                raise _fail(document, path, f"lacks the key {key!r}")
        for key, item in value.items():
            _check(item, properties[key], definitions, f"{path}.{key}" if path else key, document)
    elif kind == "map":
        if not isinstance(value, dict):
            raise _fail(document, path, f"must be an object, got {_echo(value)}")
        _check_count(len(value), rule, path, document)
        for key, item in value.items():
            _check_string(key, {"format": rule["key_format"], "max_length": 255}, f"{path} key", document)
            _check(item, rule["values"], definitions, f"{path}[{_echo(key)}]", document)
    elif kind == "array":
        if not isinstance(value, list):
            raise _fail(document, path, f"must be an array, got {_echo(value)}")
        _check_count(len(value), rule, path, document)
        for index, item in enumerate(value):
            _check(item, rule["items"], definitions, f"{path}[{index}]", document)
    elif kind == "string":
        if not isinstance(value, str):
            raise _fail(document, path, f"must be a string, got {_echo(value)}")
        _check_string(value, rule, path, document)
    elif kind == "boolean":
        if not isinstance(value, bool):
            raise _fail(document, path, f"must be true or false, got {_echo(value)}")
    elif kind in ("integer", "number"):
        if kind == "integer" and not _is_integer(value):
            raise _fail(document, path, f"must be an integer, got {_echo(value)}")
        if kind == "number" and not (_is_integer(value) or (isinstance(value, float) and math.isfinite(value))):
            raise _fail(document, path, f"must be a finite number, got {_echo(value)}")
        if "enum" in rule and value not in rule["enum"]:
            raise _fail(document, path, f"must be one of {rule['enum']}, got {_echo(value)}")
        if "minimum" in rule and value < rule["minimum"]:
            raise _fail(document, path, f"must be at least {rule['minimum']}, got {_echo(value)}")
        if "maximum" in rule and value > rule["maximum"]:
            raise _fail(document, path, f"must be at most {rule['maximum']}, got {_echo(value)}")
        if "multiple_of" in rule and value % rule["multiple_of"]:
            raise _fail(document, path, f"must be a multiple of {rule['multiple_of']}, got {_echo(value)}")
    else:  # pragma: no cover - schema.json is ours
        raise AssertionError(f"schema.json: unknown type {kind!r}")


def _check_count(count: int, rule: dict[str, Any], path: str, document: str) -> None:
    if count < rule.get("min_items", 0):
        raise _fail(document, path, f"needs at least {rule['min_items']} entries, has {count}")
    if "max_items" in rule and count > rule["max_items"]:
        raise _fail(document, path, f"has {count} entries, over the limit of {rule['max_items']}")


def _check_string(value: str, rule: dict[str, Any], path: str, document: str) -> None:
    size = len(value.encode("utf-8", errors="surrogatepass"))
    if size > rule.get("max_length", 1 << 20):
        raise _fail(document, path, f"is {size} bytes long, over the limit of {rule['max_length']}")
    if "enum" in rule and value not in rule["enum"]:
        raise _fail(document, path, f"must be one of {rule['enum']}, got {_echo(value)}")
    fmt = rule.get("format", "text")
    if fmt == "name" and not _NAME.fullmatch(value):
        raise _fail(
            document, path, f"must be a name (letters, digits, _ . -; not starting with a digit), got {_echo(value)}"
        )
    if fmt == "file_name" and (
        value in ("", ".", "..") or "/" in value or "\\" in value or any(ord(c) < 0x20 or ord(c) == 0x7F for c in value)
    ):
        raise _fail(document, path, f"must be a plain file name inside the artifact, got {_echo(value)}")
    if fmt == "device" and not _DEVICE.fullmatch(value):
        raise _fail(document, path, f"must be a device ('cpu' or 'cuda:N'), got {_echo(value)}")
    if fmt == "sha256" and not _SHA256.fullmatch(value):
        raise _fail(document, path, f"must be 64 lowercase hex digits, got {_echo(value)}")
    if fmt == "text" and any(ord(c) < 0x20 for c in value):
        raise _fail(document, path, f"must not hold control characters, got {_echo(value)}")
