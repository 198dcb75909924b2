"""Sharded == unsharded: bit-identical for table-, column-wise and replicated shards, 1e-6 for row-wise."""

from __future__ import annotations

import dataclasses
import functools
import subprocess
import sys
import textwrap

import pytest
import torch

from infer.artifact.export import export
from infer.artifact.kernels import model_tbes
from infer.artifact.load import load
from infer.config import DataType, ModelSpec, PoolingType, TableConfig
from infer.errors import ConfigError, PlanError, PlanErrorKind, RequestError
from infer.features import SparseFeatures
from infer.planner.planner import plan_for_inference
from infer.planner.types import ComputeDevice, ShardingType, Topology
from infer.quant.quantize import quantize
from infer.quant.rowwise import table_bytes
from infer.shard.builder import shard_model
from infer.shard.plans import make_plan
from infer.weights import random_weights
from tests.conftest import random_batch

TW, RW, CW, REP = ShardingType.TABLE_WISE, ShardingType.ROW_WISE, ShardingType.COLUMN_WISE, ShardingType.REPLICATED


def sharding_spec(pooling: PoolingType) -> ModelSpec:
    """Four tables (one shared by two features), mixed dtypes, dims that split into 32-column slices."""
    return ModelSpec(
        (
            TableConfig("shared", 1009, 128, ("s1", "s2"), pooling, DataType.INT8),
            TableConfig("int4", 503, 64, ("i4",), pooling, DataType.INT4),
            TableConfig("fp16", 301, 96, ("h",), pooling, DataType.FP16),
            TableConfig("plain", 257, 64, ("p",), PoolingType.SUM, DataType.INT8),
        )
    )


def layout(kind: str, world: int) -> dict[str, tuple[ShardingType, tuple[int, ...]]]:
    every = tuple(range(world))
    split = tuple(range(min(world, 4)))  # 64- and 96-column tables split into at most 2-3 slices of 32
    if kind == "table_wise":
        return {name: (TW, (i % world,)) for i, name in enumerate(["shared", "int4", "fp16", "plain"])}
    if kind == "table_blocks":  # each device's features consecutive in the request: read as one slice
        return {"shared": (TW, (0,)), "int4": (TW, (0,)), "fp16": (TW, (1 % world,)), "plain": (TW, (1 % world,))}
    if kind == "row_wise":
        return {name: (RW, every) for name in ["shared", "int4", "fp16", "plain"]}
    if kind == "column_wise":
        return {"shared": (CW, split), "int4": (CW, split[:2]), "fp16": (CW, split[:3]), "plain": (TW, (world - 1,))}
    if kind == "replicated":
        return {name: (REP, every) for name in ["shared", "int4", "fp16", "plain"]}
    # mixed: one of each
    return {
        "shared": (RW, every),
        "int4": (CW, split[:2]),
        "fp16": (REP, every),
        "plain": (TW, (world // 2,)),
    }


def assert_parity(kind: str, got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.shape == expected.shape
    if kind in ("table_wise", "table_blocks", "column_wise", "replicated"):
        assert torch.equal(got, expected)
    else:
        scale = max(float(expected.abs().max()), 1.0)
        assert float((got - expected).abs().max()) <= 1e-6 * scale


@functools.cache
def quantized_model(pooling: PoolingType) -> tuple[ModelSpec, torch.nn.Module]:
    spec = sharding_spec(pooling)
    return spec, quantize(spec, random_weights(spec, seed=4))


@pytest.fixture(scope="module", params=list(PoolingType), ids=lambda p: p.value)
def quantized(request):
    return quantized_model(request.param)


@pytest.mark.parametrize("kind", ["table_wise", "table_blocks", "row_wise", "column_wise", "replicated", "mixed"])
@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
def test_sharded_equals_unsharded(quantized, kind, world):
    spec, model = quantized
    sharded = torch.jit.script(shard_model(model, make_plan(spec, world, layout(kind, world))))
    for seed, weighted in ((0, False), (1, True)):
        batch = random_batch(spec, batch_size=13, max_len=7, weighted=weighted, seed=seed)
        with torch.no_grad():
            expected = model(batch.values, batch.lengths, batch.weights)
            got = sharded(batch.values, batch.lengths, batch.weights)
        assert_parity(kind, got, expected)
    # int32 ids take the same route
    batch = random_batch(spec, batch_size=5, seed=2, id_dtype=torch.int32)
    with torch.no_grad():
        assert_parity(kind, sharded(batch.values, batch.lengths, None), model(batch.values, batch.lengths, None))


def test_planner_made_cpu_plans_match(quantized):
    spec, model = quantized
    for world in (2, 4):
        plan = plan_for_inference(spec, Topology(world, ComputeDevice.CPU, device_memory=(64 * 1024**2,)))
        sharded = shard_model(model, plan)
        batch = random_batch(spec, 17, weighted=True, seed=5)
        with torch.no_grad():
            got = sharded(batch.values, batch.lengths, batch.weights)
            expected = model(batch.values, batch.lengths, batch.weights)
        assert float((got - expected).abs().max()) <= 1e-6 * max(float(expected.abs().max()), 1.0)


def test_allocated_bytes_match_the_planner_estimate(quantized):
    spec, model = quantized
    plan = plan_for_inference(spec, Topology(3, ComputeDevice.CPU, device_memory=(64 * 1024**2,)))
    sharded = shard_model(model, plan)
    per_device = [0] * 3
    for table_plan in plan.tables:
        for shard in table_plan.shards:
            # the estimate holds the rows plus the batch's input/output buffers, which the kernel does not keep
            per_device[shard.device] += shard.device_bytes - shard.input_bytes - shard.output_bytes
    # one TBE per device that holds shards, in rank order; CPU replicas share one buffer, whose bytes the
    # estimate spreads over the devices holding them: then the total is what must agree
    buffers = [s.tbe.weights_host for s in sharded.embeddings.shards]
    estimated = [b for b in per_device if b > 0]
    assert len(buffers) == len(estimated) >= 2
    if len({b.data_ptr() for b in buffers}) == len(buffers):
        for got, want in zip([b.numel() for b in buffers], estimated):
            assert abs(got - want) <= 0.01 * want, (got, want)
    total = sum({b.data_ptr(): b.numel() for b in buffers}.values())
    assert abs(total - sum(estimated)) <= 0.01 * sum(estimated), (total, sum(estimated))
    # and the estimate is the estimator's own formula, to the byte, for one table-wise table
    assert table_bytes(1009, 128, DataType.INT8, 1) == (1009 * 132 + 127) // 128 * 128


def test_bad_requests_are_rejected_and_leave_the_model_usable(quantized, tmp_path):
    spec, model = quantized
    plan = make_plan(spec, 4, layout("mixed", 4))
    runtime = load(export(shard_model(model, plan), tmp_path / "a", plan=plan))
    good = random_batch(spec, 6, seed=3)
    expected = runtime.lookup(good)
    too_big = good.values.clone()
    too_big[0] = 1009
    negative = good.values.clone()
    negative[-1] = -1
    short = good.lengths.clone()
    short[0] += 1
    for bad in (
        SparseFeatures(good.keys, too_big, good.lengths),
        SparseFeatures(good.keys, negative, good.lengths),
        SparseFeatures(good.keys, good.values, short),
        SparseFeatures(good.keys, good.values, good.lengths[:-1]),
    ):
        with pytest.raises(RequestError):
            runtime.lookup(bad)
        # the error of a forked device arrives as RuntimeError, of the calling thread as torch.jit.Error
        with pytest.raises((torch.jit.Error, RuntimeError), match="embserve.RequestError"):
            runtime.module(bad.values, bad.lengths, None)
    assert torch.equal(runtime.lookup(good), expected)


def test_a_device_reading_one_slice_checks_each_features_own_range(quantized):
    spec, model = quantized
    # device 0 holds "shared" (1009 rows: features s1, s2) and "int4" (503 rows: feature i4), consecutive
    sharded = torch.jit.script(shard_model(model, make_plan(spec, 2, layout("table_blocks", 2))))
    good = random_batch(spec, 4, seed=8)
    starts = [0, *good.lengths.view(len(good.keys), -1).sum(1).cumsum(0).tolist()]
    keys = list(good.keys)
    assert all(starts[keys.index(f) + 1] > starts[keys.index(f)] for f in ("s1", "s2", "i4"))  # ids to corrupt
    assert [device.contiguous_input for device in sharded.embeddings.shards] == [True, True]
    with torch.no_grad():
        # 700 is past the smaller table but inside "shared": legal for s2, so the slow path must accept it
        legal = good.values.clone()
        legal[starts[keys.index("s2")]] = 700
        assert torch.equal(sharded(legal, good.lengths, None), model(legal, good.lengths, None))
        for feature, bad_id in (("i4", 503), ("i4", 700), ("s1", 1009), ("s2", -1)):
            bad = good.values.clone()
            bad[starts[keys.index(feature)]] = bad_id
            with pytest.raises((torch.jit.Error, RuntimeError), match=f"feature '{feature}': id {bad_id} is out"):
                sharded(bad, good.lengths, None)
        assert torch.equal(sharded(good.values, good.lengths, None), model(good.values, good.lengths, None))


def test_sharded_artifacts_round_trip_in_a_fresh_process(tmp_path):
    """Every pooling's sharded artifact, loaded and looked up in one fresh process (one child for all poolings:
    each child's torch import costs more than its lookups)."""
    cases = []
    for pooling in PoolingType:
        spec, model = quantized_model(pooling)
        plan = make_plan(spec, 4, layout("mixed", 4))
        sharded = shard_model(model, plan)
        path = export(sharded, tmp_path / f"sharded-{pooling.value}", plan=plan)
        runtime = load(path)
        assert runtime.manifest.plan_file == "plan.json" and runtime.manifest.world_size == 4
        batch = random_batch(spec, 9, weighted=True, seed=8)
        torch.save((batch.values, batch.lengths, batch.weights), tmp_path / f"in-{pooling.value}.pt")
        with torch.no_grad():
            expected = sharded(batch.values, batch.lengths, batch.weights)
        cases.append(
            (str(path), str(tmp_path / f"in-{pooling.value}.pt"), str(tmp_path / f"out-{pooling.value}.pt"), expected)
        )
    script = textwrap.dedent(
        f"""
        import torch
        from infer.artifact.load import load
        from infer.features import SparseFeatures
        for path, inputs, out in {[case[:3] for case in cases]!r}:
            runtime = load(path)
            values, lengths, weights = torch.load(inputs)
            torch.save(runtime.lookup(SparseFeatures(runtime.feature_names, values, lengths, weights)), out)
        """
    )
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    # the child's stderr in the failure message: a rare abort of this child (seen twice under load) needs it
    assert child.returncode == 0, f"exit code {child.returncode}: {child.stderr[-4000:]}"
    for path, _, out, expected in cases:
        assert torch.equal(torch.load(out), expected), path


def test_shard_model_takes_only_an_unsharded_model(quantized):
    """Sharding an already sharded model is a ConfigError (a usage mistake), not a bad plan."""
    spec, model = quantized
    plan = make_plan(spec, 2, {})
    with pytest.raises(ConfigError, match="infer.quantize"):
        shard_model(shard_model(model, plan), plan)


def test_plans_that_do_not_match_the_model_are_rejected(quantized):
    spec, model = quantized
    other = ModelSpec((TableConfig("x", 10, 32, ("f",)),))
    for plan in (
        make_plan(other, 2, {}),
        make_plan(spec.with_data_types(overrides={"plain": "fp16"}), 2, {}),
    ):
        with pytest.raises(PlanError) as info:
            shard_model(model, plan)
        assert info.value.kind == PlanErrorKind.INVALID_PLAN
    plan = make_plan(spec, 2, {"shared": (RW, (0, 1))})
    table = plan.tables[0]
    second = table.shards[1]
    gap = dataclasses.replace(second, row_offset=second.row_offset + 1, num_rows=second.num_rows - 1)
    bad_plan = dataclasses.replace(
        plan, tables=(dataclasses.replace(table, shards=(table.shards[0], gap)),) + plan.tables[1:]
    )
    with pytest.raises(PlanError, match="cover"):
        shard_model(model, bad_plan)


def test_a_cuda_plan_on_a_host_without_its_devices_is_a_plan_error(quantized):
    """shard_model of a CUDA plan on a host lacking its devices is the typed PlanError the CLI gives (naming the
    devices and the fix), not torch's AssertionError; a device map to this host's CPU builds it, equal to the
    unsharded model."""
    spec, model = quantized
    plan = make_plan(spec, 2, layout("table_wise", 2), compute_device=ComputeDevice.CUDA)
    if torch.cuda.device_count() >= 2:
        pytest.skip("this host has 2 CUDA devices")
    with pytest.raises(PlanError) as info:
        shard_model(model, plan)
    assert info.value.kind == PlanErrorKind.INVALID_TOPOLOGY
    assert "['cuda:0', 'cuda:1']" in str(info.value) and "--compute-device cpu" in str(info.value)
    sharded = shard_model(model, plan, device_map={"cuda:0": "cpu", "cuda:1": "cpu"})
    batch = random_batch(spec, 4)
    with torch.no_grad():
        assert torch.equal(sharded(batch.values, batch.lengths, None), model(batch.values, batch.lengths, None))


def test_artifact_for_missing_cuda_devices_needs_a_device_map(quantized, tmp_path):
    """A manifest naming CUDA devices this host lacks fails clearly; a device map opts in."""
    import hashlib
    import json

    spec, model = quantized
    path = export(model, tmp_path / "a")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["devices"] = ["cuda:7"]
    (path / "manifest.json").write_text(json.dumps(manifest))
    from infer.errors import ArtifactError

    if torch.cuda.device_count() > 7:
        pytest.skip("this host has a cuda:7")
    with pytest.raises(ArtifactError, match=r"cuda:7.*device map"):
        load(path)
    runtime = load(path, device_map={"cuda:7": "cpu"})
    batch = random_batch(spec, 4)
    assert torch.equal(runtime.lookup(batch), model(batch.values, batch.lengths, None))
    assert hashlib.sha256((path / "model.pt").read_bytes()).hexdigest() == manifest["files"]["model.pt"]["sha256"]


@pytest.mark.parametrize(
    "devices", [(0, 1), (0, 1, 2), (2, 0, 1)], ids=["even_blocks", "uneven_blocks", "out_of_device_order"]
)
def test_row_blocks_bucketized_once_or_per_device_give_the_same_output(quantized, devices):
    """Row blocks (a CUDA plan's; a one-host CPU plan reads views instead) in device order are bucketized for
    all devices by one fbgemm call in the collection (by block size when the blocks are even, by their
    boundaries otherwise); blocks out of device order fall back to each device bucketizing its own. Every
    route equals the unsharded model."""
    spec, model = quantized
    plan = make_plan(
        spec,
        len(devices),
        {name: (RW, devices) for name in ["shared", "int4", "fp16", "plain"]},
        compute_device=ComputeDevice.CUDA,
    )
    sharded = shard_model(model, plan, device_map={f"cuda:{d}": "cpu" for d in devices})
    # 1009, 503, 301 and 257 rows: halves differ by at most one row (even); thirds of 1009 are 337, 336, 336
    assert sharded.embeddings.bucketized == (devices != (2, 0, 1))
    assert sharded.embeddings.rw_even_blocks == (devices == (0, 1))
    scripted = torch.jit.script(sharded)
    for seed, weighted in ((6, False), (7, True)):
        batch = random_batch(spec, batch_size=9, max_len=9, weighted=weighted, seed=seed)
        with torch.no_grad():
            expected = model(batch.values, batch.lengths, batch.weights)
            for module in (sharded, scripted):
                assert_parity("row_wise", module(batch.values, batch.lengths, batch.weights), expected)
    empty = SparseFeatures(spec.feature_names, torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int32))
    with torch.no_grad():
        assert scripted(empty.values, empty.lengths, None).shape == (0, spec.output_dim)


def test_cpu_replicas_share_one_weight_buffer(quantized, tmp_path):
    """Replicated tables on CPU devices are stored once: every kernel points into one buffer holding each
    distinct shard once (here: the replicated tables once, not three times), in memory and in the artifact,
    and the output still equals the unsharded model's."""
    spec, model = quantized
    layout_3 = {"shared": (REP, (0, 1, 2)), "int4": (REP, (0, 1, 2)), "fp16": (TW, (1,)), "plain": (RW, (0, 2))}
    plan = make_plan(spec, 3, layout_3)
    sharded = shard_model(model, plan)
    buffers = [s.tbe.weights_host for s in sharded.embeddings.shards]
    assert len({b.data_ptr() for b in buffers}) == 1
    one_copy = sum(table_bytes(t.num_embeddings, t.embedding_dim, t.data_type, 1) for t in spec.tables)
    assert buffers[0].numel() == one_copy  # the row-wise blocks of 'plain' add up to the table, +alignment
    batch = random_batch(spec, batch_size=11, weighted=True, seed=8)
    with torch.no_grad():
        expected = model(batch.values, batch.lengths, batch.weights)
        assert_parity("row_wise", sharded(batch.values, batch.lengths, batch.weights), expected)
    path = export(sharded, tmp_path / "replicas", plan=plan)
    assert (path / "model.pt").stat().st_size < 1.5 * one_copy + 200_000
    runtime = load(path)
    loaded = [tbe.weights_host for tbe in model_tbes(runtime.module)]
    assert len({b.data_ptr() for b in loaded}) == 1
    assert_parity("row_wise", runtime.lookup(batch), expected)


@pytest.mark.parametrize("weights, storage", [("embedded", "shared_storage"), ("mapped", "weights")])
def test_an_edited_shared_storage_offset_is_refused(quantized, tmp_path, weights, storage):
    """The shared buffer's layout (embedded: ``shared_storage``; mapped: the replicas' ``weights`` in one file) is
    derived from the plan at load, like the kernels: an edited offset in the manifest (checksums redone) is a
    MANIFEST error, before any kernel reads the buffer."""
    import json

    from infer.errors import ArtifactError, ArtifactErrorKind
    from tests.support.artifacts import rehash

    spec, model = quantized
    plan = make_plan(spec, 2, {"shared": (REP, (0, 1)), "int4": (TW, (1,))})
    path = export(shard_model(model, plan), tmp_path / "replicas", plan=plan, weights=weights)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["kernels"][1][storage]["table_offsets"][-1] += 128
    (path / "manifest.json").write_text(json.dumps(manifest))
    rehash(path, "model.pt")
    with pytest.raises(ArtifactError, match="disagrees with plan.json") as info:
        load(path)
    assert info.value.kind == ArtifactErrorKind.MANIFEST
