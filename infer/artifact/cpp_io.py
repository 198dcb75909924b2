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
- response file, version 2 (``embserve_run`` writes it): magic ``EMBSRS02``, ``u32 requests`` (the count its
  request file declares; 0 when that file's header cannot be read), then one record per request that was read, in
  order, each ``u8 status``: 0 and a tensor record (a lookup's ``[batch, output_dim]`` float32 pooled embeddings,
  a predict's ``[batch]`` float32 scores), or 1 and two strings (``u32`` byte length, UTF-8): the error kind and its
  message; then a closing record: ``u8 2`` (the request file was read whole and every request ran), or ``u8 3``
  and two strings, the kind and message of the request file's own problem or of why the records stop before
  ``requests``. The records may stop short only with a closing ``3``: when a record's frame cannot be found (an
  unknown dtype code, a size that is negative, overflows or points past the end of the file) nothing after it
  can be located, so the requests before it are answered and the closing record (``FileFormatError``) names the
  request and byte; after ``--fail-fast`` stopped, the closing record is ``NotRun``. A closing ``3`` after every
  record says the file has bytes after its last request. (A request file has no per-request length, so a size
  that is wrong but still inside the file moves every later record: what follows reads as other requests, mostly
  refused, or as a lost frame.) ``read_responses`` gives one ``Response`` per declared
  request, the closing error standing for each request without a record; ``read_response_file`` keeps the parts;
- response file, version 1 (older ``embserve_run``): magic ``EMBSRS01``, ``u32 count``, then ``count`` records as
  above and no closing record. Both versions are read.

Error kinds (``Response.error_type``): the C++ loader's ``RequestError`` (the call contract refused the request),
``ModelError``, ``LibraryError``, ``ChecksumError``, ``ManifestError``; ``FileFormatError`` (the request's records
are framed but unusable: ``values`` or ``lengths`` absent, more than 8 dimensions, a shape torch cannot hold such as
``[0, 2**62, 4]``; or the closing record's file problem);
``NotRun`` (``--fail-fast``); ``OutOfMemory``, ``TorchError``, ``Error``. ``Response.error`` is the matching
``infer.errors`` exception.

The tensors' dtypes are stored as given (a file may hold a dtype the call contract refuses, to test it).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from infer.errors import (
    ArtifactError,
    ArtifactErrorKind,
    EmbserveError,
    FileFormatError,
    RequestError,
)

REQUEST_MAGIC = b"EMBSRQ01"  # version 1: lookups only
REQUEST_MAGIC_V2 = b"EMBSRQ02"  # version 2: each request may carry dense features (a predict)
RESPONSE_MAGIC_V1 = b"EMBSRS01"  # records only
RESPONSE_MAGIC = b"EMBSRS02"  # the request count, the records of the requests read, a closing record
_RESULT, _ERROR, _END_WHOLE, _END_WITH_ERROR = 0, 1, 2, 3
_ARTIFACT_KINDS = {
    "ManifestError": ArtifactErrorKind.MANIFEST,
    "ChecksumError": ArtifactErrorKind.CHECKSUM,
    "LibraryError": ArtifactErrorKind.LIBRARY,
    "ModelError": ArtifactErrorKind.MODEL,
}
_CODES = {torch.int32: 1, torch.int64: 2, torch.float32: 3}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}

Request = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]


@dataclass(frozen=True)
class Response:
    """One request's result: ``output`` on success, else ``error_type`` (the kind) and ``message``."""

    output: torch.Tensor | None
    error_type: str | None = None
    message: str | None = None

    @property
    def ok(self) -> bool:
        return self.output is not None

    @property
    def error(self) -> EmbserveError | None:
        """The error as its ``infer.errors`` type (``RequestError``, ``ArtifactError`` of the loader's kind,
        ``FileFormatError``; any other kind an ``EmbserveError`` naming it), None for a result."""
        if self.ok:
            return None
        kind, message = self.error_type or "Error", self.message or ""
        if kind == "RequestError":
            return RequestError(message)
        if kind == "FileFormatError":
            return FileFormatError(message)
        if kind in _ARTIFACT_KINDS:
            return ArtifactError(message, kind=_ARTIFACT_KINDS[kind])
        return EmbserveError(f"{kind}: {message}")


@dataclass(frozen=True)
class ResponseFile:
    """A response file's parts: ``requests`` (as the request file declares), the ``records`` of the requests that
    were read, in order, and ``file_error``: the request file's own problem, or why the records stop short."""

    requests: int
    records: tuple[Response, ...]
    file_error: Response | None = None

    def responses(self) -> list[Response]:
        """One ``Response`` per declared request: the records, then ``file_error`` for each request without one."""
        missing = self.requests - len(self.records)
        return [*self.records, *([self.file_error] * missing if self.file_error is not None else [])]


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


def write_responses(
    path: str | Path, responses: Sequence[Response], requests: int | None = None, file_error: Response | None = None
) -> Path:
    """The writer ``embserve_run --out`` mirrors (version 2); here for tests and tools. ``requests``: the count the
    request file declares (default: one per response); ``file_error``: the closing record's error, if any."""
    path = Path(path)
    requests = len(responses) if requests is None else requests
    if len(responses) > requests or (len(responses) < requests and file_error is None):
        raise FileFormatError(
            f"{len(responses)} responses for {requests} requests; give one per request, or a file_error for the rest"
        )
    with path.open("wb") as handle:
        handle.write(RESPONSE_MAGIC + struct.pack("<I", requests))
        for response in responses:
            if response.output is not None:
                handle.write(bytes([_RESULT]))
                _write_tensor(handle, response.output)
            else:
                _write_error(handle, _ERROR, response)
        if file_error is None:
            handle.write(bytes([_END_WHOLE]))
        else:
            _write_error(handle, _END_WITH_ERROR, file_error)
    return path


def _write_error(handle: BinaryIO, status: int, response: Response) -> None:
    handle.write(bytes([status]))
    _write_string(handle, response.error_type or "Error")
    _write_string(handle, response.message or "")


def _read_error(handle: BinaryIO) -> Response:
    error_type = _read_string(handle)
    return Response(None, error_type, _read_string(handle))


def _read_status(handle: BinaryIO) -> int:
    (status,) = struct.unpack("<B", _read_exact(handle, 1))
    return int(status)


def _read_record(handle: BinaryIO, status: int, path: Path, index: int) -> Response:
    if status == _RESULT:
        return Response(_read_tensor(handle))
    if status == _ERROR:
        return _read_error(handle)
    raise FileFormatError(f"{path}: record {index} has unknown status {status} (a corrupted response file)")


def read_response_file(path: str | Path) -> ResponseFile:
    """Read the file ``embserve_run --out`` wrote (version 1 or 2) into its parts."""
    path = Path(path)
    with path.open("rb") as handle:
        magic, requests = _read_magic(handle, (RESPONSE_MAGIC, RESPONSE_MAGIC_V1), path)
        if magic == RESPONSE_MAGIC_V1:
            return ResponseFile(
                requests, tuple(_read_record(handle, _read_status(handle), path, i) for i in range(requests))
            )
        records: list[Response] = []
        status = _read_status(handle)
        while status not in (_END_WHOLE, _END_WITH_ERROR):
            if len(records) == requests:
                raise FileFormatError(f"{path}: more records than its {requests} requests (a corrupted response file)")
            records.append(_read_record(handle, status, path, len(records)))
            status = _read_status(handle)
        if status == _END_WITH_ERROR:
            return ResponseFile(requests, tuple(records), _read_error(handle))
        if len(records) != requests:
            raise FileFormatError(f"{path}: {len(records)} records for {requests} requests and no closing error")
        return ResponseFile(requests, tuple(records))


def read_responses(path: str | Path) -> list[Response]:
    """One ``Response`` per request of the file ``embserve_run --out`` wrote, in order (a request that was not read
    or not run carries the closing record's error; see ``read_response_file``)."""
    return read_response_file(path).responses()
