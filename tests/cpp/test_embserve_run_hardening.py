"""embserve_run on hostile input: wrapping lengths, impossible sizes in request files, malformed files.

Every case ends with status 1 (2 for a request file that cannot be read at all) and exactly one line on stderr
naming the problem, never a signal or a c10 backtrace; requests that fail still get their error record and the
good ones their result.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch

from infer.artifact.cpp_io import read_responses, write_requests
from infer.artifact.load import load
from infer.features import SparseFeatures
from tests.conftest import mixed_spec, random_batch
from tests.cpp.support import BACKTRACE_MARKERS, assert_clean_failure, request_file, run, tensor_record

NUM_FEATURES = len(mixed_spec().features)  # 6; the first feature is f_int8


def test_wrapping_lengths_are_one_request_error(embserve_run, unsharded_artifact, tmp_path):
    """Four lengths of 2^62 and no ids (the sum wraps to 0), then one id with a wrapping sum, then a good one."""
    good = random_batch(mixed_spec(), batch_size=2, seed=4)
    zero_ids = torch.tensor([1 << 62] * 4 + [0] * (NUM_FEATURES - 4), dtype=torch.int64)
    one_id = torch.tensor([0, 1, (1 << 63) - 1, (1 << 63) - 1, 2, 0], dtype=torch.int64)
    requests = [
        (torch.empty(0, dtype=torch.int64), zero_ids, None),
        (torch.tensor([3]), one_id, None),
        (good.values, good.lengths, None),
    ]
    write_requests(tmp_path / "r.bin", requests)
    result = run(embserve_run, unsharded_artifact, "--requests", tmp_path / "r.bin", "--out", tmp_path / "o.bin")
    assert result.returncode == 1, (result.returncode, result.stderr)
    lines = result.stderr.splitlines()
    prefix = f"embserve_run: {tmp_path / 'r.bin'}: request"
    error = "RequestError: feature"
    assert lines == [
        f"{prefix} 0: {error} 'f_int8': bag 0 has length 4611686018427387904 but the batch has only 0 ids",
        f"{prefix} 1: {error} 'f_int4': bag 0 has length 9223372036854775807 but the batch has only 1 ids",
    ]
    responses = read_responses(tmp_path / "o.bin")
    assert [r.ok for r in responses] == [False, False, True]
    assert {r.error_type for r in responses[:2]} == {"RequestError"}
    expected = load(unsharded_artifact).lookup(SparseFeatures(mixed_spec().feature_names, good.values, good.lengths))
    assert torch.equal(responses[2].output, expected)


def _ids(n: int) -> bytes:
    return struct.pack(f"<{n}q", *range(n))


LENGTHS = tensor_record(1, [NUM_FEATURES], struct.pack(f"<{NUM_FEATURES}i", 1, 0, 0, 0, 0, 0))
IMPOSSIBLE = {
    "negative size": (request_file(1, tensor_record(2, [-5]), LENGTHS, b"\x00"), "negative size -5"),
    "2^40 elements": (request_file(1, tensor_record(2, [1 << 40]), LENGTHS, b"\x00"), "needs 8796093022208 bytes"),
    "elements overflow": (
        request_file(1, tensor_record(2, [1 << 62, 1 << 62]), LENGTHS, b"\x00"),
        "more elements than fit in 64 bits",
    ),
    "bytes overflow": (request_file(1, tensor_record(2, [1 << 62]), LENGTHS, b"\x00"), "more bytes than fit"),
    "ndim 200": (
        request_file(1, tensor_record(2, [1] * 200, _ids(1)), LENGTHS, b"\x00"),
        "values has 200 dimensions, over the limit of 8",
    ),
    "truncated data": (request_file(1, tensor_record(2, [4], _ids(3)), b""), "needs 32 bytes of data"),
    "truncated sizes": (request_file(1, struct.pack("<BB", 2, 3) + b"\x01" * 10), "the file ends at byte"),
    "bad magic": (b"EMBSRQ99" + b"\x00" * 4, "not an embserve request file"),  # 01 and 02 are the versions
    "empty file": (b"", "not an embserve request file"),
    "count larger than the file": (
        request_file(1 << 31, tensor_record(2, [1], _ids(1)), LENGTHS),
        "52 bytes hold at most 10",
    ),
    "unknown dtype": (request_file(1, tensor_record(9, [1], _ids(1)), LENGTHS, b"\x00"), "unknown dtype code 9"),
    "no lengths": (request_file(1, tensor_record(2, [1], _ids(1)), b"\x00", b"\x00"), "lengths is absent"),
    "trailing bytes": (request_file(1, tensor_record(2, [1], _ids(1)), LENGTHS, b"\x00", b"junk"), "4 bytes after"),
}


UNREADABLE = {"bad magic", "empty file", "count larger than the file"}  # status 2: nothing in them can be read


@pytest.fixture(scope="module")
def malformed(embserve_run, unsharded_artifact, tmp_path_factory) -> dict[str, tuple[Path, list[str]]]:  # type: ignore[no-untyped-def]
    """Every IMPOSSIBLE file run by one embserve_run (one --requests/--out pair each; a start per file is ~0.3 CPU-s
    of libtorch): each file's path and stderr lines. test_a_malformed_file_alone_is_one_line checks the status and
    the line of a file run alone."""
    root = tmp_path_factory.mktemp("malformed")
    paths, args = {}, []
    for index, (case, (data, _)) in enumerate(sorted(IMPOSSIBLE.items())):
        paths[case] = root / f"{index}.bin"
        paths[case].write_bytes(data)
        args += ["--requests", paths[case], "--out", root / f"{index}.out"]
    result = run(embserve_run, unsharded_artifact, *args)
    assert result.returncode == 2, result.stderr[-2000:]  # the worst: some files cannot be read at all
    assert not any(marker in result.stderr for marker in BACKTRACE_MARKERS), result.stderr[-2000:]
    lines = result.stderr.splitlines()
    found = {
        case: (path, [line for line in lines if line.startswith(f"embserve_run: {path}: ")])
        for case, path in paths.items()
    }
    assert sum(len(mine) for _, mine in found.values()) == len(lines), result.stderr[-2000:]
    return found


@pytest.mark.parametrize("case", sorted(IMPOSSIBLE))
def test_malformed_request_file_is_one_line(case, malformed):
    path, lines = malformed[case]
    assert len(lines) == 1, lines
    assert IMPOSSIBLE[case][1] in lines[0], (IMPOSSIBLE[case][1], lines[0])


@pytest.mark.parametrize("case", ["bad magic", "unknown dtype"])  # status 2, status 1
def test_a_malformed_file_alone_is_one_line(case, embserve_run, unsharded_artifact, malformed, tmp_path):
    data, fragment = IMPOSSIBLE[case]
    path = tmp_path / "r.bin"
    path.write_bytes(data)
    result = run(embserve_run, unsharded_artifact, "--requests", path, "--out", tmp_path / "o.bin")
    line = assert_clean_failure(result, f"embserve_run: {path}: ", fragment, status=2 if case in UNREADABLE else 1)
    shared_path, shared_lines = malformed[case]
    assert [line] == [text.replace(str(shared_path), str(path)) for text in shared_lines]


def test_kernel_errors_reach_the_user_as_one_line(embserve_run, unsharded_artifact, tmp_path):
    """A 2-D ids tensor and a 0-d lengths tensor: typed request errors, one line each, no c10 backtrace."""
    requests = [
        (torch.zeros(2, 3, dtype=torch.int64), torch.ones(NUM_FEATURES, dtype=torch.int32), None),
        (torch.zeros(1, dtype=torch.int64), torch.tensor(1, dtype=torch.int32), None),
    ]
    write_requests(tmp_path / "r.bin", requests)
    result = run(embserve_run, unsharded_artifact, "--requests", tmp_path / "r.bin", "--out", tmp_path / "o.bin")
    assert result.returncode == 1
    assert len(result.stderr.splitlines()) == 2 and "frame #" not in result.stderr
    assert [r.error_type for r in read_responses(tmp_path / "o.bin")] == ["RequestError", "RequestError"]


def test_missing_request_file_is_one_line(embserve_run, unsharded_artifact, tmp_path):
    result = run(embserve_run, unsharded_artifact, "--requests", tmp_path / "nope.bin", "--out", tmp_path / "o")
    assert_clean_failure(result, "nope.bin: FileFormatError: cannot be opened", status=2)


def test_missing_artifact_is_one_line(embserve_run, tmp_path: Path):
    assert_clean_failure(run(embserve_run, tmp_path / "absent"), "ManifestError", "is not a folder")
