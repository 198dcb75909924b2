"""A seeded fuzz of embserve_run's request files: a few hundred mutations of good files, all in one run each.

Every run ends with status 0 or 1 and never a signal; stderr holds only one-line messages without a
backtrace; a file that parses gets one response record per request.
"""

from __future__ import annotations

import random
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from infer.artifact.cpp_io import read_responses, write_requests
from tests.conftest import mixed_spec, random_batch
from tests.cpp.support import BACKTRACE_MARKERS, run

SEED = 11
MUTANTS = 360
PER_PROCESS = 60
INTERESTING_I64 = [0, 1, -1, 2, 7, 1 << 31, (1 << 31) - 1, 1 << 32, 1 << 40, 1 << 62, (1 << 63) - 1, -(1 << 63)]


def _good_file(path: Path) -> bytes:
    spec = mixed_spec()
    requests = []
    shapes = [(2, False, torch.int64), (1, True, torch.int32), (3, False, torch.int64)]
    for seed, (batch, weighted, dtype) in enumerate(shapes):
        b = random_batch(spec, batch_size=batch, weighted=weighted, seed=seed, id_dtype=dtype)
        requests.append((b.values, b.lengths, b.weights))
    write_requests(path, requests)
    return path.read_bytes()


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


def test_fuzzed_request_files_never_crash(embserve_run, unsharded_artifact, tmp_path):
    rng = random.Random(SEED)
    good = _good_file(tmp_path / "good.bin")
    paths = []
    for i in range(MUTANTS):
        path = tmp_path / f"m{i:03d}.bin"
        path.write_bytes(_mutate(good, rng))
        paths.append(path)

    def one(chunk: list[Path]):  # type: ignore[no-untyped-def]
        # one process runs a chunk of files (--requests/--out pairs), so the model loads once per chunk
        args = [a for path in chunk for a in ("--requests", path, "--out", path.with_suffix(".out"))]
        return chunk, run(embserve_run, unsharded_artifact, *args, timeout=120)

    chunks = [paths[i : i + PER_PROCESS] for i in range(0, MUTANTS, PER_PROCESS)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(one, chunks))
    parsed = 0
    for chunk, result in results:
        assert result.returncode in (0, 1), (result.returncode, result.stderr[-1500:])
        assert not any(marker in result.stderr for marker in BACKTRACE_MARKERS), result.stderr[-1500:]
        lines = result.stderr.splitlines()
        by_file = {path: [line for line in lines if line.startswith(f"embserve_run: {path}: ")] for path in chunk}
        assert sum(map(len, by_file.values())) == len(lines), result.stderr[-1500:]  # each line names its file
        for path, file_lines in by_file.items():
            out = path.with_suffix(".out")
            if out.is_file():  # the request file parsed: one record per request, one line per failed request
                parsed += 1
                failed = [r for r in read_responses(out) if not r.ok]
                assert len(failed) == len(file_lines), (path.name, file_lines)
                assert all(r.error_type == "RequestError" for r in failed), [(r.error_type, r.message) for r in failed]
            else:
                assert len(file_lines) == 1, (path.name, file_lines)
        assert (result.returncode == 1) == bool(lines)
    # the mutations exercise both paths: files that parse (good or bad requests) and files that do not
    assert 20 < parsed < MUTANTS - 20, parsed
