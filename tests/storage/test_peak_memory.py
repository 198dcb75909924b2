"""infer/storage/memory.py: this process's resident set, its peak and its anonymous part, from /proc."""

from __future__ import annotations

import mmap
import sys

import numpy as np
import pytest

from infer.storage.memory import PeakAnonymous, memory_use

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")


def test_an_allocation_that_is_touched_shows_in_the_anonymous_peak_and_the_resident_peak():
    peak = PeakAnonymous()
    before = memory_use()
    # A fresh anonymous mapping, every page written: a tensor from malloc may land in free heap a test before
    # this one left resident, and then writing it grows nothing.
    block = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # private: shared counts as shmem
    pages = np.frombuffer(block, dtype=np.uint8)
    pages[:] = 1
    peak.sample()
    after = memory_use()
    del pages
    block.close()
    assert peak.peak - peak.start >= 60 << 20
    assert after.peak_rss >= after.rss >= after.rss_anon > 0 and after.rss_anon - before.rss_anon >= 60 << 20
    peak.sample()
    assert peak.peak - peak.start >= 60 << 20  # a peak is kept after the memory is freed
