"""server/batcher.py on its own: a drain's ``flush`` runs the batches waiting for company at once, and loses
none of their requests."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import torch

from server.batcher import DynamicBatcher
from server.validated import ValidatedBatch

NUM_FEATURES = 2
LONG_DELAY_S = 60.0  # far longer than any wait below: a test that waits it out fails on its timeout
ANSWER_TIMEOUT_S = 10.0


def _batch(seed: int, batch_size: int) -> ValidatedBatch:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (NUM_FEATURES * batch_size,), generator=generator, dtype=torch.int32)
    values = torch.randint(0, 100, (int(lengths.sum()),), generator=generator)
    return ValidatedBatch(values, lengths, None, None, batch_size, NUM_FEATURES)


def _sum_of_ids(values: torch.Tensor, lengths: torch.Tensor, weights: object, dense: object) -> torch.Tensor:
    """The runner: each example's ids summed over its features, [batch, 1] (the merged batch is feature-major)."""
    batch = lengths.numel() // NUM_FEATURES
    bag = torch.repeat_interleave(torch.arange(lengths.numel()), lengths.long()) % batch
    return torch.zeros(batch, 1, dtype=torch.int64).index_add_(0, bag, values.long().view(-1, 1))


def _expected(batch: ValidatedBatch) -> torch.Tensor:
    """Each example's ids summed, walked bag by bag (independent of the runner's index arithmetic)."""
    sums = [0] * batch.batch_size
    ids = batch.values.tolist()
    start = 0
    for position, length in enumerate(batch.lengths.tolist()):
        sums[position % batch.batch_size] += sum(ids[start : start + length])
        start += length
    return torch.tensor(sums, dtype=torch.int64).view(-1, 1)


def _run(scenario: Callable[[DynamicBatcher], Awaitable[None]], flushed_first: bool = False) -> None:
    """``scenario`` on a running batcher whose every request waits the whole delay for company (--batch-wait
    always); ``flushed_first``: flushed before it starts (the flag must hold once the consumers run)."""

    async def main() -> None:
        batcher = DynamicBatcher(_sum_of_ids, max_delay_s=LONG_DELAY_S, always_wait=True)  # type: ignore[arg-type]
        if flushed_first:
            batcher.flush()
        batcher.start()
        try:
            await scenario(batcher)
        finally:
            await batcher.close()

    asyncio.run(main())


def test_flush_runs_the_waiting_batch_at_once_and_loses_none_of_its_requests():
    async def scenario(batcher: DynamicBatcher) -> None:
        batches = [_batch(seed, 1 + seed % 3) for seed in range(5)]
        calls = [asyncio.ensure_future(batcher.submit(b)) for b in batches]
        while batcher.held < len(batches):  # every request handed to the batcher
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # the consumer took the first and waits out the delay for more
        assert not any(call.done() for call in calls)
        batcher.flush()
        answers = await asyncio.wait_for(asyncio.gather(*calls), ANSWER_TIMEOUT_S)
        for batch, answer in zip(batches, answers, strict=True):
            assert torch.equal(answer, _expected(batch))

    _run(scenario)


def test_after_a_flush_no_request_waits_for_company():
    async def scenario(batcher: DynamicBatcher) -> None:
        for seed in range(3):
            batch = _batch(seed, 2)
            answer = await asyncio.wait_for(batcher.submit(batch), ANSWER_TIMEOUT_S)
            assert torch.equal(answer, _expected(batch))

    _run(scenario, flushed_first=True)


def test_without_a_flush_the_batch_keeps_waiting_for_company():
    """The control: the same request does wait (so the flush tests above can fail)."""

    async def scenario(batcher: DynamicBatcher) -> None:
        call = asyncio.ensure_future(batcher.submit(_batch(0, 1)))
        await asyncio.sleep(0.3)
        assert not call.done()
        call.cancel()

    _run(scenario)


def test_a_lookup_batch_merges_requests_with_and_without_dense_features():
    """A lookup merges requests that carry dense features beside ones that do not (it needs none of them); the
    merge refused them with a TypeError, a 500 to valid requests that happened to overlap (bench/rest_fuzz.py)."""
    from server.batcher import merge

    plain = _batch(1, 2)
    dense = ValidatedBatch(plain.values, plain.lengths, None, torch.ones(2, 3), 2, NUM_FEATURES)
    values, lengths, weights, merged_dense = merge([dense, plain, dense])  # the first with, a later one without
    assert merged_dense is None and weights is None
    assert torch.equal(lengths, torch.cat([plain.lengths[:2], plain.lengths[:2], plain.lengths[:2],
                                           plain.lengths[2:], plain.lengths[2:], plain.lengths[2:]]))  # fmt: skip
    assert values.numel() == 3 * plain.values.numel()
    both = merge([dense, dense])[3]
    assert both is not None and torch.equal(both, torch.ones(4, 3))
