"""infer.artifact.cpp_io: the request/response files shared with embserve_run round-trip exactly."""

from __future__ import annotations

import struct

import pytest
import torch

from infer.artifact.cpp_io import (
    Response,
    read_dense_features,
    read_requests,
    read_response_file,
    read_responses,
    write_requests,
    write_responses,
)
from infer.errors import ArtifactError, ArtifactErrorKind, EmbserveError, FileFormatError, RequestError


def test_requests_round_trip(tmp_path):
    requests = [
        (torch.tensor([1, 2, 3]), torch.tensor([2, 1], dtype=torch.int32), None),
        (torch.tensor([], dtype=torch.int32), torch.zeros(4, dtype=torch.int32), torch.empty(0)),
        (torch.tensor([7], dtype=torch.int32), torch.tensor([1], dtype=torch.int64), torch.tensor([0.5])),
    ]
    back = read_requests(write_requests(tmp_path / "r.bin", requests))
    assert len(back) == len(requests)
    for got, want in zip(back, requests):
        for a, b in zip(got, want):
            assert (a is None) == (b is None)
            if a is not None and b is not None:
                assert a.dtype == b.dtype and torch.equal(a, b)


def test_responses_round_trip(tmp_path):
    responses = [Response(torch.randn(3, 5)), Response(None, "RequestError", "feature 'a': id 9 is out of range")]
    back = read_responses(write_responses(tmp_path / "o.bin", responses))
    assert back[0].ok and back[0].output is not None and torch.equal(back[0].output, responses[0].output)
    assert not back[1].ok and back[1].error_type == "RequestError" and "id 9" in (back[1].message or "")


def test_bad_files_are_rejected(tmp_path):
    (tmp_path / "x").write_bytes(b"nope")
    with pytest.raises(ValueError, match="not a cpp_io file"):
        read_requests(tmp_path / "x")
    with pytest.raises(ValueError, match="float64"):
        write_requests(tmp_path / "y", [(torch.zeros(1, dtype=torch.float64), torch.zeros(1), None)])


def test_dense_features_make_a_version_2_file(tmp_path):
    """With dense features the file is version 2 and keeps them per request (None: a lookup); without, the
    bytes stay version 1, which older readers take."""
    requests = [
        (torch.tensor([1, 2]), torch.tensor([1, 1], dtype=torch.int32), torch.tensor([0.5, 2.0])),
        (torch.tensor([3], dtype=torch.int32), torch.tensor([1, 0], dtype=torch.int64), None),
    ]
    dense = [torch.tensor([[0.25, -1.0, 3.0]]), None]
    path = write_requests(tmp_path / "r.bin", requests, dense)
    assert path.read_bytes()[:8] == b"EMBSRQ02"
    back = read_requests(path)
    for got, want in zip(back, requests):
        for a, b in zip(got, want):
            assert (a is None) == (b is None) and (a is None or (a.dtype == b.dtype and torch.equal(a, b)))
    back_dense = read_dense_features(path)
    assert back_dense[1] is None and back_dense[0] is not None and torch.equal(back_dense[0], dense[0])
    lookups = write_requests(tmp_path / "v1.bin", requests)
    assert lookups.read_bytes()[:8] == b"EMBSRQ01" and read_dense_features(lookups) == [None, None]


def test_dense_features_must_match_the_requests(tmp_path):
    request = (torch.tensor([1]), torch.tensor([1], dtype=torch.int32), None)
    with pytest.raises(ValueError, match="2 dense_features for 1 requests"):
        write_requests(tmp_path / "r.bin", [request], [None, None])


def test_a_short_response_file_carries_its_closing_error(tmp_path):
    """Version 2: records for the requests read, then the closing error, which stands for each request without a
    record in read_responses."""
    closing = Response(None, "FileFormatError", "request 1 (from byte 81) cannot be read")
    path = write_responses(tmp_path / "o.bin", [Response(torch.ones(2, 3))], requests=3, file_error=closing)
    assert path.read_bytes()[:8] == b"EMBSRS02"
    parts = read_response_file(path)
    assert parts.requests == 3 and len(parts.records) == 1 and parts.file_error == closing
    assert [r.error_type for r in read_responses(path)] == [None, "FileFormatError", "FileFormatError"]
    whole = read_response_file(write_responses(tmp_path / "w.bin", [Response(torch.ones(1))], file_error=closing))
    assert whole.requests == 1 and whole.file_error == closing  # e.g. bytes after the last request
    with pytest.raises(FileFormatError, match="1 responses for 3 requests"):
        write_responses(tmp_path / "x.bin", [Response(torch.ones(1))], requests=3)


def test_version_1_response_files_are_still_read(tmp_path):
    """EMBSRS01 as older embserve_run wrote it (bytes by hand): count, records, no closing record."""
    result = struct.pack("<BBBq", 0, 3, 1, 2) + struct.pack("<2f", 1.5, -2.0)
    error = b"\x01" + struct.pack("<I", 12) + b"RequestError" + struct.pack("<I", 3) + b"bad"
    (tmp_path / "v1.bin").write_bytes(b"EMBSRS01" + struct.pack("<I", 2) + result + error)
    parts = read_response_file(tmp_path / "v1.bin")
    assert parts.requests == 2 and parts.file_error is None
    first, second = parts.records
    assert first.output is not None and torch.equal(first.output, torch.tensor([1.5, -2.0]))
    assert (second.error_type, second.message) == ("RequestError", "bad")


def test_a_corrupted_response_file_is_refused(tmp_path):
    header = b"EMBSRS02" + struct.pack("<I", 2)
    (tmp_path / "short.bin").write_bytes(header + b"\x00" + struct.pack("<BBq", 3, 1, 0) + b"\x02")
    with pytest.raises(FileFormatError, match="1 records for 2 requests and no closing error"):
        read_response_file(tmp_path / "short.bin")
    (tmp_path / "status.bin").write_bytes(header + b"\x07")
    with pytest.raises(FileFormatError, match="record 0 has unknown status 7"):
        read_response_file(tmp_path / "status.bin")
    (tmp_path / "unended.bin").write_bytes(header + b"\x00" + struct.pack("<BBq", 3, 1, 0))
    with pytest.raises(FileFormatError, match="truncated"):
        read_response_file(tmp_path / "unended.bin")


@pytest.mark.parametrize(
    "kind, error_class, artifact_kind",
    [
        ("RequestError", RequestError, None),
        ("FileFormatError", FileFormatError, None),
        ("ModelError", ArtifactError, ArtifactErrorKind.MODEL),
        ("LibraryError", ArtifactError, ArtifactErrorKind.LIBRARY),
        ("ChecksumError", ArtifactError, ArtifactErrorKind.CHECKSUM),
        ("ManifestError", ArtifactError, ArtifactErrorKind.MANIFEST),
        ("NotRun", EmbserveError, None),
        ("OutOfMemory", EmbserveError, None),
    ],
)
def test_error_records_are_typed(kind, error_class, artifact_kind):
    error = Response(None, kind, "the message").error
    assert type(error) is error_class and str(error).endswith("the message")
    assert getattr(error, "kind", None) == artifact_kind
    assert Response(torch.ones(1)).error is None
