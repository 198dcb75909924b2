"""infer.artifact.cpp_io: the request/response files shared with embserve_run round-trip exactly."""

from __future__ import annotations

import pytest
import torch

from infer.artifact.cpp_io import (
    Response,
    read_dense_features,
    read_requests,
    read_responses,
    write_requests,
    write_responses,
)


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
