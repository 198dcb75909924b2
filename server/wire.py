"""Responses written once: a message's small fields through protobuf, its large payloads appended as raw fields.

Protobuf's wire format is a sequence of fields, and a field may come anywhere in it, so a response is its
serialized small part followed by each large ``bytes`` field written straight from the output tensor's memory:
one copy into the response buffer, instead of ``tobytes``, the message's own copy and serialization's copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

_LENGTH_DELIMITED = 2


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def field_number(message_type: Any, name: str) -> int:
    number: int = message_type.DESCRIPTOR.fields_by_name[name].number
    return number


def payload(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, without a copy (the response buffer is the one copy)."""
    array: np.ndarray = tensor.contiguous().numpy()
    return array.reshape(-1).view(np.uint8).data


def with_bytes_fields(head: bytes, number: int, payloads: Sequence[memoryview | bytes]) -> bytes:
    """``head`` (a serialized message) followed by one ``bytes`` field ``number`` per payload, in order (a
    repeated field keeps this order; a singular one takes the last)."""
    tag = _varint((number << 3) | _LENGTH_DELIMITED)
    parts: list[bytes | memoryview] = [head]
    for data in payloads:
        parts += [tag, _varint(len(data)), data]
    return b"".join(parts)


def serialize(response: Any) -> bytes:
    """The response serializer of our handlers: a message, or bytes already written by ``with_bytes_fields``."""
    if isinstance(response, bytes):
        return response
    data: bytes = response.SerializeToString()
    return data
