"""Checksums of an artifact's large files in chunks: written at export, hashed in parallel at load.

A file of ``CHUNKED_MIN_BYTES`` or more carries, beside its whole-file sha256 (which the C++ loader checks),
the sha256 of every ``CHUNK_BYTES`` slice (``WEIGHTS_CHUNK_BYTES`` for a mapped artifact's weight files).

A mapped artifact's ``model.pt`` is small, so its chunks are hashed by a thread pool of this process, started
before the model loads (hashlib releases the GIL on large buffers; it reads a read-only mapping, no copy). In an
embedded artifact ``torch.jit.load`` holds the GIL for its whole run (measured: a spinning Python thread got
~0.2 % of its idle rate during it), so threads of this process cannot hash while it reads; a child interpreter
(``python -I -S``, stdlib only, a few tens of ms to start) hashes the chunks on its own threads instead, and the
load overlaps it. Where no child can be started (an embedded interpreter) the chunks are hashed by a thread pool
here, after the load.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import subprocess
import sys
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infer.errors import ArtifactError, ArtifactErrorKind

logger = logging.getLogger(__name__)

CHECKSUM = ArtifactErrorKind.CHECKSUM
CHUNK_BYTES = 32 << 20  # 63 chunks for a 2.1 GB file: enough to keep every core busy to the end
WEIGHTS_CHUNK_BYTES = 8 << 20  # a weight file's chunks (bench/load.py: 8 MiB hashes as fast as 32 MiB)
CHUNKED_MIN_BYTES = 64 << 20  # smaller files hash in well under 0.1 s on one core
SUBPROCESS_MIN_BYTES = 256 << 20  # below this a child interpreter costs more than it overlaps
USE_SUBPROCESS = True  # False: hash in this process's threads (bench/load.py compares the designs)
FULL = "full"  # every file's sha256 (chunks in parallel) before the model is ready
NONE = "none"  # paths and sizes only: for a trusted, already verified artifact
VERIFY_MODES = (FULL, NONE)

# The child's whole program: argv = chunk_bytes workers path...; stdout = JSON [[digest, ...] per path].
_HASHER_SOURCE = r"""
import hashlib, json, mmap, os, sys
from concurrent.futures import ThreadPoolExecutor
chunk, workers, paths = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
def digests(pool, path):
    size = os.path.getsize(path)
    if size == 0:
        return []
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        try:
            return list(pool.map(lambda start: hashlib.sha256(view[start:start + chunk]).hexdigest(),
                                 range(0, size, chunk)))
        finally:
            view.release()
with ThreadPoolExecutor(workers) as pool:
    json.dump([digests(pool, path) for path in paths], sys.stdout)
"""


@dataclass(frozen=True)
class Chunks:
    """The sha256 of every ``bytes``-long slice of a file (the last one may be shorter), in order."""

    bytes: int
    sha256: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "sha256": list(self.sha256)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Chunks:
        return cls(int(data["bytes"]), tuple(str(d) for d in data["sha256"]))

    def count_for(self, size: int) -> int:
        return -(-size // self.bytes)

    def byte_range(self, index: int, size: int) -> tuple[int, int]:
        """First and last byte (inclusive) of chunk ``index`` of a ``size``-byte file."""
        start = index * self.bytes
        return start, min(size, start + self.bytes) - 1


def check_verify_mode(verify: str) -> str:
    if verify not in VERIFY_MODES:
        from infer.errors import ConfigError

        raise ConfigError(f"unknown verify mode {verify!r}; choose one of {list(VERIFY_MODES)}")
    return verify


def default_workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def chunk_digests(path: Path, chunk_bytes: int, pool: ThreadPoolExecutor) -> list[str]:
    """The sha256 of every ``chunk_bytes`` slice of ``path``, hashed by ``pool`` over a read-only mapping
    (hashlib releases the GIL on large buffers; the mapping copies nothing)."""
    size = path.stat().st_size
    if size == 0:
        return []
    with path.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        try:
            return list(
                pool.map(
                    lambda start: hashlib.sha256(view[start : start + chunk_bytes]).hexdigest(),
                    range(0, size, chunk_bytes),
                )
            )
        finally:
            view.release()


def chunked(size: int) -> bool:
    """Whether a file of ``size`` bytes is listed with per-chunk checksums (else its whole-file sha256 only)."""
    return size >= CHUNKED_MIN_BYTES


def file_digests(path: Path, chunk_bytes: int | None = None) -> tuple[str, Chunks | None]:
    """Whole-file sha256 and, for a file of ``CHUNKED_MIN_BYTES`` or more, its digests of ``chunk_bytes``
    (default ``CHUNK_BYTES``) chunks (hashed by a pool while this thread hashes the whole file)."""
    size = path.stat().st_size
    if not chunked(size):
        return _sha256_mapped(path), None
    chunk_bytes = chunk_bytes or CHUNK_BYTES
    with ThreadPoolExecutor(default_workers()) as pool, ThreadPoolExecutor(1) as whole_file:
        whole = whole_file.submit(_sha256_mapped, path)
        chunks = chunk_digests(path, chunk_bytes, pool)
        return whole.result(), Chunks(chunk_bytes, tuple(chunks))


def _sha256_mapped(path: Path) -> str:
    digest = hashlib.sha256()
    if path.stat().st_size:
        with path.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                digest.update(view)
            finally:
                view.release()
    return digest.hexdigest()


@dataclass(frozen=True)
class ChunkedFile:
    """A file to verify chunk by chunk: where it is, its size (already checked) and its expected chunks."""

    path: Path
    size: int
    chunks: Chunks


class PendingVerification:
    """Chunk hashing under way (in this process's threads, in a child process, or not started yet); ``wait``
    finishes it and raises ``ArtifactError(kind=CHECKSUM)`` naming the file and byte range of the first chunk
    that does not match. Every file is hashed once: a later ``wait`` returns or raises what the first did."""

    def __init__(self, files: Sequence[ChunkedFile], overlap: bool, in_threads: bool = False) -> None:
        """``overlap``: start hashing now, in this process's threads (``in_threads``) or a child process."""
        self.files = tuple(files)
        self.bytes = sum(f.size for f in self.files)
        self._child: subprocess.Popen[str] | None = None
        self._threads: _ThreadHashing | None = None
        if overlap and in_threads and self.files:
            self._threads = _ThreadHashing(self.files)
        elif overlap and USE_SUBPROCESS and self.bytes >= SUBPROCESS_MIN_BYTES:
            self._child = _start_child(self.files)
        if self._child is not None:  # a load that fails before ``wait`` leaves no hasher running
            self._stop = weakref.finalize(self, _stop_child, self._child)
        self._done = False
        self._failure: ArtifactError | None = None

    def wait(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._done:
            return
        try:
            self._finish()
        except ArtifactError as err:
            self._failure = err
            raise
        self._done = True

    def _finish(self) -> None:
        found = _child_result(self._child, self.files) if self._child is not None else None
        if self._child is not None:
            self._stop.detach()
        self._child = None
        if self._threads is not None:
            found, self._threads = self._threads.result(), None
        if found is None:
            found = self._hash_here()
        for file, digests in zip(self.files, found):
            _compare(file, digests)

    def _hash_here(self) -> list[list[str]]:
        with ThreadPoolExecutor(default_workers()) as pool:
            return [chunk_digests(f.path, f.chunks.bytes, pool) for f in self.files]


class _ThreadHashing:
    """Every chunk of ``files`` submitted to a thread pool now, each hashed from a read-only mapping of its file;
    ``result`` waits for the digests and releases the mappings."""

    def __init__(self, files: Sequence[ChunkedFile]) -> None:
        pool = ThreadPoolExecutor(default_workers(), thread_name_prefix="embserve-sha256")
        self._mappings: list[mmap.mmap] = []
        self._futures: list[list[Future[str]]] = []
        for file in files:
            if file.size == 0:
                self._futures.append([])
                continue
            with file.path.open("rb") as handle:
                mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
            self._mappings.append(mapped)
            step = file.chunks.bytes
            self._futures.append(
                [pool.submit(_sha256_range, mapped, start, step) for start in range(0, file.size, step)]
            )
        pool.shutdown(wait=False)  # its threads end when the queued chunks are hashed

    def result(self) -> list[list[str]]:
        wait([future for futures in self._futures for future in futures])  # all done before the mappings close
        for mapped in self._mappings:
            mapped.close()
        self._mappings = []
        return [[future.result() for future in futures] for futures in self._futures]


def _sha256_range(mapped: mmap.mmap, start: int, size: int) -> str:
    with memoryview(mapped) as view:
        return hashlib.sha256(view[start : start + size]).hexdigest()


def _start_child(files: Sequence[ChunkedFile]) -> subprocess.Popen[str] | None:
    chunk_sizes = {f.chunks.bytes for f in files}
    if not sys.executable or len(chunk_sizes) != 1:
        return None
    command = [sys.executable, "-I", "-S", "-c", _HASHER_SOURCE, str(chunk_sizes.pop()), str(default_workers())]
    try:
        return subprocess.Popen(
            command + [str(f.path) for f in files], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    except OSError as err:
        logger.info("no child interpreter to hash chunks (%s); hashing them in this process", err)
        return None


def _stop_child(child: subprocess.Popen[str]) -> None:
    if child.poll() is None:
        child.kill()
    child.communicate()


def _child_result(child: subprocess.Popen[str], files: Sequence[ChunkedFile]) -> list[list[str]] | None:
    """The child's digests, or None (hash here instead) when it failed: it must never pass a file unread."""
    out, err = child.communicate()
    try:
        found = json.loads(out) if child.returncode == 0 else None
    except ValueError:
        found = None
    if not isinstance(found, list) or len(found) != len(files) or not all(isinstance(d, list) for d in found):
        logger.info("the chunk hasher exited %s (%s); hashing the chunks in this process", child.returncode, err[-200:])
        return None
    return found


def _compare(file: ChunkedFile, digests: Sequence[str]) -> None:
    expected = file.chunks.sha256
    for index, want in enumerate(expected):
        got = digests[index] if index < len(digests) else ""
        if got != want:
            first, last = file.chunks.byte_range(index, file.size)
            raise ArtifactError(
                f"{file.path} fails its sha256 check in bytes {first}-{last} (chunk {index} of {len(expected)}: "
                f"{got[:12]}… != {want[:12]}…); the file is corrupted",
                path=str(file.path),
                kind=CHECKSUM,
            )
    if len(digests) != len(expected):  # the file grew after its size was checked
        raise ArtifactError(
            f"{file.path} has {len(digests)} chunks of {file.chunks.bytes} bytes, the manifest lists "
            f"{len(expected)}; the file is truncated or corrupted",
            path=str(file.path),
            kind=CHECKSUM,
        )
