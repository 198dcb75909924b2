"""infer/storage/writer.py: a weight file written from pieces at increasing offsets, zeros between them, hashed as
it is written; the digests equal hashlib's over the file's bytes read back."""

from __future__ import annotations

import hashlib

import pytest
import torch

from infer.storage.writer import StreamingFileWriter


def _piece(size: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("chunk_bytes", [1, 7, 4096, 1 << 20])
def test_pieces_land_at_their_offsets_with_zeros_between_and_digests_of_what_is_on_disk(tmp_path, chunk_bytes):
    pieces = [(0, _piece(10, 0)), (100, _piece(5000, 1).reshape(50, 100)), (9000, _piece(3, 2))]
    expected = bytearray(12000)
    for offset, piece in pieces:
        flat = bytes(piece.reshape(-1).tolist())
        expected[offset : offset + len(flat)] = flat
    path = tmp_path / "weights-0.bin"
    with StreamingFileWriter(path, chunk_bytes) as writer:
        for offset, piece in pieces:
            writer.write_at(offset, piece)
        digests = writer.finish(12000)
    written = path.read_bytes()
    assert written == bytes(expected)
    assert digests.size == 12000 and digests.sha256 == hashlib.sha256(written).hexdigest()
    chunks = [hashlib.sha256(written[i : i + chunk_bytes]).hexdigest() for i in range(0, len(written), chunk_bytes)]
    assert digests.chunk_bytes == chunk_bytes and list(digests.chunk_sha256) == chunks


def test_an_empty_file_has_no_chunks(tmp_path):
    with StreamingFileWriter(tmp_path / "empty.bin", 4096) as writer:
        digests = writer.finish(0)
    assert (digests.size, digests.chunk_sha256) == (0, ())
    assert digests.sha256 == hashlib.sha256(b"").hexdigest() and (tmp_path / "empty.bin").read_bytes() == b""


def test_overlapping_pieces_and_a_short_size_are_refused(tmp_path):
    with StreamingFileWriter(tmp_path / "w.bin", 16) as writer:
        writer.write_at(10, _piece(10, 0))
        with pytest.raises(ValueError, match="overlaps the previous one"):
            writer.write_at(19, _piece(1, 0))
        with pytest.raises(ValueError, match="ends before the last piece"):
            writer.finish(19)
