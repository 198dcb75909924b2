"""Loaded TorchScript structures, reused: a model file equal to one already loaded but for the ids every save makes
anew (the archive's serialization id, the kernels' uuids) becomes a deep copy of that one (milliseconds) instead of
another ``torch.jit.load``, which compiles the model's code holding the GIL (0.1-0.3 s here: every other thread of
a serving process waits). Versions of one model retrained with the same layout differ only in their weight files
(format 3), so a repository swapping between them loads each structure once."""

from __future__ import annotations

import copy
import hashlib
import re
import threading
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

# fbgemm's TBE gives itself a uuid4 at construction (saved with the model); torch writes a fresh serialization id
_UUID = re.compile(rb"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_SERIALIZATION_ID = ".data/serialization_id"


def structure_digest(model_path: Path) -> str:
    """sha256 of every entry of the model archive (names, sizes and bytes: code, constants, tensors), leaving out
    the serialization id and any uuid in the pickled attributes."""
    digest = hashlib.sha256()
    with zipfile.ZipFile(model_path) as archive:
        for info in sorted(archive.infolist(), key=lambda entry: entry.filename):
            if info.filename.endswith(_SERIALIZATION_ID):
                continue
            data = archive.read(info)
            if info.filename.endswith(".pkl"):
                data = _UUID.sub(b"0" * 36, data)
            digest.update(info.filename.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()


class StructureCache:
    """Up to ``capacity`` loaded models as their files left them (nothing attached), by structure digest and map
    location; ``load`` hands out deep copies. Thread-safe."""

    def __init__(self, capacity: int = 4) -> None:
        self.capacity = capacity
        self.hits = 0
        self._pristine: OrderedDict[tuple[str, str], torch.jit.ScriptModule] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._pristine)

    def load(self, model_path: Path, map_location: Any = None) -> torch.jit.ScriptModule:
        """A module of ``model_path`` of its own: a copy of an equal structure loaded before, or a fresh load."""
        key = (structure_digest(model_path), repr(map_location))
        with self._lock:
            pristine = self._pristine.get(key)
            if pristine is not None:
                self._pristine.move_to_end(key)
                self.hits += 1
        if pristine is None:
            pristine = torch.jit.load(str(model_path), map_location=map_location)
            with self._lock:
                self._pristine[key] = pristine
                while len(self._pristine) > self.capacity:
                    self._pristine.popitem(last=False)
        return copy.deepcopy(pristine)
