"""Dynamic batching: concurrent requests merged into one forward, results split back.

A bounded queue holds validated requests; ``workers`` consumer tasks each take the first request,
wait up to ``max_delay`` for more (never past ``max_merge_examples`` examples, nor ``max_batch_size``), merge
them into one jagged batch, run the model in a thread (the kernels release the GIL) and hand every request its
rows. A request whose caller went away (cancelled, deadline passed) is dropped before the merge.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from infer.errors import ConfigError, EmbserveError
from infer.features import SparseFeatures
from server.statistics import StageTimes
from server.validated import ValidatedBatch

logger = logging.getLogger(__name__)

# Merging stops at this many examples. Batching amortises the per-call costs of small requests; past about a
# thousand examples a merged forward is no cheaper per example (slower: its output outgrows the caches) and
# every request in it waits for the whole (bench/server.py, Predict at batch 512 x 16 clients on 2 cores:
# merges up to 4096 gave p99/p50 3.6-4.1, capped at 512 or 1024 2.0-2.6 at the same or better throughput).
MAX_MERGE_EXAMPLES = 1024

# A request waits for others (up to the batching delay) while callers overlapped within this many seconds (or
# two batching delays, if longer): one closed-loop caller never waits, a crowd keeps merging between bursts.
CONCURRENCY_MEMORY_S = 1.0

# run(values, lengths, weights, dense or None) -> [batch, ...] tensor
Runner = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None], torch.Tensor]


class QueueFullError(EmbserveError):
    """The request queue is at its bound: the caller should back off (RESOURCE_EXHAUSTED)."""


@dataclass
class _Pending:
    batch: ValidatedBatch
    future: asyncio.Future[torch.Tensor]
    enqueued: float = field(default_factory=time.perf_counter)
    timing: StageTimes | None = None  # filled in for a caller that asked (the statistics extension)


def merge(
    batches: Sequence[ValidatedBatch],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Concatenate validated batches (model feature order) into one feature-major jagged batch; one batch is
    passed through as it is (its tensors are already the kernel's)."""
    if len(batches) == 1:
        only = batches[0]
        return only.values, only.lengths, only.weights, only.dense
    num_features = batches[0].num_features
    per_batch = []
    for batch in batches:
        size = batch.batch_size
        ends = [0] + torch.cumsum(batch.lengths.view(num_features, size).sum(1), 0).tolist()
        per_batch.append((batch, size, ends))
    id_dtype = torch.int64 if any(b.values.dtype == torch.int64 for b in batches) else torch.int32
    weighted = any(b.weights is not None for b in batches)
    values, lengths, weights = [], [], []
    for f in range(num_features):
        for batch, size, ends in per_batch:
            values.append(batch.values[ends[f] : ends[f + 1]])
            lengths.append(batch.lengths[f * size : (f + 1) * size])
            if weighted:
                w = batch.weights
                weights.append(w[ends[f] : ends[f + 1]] if w is not None else torch.ones(ends[f + 1] - ends[f]))
    # a lookup batch may merge requests with dense features and requests without (it needs none of them)
    dense_parts = [b.dense for b in batches if b.dense is not None]
    dense = torch.cat(dense_parts) if len(dense_parts) == len(batches) else None
    return (
        torch.cat(values).to(id_dtype),
        torch.cat(lengths),
        torch.cat(weights) if weighted else None,
        dense,
    )


# stage -> seconds, for the per-stage histograms (server/metrics.py)
StageObserver = Callable[[str, float], None]


class DynamicBatcher:
    """Merges concurrent requests of one kind (lookup or predict) into batched forwards.

    The event loop only queues requests and hands out results: merging, the forward and splitting the output
    run together on a forward thread (the kernels release the GIL). Even a tiny forward leaves the loop: run
    in place it saved ~0.1 ms of CPU per batch-1 request, but a lookup on mapped weights can wait on page
    faults, and the loop must never wait. A request waits up to ``max_delay_s`` for others only while more
    may come: callers overlapped within ``CONCURRENCY_MEMORY_S``, or ``arriving()`` counts calls accepted and
    not yet queued. A lone caller is served at once instead of paying the delay.
    """

    def __init__(
        self,
        run: Runner,
        max_batch_size: int = 2048,
        max_delay_s: float = 0.001,
        max_queue: int = 1024,
        workers: int = 1,
        on_batch: Callable[[int, int], None] | None = None,
        max_merge_examples: int = MAX_MERGE_EXAMPLES,
        on_stage: StageObserver | None = None,
        arriving: Callable[[], int] | None = None,
        always_wait: bool = False,
    ) -> None:
        if max_batch_size < 1 or max_queue < 1 or workers < 1 or max_delay_s < 0 or max_merge_examples < 1:
            raise ConfigError(
                f"batcher settings max_batch_size={max_batch_size}, max_queue={max_queue}, workers={workers}, "
                f"max_merge_examples={max_merge_examples}, max_delay_s={max_delay_s}: the first four must be >= 1 "
                "and the delay >= 0"
            )
        self.run = run
        self.max_batch_size = max_batch_size
        self.max_merge_examples = max_merge_examples
        self._merge_limit = min(max_batch_size, max_merge_examples)  # a larger request still runs, alone
        self.max_delay_s = max_delay_s
        self.workers = workers
        self.on_batch = on_batch  # (requests, examples) of every batch, for metrics
        self.on_stage = on_stage
        # (examples, merge s, forward s, split s) of every batched forward: the model version's statistics
        # (server.statistics), set by whoever serves a model on this batcher
        self.on_execution: Callable[[int, float, float, float], None] | None = None
        # calls accepted but not yet queued (None: unknown, so always wait up to the delay)
        self.arriving = arriving
        self.always_wait = always_wait  # --batch-wait always: every request waits the delay for company
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue(maxsize=max_queue)
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="embserve-forward")
        self._tasks: list[asyncio.Task[None]] = []
        self._carry: list[_Pending] = []  # a request that did not fit the last batch goes first next time
        self.held = 0  # requests submitted and not yet answered
        self._concurrent_at = -CONCURRENCY_MEMORY_S  # when two requests last waited here together
        self.flushing = False  # set by ``flush``: no batch waits for company any more (the server is draining)
        self._flushed: asyncio.Future[None] | None = None  # resolved by ``flush``: wakes every waiting batch

    @property
    def depth(self) -> int:
        return self._queue.qsize() + len(self._carry)

    @property
    def merges(self) -> bool:
        """Whether concurrent requests can share a forward (the model configuration's dynamic batching)."""
        return self._merge_limit > 1

    def start(self) -> None:
        if not self._tasks:
            if self._flushed is None:
                self._flushed = asyncio.get_running_loop().create_future()
                if self.flushing:
                    self._flushed.set_result(None)
            self._tasks = [asyncio.create_task(self._consume()) for _ in range(self.workers)]

    def flush(self) -> None:
        """Stop waiting for company: a batch waiting out the delay runs now, and every later one at once. The
        server calls this when its drain begins: no new call will join a waiting batch, so waiting out a long
        ``--max-delay-us`` would only hold the shutdown back."""
        self.flushing = True
        if self._flushed is not None and not self._flushed.done():
            self._flushed.set_result(None)

    async def submit(
        self,
        batch: ValidatedBatch | SparseFeatures,
        dense: torch.Tensor | None = None,
        timing: StageTimes | None = None,
    ) -> torch.Tensor:
        """Queue one validated request and wait for its rows of the batched output (a ``SparseFeatures`` must
        have passed ``SparseFeatures.validate``; ``dense`` goes with it). ``timing``, if given, receives the
        request's seconds in the queue and its forward's stages."""
        if isinstance(batch, SparseFeatures):
            batch = ValidatedBatch.of_features(batch, dense)
        future: asyncio.Future[torch.Tensor] = asyncio.get_running_loop().create_future()
        try:
            self._queue.put_nowait(_Pending(batch, future, timing=timing))
        except asyncio.QueueFull:
            raise QueueFullError(f"the request queue is full ({self._queue.maxsize} requests); retry later") from None
        self.held += 1
        if self.held > 1:
            self._concurrent_at = time.monotonic()
        try:
            return await future
        finally:
            self.held -= 1

    async def run_now(self, batch: ValidatedBatch | SparseFeatures, dense: torch.Tensor | None = None) -> torch.Tensor:
        """Run one request at once on a forward thread, bypassing the queue and the batching delay (warm-up)."""
        if isinstance(batch, SparseFeatures):
            batch = ValidatedBatch.of_features(batch, dense)
        loop = asyncio.get_running_loop()
        outputs, _ = await loop.run_in_executor(self._executor, self._forward, [batch])
        return outputs[0]

    async def _next(self) -> _Pending:
        if self._carry:
            return self._carry.pop()
        return await self._queue.get()

    def _expecting_more(self) -> bool:
        """Worth waiting for: callers have overlapped lately, or calls are accepted and not yet queued."""
        if self.flushing:
            return False
        memory = max(CONCURRENCY_MEMORY_S, 2 * self.max_delay_s)
        if self.always_wait or self.arriving is None or time.monotonic() - self._concurrent_at < memory:
            return True
        return self.arriving() > 0

    async def _gather(self) -> list[_Pending]:
        first = await self._next()
        items = [first]
        size = first.batch.batch_size
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.max_delay_s
        while size < self._merge_limit:
            try:
                item = self._queue.get_nowait()
            except asyncio.QueueEmpty:
                remaining = deadline - loop.time()
                if remaining <= 0 or not self._expecting_more():
                    break
                waited = await self._wait_for_company(remaining)
                if waited is None:
                    break
                item = waited
            if size + item.batch.batch_size > self._merge_limit:
                self._carry.append(item)
                break
            items.append(item)
            size += item.batch.batch_size
        return items

    async def _wait_for_company(self, timeout_s: float) -> _Pending | None:
        """The next request within ``timeout_s``, or None once the time is up or ``flush`` was called. A
        request the queue handed over is never dropped: a getter cancelled before it ran left it queued."""
        getter = asyncio.ensure_future(self._queue.get())
        waits: set[asyncio.Future[Any]] = {getter}
        if self._flushed is not None:
            waits.add(self._flushed)
        try:
            await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            taken = getter.done()
            if not taken:
                getter.cancel()
        return getter.result() if taken else None

    def _forward(self, batches: list[ValidatedBatch]) -> tuple[list[torch.Tensor], tuple[float, float, float]]:
        """Merge, run and split on a forward thread: every request's rows, and the three stages' seconds."""
        started = time.perf_counter()
        values, lengths, weights, dense = merge(batches)
        merged = time.perf_counter()
        output = self.run(values, lengths, weights, dense)
        ran = time.perf_counter()
        rows = [b.batch_size for b in batches]
        outputs = list(output.split(rows)) if len(rows) > 1 else [output]
        return outputs, (merged - started, ran - merged, time.perf_counter() - ran)

    async def _consume(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            items = [i for i in await self._gather() if not i.future.done()]
            if not items:
                continue
            gathered = time.perf_counter()
            batches = [item.batch for item in items]
            try:
                outputs, stages = await loop.run_in_executor(self._executor, self._forward, batches)
            except Exception as err:  # noqa: BLE001 - every waiting request must hear about the failure
                for item in items:
                    if not item.future.done():
                        item.future.set_exception(err)
                continue
            examples = sum(b.batch_size for b in batches)
            if self.on_batch is not None:
                self.on_batch(len(items), examples)
            if self.on_execution is not None:
                self.on_execution(examples, *stages)
            for item in items:
                if item.timing is not None:
                    item.timing.queue = gathered - item.enqueued
                    item.timing.merge, item.timing.forward, item.timing.split = stages
            if self.on_stage is not None:
                for item in items:
                    self.on_stage("queue", gathered - item.enqueued)
                for stage, seconds in zip(("merge", "lookup", "split"), stages):
                    self.on_stage(stage, seconds)
            for item, rows in zip(items, outputs):
                if not item.future.done():
                    item.future.set_result(rows)

    async def close(self) -> None:
        """Stop consuming (after the server drained its in-flight calls) and release the threads."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        self._executor.shutdown(wait=True)
