"""Request and response files shared with the C++ loader's ``embserve_run`` (see ``cpp_loader/``).

A tiny little-endian binary format, so neither side needs the other's serializer:

- tensor record: ``u8 dtype`` (0 = absent, 1 = int32, 2 = int64, 3 = float32), ``u8 ndim``,
  ``ndim × i64`` sizes, then the contiguous data (absent: the dtype byte only);
- request file, version 1: magic ``EMBSRQ01``, ``u32 count``, then per request the tensor records
  ``values``, ``lengths``, ``weights`` (``weights`` may be absent): every request is a lookup;
- request file, version 2: magic ``EMBSRQ02``, ``u32 count``, then per request ``values``, ``lengths``,
  ``weights`` and ``dense_features`` (``weights`` and ``dense_features`` may be absent): a request with
  ``dense_features`` (``[batch, num_dense_features]``) is a predict, one without a lookup. ``write_requests``
  writes version 1 unless it is given dense features, so files for lookups stay readable by older readers;
  ``embserve_run`` reads both;
- response file: magic ``EMBSRS01``, ``u32 count``, then per request ``u8 status``: 0 and a tensor
  record (a lookup's ``[batch, output_dim]`` float32 pooled embeddings, a predict's ``[batch]`` float32
  scores), or 1 and two strings (``u32`` byte length, UTF-8): the error type (e.g. ``RequestError``) and
  its message.

The tensors' dtypes are stored as given (a file may hold a dtype the call contract refuses, to test it).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from infer.errors import FileFormatError

REQUEST_MAGIC = b"EMBSRQ01"  # version 1: lookups only
REQUEST_MAGIC_V2 = b"EMBSRQ02"  # version 2: each request may carry dense features (a predict)
RESPONSE_MAGIC = b"EMBSRS01"
_CODES = {torch.int32: 1, torch.int64: 2, torch.float32: 3}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}

Request = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]


@dataclass(frozen=True)
class Response:
    """One request's result: ``output`` on success, else ``error_type`` and ``message``."""

    output: torch.Tensor | None
    error_type: str | None = None
    message: str | None = None

    @property
    def ok(self) -> bool:
        return self.output is not None


def _write_tensor(handle: BinaryIO, tensor: torch.Tensor | None) -> None:
    if tensor is None:
        handle.write(b"\x00")
        return
    if tensor.dtype not in _CODES:
        raise FileFormatError(f"cpp_io stores int32, int64 and float32 tensors, not {tensor.dtype}")
    tensor = tensor.detach().cpu().contiguous()
    handle.write(struct.pack("<BB", _CODES[tensor.dtype], tensor.dim()))
    handle.write(struct.pack(f"<{tensor.dim()}q", *tensor.shape))
    handle.write(tensor.numpy().astype(tensor.numpy().dtype.newbyteorder("<"), copy=False).tobytes())


def _read_exact(handle: BinaryIO, size: int) -> bytes:
    data = handle.read(size)
    if len(data) != size:
        raise FileFormatError("cpp_io file is truncated")
    return data


def _read_tensor(handle: BinaryIO) -> torch.Tensor | None:
    (code,) = struct.unpack("<B", _read_exact(handle, 1))
    if code == 0:
        return None
    if code not in _DTYPES:
        raise FileFormatError(f"cpp_io file has unknown dtype code {code}")
    (ndim,) = struct.unpack("<B", _read_exact(handle, 1))
    shape = struct.unpack(f"<{ndim}q", _read_exact(handle, 8 * ndim))
    dtype = _DTYPES[code]
    count = 1
    for size in shape:
        count *= size
    data = bytearray(_read_exact(handle, count * dtype.itemsize))
    return torch.frombuffer(data, dtype=dtype, count=count).reshape(shape) if count else torch.empty(shape, dtype=dtype)


def _read_magic(handle: BinaryIO, magics: Sequence[bytes], path: Path) -> tuple[bytes, int]:
    """The file's magic (one of ``magics``) and its record count."""
    magic = handle.read(len(magics[0]))
    if magic not in magics:
        expected = " or ".join(m.decode() for m in magics)
        raise FileFormatError(f"{path} is not a cpp_io file (expected magic {expected})")
    (count,) = struct.unpack("<I", _read_exact(handle, 4))
    return magic, int(count)


def write_requests(
    path: str | Path,
    requests: Iterable[Request],
    dense_features: Sequence[torch.Tensor | None] | None = None,
) -> Path:
    """Write ``(values, lengths, weights_or_None)`` requests for ``embserve_run --requests``.

    ``dense_features``: one ``[batch, num_dense_features]`` tensor (or None: a lookup) per request, which makes
    each request with one a predict (a version 2 file); without it the file is version 1, lookups only."""
    path = Path(path)
    items = list(requests)
    if dense_features is not None and len(dense_features) != len(items):
        raise FileFormatError(
            f"{len(dense_features)} dense_features for {len(items)} requests; give one (or None) per request"
        )
    magic = REQUEST_MAGIC if dense_features is None else REQUEST_MAGIC_V2
    with path.open("wb") as handle:
        handle.write(magic + struct.pack("<I", len(items)))
        for i, (values, lengths, weights) in enumerate(items):
            _write_tensor(handle, values)
            _write_tensor(handle, lengths)
            _write_tensor(handle, weights)
            if dense_features is not None:
                _write_tensor(handle, dense_features[i])
    return path


def _read_request_file(path: str | Path) -> list[tuple[Request, torch.Tensor | None]]:
    """Every request of a version 1 or 2 file with its dense features (None: a lookup)."""
    path = Path(path)
    with path.open("rb") as handle:
        magic, count = _read_magic(handle, (REQUEST_MAGIC, REQUEST_MAGIC_V2), path)
        records = []
        for _ in range(count):
            values, lengths, weights = _read_tensor(handle), _read_tensor(handle), _read_tensor(handle)
            dense = _read_tensor(handle) if magic == REQUEST_MAGIC_V2 else None
            if values is None or lengths is None:
                raise FileFormatError(f"{path}: a request lacks values or lengths")
            records.append(((values, lengths, weights), dense))
        return records


def read_requests(path: str | Path) -> list[Request]:
    """The ``(values, lengths, weights_or_None)`` of every request (version 1 or 2)."""
    return [request for request, _ in _read_request_file(path)]


def read_dense_features(path: str | Path) -> list[torch.Tensor | None]:
    """Each request's dense features, None for a lookup (every request of a version 1 file)."""
    return [dense for _, dense in _read_request_file(path)]


def _write_string(handle: BinaryIO, text: str) -> None:
    data = text.encode("utf-8")
    handle.write(struct.pack("<I", len(data)) + data)


def _read_string(handle: BinaryIO) -> str:
    (size,) = struct.unpack("<I", _read_exact(handle, 4))
    return _read_exact(handle, size).decode("utf-8")


def write_responses(path: str | Path, responses: Sequence[Response]) -> Path:
    """The writer ``embserve_run --out`` mirrors; here for tests and tools."""
    path = Path(path)
    with path.open("wb") as handle:
        handle.write(RESPONSE_MAGIC + struct.pack("<I", len(responses)))
        for response in responses:
            if response.output is not None:
                handle.write(b"\x00")
                _write_tensor(handle, response.output)
            else:
                handle.write(b"\x01")
                _write_string(handle, response.error_type or "Error")
                _write_string(handle, response.message or "")
    return path


def _read_response(handle: BinaryIO, path: Path) -> Response:
    (status,) = struct.unpack("<B", _read_exact(handle, 1))
    if status == 0:
        return Response(_read_tensor(handle))
    error_type = _read_string(handle)
    return Response(None, error_type, _read_string(handle))


def read_responses(path: str | Path) -> list[Response]:
    """Read the file ``embserve_run --out`` wrote: one ``Response`` per request, in order."""
    path = Path(path)
    with path.open("rb") as handle:
        _, count = _read_magic(handle, (RESPONSE_MAGIC,), path)
        return [_read_response(handle, path) for _ in range(count)]
