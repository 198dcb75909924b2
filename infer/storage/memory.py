"""This process's memory as the kernel counts it (``/proc/self/status``): the resident set, its peak, and the
anonymous part, which a streaming export keeps bounded (file-backed pages of a mapped checkpoint are the page
cache's, reclaimable; anonymous ones are the process's own)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

_FIELDS = {"VmRSS": "rss", "VmHWM": "peak_rss", "RssAnon": "rss_anon", "RssFile": "rss_file"}


@dataclass(frozen=True)
class MemoryUse:
    """Bytes: resident set, its peak over the process's life (VmHWM), and its anonymous and file-backed parts;
    zeros where ``/proc`` is not there."""

    rss: int = 0
    peak_rss: int = 0
    rss_anon: int = 0
    rss_file: int = 0


def memory_use(pid: int | str = "self") -> MemoryUse:
    """The memory of process ``pid`` (default this one) from ``/proc/<pid>/status``."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return MemoryUse()
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in _FIELDS:
            values[_FIELDS[key]] = int(rest.split()[0]) * 1024  # reported in kB
    return MemoryUse(**values)


class PeakAnonymous:
    """The largest anonymous resident set seen at the moments ``sample`` is called (the kernel keeps a peak of
    the whole resident set, VmHWM, but none of its anonymous part)."""

    def __init__(self) -> None:
        self.start = memory_use().rss_anon
        self.peak = self.start

    def sample(self) -> int:
        now = memory_use().rss_anon
        self.peak = max(self.peak, now)
        return now
