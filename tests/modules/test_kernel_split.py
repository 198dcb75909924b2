"""Batch-parallel kernels: a batch split into 1..4 example ranges over the same TBE gives the single call's
output bit for bit — unsharded and every sharding type, SUM and MEAN, weighted, empty bags, batch 1."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from infer.artifact.export import export
from infer.artifact.kernels import kernel_holders
from infer.artifact.load import load
from infer.config import PoolingType
from infer.features import SparseFeatures
from infer.quant.quantize import dequantized_weights, quantize
from infer.reference import FloatEmbeddingBagCollection
from infer.shard.builder import shard_model
from infer.shard.plans import make_plan
from infer.weights import random_weights
from tests.conftest import random_batch
from tests.shard.test_sharded import layout, sharding_spec

KINDS = ["unsharded", "table_wise", "row_wise", "column_wise", "replicated", "mixed"]


@pytest.fixture(scope="module", params=[PoolingType.SUM, PoolingType.MEAN], ids=["sum", "mean"])
def artifacts(request, tmp_path_factory) -> dict[str, tuple[Path, dict[str, torch.Tensor]]]:
    spec = sharding_spec(request.param)
    model = quantize(spec, random_weights(spec, seed=41))
    tables = dequantized_weights(spec, model)
    folder = tmp_path_factory.mktemp("split")
    out = {"unsharded": (export(model, folder / "unsharded"), tables)}
    for kind in KINDS[1:]:
        plan = make_plan(spec, 2, layout(kind, 2))
        out[kind] = (export(shard_model(model, plan), folder / kind, plan=plan), tables)
    return out


def _batches(spec) -> list[SparseFeatures]:  # type: ignore[no-untyped-def]
    return [
        random_batch(spec, batch_size=1, seed=1),
        random_batch(spec, batch_size=5, weighted=True, seed=2),
        random_batch(spec, batch_size=64, max_len=9, seed=3, id_dtype=torch.int32),
        random_batch(spec, batch_size=33, max_len=4, weighted=True, seed=4),
    ]


@pytest.mark.parametrize("kind", KINDS)
def test_every_split_equals_the_single_call(artifacts, kind):
    path, tables = artifacts[kind]
    runtime = load(path, threads=1)
    spec = runtime.spec
    reference = FloatEmbeddingBagCollection(spec, tables)
    for holder in kernel_holders(runtime.module):
        holder.min_ids_per_chunk = 1  # split even the small test batches
    for batch in _batches(spec):
        runtime.set_threads(1)
        single = runtime.lookup(batch)
        torch.testing.assert_close(single, reference(batch), rtol=1e-5, atol=1e-5)
        for threads in (2, 3, 4):
            runtime.set_threads(threads)
            assert torch.equal(runtime.lookup(batch), single), (kind, threads, batch.batch_size)


def test_small_requests_stay_on_one_thread(artifacts):
    """Below the minimum ids per range, the kernel is called once whatever the budget."""
    path, _ = artifacts["unsharded"]
    runtime = load(path, threads=4)
    holder = kernel_holders(runtime.module)[0]
    assert holder.chunks_for(1, 20) == 1
    assert holder.chunks_for(4096, 4 * holder.min_ids_per_chunk) == 4
    assert holder.chunks_for(3, 10**6) == 3  # never more ranges than examples


def test_the_budget_is_cores_over_cpu_kernels(artifacts):
    import os

    cores = os.cpu_count() or 1
    assert load(artifacts["unsharded"][0]).threads == cores
    assert load(artifacts["table_wise"][0]).threads == max(1, cores // 2)
    runtime = load(artifacts["unsharded"][0], threads=3)
    assert runtime.threads == 3 and all(h.threads == 3 for h in kernel_holders(runtime.module))
