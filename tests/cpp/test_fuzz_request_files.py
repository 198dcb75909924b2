"""A seeded fuzz of embserve_run's request files: a few hundred mutations of good files, all in one run each.

Every run ends with status 0, 1 or 2 and never a signal; stderr holds only one-line messages without a
backtrace. The oracle is a walk of each file's frames written here from the format in ``cpp_io.py``: every
request that can be located is answered (a result equal to Python's lookup of the same tensors, or the error
Python raises too), a framed but unusable one is a FileFormatError record, and where the framing is lost the
response file's closing record says so; a file whose header cannot be read is status 2 with no records.
"""

from __future__ import annotations

import random
import struct
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from infer.artifact.cpp_io import Response, read_response_file, write_requests
from infer.artifact.load import load
from infer.artifact.runtime import Runtime
from infer.config import ModelSpec
from infer.errors import EmbserveError
from infer.features import SparseFeatures
from tests.conftest import mixed_spec, random_batch
from tests.cpp.support import BACKTRACE_MARKERS, run

SEED = 11
MUTANTS = 360
PER_PROCESS = 60
MAX_DIMS = 8
MIN_REQUEST_BYTES = 5  # values and lengths a dtype code and ndim 0 each, weights absent
ITEMSIZE = {1: 4, 2: 8, 3: 4}
NUMPY = {1: "<i4", 2: "<i8", 3: "<f4"}
DTYPES = {1: torch.int32, 2: torch.int64, 3: torch.float32}
INTERESTING_I64 = [0, 1, -1, 2, 7, 1 << 31, (1 << 31) - 1, 1 << 32, 1 << 40, 1 << 62, (1 << 63) - 1, -(1 << 63)]


def _good_file(path: Path, spec: ModelSpec) -> bytes:
    """Three requests; for a model with a dense part a version 2 file: predicts around a lookup."""
    requests, dense = [], []
    shapes = [(2, False, torch.int64), (1, True, torch.int32), (3, False, torch.int64)]
    generator = torch.Generator().manual_seed(SEED)
    for seed, (batch, weighted, dtype) in enumerate(shapes):
        b = random_batch(spec, batch_size=batch, weighted=weighted, seed=seed, id_dtype=dtype)
        requests.append((b.values, b.lengths, b.weights))
        dense.append(None if seed == 1 else torch.randn(batch, spec.num_dense_features, generator=generator))
    write_requests(path, requests, dense if spec.dense_arch is not None else None)
    return path.read_bytes()


class _Lost(Exception):
    """A record whose frame cannot be found."""


@dataclass(frozen=True)
class Walk:
    """What a request file holds, walked frame by frame: None when its header cannot be read, else the declared
    count, each request read (its tensors, or None when framed but unusable), whether the framing was lost and
    how many bytes follow the last request."""

    declared: int
    requests: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None]
    lost: bool
    trailing: int


def _record(data: bytes, at: int) -> tuple[torch.Tensor | None, bool, int]:
    """One tensor record from ``at``: (tensor or None when absent, usable, the offset after it)."""
    if at >= len(data):
        raise _Lost
    code, at = data[at], at + 1
    if code == 0:
        return None, True, at
    if code not in ITEMSIZE or at >= len(data):
        raise _Lost
    ndim, at = data[at], at + 1
    if at + 8 * ndim > len(data):
        raise _Lost
    shape = struct.unpack_from(f"<{ndim}q", data, at)
    at += 8 * ndim
    count = 1
    for size in shape:  # checked size by size, as a 64-bit count would overflow
        count *= size
        if size < 0 or count >= 1 << 64:
            raise _Lost
    size_bytes = count * ITEMSIZE[code]
    if size_bytes > len(data) - at:
        raise _Lost
    if ndim > MAX_DIMS:  # framed, so the walk goes on, but no request
        return None, False, at + size_bytes
    if count == 0:  # numpy refuses shapes like [2**62, 0]; torch holds them unless their strides overflow
        try:
            return torch.empty(shape, dtype=DTYPES[code]), True, at
        except RuntimeError:  # e.g. [0, 2**62, 4]: framed (no data), but no tensor
            return None, False, at
    array = np.frombuffer(data, dtype=NUMPY[code], count=count, offset=at).reshape(shape)
    return torch.from_numpy(array.astype(array.dtype.newbyteorder("="))), True, at + size_bytes


def _walk(data: bytes) -> Walk | None:
    if len(data) < 12 or data[:8] not in (b"EMBSRQ01", b"EMBSRQ02"):
        return None
    (declared,) = struct.unpack_from("<I", data, 8)
    if declared > (len(data) - 12) // MIN_REQUEST_BYTES:
        return None
    at, requests = 12, []
    for _ in range(declared):
        try:
            tensors = []
            for _ in range(4 if data[:8] == b"EMBSRQ02" else 3):
                tensor, usable, at = _record(data, at)
                tensors.append((tensor, usable))
        except _Lost:
            return Walk(declared, requests, True, 0)
        values, lengths, weights, dense = [tensor for tensor, _ in tensors] + [None] * (4 - len(tensors))
        if values is None or lengths is None or not all(usable for _, usable in tensors):
            requests.append(None)
        else:
            requests.append((values, lengths, weights, dense))
    return Walk(declared, requests, False, len(data) - at)


def _check_file(path: Path, runtime: Runtime, lines: list[str], seen: Counter[str]) -> str:
    """Compares one file's responses and stderr lines with its walk; counts what it exercised in ``seen``."""
    walk = _walk(path.read_bytes())
    answers = read_response_file(path.with_suffix(".out"))
    if walk is None:
        assert (answers.requests, answers.records) == (0, ()), path.name
        assert answers.file_error is not None and answers.file_error.error_type == "FileFormatError"
        assert len(lines) == 1, (path.name, lines)
        return "unreadable"
    assert answers.requests == walk.declared and len(answers.records) == len(walk.requests), path.name
    assert (answers.file_error is not None) == (walk.lost or walk.trailing > 0), (path.name, answers.file_error)
    failed = 0
    for index, (request, answer) in enumerate(zip(walk.requests, answers.records)):
        if request is None:
            assert answer.error_type == "FileFormatError", (path.name, index, answer)
        else:
            _check_answer(runtime, request, answer, f"{path.name} request {index}")
        failed += not answer.ok
        seen["answered" if answer.ok else f"record {answer.error_type}"] += 1
    assert len(lines) == failed + (answers.file_error is not None), (path.name, lines)
    return "lost" if walk.lost else "read"


def _check_answer(runtime: Runtime, request, answer: Response, where: str) -> None:  # type: ignore[no-untyped-def]
    """A located request: Python's lookup (or predict) of the same tensors answers it the same (a result bit for
    bit, or an error, in which case the C++ record is a RequestError)."""
    values, lengths, weights, dense = request
    try:
        batch = SparseFeatures(runtime.feature_names, values, lengths, weights)
        expected = runtime.lookup(batch) if dense is None else runtime.predict(batch, dense).reshape(-1)
    except EmbserveError as err:
        assert answer.error_type == "RequestError", (where, answer, str(err))
        return
    assert answer.output is not None, (where, answer)
    # bit for bit; a mutated float may be NaN, which both sides carry through
    torch.testing.assert_close(answer.output, expected, rtol=0, atol=0, equal_nan=True, msg=where)


def _mutate(data: bytes, rng: random.Random) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        op = rng.randrange(6)
        at = rng.randrange(len(out)) if out else 0
        if op == 0 and out:  # flip a byte
            out[at] ^= 1 << rng.randrange(8)
        elif op == 1 and out:  # a random byte
            out[at] = rng.randrange(256)
        elif op == 2:  # an interesting int64 (a size, a length or an id)
            out[at : at + 8] = struct.pack("<q", rng.choice(INTERESTING_I64))
        elif op == 3:  # truncate
            del out[at:]
        elif op == 4:  # an interesting int32 (count, int32 length or id)
            out[at : at + 4] = struct.pack("<i", rng.choice([-1, 0, 1, 3, 1 << 30, (1 << 31) - 1, -(1 << 31)]))
        else:  # duplicate a chunk
            out[at:at] = out[at : at + rng.randint(1, 32)]
    return bytes(out)


@pytest.mark.parametrize("kind", ["lookups", "predicts"])
def test_fuzzed_request_files_never_crash(kind, embserve_run, unsharded_artifact, dense_artifact, tmp_path):
    """lookups: version 1 files for mixed_spec; predicts: version 2 files (dense records) for a dense model."""
    rng = random.Random(SEED)
    spec, artifact = (
        (mixed_spec(), unsharded_artifact) if kind == "lookups" else (dense_artifact.spec, dense_artifact.path)
    )
    good = _good_file(tmp_path / "good.bin", spec)
    paths = []
    for i in range(MUTANTS):
        path = tmp_path / f"m{i:03d}.bin"
        path.write_bytes(_mutate(good, rng))
        paths.append(path)

    def one(chunk: list[Path]):  # type: ignore[no-untyped-def]
        # one process runs a chunk of files (--requests/--out pairs), so the model loads once per chunk
        args = [a for path in chunk for a in ("--requests", path, "--out", path.with_suffix(".out"))]
        return chunk, run(embserve_run, artifact, *args, timeout=120)

    chunks = [paths[i : i + PER_PROCESS] for i in range(0, MUTANTS, PER_PROCESS)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(one, chunks))
    runtime = load(artifact)
    seen: Counter[str] = Counter()
    for chunk, result in results:
        assert result.returncode in (0, 1, 2), (result.returncode, result.stderr[-1500:])
        assert not any(marker in result.stderr for marker in BACKTRACE_MARKERS), result.stderr[-1500:]
        lines = result.stderr.splitlines()
        by_file = {path: [line for line in lines if line.startswith(f"embserve_run: {path}: ")] for path in chunk}
        assert sum(map(len, by_file.values())) == len(lines), result.stderr[-1500:]  # each line names its file
        outcomes = [_check_file(path, runtime, by_file[path], seen) for path in chunk]
        seen.update(outcomes)
        expected_status = 2 if "unreadable" in outcomes else 1 if lines else 0
        assert result.returncode == expected_status, (result.returncode, outcomes)
    # the mutations exercise every path: headers that cannot be read (few: 12 of the file's bytes), framing lost,
    # files read whole; requests answered, refused by the call contract and framed but unusable
    assert seen["unreadable"] >= 5 and seen["lost"] > 20 and seen["read"] > 20, seen
    assert seen["answered"] > 100 and seen["record RequestError"] > 20 and seen["record FileFormatError"] > 5, seen
