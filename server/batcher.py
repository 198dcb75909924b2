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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from infer.errors import ConfigError, EmbserveError
from infer.features import SparseFeatures

logger = logging.getLogger(__name__)

# Merging stops at this many examples. Batching amortises the per-call costs of small requests; past about a
# thousand examples a merged forward is no cheaper per example (slower: its output outgrows the caches) and
# every request in it waits for the whole (bench/server.py, Predict at batch 512 x 16 clients on 2 cores:
# merges up to 4096 gave p99/p50 3.6-4.1, capped at 512 or 1024 2.0-2.6 at the same or better throughput).
MAX_MERGE_EXAMPLES = 1024

# run(values, lengths, weights, dense or None) -> [batch, ...] tensor
Runner = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None], torch.Tensor]


class QueueFullError(EmbserveError):
    """The request queue is at its bound: the caller should back off (RESOURCE_EXHAUSTED)."""


@dataclass
class _Pending:
    features: SparseFeatures
    dense: torch.Tensor | None
    future: asyncio.Future[torch.Tensor]
    enqueued: float = field(default_factory=time.perf_counter)


def merge(items: list[_Pending]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Concatenate validated batches (same feature order) into one feature-major jagged batch."""
    num_features = len(items[0].features.keys)
    per_item = []
    for item in items:
        features = item.features
        batch = features.batch_size
        ends = [0] + torch.cumsum(features.lengths.to(torch.int64).view(num_features, batch).sum(1), 0).tolist()
        per_item.append((features, batch, ends))
    id_dtype = torch.int64 if any(i.features.values.dtype == torch.int64 for i in items) else torch.int32
    weighted = any(i.features.weights is not None for i in items)
    values, lengths, weights = [], [], []
    for f in range(num_features):
        for features, batch, ends in per_item:
            values.append(features.values[ends[f] : ends[f + 1]])
            lengths.append(features.lengths[f * batch : (f + 1) * batch])
            if weighted:
                w = features.weights
                weights.append(w[ends[f] : ends[f + 1]] if w is not None else torch.ones(ends[f + 1] - ends[f]))
    dense = torch.cat([i.dense for i in items]) if items[0].dense is not None else None  # type: ignore[misc]
    return (
        torch.cat(values).to(id_dtype),
        torch.cat(lengths).to(torch.int32),
        torch.cat(weights) if weighted else None,
        dense,
    )


class DynamicBatcher:
    """Merges concurrent requests of one kind (lookup or predict) into batched forwards."""

    def __init__(
        self,
        run: Runner,
        max_batch_size: int = 2048,
        max_delay_s: float = 0.001,
        max_queue: int = 1024,
        workers: int = 1,
        on_batch: Callable[[int, int], None] | None = None,
        max_merge_examples: int = MAX_MERGE_EXAMPLES,
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
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue(maxsize=max_queue)
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="embserve-forward")
        self._tasks: list[asyncio.Task[None]] = []
        self._carry: list[_Pending] = []  # a request that did not fit the last batch goes first next time

    @property
    def depth(self) -> int:
        return self._queue.qsize() + len(self._carry)

    def start(self) -> None:
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._consume()) for _ in range(self.workers)]

    async def submit(self, features: SparseFeatures, dense: torch.Tensor | None = None) -> torch.Tensor:
        """Queue one validated request and wait for its rows of the batched output."""
        future: asyncio.Future[torch.Tensor] = asyncio.get_running_loop().create_future()
        try:
            self._queue.put_nowait(_Pending(features, dense, future))
        except asyncio.QueueFull:
            raise QueueFullError(f"the request queue is full ({self._queue.maxsize} requests); retry later") from None
        return await future

    async def run_now(self, features: SparseFeatures, dense: torch.Tensor | None = None) -> torch.Tensor:
        """Run one request at once on a forward thread, bypassing the queue and the batching delay (warm-up)."""
        values, lengths, weights, merged_dense = merge([_Pending(features, dense, asyncio.Future())])
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.run, values, lengths, weights, merged_dense)

    async def _next(self) -> _Pending:
        if self._carry:
            return self._carry.pop()
        return await self._queue.get()

    async def _gather(self) -> list[_Pending]:
        first = await self._next()
        items = [first]
        size = first.features.batch_size
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.max_delay_s
        while size < self._merge_limit:
            try:
                item = self._queue.get_nowait()
            except asyncio.QueueEmpty:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    item = await asyncio.wait_for(self._queue.get(), remaining)
                except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
                    break
            if size + item.features.batch_size > self._merge_limit:
                self._carry.append(item)
                break
            items.append(item)
            size += item.features.batch_size
        return items

    async def _consume(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            items = [i for i in await self._gather() if not i.future.done()]
            if not items:
                continue
            try:
                values, lengths, weights, dense = merge(items)
                output = await loop.run_in_executor(self._executor, self.run, values, lengths, weights, dense)
            except Exception as err:  # noqa: BLE001 - every waiting request must hear about the failure
                for item in items:
                    if not item.future.done():
                        item.future.set_exception(err)
                continue
            if self.on_batch is not None:
                self.on_batch(len(items), int(lengths.numel() // len(items[0].features.keys)))
            start = 0
            for item in items:
                rows = item.features.batch_size
                if not item.future.done():
                    item.future.set_result(output[start : start + rows])
                start += rows

    async def close(self) -> None:
        """Stop consuming (after the server drained its in-flight calls) and release the threads."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        self._executor.shutdown(wait=True)
