"""Weight files written from a kernel's buffer and mapped back read-only.

A mapping is the file opened ``O_RDONLY`` and mapped ``PROT_READ``, ``MAP_PRIVATE``, wrapped by a uint8 tensor
(``torch.frombuffer``, which keeps the mapping alive): the artifact may sit on a read-only volume, the file is never
written, and every process mapping it shares the page cache's one copy. Read-only matters for size: a writable
private mapping (``torch.from_file(shared=False)`` maps ``PROT_READ | PROT_WRITE``) is charged to the commit
limit, and with the kernel's default heuristic overcommit one larger than RAM is refused (``ENOMEM``: measured on
DLRM-v2's 27 GB weight file on a 24 GiB host), while a read-only one is not charged; the kernels only read their
weights. A mapping of a file shorter than the mapping raises SIGBUS on access: the size is checked first.
"""

from __future__ import annotations

import logging
import mmap
import os
import warnings
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
    fd = os.open(path, os.O_RDONLY)
    try:
        mapped = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    with warnings.catch_warnings():
        # torch warns that the buffer is not writable: that is the point (nothing writes weights)
        warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
        return torch.frombuffer(mapped, dtype=torch.uint8)
