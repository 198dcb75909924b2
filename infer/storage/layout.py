"""The layout of a weight file: every table of a kernel's weight buffer starts on a page boundary.

A page-aligned table can be mapped, prefetched (``madvise``) and evicted without touching its neighbours, and
the file's bytes are the kernel's own rows (its row layout and row alignment): the TBE reads them in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

PAGE_BYTES = 4096
WEIGHTS_FILE_PATTERN = "weights-{index}.bin"


@dataclass(frozen=True)
class WeightsFile:
    """Where one kernel's weight buffer lies: in artifact file ``file`` (a plain name, or ``hosts/<h>/<name>``)
    from byte ``offset`` (a page boundary)."""

    file: str
    offset: int = 0


def page_round_up(value: int) -> int:
    return -(-value // PAGE_BYTES) * PAGE_BYTES


def page_aligned_offsets(table_sizes: Sequence[int]) -> tuple[list[int], int]:
    """Each table's first byte when the tables are laid out in order, each on a page boundary, and the end of
    the last one (the buffer's size; no padding after it)."""
    offsets = []
    cursor = 0
    for size in table_sizes:
        cursor = page_round_up(cursor)
        offsets.append(cursor)
        cursor += size
    return offsets, cursor


def weights_file_name(index: int, prefix: str = "") -> str:
    """The ``index``-th weight file of an artifact (``prefix``: ``hosts/<h>/`` for one host's part)."""
    return prefix + WEIGHTS_FILE_PATTERN.format(index=index)
