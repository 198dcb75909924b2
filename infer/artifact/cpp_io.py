"""Request and response files shared with the C++ loader's ``embserve_run`` (see ``cpp_loader/``).

A tiny little-endian binary format, so neither side needs the other's serializer:

- tensor record: ``u8 dtype`` (0 = absent, 1 = int32, 2 = int64, 3 = float32), ``u8 ndim``,
  ``ndim × i64`` sizes, then the contiguous data (absent: the dtype byte only);
- request file: magic ``EMBSRQ01``, ``u32 count``, then per request the tensor records
  ``values``, ``lengths``, ``weights`` (``weights`` may be absent);
- response file: magic ``EMBSRS01``, ``u32 count``, then per request ``u8 status``: 0 and a tensor
  record (the ``[batch, output_dim]`` float32 output), or 1 and two strings (``u32`` byte length,
  UTF-8): the error type (e.g. ``RequestError``) and its message.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TypeVar

import torch

from infer.errors import FileFormatError

REQUEST_MAGIC = b"EMBSRQ01"
RESPONSE_MAGIC = b"EMBSRS01"
_CODES = {torch.int32: 1, torch.int64: 2, torch.float32: 3}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}

Request = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]
T = TypeVar("T")


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


def _check_magic(handle: BinaryIO, magic: bytes, path: Path) -> int:
    if handle.read(len(magic)) != magic:
        raise FileFormatError(f"{path} is not a cpp_io file (expected magic {magic.decode()})")
    (count,) = struct.unpack("<I", _read_exact(handle, 4))
    return int(count)


def write_requests(path: str | Path, requests: Iterable[Request]) -> Path:
    """Write ``(values, lengths, weights_or_None)`` requests for ``embserve_run --requests``."""
    path = Path(path)
    items = list(requests)
    with path.open("wb") as handle:
        handle.write(REQUEST_MAGIC + struct.pack("<I", len(items)))
        for values, lengths, weights in items:
            _write_tensor(handle, values)
            _write_tensor(handle, lengths)
            _write_tensor(handle, weights)
    return path


def _read_records(path: str | Path, magic: bytes, read_one: Callable[[BinaryIO, Path], T]) -> list[T]:
    """Every record of a request or response file, in order, after its magic and count."""
    path = Path(path)
    with path.open("rb") as handle:
        return [read_one(handle, path) for _ in range(_check_magic(handle, magic, path))]


def _read_request(handle: BinaryIO, path: Path) -> Request:
    values, lengths, weights = _read_tensor(handle), _read_tensor(handle), _read_tensor(handle)
    if values is None or lengths is None:
        raise FileFormatError(f"{path}: a request lacks values or lengths")
    return values, lengths, weights


def read_requests(path: str | Path) -> list[Request]:
    return _read_records(path, REQUEST_MAGIC, _read_request)


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
    return _read_records(path, RESPONSE_MAGIC, _read_response)
