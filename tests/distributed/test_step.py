"""The step loop's merge of queued batches (``server.group.step.MergedBatch``): the model's output on the merged
batch, answered back, gives each caller exactly the model's output on its own batch (weights and MEAN included)."""

from __future__ import annotations

from concurrent.futures import Future

import torch

from server.group.step import MergedBatch
from tests.conftest import random_batch


def test_merged_batches_answer_each_caller_its_own_rows(quantized):
    spec = quantized.spec
    for weighted in (False, True):
        sizes = (3, 1, 6)
        batches = [random_batch(spec, batch_size=n, max_len=5, weighted=weighted, seed=70 + n) for n in sizes]
        items = [((b.values, b.lengths, b.weights), Future()) for b in batches]
        merged = MergedBatch(items, len(spec.features))
        with torch.inference_mode():
            merged.answer(quantized(*merged.batch))
            for batch, (_, done) in zip(batches, items):
                want = quantized(batch.values, batch.lengths, batch.weights)
                assert torch.equal(done.result(), want)
