"""A weight file written front to back from pieces at known offsets, hashed as it is written.

A streaming export knows every table's place in its file before it reads a row, so it hands the writer each
chunk's bytes at its offset (offsets only increase); the writer fills gaps with zeros and hashes what it writes:
the whole file's sha256 and the sha256 of every ``chunk_bytes`` slice (the manifest's per-chunk checksums), so
the file is never read back. Writing and hashing run on a thread of the writer's own (file writes and hashlib
release the GIL) while the caller reads and quantizes the next piece; one write is in flight at a time, so
memory holds at most the piece being written and the one being made.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from infer.errors import ArtifactError

_ZEROS = memoryview(bytes(1 << 20))


@dataclass(frozen=True)
class FileDigests:
    """What a finished file holds: its size, its sha256 and the sha256 of each ``chunk_bytes`` slice (the last
    one may be shorter; none for an empty file)."""

    size: int
    sha256: str
    chunk_bytes: int
    chunk_sha256: tuple[str, ...]


class StreamingFileWriter:
    """Writes ``path`` from ``write_at(offset, bytes)`` calls in increasing offset order; ``finish(size)`` pads
    the file with zeros to ``size`` and returns its digests. Use as a context manager: a failure closes the file
    (the caller removes its staging folder)."""

    def __init__(self, path: Path, chunk_bytes: int) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.path = path
        self.chunk_bytes = chunk_bytes
        self._out = path.open("wb")
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="weights-writer")
        self._pending: Future[None] | None = None
        self._queued_end = 0  # where the last queued piece ends (the caller's view)
        self._size = 0  # bytes written so far (the worker's view)
        self._whole = hashlib.sha256()
        self._chunk = hashlib.sha256()
        self._chunks: list[str] = []

    def __enter__(self) -> StreamingFileWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._close()

    def write_at(self, offset: int, piece: torch.Tensor) -> None:
        """Queue ``piece`` (a CPU uint8 tensor, kept alive until written) at byte ``offset`` of the file, after
        the previous piece has been written."""
        if offset < self._queued_end:
            raise ValueError(
                f"{self.path}: piece at byte {offset} overlaps the previous one (ends at {self._queued_end})"
            )
        flat = piece.reshape(-1).contiguous()
        self._wait()
        self._queued_end = offset + flat.numel()
        self._pending = self._pool.submit(self._write, offset, flat)

    def finish(self, size: int) -> FileDigests:
        """Pad the file with zeros to ``size`` bytes (at least the end of the last piece), close it and return
        its digests."""
        if size < self._queued_end:
            raise ValueError(f"{self.path}: size {size} ends before the last piece (byte {self._queued_end})")
        self._wait()
        self._zeros_to(size)
        self._close()
        if self._size % self.chunk_bytes:
            self._chunks.append(self._chunk.hexdigest())
        return FileDigests(self._size, self._whole.hexdigest(), self.chunk_bytes, tuple(self._chunks))

    def _wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def _close(self) -> None:
        self._pool.shutdown(wait=True)
        self._out.close()

    def _write(self, offset: int, flat: torch.Tensor) -> None:
        self._zeros_to(offset)
        self._append(flat.numpy().data)

    def _zeros_to(self, offset: int) -> None:
        while self._size < offset:
            self._append(_ZEROS[: min(len(_ZEROS), offset - self._size)])

    def _append(self, data: Any) -> None:
        try:
            self._out.write(data)
        except OSError as err:
            raise ArtifactError(
                f"cannot write {self.path}: {err.strerror}; free space there or choose another output folder",
                path=str(self.path),
            ) from None
        self._whole.update(data)
        position = 0
        while position < len(data):
            room = self.chunk_bytes - self._size % self.chunk_bytes
            part = data[position : position + room]
            self._chunk.update(part)
            position += len(part)
            self._size += len(part)
            if self._size % self.chunk_bytes == 0:
                self._chunks.append(self._chunk.hexdigest())
                self._chunk = hashlib.sha256()
