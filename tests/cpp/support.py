"""Helpers shared by the C++ hardening tests: run embserve_run, assert one-line errors, build raw request files."""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

BACKTRACE_MARKERS = ("frame #", "Exception raised from", "Traceback")


def run(binary: Path, *args: object, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(binary), *map(str, args)], capture_output=True, text=True, errors="replace", timeout=timeout
    )


def assert_clean_failure(result: subprocess.CompletedProcess[str], *fragments: str, status: int = 1) -> str:
    """rc ``status`` (no signal), exactly one stderr line, no backtrace text, every fragment in that line."""
    assert result.returncode == status, (result.returncode, result.stderr[-2000:])
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr[-2000:]
    assert not any(marker in result.stderr for marker in BACKTRACE_MARKERS), result.stderr[-2000:]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def tensor_record(code: int, shape: list[int], data: bytes = b"") -> bytes:
    """A raw cpp_io tensor record (no checks: tests write impossible ones on purpose)."""
    if code == 0:
        return b"\x00"
    return struct.pack("<BB", code, len(shape)) + struct.pack(f"<{len(shape)}q", *shape) + data


def request_file(count: int, *records: bytes) -> bytes:
    return b"EMBSRQ01" + struct.pack("<I", count) + b"".join(records)
