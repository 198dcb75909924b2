"""Weight files written from a kernel's buffer and mapped back read-only.

A mapping is ``torch.from_file(path, shared=False)``: the file is opened ``O_RDONLY`` and mapped
``MAP_PRIVATE`` (measured with strace on torch 2.13), so the artifact may sit on a read-only volume, the file is
never written, and every process mapping it shares the page cache's one copy. A mapping of a file shorter than
the mapping raises SIGBUS on access: the size is checked first.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

import torch

from infer.errors import ArtifactError, ArtifactErrorKind

logger = logging.getLogger(__name__)

_ZEROS = bytes(1 << 16)


def write_pieces(path: Path, pieces: Iterable[tuple[int, torch.Tensor]]) -> int:
    """Write each ``(offset, bytes)`` piece (a CPU uint8 tensor, written without a copy) at its offset, in
    increasing order, zeros between them; returns the file's size."""
    size = 0
    with path.open("wb") as out:
        for offset, piece in pieces:
            if offset < size:
                raise ValueError(f"{path}: piece at byte {offset} overlaps the previous one (ends at {size})")
            while size < offset:
                size += out.write(_ZEROS[: min(len(_ZEROS), offset - size)])
            size += out.write(piece.contiguous().numpy().data)
    return size


def map_read_only(path: Path, expected_bytes: int) -> torch.Tensor:
    """The file at ``path`` as a uint8 tensor backed by a read-only, private mapping of it. Its size is checked
    first: a file that is missing or of another size is ``ArtifactError(kind=CHECKSUM)`` naming it."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise ArtifactError(
            f"{path} is missing from the artifact", path=str(path), kind=ArtifactErrorKind.CHECKSUM
        ) from None
    if size != expected_bytes:
        raise ArtifactError(
            f"{path} is {size} bytes but the manifest says {expected_bytes}; the file is truncated or corrupted",
            path=str(path),
            kind=ArtifactErrorKind.CHECKSUM,
        )
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
