"""Reading a batch's pages of mapped tables ahead of the kernel: the pages its ids will touch are asked of the
kernel (``madvise(MADV_WILLNEED)``: asynchronous reads, many in flight) before the lookup runs, so the lookup's
page faults find them read or reading instead of each waiting for one synchronous read.

A table's mapping is advised ``MADV_RANDOM`` first: a fault then reads the page it needs, not a readahead window
around it (measured on DLRM-v2 INT8: 44-93 KB read per lookup without it). ``madvise`` releases the GIL (ctypes
drops it for the call); each single-page ``MADV_WILLNEED`` costs ~20 us here (it submits its read), so a pool of
16 threads issues them (measured at scale 0.02: 4 threads 73 ms a batch, 8: 88, 16: 39-52, 32: 52).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from infer.storage.layout import PAGE_BYTES

logger = logging.getLogger(__name__)

MADV_RANDOM = getattr(mmap, "MADV_RANDOM", 1)
MADV_WILLNEED = getattr(mmap, "MADV_WILLNEED", 3)
MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)
# one madvise call per run of pages; runs are split between the pool's threads in pieces of at least this many
MIN_RUNS_PER_TASK = 64

_libc: ctypes.CDLL | None = None


def _c() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        libc.mincore.restype = ctypes.c_int
        _libc = libc
    return _libc


def advise(address: int, length: int, advice: int) -> None:
    """``madvise`` on the pages covering ``[address, address + length)``; an error is logged, never raised (advice
    only changes speed)."""
    first = address // PAGE_BYTES * PAGE_BYTES
    if _c().madvise(first, address + length - first, advice) != 0:
        error = ctypes.get_errno()
        logger.warning("madvise(%d) of %d bytes failed: %s", advice, length, os.strerror(error))


def resident_pages(tensor: torch.Tensor) -> np.ndarray:
    """Per page of ``tensor``'s bytes (its first byte's page to its last's), whether it is in memory (``mincore``)."""
    start = tensor.data_ptr() // PAGE_BYTES * PAGE_BYTES
    length = tensor.data_ptr() + tensor.numel() * tensor.element_size() - start
    pages = -(-length // PAGE_BYTES)
    status = np.zeros(pages, dtype=np.uint8)
    if pages and _c().mincore(start, length, status.ctypes.data) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return (status & 1).astype(bool)


@dataclass(frozen=True)
class RowRegion:
    """Where feature ``feature``'s rows ``lo .. hi`` lie in memory: row ``r`` at ``address + (r - lo) * row_bytes``
    (a table, or one row block or column slice of it, of a mapped weight buffer)."""

    feature: int
    address: int
    row_bytes: int
    lo: int
    hi: int


class Prefetcher:
    """Asks for the pages a batch of ids will read, ahead of the kernel. ``regions``: every place a feature's ids
    are read from (a feature may have several: row blocks, column slices).

    A page asked for once is not asked for again until ``forget_after`` batches have passed (then every page is
    asked for anew): ``madvise`` is a system call per run of pages (~0.5 us), which on resident tables would cost
    more than the lookup; a page the kernel evicted meanwhile is read by the fault, as without prefetch."""

    def __init__(
        self, regions: Sequence[RowRegion], num_features: int, threads: int = 16, forget_after: int = 64
    ) -> None:
        self.num_features = num_features
        self.forget_after = forget_after
        self.regions = list(dict.fromkeys(regions))
        self.by_feature: list[list[int]] = [[] for _ in range(num_features)]
        for index, region in enumerate(self.regions):
            self.by_feature[region.feature].append(index)
        # per region, the pages asked for since the last reset (page 0: the page of the region's first byte)
        self._asked = [np.zeros(_pages_of(r)[1] - _pages_of(r)[0], dtype=bool) for r in self.regions]
        self._batches = 0
        self.threads = max(1, threads)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self.pages_requested = 0  # pages asked for, over all batches (a count for benchmarks)

    def advise_random(self) -> None:
        """``MADV_RANDOM`` on every region: a page fault reads its own page only."""
        for region in self.regions:
            advise(region.address, (region.hi - region.lo) * region.row_bytes, MADV_RANDOM)

    def pages(self, values: torch.Tensor, lengths: torch.Tensor, skip_asked: bool = False) -> np.ndarray:
        """The distinct pages (address // 4096, sorted) that the ids ``values`` (feature-major, ``lengths`` per
        feature and bag) read; with ``skip_asked``, only those not asked for since the last reset (and they are
        marked asked)."""
        batch = lengths.numel() // self.num_features if self.num_features else 0
        counts = lengths.view(self.num_features, batch).sum(1).tolist() if batch else [0] * self.num_features
        ids = values.numpy() if values.dtype == torch.int64 else values.to(torch.int64).numpy()
        found: list[np.ndarray] = []
        start = 0
        for feature, count in enumerate(counts):
            end = start + int(count)
            if self.by_feature[feature] and end > start:
                chunk = ids[start:end]
                for index in self.by_feature[feature]:
                    region = self.regions[index]
                    rows = chunk
                    if int(chunk.min()) < region.lo or int(chunk.max()) >= region.hi:
                        rows = chunk[(chunk >= region.lo) & (chunk < region.hi)]
                    first = region.address + (rows - region.lo) * region.row_bytes
                    pages = np.unique(
                        np.concatenate((first // PAGE_BYTES, (first + region.row_bytes - 1) // PAGE_BYTES))
                    )
                    if skip_asked:
                        asked = self._asked[index]
                        local = pages - region.address // PAGE_BYTES
                        pages = pages[~asked[local]]
                        asked[local] = True
                    found.append(pages)
            start = end
        if not found:
            return np.empty(0, dtype=np.int64)
        return np.unique(np.concatenate(found))

    def prefetch(self, values: torch.Tensor, lengths: torch.Tensor) -> int:
        """Ask for every page the batch reads that was not asked for lately (``MADV_WILLNEED``, one call per run of
        consecutive pages, the runs spread over the pool); returns when all are asked for, not read. Returns the
        pages asked for."""
        self._batches += 1
        if self._batches > self.forget_after:
            for asked in self._asked:
                asked[:] = False
            self._batches = 1
        return self.ask(self.pages(values, lengths, skip_asked=True))

    def ask(self, pages: np.ndarray) -> int:
        """``MADV_WILLNEED`` on ``pages`` (sorted distinct page numbers: address // 4096), one call per run of
        consecutive pages, the runs spread over the pool; returns the pages asked for."""
        if pages.size == 0:
            return 0
        breaks = np.flatnonzero(np.diff(pages) != 1) + 1
        starts = np.concatenate(([0], breaks))
        ends = np.concatenate((breaks, [pages.size]))
        runs = list(zip((pages[starts] * PAGE_BYTES).tolist(), ((ends - starts) * PAGE_BYTES).tolist()))
        tasks = min(self.threads, max(1, len(runs) // MIN_RUNS_PER_TASK))
        if tasks == 1:
            _advise_runs(runs)
        else:
            with self._pool_lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="embserve-prefetch")
            step = -(-len(runs) // tasks)
            for future in [self._pool.submit(_advise_runs, runs[i : i + step]) for i in range(0, len(runs), step)]:
                future.result()
        self.pages_requested += int(pages.size)
        return int(pages.size)

    def ask_rows(self, region: RowRegion, rows: np.ndarray) -> int:
        """Ask for the pages of rows ``rows`` (inside ``region``), e.g. before copying them out."""
        first = region.address + (rows - region.lo) * region.row_bytes
        return self.ask(np.unique(np.concatenate((first // PAGE_BYTES, (first + region.row_bytes - 1) // PAGE_BYTES))))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _pages_of(region: RowRegion) -> tuple[int, int]:
    """The region's first page and the page after its last byte."""
    end = region.address + (region.hi - region.lo) * region.row_bytes
    return region.address // PAGE_BYTES, -(-end // PAGE_BYTES)


def _advise_runs(runs: list[tuple[int, int]]) -> None:
    madvise = _c().madvise
    for address, length in runs:
        madvise(address, length, MADV_WILLNEED)  # an error only costs the read ahead; the fault reads the page
