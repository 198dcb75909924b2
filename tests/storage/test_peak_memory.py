"""infer/storage/memory.py: this process's resident set, its peak and its anonymous part, from /proc."""

from __future__ import annotations

import sys

import pytest
import torch

from infer.storage.memory import PeakAnonymous, memory_use

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")


def test_an_allocation_that_is_touched_shows_in_the_anonymous_peak_and_the_resident_peak():
    peak = PeakAnonymous()
    before = memory_use()
    block = torch.ones(64 << 20, dtype=torch.uint8)  # every page written
    peak.sample()
    after = memory_use()
    del block
    assert peak.peak - peak.start >= 60 << 20
    assert after.peak_rss >= after.rss >= after.rss_anon > 0 and after.rss_anon - before.rss_anon >= 60 << 20
    peak.sample()
    assert peak.peak - peak.start >= 60 << 20  # a peak is kept after the memory is freed
