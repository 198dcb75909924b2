"""The counters of Triton's statistics extension, one set per model version: requests, forwards, time per stage.

The Open Inference Protocol's core records each request it answers on a version (``request_succeeded`` /
``request_failed``); the version's batchers record each batched forward (``execution``) and fill in a request's
``StageTimes``. Everything runs on the event loop, so the counters need no lock. ``as_json`` is the entry of
``GET /v2/models/<m>/stats`` (gRPC ``ModelStatistics`` parses the same dict).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any


@dataclass
class StageTimes:
    """Seconds one request spent in its batcher, filled in by the forward that served it."""

    queue: float = 0.0  # waiting for a forward
    merge: float = 0.0  # its batch's inputs merged
    forward: float = 0.0  # its batch's forward
    split: float = 0.0  # its batch's outputs split back


@dataclass
class Duration:
    """How many times, and how long in all (Triton's ``StatisticDuration``)."""

    count: int = 0
    ns: int = 0

    def add(self, seconds: float, count: int = 1) -> None:
        self.count += count
        self.ns += max(0, round(seconds * 1e9))

    def as_json(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


@dataclass
class _BatchStatistics:
    compute_input: Duration
    compute_infer: Duration
    compute_output: Duration


class VersionStatistics:
    """What one model version served since it was loaded (warm-up forwards not counted)."""

    def __init__(self) -> None:
        self.success = Duration()
        self.fail = Duration()
        self.queue = Duration()
        self.compute_input = Duration()
        self.compute_infer = Duration()
        self.compute_output = Duration()
        self.inference_count = 0  # examples of successful requests
        self.execution_count = 0  # batched forwards
        self.last_inference_ms = 0
        self._batches: dict[int, _BatchStatistics] = {}

    def request_succeeded(
        self, examples: int, total_s: float, decode_s: float, encode_s: float, stages: StageTimes
    ) -> None:
        """One answered request of ``examples`` examples: ``total_s`` from arrival to encoded answer."""
        self.success.add(total_s)
        self.queue.add(stages.queue)
        self.compute_input.add(decode_s + stages.merge)
        self.compute_infer.add(stages.forward)
        self.compute_output.add(stages.split + encode_s)
        self.inference_count += examples
        self.last_inference_ms = int(time.time() * 1000)

    def request_failed(self, total_s: float) -> None:
        """One request that named this version and got no outputs (refused, failed, or its caller went away)."""
        self.fail.add(total_s)

    def execution(self, examples: int, merge_s: float, forward_s: float, split_s: float) -> None:
        """One batched forward of ``examples`` examples (``DynamicBatcher.on_execution``)."""
        self.execution_count += 1
        batch = self._batches.get(examples)
        if batch is None:
            batch = self._batches[examples] = _BatchStatistics(Duration(), Duration(), Duration())
        batch.compute_input.add(merge_s)
        batch.compute_infer.add(forward_s)
        batch.compute_output.add(split_s)

    def as_json(self, name: str, version: str) -> dict[str, Any]:
        """Triton's ``ModelStatistics`` of this version, in its JSON shape."""
        return {
            "name": name,
            "version": version,
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": {
                "success": self.success.as_json(),
                "fail": self.fail.as_json(),
                "queue": self.queue.as_json(),
                "compute_input": self.compute_input.as_json(),
                "compute_infer": self.compute_infer.as_json(),
                "compute_output": self.compute_output.as_json(),
            },
            "batch_stats": [
                {
                    "batch_size": size,
                    "compute_input": batch.compute_input.as_json(),
                    "compute_infer": batch.compute_infer.as_json(),
                    "compute_output": batch.compute_output.as_json(),
                }
                for size, batch in sorted(self._batches.items())
            ],
        }
