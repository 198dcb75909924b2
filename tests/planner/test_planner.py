"""End-to-end planning: caps, constraints, determinism, JSON, fallbacks and errors."""

from __future__ import annotations

import json

import pytest

from infer.cli import main
from infer.config import DataType, ModelSpec, TableConfig
from infer.demo import demo_spec
from infer.errors import PlanError, PlanErrorKind
from infer.planner import constants as C
from infer.planner.planner import EmbeddingPlanner, plan_for_inference
from infer.planner.stats import format_stats, plot_plan
from infer.planner.storage_reservations import dense_part_bytes
from infer.planner.types import ComputeDevice, ParameterConstraints, Placement, ShardingPlan, ShardingType, Topology


def spec_of(num_tables: int, rows: int = 100_000, dim: int = 64) -> ModelSpec:
    return ModelSpec(
        tuple(TableConfig(f"t{i}", rows * (1 + i % 7), dim * (1 + i % 3), (f"f{i}",)) for i in range(num_tables))
    )


def check_plan_is_consistent(plan: ShardingPlan, spec: ModelSpec) -> None:
    assert [t.table for t in plan.tables] == [t.name for t in spec.tables]
    usable = plan.planner["usable_device_memory"]
    for d, storage in enumerate(plan.device_storage()):
        assert storage.device <= usable[d] <= plan.topology.device_memory[d]
    assert sum(s.host for s in plan.device_storage()) <= max(plan.topology.host_memory, 0)
    for table_plan in plan.tables:
        table = spec.table(table_plan.table)
        shards = table_plan.shards
        devices = [s.device for s in shards]
        assert all(0 <= d < plan.topology.world_size for d in devices)
        if table_plan.sharding_type in (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE):
            assert sum(s.num_rows for s in shards) == table.num_embeddings
            assert len(set(devices)) == len(devices)
        elif table_plan.sharding_type == ShardingType.COLUMN_WISE:
            assert sum(s.num_cols for s in shards) == table.embedding_dim
            assert len(set(devices)) == len(devices)
        elif table_plan.sharding_type == ShardingType.REPLICATED:
            assert devices == list(range(plan.topology.world_size))
        else:
            assert len(shards) == 1
    assert plan.bottleneck_cost == pytest.approx(max(plan.device_costs()))
    assert plan.lower_bound <= plan.bottleneck_cost * (1 + 1e-9)


@pytest.mark.parametrize("world_size", [1, 2, 8])
def test_plans_fit_and_are_consistent(world_size):
    spec = spec_of(20)
    plan = plan_for_inference(spec, Topology(world_size, device_memory=(2 * C.GB,)))
    check_plan_is_consistent(plan, spec)


def test_plan_is_deterministic_and_round_trips_json():
    spec = spec_of(30)
    topology = Topology(4, device_memory=(1 * C.GB,))
    first = plan_for_inference(spec, topology)
    second = plan_for_inference(spec, topology)
    assert first == second
    assert first.to_dict()["tables"] == second.to_dict()["tables"]
    restored = ShardingPlan.from_json(first.to_json())
    assert restored == first and restored.to_json() == first.to_json()


def test_bottleneck_is_close_to_the_lower_bound():
    spec = spec_of(100)
    plan = plan_for_inference(spec, Topology(8))
    assert plan.bottleneck_cost <= 1.05 * plan.lower_bound


def test_constraints_are_honoured_in_the_plan():
    spec = spec_of(6)
    constraints = {
        "t0": ParameterConstraints(sharding_types=(ShardingType.COLUMN_WISE,)),
        "t1": ParameterConstraints(sharding_types=(ShardingType.ROW_WISE,), min_shards=4, max_shards=4),
        "t2": ParameterConstraints(sharding_types=(ShardingType.TABLE_WISE,), placements=(Placement.HOST,)),
        "t3": ParameterConstraints(data_type=DataType.INT4),
    }
    plan = plan_for_inference(spec, Topology(4), constraints)
    assert plan.table("t0").sharding_type == ShardingType.COLUMN_WISE
    assert plan.table("t1").sharding_type == ShardingType.ROW_WISE and len(plan.table("t1").shards) == 4
    assert plan.table("t2").placement == Placement.HOST and plan.table("t2").shards[0].host_bytes > 0
    assert plan.table("t3").data_type == DataType.INT4
    check_plan_is_consistent(plan, spec)


def test_cuda_falls_back_to_host_memory_for_the_largest_tables():
    # 4 tables of 1.4 GB INT8 each on two 2 GB devices (1.7 GB usable): at most one table per device fits
    spec = ModelSpec(tuple(TableConfig(f"t{i}", 10_000_000, 128, (f"f{i}",)) for i in range(4)))
    topo = Topology(2, device_memory=(2 * C.GB,), host_memory=64 * C.GB)
    plan = plan_for_inference(spec, topo)
    placements = [t.placement for t in plan.tables]
    assert any(p != Placement.DEVICE for p in placements)
    check_plan_is_consistent(plan, spec)


def test_nothing_fits_raises_insufficient_memory_naming_devices():
    spec = ModelSpec((TableConfig("huge", 50_000_000, 256, ("f",)),))  # ~13 GB of INT8 rows
    with pytest.raises(PlanError) as info:
        # mapped_capacity=0: no mapped tier, every table in RAM (with one, it is planned paged: test_memory_tiers)
        plan_for_inference(spec, Topology(2, ComputeDevice.CPU, device_memory=(4 * C.GB,), mapped_capacity=0))
    assert info.value.kind == PlanErrorKind.INSUFFICIENT_MEMORY
    message = str(info.value)
    assert "device 0" in message and "device 1" in message and "'huge'" in message
    with pytest.raises(PlanError) as info:
        plan_for_inference(spec, Topology(2, device_memory=(1 * C.GB,), host_memory=2 * C.GB))
    assert info.value.kind == PlanErrorKind.INSUFFICIENT_MEMORY and "host memory" in str(info.value)


def test_training_estimates_exceed_inference_estimates():
    spec = spec_of(8)
    topology = Topology(2)
    inference = EmbeddingPlanner(topology, is_inference=True).plan(spec)
    training = EmbeddingPlanner(topology, is_inference=False).plan(spec)
    assert not training.is_inference and inference.is_inference
    assert training.lower_bound > inference.lower_bound
    assert sum(s.device for s in training.device_storage()) > sum(s.device for s in inference.device_storage())


def test_reservation_holds_back_a_percentage_and_the_dense_part():
    spec = demo_spec()
    plan = plan_for_inference(spec, Topology(2, device_memory=(10 * C.GB,)))
    dense = dense_part_bytes(spec)
    assert dense > 0
    assert plan.planner["usable_device_memory"] == [int(10 * C.GB * 0.85) - dense] * 2


def test_stats_and_plot(tmp_path):
    spec = spec_of(10)
    plan = plan_for_inference(spec, Topology(4))
    text = format_stats(plan)
    for d in range(4):
        assert f"cuda:{d}" in text
    for table in spec.tables:
        assert table.name in text
    assert "lower bound" in text
    path = plot_plan(plan, tmp_path / "plan.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_plan_on_the_demo_spec(tmp_path, capsys):
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    args = ["plan", "--spec", "demo", "--world-size", "8", "--device-memory", "80GB", "--compute-device", "cuda"]
    assert main([*args, "--out", str(out), "--plot", str(png)]) == 0
    printed = capsys.readouterr().out
    assert "cuda:7" in printed and "user_id" in printed and "lower bound" in printed
    plan = ShardingPlan.from_json(out.read_text())
    assert plan.topology.world_size == 8 and len(plan.tables) == 8
    assert png.read_bytes()[:4] == b"\x89PNG"
    constraints = tmp_path / "c.json"
    constraints.write_text(json.dumps({"user_id": {"sharding_types": ["row_wise"]}}))
    assert main([*args, "--out", str(out), "--constraints", str(constraints)]) == 0
    assert ShardingPlan.from_json(out.read_text()).table("user_id").sharding_type == ShardingType.ROW_WISE
    capsys.readouterr()
    constraints.write_text(json.dumps({"nosuch": {}}))
    assert main([*args, "--out", str(out), "--constraints", str(constraints)]) == 2
    assert "nosuch" in capsys.readouterr().err


# --- issue 24: the host's devices and memory, a CUDA plan on a CPU host, the plot's axis ----------------------


def _meminfo_total() -> int:
    """MemTotal from /proc/meminfo, read here (the reference the planner's default must match)."""
    for line in open("/proc/meminfo").read().splitlines():
        key, value = line.split(":", 1)
        if key == "MemTotal":
            return int(value.split()[0]) * 1024
    raise AssertionError("no MemTotal in /proc/meminfo")


def _small_spec_file(tmp_path) -> str:
    spec = ModelSpec((TableConfig("a", 100, 8, ("fa",)), TableConfig("b", 50, 8, ("fb",))))
    (tmp_path / "spec.json").write_text(spec.to_json())
    return str(tmp_path / "spec.json")


def test_cli_plan_takes_the_device_and_memory_from_this_host(tmp_path, capsys):
    import torch

    out = tmp_path / "plan.json"
    assert main(["plan", "--spec", _small_spec_file(tmp_path), "--world-size", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    plan = ShardingPlan.from_json(out.read_text())
    if torch.cuda.is_available():
        assert plan.topology.compute_device == ComputeDevice.CUDA
        assert plan.topology.device_memory[0] == torch.cuda.get_device_properties(0).total_memory
    else:
        assert plan.topology.compute_device == ComputeDevice.CPU and "cpu:1" in printed
        assert plan.topology.device_memory == (_meminfo_total() // 2,) * 2
        assert "this host has no CUDA device" in printed and "MemTotal in /proc/meminfo" in printed
    assert plan.planner["topology_source"] in printed  # the stats say where the numbers came from
    # told otherwise, the flags win and the stats say so
    args = ["plan", "--spec", _small_spec_file(tmp_path), "--world-size", "2", "--out", str(out)]
    assert main([*args, "--compute-device", "cpu", "--device-memory", "3GB"]) == 0
    plan = ShardingPlan.from_json(out.read_text())
    assert plan.topology.device_memory == (3 * 1024**3,) * 2
    assert "compute device cpu (given)" in capsys.readouterr().out


def test_a_cpu_topology_divides_this_hosts_ram_among_its_devices():
    topology = Topology(4, ComputeDevice.CPU)
    assert topology.device_memory == (_meminfo_total() // 4,) * 4
    plan = plan_for_inference(spec_of(3, rows=1000), topology)
    assert "/proc/meminfo" in plan.planner["topology_source"]
    assert "/proc/meminfo" in format_stats(plan)


def test_exporting_a_cuda_plan_on_a_host_without_cuda_is_a_typed_error(tmp_path, capsys):
    import torch

    from infer.weights import random_weights

    if torch.cuda.is_available():
        pytest.skip("this host has CUDA: the plan's devices exist")
    spec_file = _small_spec_file(tmp_path)
    torch.save(random_weights(ModelSpec.load(spec_file)), tmp_path / "w.pt")
    plan = tmp_path / "plan.json"
    args = ["plan", "--spec", spec_file, "--world-size", "2", "--compute-device", "cuda", "--device-memory", "1GB"]
    assert main([*args, "--out", str(plan)]) == 0
    capsys.readouterr()
    export = ["export", "--spec", spec_file, "--weights", str(tmp_path / "w.pt"), "--out", str(tmp_path / "art")]
    assert main([*export, "--plan", str(plan)]) == 2
    message = capsys.readouterr().err
    assert "plan.json" in message and "['cuda:0', 'cuda:1']" in message and "no CUDA device" in message
    assert "--compute-device cpu" in message and "--device-map" in message
    assert "Traceback" not in message and "AssertionError" not in message
    assert not (tmp_path / "art").exists()


@pytest.mark.parametrize("devices", [1, 3])
def test_the_plot_has_one_labelled_tick_per_device_and_limits_around_the_bars(tmp_path, devices):
    from infer.planner.stats import plan_figure

    plan = plan_for_inference(spec_of(2, rows=1000), Topology(devices, ComputeDevice.CPU, (C.GB,)))
    figure = plan_figure(plan)
    axes = figure.axes
    for ax in axes:
        assert list(ax.get_xticks()) == list(range(devices))
        low, high = ax.get_xlim()
        bars = [(patch.get_x(), patch.get_x() + patch.get_width()) for patch in ax.patches]
        assert bars and all(low < left and right < high for left, right in bars)
        assert high - low <= devices + 1  # about one unit per device, not a fractional axis around one bar
    labels = [label.get_text() for label in axes[-1].get_xticklabels()]
    assert labels == [f"cpu:{d}" for d in range(devices)]
    assert plot_plan(plan, tmp_path / "plan.png").read_bytes()[:4] == b"\x89PNG"


def _memory_bars(plan):
    """The memory axis of the plan's figure, its planned bars' heights and its capacity bars' heights."""
    from infer.planner.stats import plan_figure

    memory_ax = plan_figure(plan).axes[0]
    bars = {
        container.get_label().split(",")[0]: [p.get_height() for p in container] for container in memory_ax.containers
    }
    return memory_ax, bars["planned"], bars["capacity"]


def test_the_plot_scales_memory_to_what_is_used():
    """Issue 39 item 7: a small model's bars on a 1 GiB device were 0.03% of the axis (invisible); the axis now
    spans what is used, in a unit that fits it."""
    plan = plan_for_inference(spec_of(2, rows=1000), Topology(2, ComputeDevice.CPU, (C.GB,)))
    memory_ax, planned, _ = _memory_bars(plan)
    low, high = memory_ax.get_ylim()
    assert low == 0 and max(planned) / high >= 0.5
    used = [s.device for s in plan.device_storage()]
    unit = memory_ax.get_ylabel().split("(")[1].rstrip(")")
    scale = {"GiB": 1024**3, "MiB": 1024**2, "KiB": 1024, "B": 1}[unit]
    assert [h * scale for h in planned] == pytest.approx(used)  # heights are the planned bytes in that unit
    assert "above the axis" in " ".join(t.get_text() for t in memory_ax.get_legend().get_texts())
    # a device that is mostly used keeps its capacity on the axis
    capacity = 2 * max(used)
    plan = plan_for_inference(spec_of(2, rows=1000), Topology(2, ComputeDevice.CPU, (capacity,)))
    memory_ax, planned, capacities = _memory_bars(plan)
    assert memory_ax.get_ylim()[1] >= max(capacities) and max(planned) / memory_ax.get_ylim()[1] >= 0.25
