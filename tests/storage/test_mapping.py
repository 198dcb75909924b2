"""infer/storage/mapping.py: weight files mapped read-only, whatever their size beside RAM."""

from __future__ import annotations

import os
import sys

import pytest

from infer.storage.mapping import map_read_only

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _ram_bytes() -> int:
    for line in open("/proc/meminfo").read().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemTotal in /proc/meminfo")


def test_a_file_larger_than_ram_maps_read_only_and_reads(tmp_path):
    """A sparse file twice the size of RAM (no disk used): a writable private mapping of it is charged to the commit
    limit and refused (ENOMEM) under the default heuristic overcommit; the read-only mapping is not."""
    size = 2 * _ram_bytes() // 4096 * 4096
    path = tmp_path / "weights-0.bin"
    with path.open("wb") as out:
        out.truncate(size)
        out.seek(size - 4096)
        out.write(b"\x07" * 4096)
    mapped = map_read_only(path, size)
    assert mapped.numel() == size
    assert int(mapped[size - 1]) == 7 and int(mapped[0]) == 0
    ranges = [line.split() for line in open(f"/proc/{os.getpid()}/maps") if line.rstrip().endswith(str(path))]
    assert [fields[1] for fields in ranges] == ["r--p"]  # read-only, private: never written, never charged
