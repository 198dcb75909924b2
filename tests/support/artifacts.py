"""Editing exported artifacts in tests: copy one, rewrite its manifest, re-hash a file after tampering."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any


def copy_artifact(artifact: Path, folder: Path) -> Path:
    copy = folder / "copy"
    shutil.copytree(artifact, copy)
    return copy


def edit_manifest(artifact: Path, edit: Callable[[dict[str, Any]], Any]) -> None:
    path = artifact / "manifest.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=2))


def rehash(artifact: Path, name: str) -> None:
    """Make the manifest's size and sha256 of ``name`` match the file again (what a careless tool does)."""
    data = (artifact / name).read_bytes()
    edit_manifest(
        artifact, lambda m: m["files"].update({name: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}})
    )
