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


def load_each(binary: Path, folders: list[Path], *options: object, timeout: float = 300) -> dict[Path, str]:
    """``embserve_run --load-each FOLDER... OPTIONS``: every folder loaded in one process; each folder's outcome,
    "ok" or the one-folder run's stderr line without its "embserve_run: " prefix (with ``--requests FILE``: or the
    first failed request's, "request I: KIND: MESSAGE"). Asserts a clean run: status 0 or 1 (1 exactly when some
    folder failed), nothing on stderr, no backtrace, one stdout line per folder in order."""
    result = run(binary, "--load-each", *folders, *options, timeout=timeout)
    lines = result.stdout.splitlines()
    done = f"the last folder answered: {lines[-1]!r}" if lines else "no folder answered"
    assert result.returncode in (0, 1), (result.returncode, done, result.stderr[-2000:])
    assert result.stderr == "" and not any(m in result.stdout for m in BACKTRACE_MARKERS), result.stderr[-2000:]
    assert len(lines) == len(folders), (len(lines), len(folders), result.stdout[-2000:])
    outcomes = {}
    for folder, line in zip(folders, lines, strict=True):
        prefix = f"{folder}: "
        assert line.startswith(prefix), (str(folder), line)
        outcomes[folder] = line[len(prefix) :]
    assert result.returncode == (0 if all(o == "ok" for o in outcomes.values()) else 1), result.stdout[-2000:]
    return outcomes


def assert_same_as_one_folder_run(binary: Path, folder: Path, outcome: str) -> None:
    """The one-folder run of ``folder`` prints exactly ``outcome`` (from load_each) as its one stderr line."""
    result = run(binary, folder)
    assert_clean_failure(result)
    assert result.stderr.splitlines() == [f"embserve_run: {outcome}"], (result.stderr, outcome)


def tensor_record(code: int, shape: list[int], data: bytes = b"") -> bytes:
    """A raw cpp_io tensor record (no checks: tests write impossible ones on purpose)."""
    if code == 0:
        return b"\x00"
    return struct.pack("<BB", code, len(shape)) + struct.pack(f"<{len(shape)}q", *shape) + data


def request_file(count: int, *records: bytes) -> bytes:
    return b"EMBSRQ01" + struct.pack("<I", count) + b"".join(records)
