"""Memory tiers of CPU plans: tables beyond RAM are planned paged from mapped files, the hottest bytes resident."""

from __future__ import annotations

import json

import numpy as np
import pytest

from infer.artifact.schema import validate
from infer.config import ModelSpec, TableConfig
from infer.errors import PlanError, PlanErrorKind
from infer.planner import constants as C
from infer.planner.access import load_sample_ids, sample_from_ids
from infer.planner.planner import plan_for_inference
from infer.planner.stats import format_plan_choices, format_stats
from infer.planner.types import ComputeDevice, MemoryTier, ParameterConstraints, ShardingPlan, ShardingType, Topology

DIM = 128
INT8_ROW = DIM + 4  # [fp16 scale][fp16 bias][128 codes], row alignment 1 on CPU
TABLE_WISE = ParameterConstraints(sharding_types=(ShardingType.TABLE_WISE,))


def model(big_rows: tuple[int, ...], small: int = 4) -> ModelSpec:
    tables = [TableConfig(f"big{i}", rows, DIM, (f"fbig{i}",)) for i, rows in enumerate(big_rows)]
    tables += [TableConfig(f"small{i}", 100_000, DIM, (f"fsmall{i}",)) for i in range(small)]
    return ModelSpec(tuple(tables))


def tiers(plan: ShardingPlan) -> dict[str, set[MemoryTier]]:
    return {t.table: {s.tier for s in t.shards} for t in plan.tables}


def resident_budget(device_memory: int, world_size: int) -> int:
    """RAM the weights may use, by hand: 85 % of every device (15 % reserved), less nothing else here."""
    return world_size * int(device_memory * (1 - C.DEFAULT_RESERVED_PERCENT / 100))


def test_a_model_larger_than_ram_plans_with_the_big_cold_tables_paged():
    spec = model((16_000_000, 16_000_000))  # 2 x 2.11 GB of INT8 rows, their halves 1.06 GB: none fits
    memory = 400 * C.MB
    topology = Topology(2, ComputeDevice.CPU, (memory,))
    plan = plan_for_inference(spec, topology)
    assert tiers(plan) == {
        "big0": {MemoryTier.PAGED},
        "big1": {MemoryTier.PAGED},
        **{f"small{i}": {MemoryTier.RESIDENT} for i in range(4)},
    }
    resident = sum(s.weight_bytes for t in plan.tables for s in t.shards if s.tier == MemoryTier.RESIDENT)
    assert resident <= resident_budget(memory, 2)
    paged = plan.planner["memory_tiers"]["paged_bytes"]
    assert paged == 2 * 16_000_000 * INT8_ROW  # whole tables, 128-byte aligned already (16e6 * 132 % 128 == 0)
    text = format_stats(plan)
    assert "paged" in text and "memory tiers" in text and "uniform per row" in text


def test_without_a_mapped_tier_or_with_too_little_the_plan_fails_naming_what_is_needed():
    spec = model((16_000_000, 16_000_000))
    with pytest.raises(PlanError) as info:
        plan_for_inference(spec, Topology(2, ComputeDevice.CPU, (400 * C.MB,), mapped_capacity=0))
    assert info.value.kind == PlanErrorKind.INSUFFICIENT_MEMORY
    with pytest.raises(PlanError) as info:
        plan_for_inference(spec, Topology(2, ComputeDevice.CPU, (400 * C.MB,), mapped_capacity=2 * C.GB))
    assert info.value.kind == PlanErrorKind.INSUFFICIENT_MEMORY
    assert "mapped capacity 2.00 GiB" in str(info.value) and "--mapped-capacity" in str(info.value)


def test_everything_resident_when_it_fits_ram():
    spec = model((1_000_000,))
    plan = plan_for_inference(spec, Topology(2, ComputeDevice.CPU, (1 * C.GB,)))
    assert all(s.tier == MemoryTier.RESIDENT for t in plan.tables for s in t.shards)
    assert plan.planner["memory_tiers"]["paged_bytes"] == 0


def test_sample_ids_skewed_to_one_big_table_keep_it_resident():
    # big0 4.0M rows (528 MB), big1 4.2M rows (554 MB); RAM for weights 2 x 425 MB: one big table fits
    spec = model((4_000_000, 4_200_000))
    constraints = {"big0": TABLE_WISE, "big1": TABLE_WISE}
    topology = Topology(2, ComputeDevice.CPU, (500 * C.MB,))
    uniform = plan_for_inference(spec, topology, constraints)
    # uniform rows: the smaller big table has more reads per byte, so it is the one kept resident
    assert tiers(uniform)["big0"] == {MemoryTier.RESIDENT} and tiers(uniform)["big1"] == {MemoryTier.PAGED}
    rng = np.random.default_rng(0)
    sample = sample_from_ids(
        {
            "fbig0": rng.integers(0, 4_000_000, 10),
            "fbig1": rng.integers(0, 4_200_000, 10_000),
            **{f"fsmall{i}": rng.integers(0, 100_000, 100) for i in range(4)},
        },
        spec,
    )
    skewed = plan_for_inference(spec, topology, constraints, sample=sample)
    assert tiers(skewed)["big1"] == {MemoryTier.RESIDENT} and tiers(skewed)["big0"] == {MemoryTier.PAGED}
    assert all(tiers(skewed)[f"small{i}"] == {MemoryTier.RESIDENT} for i in range(4))
    assert skewed.planner["memory_tiers"]["access"] == "sample ids"


def test_tiered_plan_round_trips_json_and_passes_the_artifact_schema():
    spec = model((16_000_000,))
    rng = np.random.default_rng(1)
    sample = sample_from_ids({"fsmall0": rng.integers(0, 100_000, 50)}, spec)
    plan = plan_for_inference(
        spec, Topology(2, ComputeDevice.CPU, (400 * C.MB,), mapped_capacity=64 * C.GB), {}, 512, sample
    )
    text = plan.to_json()
    again = ShardingPlan.from_json(text)
    assert again == plan and again.to_json() == text
    assert again.topology.mapped_capacity == 64 * C.GB
    assert tiers(again) == tiers(plan) and MemoryTier.PAGED in tiers(again)["big0"]
    validate(json.loads(text), "plan", "plan.json")
    assert "big0" in format_plan_choices(again) and "paged" in format_plan_choices(again)
    # deterministic: the same inputs give the same plan
    again_planned = plan_for_inference(spec, again.topology, {}, 512, sample)
    assert again_planned == plan and again_planned.planner["memory_tiers"] == plan.planner["memory_tiers"]


def test_sample_ids_file_errors_name_the_feature(tmp_path):
    spec = model((1000,), small=1)
    path = tmp_path / "ids.json"
    path.write_text(json.dumps({"nope": [1]}))
    with pytest.raises(PlanError, match="unknown feature 'nope'") as info:
        load_sample_ids(path, spec)
    assert info.value.kind == PlanErrorKind.INVALID_CONSTRAINT
    path.write_text(json.dumps({"fbig0": [1, 1000]}))
    with pytest.raises(PlanError, match="'fbig0' has ids outside"):
        load_sample_ids(path, spec)
    npz = tmp_path / "ids.npz"
    np.savez(npz, fbig0=np.array([3, 3, 999]))
    assert load_sample_ids(npz, spec).reads(spec.table("big0"), 0, 4) == 2


def test_cli_export_plans_tiers_and_inspect_shows_them(tmp_path, capsys):
    import torch

    from infer.cli import main

    spec = ModelSpec((TableConfig("big", 40_000, 32, ("fbig",)), TableConfig("small", 100, 32, ("fsmall",))))
    (tmp_path / "spec.json").write_text(spec.to_json())
    generator = torch.Generator().manual_seed(0)
    torch.save({t.name: torch.randn(t.num_embeddings, 32, generator=generator) for t in spec.tables}, tmp_path / "w.pt")
    out = tmp_path / "art"
    args = ["export", "--spec", str(tmp_path / "spec.json"), "--weights", str(tmp_path / "w.pt"), "--out", str(out)]
    # 1 MB of RAM for one CPU device: the 1.44 MB INT8 table is paged, the small one resident
    assert main([*args, "--world-size", "1", "--device", "cpu", "--device-memory", "1MB"]) == 0
    printed = capsys.readouterr().out
    assert "memory tiers" in printed and "free disk of" in printed
    assert main(["inspect", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.split()[:2] == ["big", "paged"] for line in lines)
    assert any(line.split()[:2] == ["small", "resident"] for line in lines)


def _aligned(size: int) -> int:
    return -(-size // 128) * 128


@pytest.mark.parametrize("sharding", [ShardingType.COLUMN_WISE, ShardingType.ROW_WISE])
def test_view_shards_on_one_cpu_host_count_their_table_once(sharding):
    """On one CPU host a row- or column-wise table's shards are views of one stored copy: each of its n shards
    accounts for 1/n of the whole table's bytes (by hand), and the tier stats add up to one copy (a column
    slice does not repeat every row's scale and bias). Over two CPU hosts the shards are real slices and keep
    their own sizes."""
    rows, dim = 1_000_003, 64
    spec = ModelSpec((TableConfig("wide", rows, dim, ("fwide",)),))
    split = {"wide": ParameterConstraints(sharding_types=(sharding,))}
    whole = _aligned(rows * (dim + 4))  # INT8 rows of dim + 4 bytes, the table 128-byte aligned
    plan = plan_for_inference(spec, Topology(4, ComputeDevice.CPU, (C.GB,)), constraints=split)
    (table,) = plan.tables
    count = len(table.shards)
    assert table.sharding_type == sharding and count >= 2
    share = _aligned(-(-whole // count))
    assert [s.weight_bytes for s in table.shards] == [share] * count
    stats = plan.planner["memory_tiers"]
    assert stats["resident_bytes"] + stats["paged_bytes"] == count * share < whole + count * 128
    # two hosts of two CPU devices: no views, each shard stores its own slice
    hosts = plan_for_inference(spec, Topology(4, ComputeDevice.CPU, (C.GB,), local_world_size=2), constraints=split)
    shards = hosts.tables[0].shards
    if sharding == ShardingType.COLUMN_WISE:
        assert [s.weight_bytes for s in shards] == [_aligned(rows * (s.num_cols + 4)) for s in shards]
    else:
        assert [s.weight_bytes for s in shards] == [_aligned(s.num_rows * (dim + 4)) for s in shards]


def test_column_slices_of_one_cpu_host_are_tiered_together():
    """The column slices of a view table read the same pages: with room for half the table, every slice gets
    the same tier (one block), never some slices resident and others paged."""
    rows, dim = 4_000_000, 128
    spec = ModelSpec((TableConfig("wide", rows, dim, ("fwide",)),))
    split = {"wide": ParameterConstraints(sharding_types=(ShardingType.COLUMN_WISE,))}
    whole = rows * (dim + 4)  # 528 MB, 128-byte aligned already
    memory = int(whole * 0.6 / 4 / (1 - C.DEFAULT_RESERVED_PERCENT / 100))  # 60 % of the table over 4 devices
    plan = plan_for_inference(spec, Topology(4, ComputeDevice.CPU, (memory,)), constraints=split)
    assert len(plan.tables[0].shards) > 1
    assert {s.tier for s in plan.tables[0].shards} == {MemoryTier.PAGED}
    assert plan.planner["memory_tiers"]["paged_bytes"] == whole
