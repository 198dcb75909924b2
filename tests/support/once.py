"""Artifacts several test files need, built once per test session (an AOTInductor compile takes up to a minute).

``make test`` runs pytest-xdist with ``--dist loadfile``: a test file per worker, and a session fixture is built
once per *worker*, so two files in two workers would each compile the same model. ``built_once`` builds under a
file lock in a folder every worker of the session shares (pytest-xdist's recipe: the parent of each worker's
basetemp; the basetemp itself without xdist), keyed by what goes into the build (``digest``: the model's tensors,
spec, plan and export options, hashed). The first worker to ask builds; the others wait on the lock and reuse the
folder. Nothing outlives the session, so a change to the exporter is always compiled afresh.

Tests never write into a shared artifact: they ``copy_artifact`` it first (as with any session fixture).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

_DONE = ".built"  # holds the result's path relative to the key's folder


def shared_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "built-once"


def built_once(tmp_path_factory: pytest.TempPathFactory, key: str, build: Callable[[Path], Path]) -> Path:
    """``build(folder)`` (returning a path inside ``folder``) once per session for ``key``; its path."""
    folder = shared_folder(tmp_path_factory) / key
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if the build raises
        done = folder / _DONE
        if done.is_file():
            return folder / done.read_text()
        shutil.rmtree(folder, ignore_errors=True)  # a build that failed in another worker
        folder.mkdir()
        path = build(folder)
        done.write_text(str(path.relative_to(folder)))
        return path


def digest(*parts: Any) -> str:
    """A short sha256 of tensors, modules (class and state_dict), mappings, sequences and JSON-able values."""
    hasher = hashlib.sha256()
    for part in parts:
        _feed(hasher, part)
    return hasher.hexdigest()[:20]


def _feed(hasher: Any, part: Any) -> None:
    if isinstance(part, torch.Tensor):
        tensor = part.detach().cpu().contiguous()
        hasher.update(f"tensor {tensor.dtype} {tuple(tensor.shape)}".encode())
        hasher.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(part, torch.nn.Module):
        hasher.update(f"module {type(part).__module__}.{type(part).__qualname__}".encode())
        _feed(hasher, dict(part.state_dict()))
    elif isinstance(part, dict):
        hasher.update(f"dict {len(part)}".encode())
        for key in sorted(part, key=str):
            _feed(hasher, str(key))
            _feed(hasher, part[key])
    elif isinstance(part, list | tuple):
        hasher.update(f"seq {len(part)}".encode())
        for item in part:
            _feed(hasher, item)
    else:
        hasher.update(json.dumps(part, sort_keys=True, default=repr).encode())
