"""CUDA placement of sharded models: cuda:0..n-1, row alignment 16, parity (skipped without GPUs)."""

from __future__ import annotations

import pytest
import torch

from infer.artifact.export import export
from infer.artifact.load import load
from infer.config import PoolingType
from infer.planner.types import ComputeDevice, ShardingType
from infer.quant.quantize import quantize
from infer.shard.builder import shard_model
from infer.shard.plans import make_plan
from infer.weights import random_weights
from tests.conftest import CUDA_TOLERANCE, random_batch
from tests.shard.test_sharded import assert_parity, layout, sharding_spec


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["table_wise", "row_wise", "column_wise", "replicated", "mixed"])
def test_cuda_shards_on_every_device_match_cpu(kind):
    """Shards on every GPU answer as the unsharded CUDA model (the same kernel: TW/CW/replicated bit for bit, RW/mixed
    at 1e-6) and as the CPU model within CUDA_TOLERANCE."""
    world = _gpus()
    spec = sharding_spec(PoolingType.MEAN)
    weights = random_weights(spec, seed=4)
    model = quantize(spec, weights)
    plan = make_plan(spec, world, layout(kind, world), ComputeDevice.CUDA)
    sharded = torch.jit.script(shard_model(model, plan))
    devices = {str(s.tbe.weights_dev.device) for s in sharded.embeddings.shards}
    assert devices <= {f"cuda:{i}" for i in range(world)}
    assert all(s.tbe.row_alignment == 16 for s in sharded.embeddings.shards)
    batch = random_batch(spec, 32, weighted=True)
    on_cpu = model(batch.values, batch.lengths, batch.weights)
    unsharded_cuda = quantize(spec, weights, device="cuda:0")
    with torch.no_grad():
        on_cuda = unsharded_cuda(batch.values.cuda(), batch.lengths.cuda(), batch.weights.cuda()).cpu()
    got = sharded(batch.values, batch.lengths, batch.weights).cpu()
    assert_parity(kind, got, on_cuda)
    assert torch.allclose(got, on_cpu, rtol=CUDA_TOLERANCE, atol=CUDA_TOLERANCE)


@pytest.mark.gpu
def test_cuda_artifact_loads_on_cpu_with_a_device_map(tmp_path):
    spec = sharding_spec(PoolingType.SUM)
    model = quantize(spec, random_weights(spec, seed=4))
    plan = make_plan(spec, 1, {t.name: (ShardingType.TABLE_WISE, (0,)) for t in spec.tables}, ComputeDevice.CUDA)
    path = export(shard_model(model, plan), tmp_path / "a", plan=plan)
    runtime = load(path, device_map={"cuda:0": "cpu"})
    batch = random_batch(spec, 8)
    assert torch.allclose(runtime.lookup(batch), model(batch.values, batch.lengths, None), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("pooling", [PoolingType.SUM, PoolingType.MEAN], ids=["sum", "mean"])
def test_a_block_table_on_cuda_unsharded_and_table_wise_matches_the_dequantized_blocks(pooling):
    """A table in precision blocks on cuda:0 and, sharded table-wise, on the last GPU beside a plain table on cuda:0:
    both answer as fp32 ``embedding_bag`` over the table dequantized block by block (CUDA_TOLERANCE), every id hot,
    every id cold and any id, weighted, with empty bags."""
    from tests.modules.test_blocks import any_ids, cold_ids, hot_ids, random_request, reference
    from tests.shard.test_block_shards import _quantized

    world = _gpus()
    spec, model, tables, orders = _quantized(pooling)
    weights = random_weights(spec, seed=21)  # the weights _quantized quantized
    on_cuda = quantize(spec, weights, device="cuda:0", block_orders=orders)
    placed = {"plain": (ShardingType.TABLE_WISE, (0,)), "blocked": (ShardingType.TABLE_WISE, (world - 1,))}
    sharded = shard_model(model, make_plan(spec, world, placed, ComputeDevice.CUDA))
    devices = [str(s.tbe.weights_dev.device) for s in sharded.embeddings.shards if s.block_table_names]
    assert devices == [f"cuda:{world - 1}"]
    assert all(s.tbe.row_alignment == 16 for s in sharded.embeddings.shards)
    for seed, pick in enumerate((hot_ids(orders), cold_ids(orders), any_ids)):
        values, lengths, bag_weights = random_request(spec, 24, pick, seed=60 + seed, weighted=True)
        expected = reference(spec, tables, values, lengths, bag_weights)
        with torch.no_grad():
            unsharded = on_cuda(values.cuda(), lengths.cuda(), bag_weights.cuda()).cpu()
            got = sharded(values, lengths, bag_weights).cpu()
        assert torch.allclose(unsharded, expected, rtol=CUDA_TOLERANCE, atol=CUDA_TOLERANCE)
        assert torch.allclose(got, expected, rtol=CUDA_TOLERANCE, atol=CUDA_TOLERANCE)
