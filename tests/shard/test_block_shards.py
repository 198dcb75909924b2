"""Tables held in precision blocks, sharded (issue 43): a block table placed table-wise on one of two CPU devices is
held there with its blocks and id remap, and the sharded model (eager, and exported then loaded) answers as the
unsharded block model bit for bit and as fp32 ``embedding_bag`` over the table dequantized block by block — SUM,
MEAN, weighted, empty bags, every id hot, every id cold. Row-wise, column-wise and replicated plans of a block table
are refused naming it; a remap or block split edited in a shard's model file is a typed error."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from infer.artifact.export import export
from infer.artifact.load import load
from infer.config import ModelSpec, PoolingType, TableConfig
from infer.errors import ArtifactError, ArtifactErrorKind, PlanError, PlanErrorKind
from infer.planner.types import ShardingType
from infer.quant.blocks import rank_rows
from infer.quant.quantize import quantize
from infer.shard.builder import shard_model
from infer.shard.plans import make_plan
from infer.weights import random_weights
from tests.modules.test_blocks import any_ids, cold_ids, hot_ids, random_request, reference, reference_tables
from tests.support.artifacts import copy_artifact, edit_manifest, edit_remap, rehash

TW = ShardingType.TABLE_WISE
# the block table on device 1, the plain one on device 0: device 0's kernel has no blocks, device 1's splits by block
PLACED = {"plain": (TW, (0,)), "blocked": (TW, (1,))}


def shard_spec(pooling: PoolingType) -> ModelSpec:
    """One table in three precision blocks read by two features, one plain table."""
    return ModelSpec(
        (
            TableConfig("plain", 50, 8, ("query",), pooling=pooling, data_type="int4"),
            TableConfig(
                "blocked",
                200,
                16,
                ("user", "item"),
                pooling=pooling,
                blocks=((12, "int8"), (28, "fp16"), (160, "int4")),
            ),
        )
    )


def _quantized(pooling: PoolingType):  # type: ignore[no-untyped-def]
    spec = shard_spec(pooling)
    weights = random_weights(spec, seed=21)
    generator = torch.Generator().manual_seed(4)
    shuffle = torch.randperm(200, generator=generator)  # hot rows spread over the ids
    orders = {"blocked": rank_rows(200, shuffle[torch.randint(0, 30, (400,), generator=generator)].numpy(), "blocked")}
    return spec, quantize(spec, weights, block_orders=orders), reference_tables(spec, weights, orders), orders


@pytest.fixture(scope="module", params=[PoolingType.SUM, PoolingType.MEAN], ids=["sum", "mean"])
def sharded(request, tmp_path_factory):  # type: ignore[no-untyped-def]
    spec, model, tables, orders = _quantized(request.param)
    plan = make_plan(spec, 2, PLACED)
    eager = shard_model(model, plan)
    artifact = export(eager, tmp_path_factory.mktemp("block-shards") / "artifact", plan=plan)
    return SimpleNamespace(
        spec=spec, model=model, tables=tables, orders=orders, eager=eager, artifact=artifact, runtime=load(artifact)
    )


def test_the_block_table_is_held_on_its_device_alone(sharded):
    devices = list(sharded.eager.embeddings.shards)
    assert [d.block_table_names for d in devices] == [[], ["blocked"]]
    assert [d.has_blocks for d in devices] == [False, True]
    kernel = json.loads((sharded.artifact / "manifest.json").read_text())["kernels"][1]
    # a kernel table per block, every feature read once per level (cold block first)
    assert [(t["rows"], t["data_type"]) for t in kernel["tables"]] == [(12, "int8"), (28, "fp16"), (160, "int4")]
    assert kernel["feature_table_map"] == [2, 2, 0, 0, 1, 1]
    assert torch.equal(devices[1].block_ranks("blocked"), sharded.model.embeddings.block_ranks("blocked"))


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("which", ["any", "all_hot", "all_cold"])
def test_sharded_blocks_equal_the_unsharded_model_and_fp32_embedding_bag(sharded, which, weighted):
    pick = {"any": any_ids, "all_hot": hot_ids(sharded.orders), "all_cold": cold_ids(sharded.orders)}[which]
    runtime = sharded.runtime
    spec = sharded.spec
    values, lengths, weights = random_request(spec, 23, pick, seed=len(which) + weighted, weighted=weighted)
    unsharded = sharded.model(values, lengths, weights)
    assert torch.equal(sharded.eager(values, lengths, weights), unsharded)
    served = runtime.module(values, lengths.to(torch.int32), weights)
    assert torch.equal(served, unsharded)
    want = reference(spec, sharded.tables, values, lengths, weights)
    torch.testing.assert_close(served, want, rtol=1e-5, atol=1e-5)


def test_batch_parallel_ranges_split_by_block_as_the_single_call(sharded):
    """Each CPU device may cut a batch into example ranges run in parallel (the loader's ``threads``); the block
    device splits each range by block itself, and the output is the single call's, bit for bit."""
    module = sharded.runtime.module
    values, lengths, weights = random_request(sharded.spec, 64, any_ids, seed=9, weighted=True)
    single = module(values, lengths, weights)
    devices = list(module.embeddings.shards.children())
    held = [(device.threads, device.min_ids_per_chunk) for device in devices]
    try:
        for device in devices:
            device.threads, device.min_ids_per_chunk = 4, 1
        assert torch.equal(module(values, lengths, weights), single)
    finally:
        for device, (threads, smallest) in zip(devices, held):
            device.threads, device.min_ids_per_chunk = threads, smallest
    assert torch.equal(single, sharded.model(values, lengths, weights))


def test_empty_bags_and_an_empty_request(sharded):
    runtime = sharded.runtime
    features = len(sharded.spec.features)
    lengths = torch.tensor([0, 0, 2, 0, 0, 1], dtype=torch.int64)  # batch 2: one bag of user, one of item
    values = torch.tensor([5, 199, 7], dtype=torch.int64)
    served = runtime.module(values, lengths, None)
    assert torch.equal(served, sharded.model(values, lengths, None))
    torch.testing.assert_close(served, reference(sharded.spec, sharded.tables, values, lengths, None))
    assert torch.count_nonzero(served[:, :8]) == 0  # query's bags are empty
    empty = runtime.module(torch.zeros(0, dtype=torch.int64), torch.zeros(features, dtype=torch.int64), None)
    assert empty.shape == (1, 40) and torch.count_nonzero(empty) == 0


def test_a_device_mixing_a_block_table_with_views_of_another_table():
    """The block table's device also reads its share of the batch from a row-wise plain table (one CPU host: views
    of the whole table), and the output is still the unsharded model's."""
    spec, model, _, _ = _quantized(PoolingType.MEAN)
    plan = make_plan(spec, 2, {"plain": (ShardingType.ROW_WISE, (0, 1)), "blocked": (TW, (0,))})
    eager = shard_model(model, plan)
    scripted = torch.jit.script(eager)
    for seed, weighted in ((1, False), (2, True)):
        values, lengths, weights = random_request(spec, 13, any_ids, seed, weighted)
        assert torch.equal(scripted(values, lengths, weights), model(values, lengths, weights))


@pytest.mark.parametrize(
    "kind, words",
    [
        (ShardingType.ROW_WISE, "row-wise/column-wise sharding of a table in precision blocks is not supported"),
        (ShardingType.TABLE_ROW_WISE, "row-wise/column-wise sharding of a table in precision blocks is not supported"),
        (ShardingType.COLUMN_WISE, "row-wise/column-wise sharding of a table in precision blocks is not supported"),
        (ShardingType.REPLICATED, "replicating a table in precision blocks is not supported"),
    ],
)
def test_row_column_wise_or_replicated_block_tables_are_refused(kind, words):
    spec, model, _, _ = _quantized(PoolingType.SUM)
    plan = make_plan(spec, 2, {"blocked": (kind, (0, 1))}, column_unit=8)
    with pytest.raises(PlanError) as caught:
        shard_model(model, plan)
    assert caught.value.kind == PlanErrorKind.INVALID_PLAN
    message = str(caught.value)
    assert message.startswith(f"table 'blocked': the plan shards it {kind.value}, but {words}")
    assert message.endswith("; shard it table-wise or store it in one type")


def test_a_plan_edited_to_shard_the_block_table_row_wise_is_refused_at_load(sharded, tmp_path):
    copy = copy_artifact(sharded.artifact, tmp_path)
    plan = json.loads((copy / "plan.json").read_text())
    entry = next(t for t in plan["tables"] if t["table"] == "blocked")
    entry["sharding_type"] = "row_wise"
    (copy / "plan.json").write_text(json.dumps(plan))
    rehash(copy, "plan.json")
    with pytest.raises(ArtifactError, match="row-wise/column-wise sharding of a table in precision blocks"):
        load(copy)


def shard_holder(artifact: Path, device: int) -> SimpleNamespace:
    """What ``edit_remap`` reads of a model: here one device's shards (their ``block_lookup``)."""
    module = torch.jit.load(str(artifact / "model.pt"))
    return SimpleNamespace(embeddings=getattr(module.embeddings.shards, str(device)))


def test_a_remap_edited_in_a_shard_is_caught(sharded, tmp_path):
    copy = copy_artifact(sharded.artifact, tmp_path)

    def flip(data: np.ndarray) -> None:
        data.view(np.uint8)[5] ^= 0x01

    edit_remap(copy, shard_holder(sharded.artifact, 1), 1, flip)
    with pytest.raises(ArtifactError) as caught:
        load(copy)
    assert caught.value.kind == ArtifactErrorKind.CHECKSUM
    rehash(copy, "model.pt")  # the file checksum rewritten: the remap's own checks still catch it
    with pytest.raises(ArtifactError, match="the id remap of table 'blocked' ") as caught:
        load(copy)
    assert caught.value.kind == ArtifactErrorKind.MODEL


def test_a_permuted_remap_in_a_shard_or_a_changed_manifest_sha256_is_refused(sharded, tmp_path):
    swapped = copy_artifact(sharded.artifact, tmp_path / "swapped")

    def swap(data: np.ndarray) -> None:  # still one to one onto the blocks' rows: only the sha256 tells
        data[[0, 1]] = data[[1, 0]]

    edit_remap(swapped, shard_holder(sharded.artifact, 1), 0, swap)
    rehash(swapped, "model.pt")
    listed = copy_artifact(sharded.artifact, tmp_path / "listed")
    edit_manifest(listed, lambda m: m["block_remaps"]["blocked"].update(sha256="0" * 64))
    for folder in (swapped, listed):
        with pytest.raises(
            ArtifactError, match="remap of table 'blocked' differs from the one manifest.json"
        ) as caught:
            load(folder)
        assert caught.value.kind == ArtifactErrorKind.MODEL


def test_a_tampered_block_split_in_a_shard_is_refused(sharded, tmp_path):
    copy = copy_artifact(sharded.artifact, tmp_path)
    module = torch.jit.load(str(copy / "model.pt"))
    device = getattr(module.embeddings.shards, "1")
    device.block_levels = device.block_levels + 1
    module.save(str(copy / "model.pt"))
    rehash(copy, "model.pt")
    with pytest.raises(
        ArtifactError, match=r"block split of kernel 1 \(embeddings.shards.1\)'s block_levels"
    ) as caught:
        load(copy)
    assert caught.value.kind == ArtifactErrorKind.MODEL


def test_prefetch_skips_the_block_kernel_and_hot_rows_are_refused(sharded):
    """Read-ahead serves the plain device's pages and leaves the block device's alone (its rows lie at remapped
    positions), with the same answers; a hot-row cache over block tables is refused naming them."""
    from infer.errors import ConfigError

    runtime = load(sharded.artifact, prefetch="on")
    values, lengths, weights = random_request(sharded.spec, 9, any_ids, seed=5, weighted=True)
    assert torch.equal(runtime.module(values, lengths, weights), sharded.model(values, lengths, weights))
    with pytest.raises(
        ConfigError, match=r"hot_rows does not serve a model with tables in precision blocks \(\['blocked'\]\)"
    ):
        load(sharded.artifact, hot_rows={"plain": [1, 2]})


def test_a_plan_over_two_hosts_serves_the_block_table_from_its_host(tmp_path):
    """Two hosts of one CPU device each: the plain table on host 0, the block table on host 1 (its part holds the
    blocks and the remap, checked at load); the hosts' partial outputs summed and finished are the unsharded model's,
    bit for bit. A remap edited in host 1's part (rehashed) is refused naming the table; host 0 never reads it."""
    import dataclasses

    from infer.artifact.hosts import export_hosts, load_host_part
    from infer.planner.types import ComputeDevice, Topology
    from infer.shard.hosts import finish_partial

    spec, model, _, _ = _quantized(PoolingType.MEAN)
    plan = make_plan(spec, 2, PLACED)
    plan = dataclasses.replace(plan, topology=Topology(2, ComputeDevice.CPU, local_world_size=1))
    artifact = export_hosts(model, tmp_path / "hosts", plan)
    parts = [load_host_part(artifact, host) for host in (0, 1)]
    for seed, weighted in ((1, False), (2, True)):
        values, lengths, weights = random_request(spec, 11, any_ids, seed, weighted)
        summed = parts[0].module(values, lengths, weights) + parts[1].module(values, lengths, weights)
        assert torch.equal(finish_partial(spec, summed, lengths), model(values, lengths, weights))
    copy = copy_artifact(artifact, tmp_path / "edited")
    part = torch.jit.load(str(copy / "hosts" / "1" / "model.pt"))
    holder = SimpleNamespace(embeddings=getattr(part.embeddings.shards, "0"))

    def swap(data: np.ndarray) -> None:
        data[[0, 1]] = data[[1, 0]]

    edit_remap(copy, holder, 1, swap, "hosts/1/model.pt")
    rehash(copy, "hosts/1/model.pt")
    assert load_host_part(copy, 0).host == 0
    with pytest.raises(ArtifactError, match="the id remap of table 'blocked' differs") as caught:
        load_host_part(copy, 1)
    assert caught.value.kind == ArtifactErrorKind.MODEL
