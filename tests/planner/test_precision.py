"""The precision planner: exact choice (checked by brute force), greedy and uniform beside it, budgets, floors."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch

from infer.config import DataType, ModelSpec, TableConfig
from infer.errors import ConfigError, PlanError, PlanErrorKind
from infer.planner import constants as C
from infer.planner.planner import EmbeddingPlanner
from infer.planner.precision import (
    choose_exact,
    choose_greedy,
    choose_uniform,
    frontier,
    plan_precision,
    precision_problem,
)
from infer.planner.stats import format_plan_choices, format_stats, plot_frontier
from infer.planner.types import ComputeDevice, ParameterConstraints, ShardingPlan, Topology
from infer.quant.measured_error import TableError, measure_errors, rows_from_weights

TYPES = (DataType.FP32, DataType.FP16, DataType.INT8, DataType.INT4, DataType.INT2)


def hand_bytes(rows: int, dim: int, data_type: DataType) -> int:
    """The TBE's CPU layout by hand (DESIGN.md): value bytes, + 4 bytes fp16 scale/bias for INT types, row
    alignment 1, each table rounded up to 128 bytes."""
    row = dim * data_type.bits // 8 + (4 if data_type in (DataType.INT8, DataType.INT4, DataType.INT2) else 0)
    return -(-rows * row // 128) * 128


def random_instance(rng: np.random.Generator, num_tables: int) -> tuple[ModelSpec, list[TableError]]:
    tables, measured = [], []
    for i in range(num_tables):
        rows = int(rng.integers(10, 200_000))
        dim = int(rng.choice([8, 16, 40, 64, 128]))
        tables.append(TableConfig(f"t{i}", rows, dim, (f"f{i}",)))
        # errors fall with precision, like measured ones, with a random scale per table
        scale = float(rng.uniform(0.2, 3.0))
        errs = [0.0, 2e-4 * scale, 5e-3 * scale, 9e-2 * scale, 0.45 * scale]
        measured.append(TableError(f"t{i}", tuple(zip(TYPES, errs)), 100, 10))
    return ModelSpec(tuple(tables)), measured


def brute_force(spec, measured, weights, budget, floors=None, error_budget=None):
    """Every assignment of the five types (floors filtered by hand): least weighted error within the budget,
    or with an error budget the fewest bytes within it."""
    floors = floors or {}
    errors = {m.table: dict(m.errors) for m in measured}
    choices = []
    for table in spec.tables:
        floor = floors.get(table.name)
        choices.append([d for d in TYPES if floor is None or d.bits >= floor.bits])
    best = None
    for combo in itertools.product(*choices):
        total = sum(hand_bytes(t.num_embeddings, t.embedding_dim, d) for t, d in zip(spec.tables, combo))
        error = sum(w * errors[t.name][d] for t, d, w in zip(spec.tables, combo, weights))
        if budget is not None and total > budget:
            continue
        if error_budget is not None:
            if error > error_budget:
                continue
            key = (total, error)
        else:
            key = (error, total)
        if best is None or key < best[0]:
            best = (key, combo)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_exact_choice_equals_brute_force_and_greedy_is_never_better(seed):
    rng = np.random.default_rng(seed)
    spec, measured = random_instance(rng, 5)
    pooling = [float(rng.integers(1, 50)) for _ in spec.tables]
    constraints = {t.name: ParameterConstraints(pooling_factors=(p,)) for t, p in zip(spec.tables, pooling)}
    floors = {}
    if seed % 3 == 0:  # floors on two tables
        floors = {"t0": DataType.INT8, "t3": DataType.FP16}
        constraints = {n: ParameterConstraints(pooling_factors=c.pooling_factors, min_data_type=floors.get(n))
                       for n, c in constraints.items()}  # fmt: skip
    weights = [p / sum(pooling) for p in pooling]
    low = brute_force(spec, measured, weights, None, floors, error_budget=math.inf)[0][0]
    high = sum(hand_bytes(t.num_embeddings, t.embedding_dim, DataType.FP32) for t in spec.tables)
    budget = int(rng.uniform(low, (low + high) / 2))
    problem = precision_problem(spec, measured, constraints)
    exact = choose_exact(problem, budget)
    (best_error, _), best_combo = brute_force(spec, measured, weights, budget, floors)
    assert exact.error == pytest.approx(best_error, rel=1e-9, abs=1e-12)
    assert exact.total_bytes <= budget
    assert exact.total_bytes == sum(
        hand_bytes(t.num_embeddings, t.embedding_dim, d) for t, d in zip(spec.tables, exact.data_types)
    )
    for table, data_type in zip(spec.tables, exact.data_types):
        assert table.name not in floors or data_type.bits >= floors[table.name].bits
    assert exact.gap is not None and exact.gap <= 1e-6
    greedy = choose_greedy(problem, budget)
    assert greedy.total_bytes <= budget and greedy.error >= exact.error - 1e-12
    # with an error budget: the fewest bytes within it
    target = float(rng.uniform(best_error, best_error * 3 + 1e-3))
    (fewest, _), _ = brute_force(spec, measured, weights, None, floors, error_budget=target)
    by_error = choose_exact(problem, None, target)
    assert by_error.total_bytes == fewest and by_error.error <= target + 1e-7


def test_budget_holds_exactly_against_the_kernels_allocation():
    from infer.modules.collection import QuantizedEmbeddingBagCollection

    rng = np.random.default_rng(7)
    spec, measured = random_instance(rng, 5)
    problem = precision_problem(spec, measured)
    low = sum(t.options[0].bytes for t in problem)
    for budget in (low, low + 12_345, 2 * low, 5 * low):
        exact = choose_exact(problem, budget)
        chosen = spec.with_data_types(overrides=dict(zip((t.name for t in spec.tables), exact.data_types)))
        allocated = QuantizedEmbeddingBagCollection(chosen).tbe.weights_host.numel()
        assert exact.total_bytes == allocated <= budget


def test_too_small_a_budget_names_what_the_smallest_choice_needs():
    spec = ModelSpec((TableConfig("big", 1_000_000, 128, ("f",)), TableConfig("small", 10, 8, ("g",))))
    measured = [TableError(t.name, tuple((d, 0.1) for d in TYPES), 1, 1) for t in spec.tables]
    constraints = {"big": ParameterConstraints(min_data_type="int4")}
    problem = precision_problem(spec, measured, constraints)
    need = hand_bytes(1_000_000, 128, DataType.INT4) + hand_bytes(10, 8, DataType.INT2)
    for choose in (lambda: choose_exact(problem, need - 1), lambda: choose_greedy(problem, need - 1)):
        with pytest.raises(PlanError) as info:
            choose()
        assert info.value.kind == PlanErrorKind.INSUFFICIENT_MEMORY
        assert f"needs {need / C.GB:.2f} GiB" in str(info.value) and "'big'" in str(info.value)
    assert choose_exact(problem, need).total_bytes == need


def test_uniform_choices_and_the_frontier():
    rng = np.random.default_rng(3)
    spec, measured = random_instance(rng, 4)
    problem = precision_problem(spec, measured)
    int4 = choose_uniform(problem, DataType.INT4)
    assert int4.data_types == (DataType.INT4,) * 4
    assert int4.total_bytes == sum(hand_bytes(t.num_embeddings, t.embedding_dim, DataType.INT4) for t in spec.tables)
    points = frontier(problem, 16)
    assert [p[0] for p in points] == sorted(p[0] for p in points)
    assert all(b[1] < a[1] for a, b in zip(points, points[1:]))  # more bytes buy less error
    # the exact choice at uniform INT4's bytes is no worse than uniform INT4
    assert choose_exact(problem, int4.total_bytes).error <= int4.error


def test_int2_is_never_offered_to_a_dim_it_cannot_store():
    """fbgemm stores INT2 rows only in an even number of bytes (dim a multiple of 8): a dim-12 table is measured and
    offered every other type, so even a budget that only INT2 everywhere would meet keeps it at INT4."""
    spec = ModelSpec((TableConfig("odd", 4_000, 12, ("fo",)), TableConfig("even", 4_000, 16, ("fe",))))
    measured = measure_errors(spec, rows_from_weights(make_weights(spec)), bags=32)
    assert [d for d, _ in measured[0].errors] == [DataType.FP32, DataType.FP16, DataType.INT8, DataType.INT4]
    assert DataType.INT2 in [d for d, _ in measured[1].errors]
    problem = precision_problem(spec, measured)
    assert DataType.INT2 not in [o.data_type for o in problem[0].options]
    smallest = hand_bytes(4_000, 12, DataType.INT4) + hand_bytes(4_000, 16, DataType.INT2)
    choice = choose_exact(problem, smallest)
    assert choice.data_types == (DataType.INT4, DataType.INT2)
    with pytest.raises(ConfigError, match="'odd'.*int2.*multiple of 8"):
        precision_problem(spec, measured, {"odd": ParameterConstraints(data_type="int2")})


def make_weights(spec: ModelSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {t.name: torch.randn(t.num_embeddings, t.embedding_dim, generator=generator) for t in spec.tables}


def test_precision_lands_in_the_plan_with_reasons_and_round_trips(tmp_path):
    spec = ModelSpec(
        (
            TableConfig("hot", 2_000, 64, ("fh",)),
            TableConfig("cold", 50_000, 64, ("fc",)),
            TableConfig("tiny", 100, 32, ("ft",)),
        )
    )
    weights = make_weights(spec)
    constraints = {
        "hot": ParameterConstraints(pooling_factors=(50.0,)),
        "cold": ParameterConstraints(pooling_factors=(1.0,)),
        "tiny": ParameterConstraints(pooling_factors=(5.0,), min_data_type="fp16"),
    }
    measured = measure_errors(spec, rows_from_weights(weights), bags=64)
    int8_bytes = sum(hand_bytes(t.num_embeddings, t.embedding_dim, DataType.INT8) for t in spec.tables)
    budget = int8_bytes // 2
    precision = plan_precision(spec, measured, budget, constraints=constraints, frontier_points=8)
    chosen = precision.data_types()
    assert chosen["tiny"].bits >= 16 and precision.chosen.total_bytes <= budget
    # the cold table is the one to squeeze: 1 read in 56, 25x the rows of the hot one
    assert chosen["cold"].bits < chosen["hot"].bits
    plan = EmbeddingPlanner(Topology(1, ComputeDevice.CPU, (C.GB,))).plan(spec, constraints, precision=precision)
    assert {t.table: t.data_type for t in plan.tables} == chosen
    again = ShardingPlan.from_json(plan.to_json())
    assert again == plan and again.planner["precision"] == json.loads(json.dumps(plan.planner["precision"]))
    reasons = {r["table"]: r for r in again.planner["precision"]["tables"]}
    cold = reasons["cold"]
    assert cold["bytes_saved"] == hand_bytes(50_000, 64, DataType.INT8) - hand_bytes(50_000, 64, chosen["cold"])
    text = format_stats(again)
    assert "chosen (exact MILP)" in text and "greedy" in text and "uniform int4" in text
    assert "cold" in format_plan_choices(again)
    png = plot_frontier(again.planner["precision"], tmp_path / "frontier.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_plan_and_export_choose_dtypes_under_a_budget_and_inspect_shows_why(tmp_path, capsys):
    from infer.cli import main

    spec = ModelSpec((TableConfig("hot", 3_000, 64, ("fh",)), TableConfig("cold", 60_000, 64, ("fc",))))
    (tmp_path / "spec.json").write_text(spec.to_json())
    torch.save(make_weights(spec), tmp_path / "w.pt")
    rng = np.random.default_rng(0)
    # the sample: the hot table is read 40x as often as the cold one
    np.savez(tmp_path / "ids.npz", fh=rng.integers(0, 3_000, 4000), fc=rng.integers(0, 60_000, 100))
    int8 = hand_bytes(3_000, 64, DataType.INT8) + hand_bytes(60_000, 64, DataType.INT8)
    budget = str(int8 // 2)
    flags = ["--memory-budget", budget, "--sample-ids", str(tmp_path / "ids.npz")]
    out = tmp_path / "plan.json"
    code = main(["plan", "--spec", str(tmp_path / "spec.json"), "--world-size", "1", "--compute-device", "cpu",
                 "--out", str(out), "--frontier", str(tmp_path / "f.png"), *flags])  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "synthetic N(0,1) rows" in printed and "frontier" in printed and (tmp_path / "f.png").exists()
    plan = ShardingPlan.from_json(out.read_text())
    chosen = {t.table: t.data_type for t in plan.tables}
    total = sum(hand_bytes(t.num_embeddings, t.embedding_dim, chosen[t.name]) for t in spec.tables)
    assert total <= int(budget) and chosen["cold"].bits < chosen["hot"].bits
    art = tmp_path / "art"
    args = ["export", "--spec", str(tmp_path / "spec.json"), "--weights", str(tmp_path / "w.pt"), "--out", str(art)]
    assert main([*args, *flags]) == 0
    capsys.readouterr()
    assert main(["inspect", str(art)]) == 0
    shown = capsys.readouterr().out
    assert "chosen (exact MILP)" in shown and "uniform int4" in shown
    rows = {line.split()[0]: line.split() for line in shown.splitlines() if line.strip().startswith(("hot ", "cold "))}
    assert rows["cold"][1] == [t.data_type.value for t in infer_load_tables(art) if t.name == "cold"][0]
    assert main([*args, "--force", "--memory-budget", "1KB"]) == 2
    assert "too small" in capsys.readouterr().err


def infer_load_tables(folder):
    from infer.artifact.manifest import Manifest

    return Manifest.read(folder).spec.tables


# ---------------------------------------------------------------------------- exhaustive check to 8 tables
def mixed_radix_digits(sizes: list[int], start: int, stop: int) -> np.ndarray:
    """Combinations ``start .. stop`` of one option per table, as a [combos, tables] array of option indices."""
    combos = np.arange(start, stop, dtype=np.int64)
    digits = np.empty((combos.size, len(sizes)), dtype=np.int64)
    for column, size in enumerate(sizes):
        digits[:, column] = combos % size
        combos //= size
    return digits


def brute_force_vectorized(byte_table, error_table, budget, error_budget=None, chunk=1 << 20):
    """Every combination of one option per table, in numpy: least error with total bytes <= ``budget``, or with
    ``error_budget`` the fewest bytes with error within it. ``byte_table[t]`` / ``error_table[t]``: table t's
    options' bytes and weighted errors."""
    sizes = [len(b) for b in byte_table]
    total = int(np.prod(sizes))
    best_key, best_digits = None, None
    for start in range(0, total, chunk):
        digits = mixed_radix_digits(sizes, start, min(total, start + chunk))
        nbytes = np.zeros(digits.shape[0], dtype=np.int64)
        error = np.zeros(digits.shape[0], dtype=np.float64)
        for column in range(len(sizes)):
            nbytes += np.asarray(byte_table[column], dtype=np.int64)[digits[:, column]]
            error += np.asarray(error_table[column], dtype=np.float64)[digits[:, column]]
        feasible = np.ones(digits.shape[0], dtype=bool) if budget is None else nbytes <= budget
        if error_budget is not None:
            feasible &= error <= error_budget
        if not feasible.any():
            continue
        index = np.flatnonzero(feasible)
        primary, secondary = (nbytes, error) if error_budget is not None else (error, nbytes)
        pick = index[np.lexsort((secondary[index], primary[index]))[0]]
        key = (primary[pick], secondary[pick])
        if best_key is None or key < best_key:
            best_key, best_digits = key, digits[pick]
    return best_key, best_digits


@pytest.mark.parametrize("seed", range(10))
def test_exact_choice_equals_exhaustive_search_up_to_eight_tables(seed):
    """Random instances of 6 to 8 tables x 5 types (5^8 = 390,625 combinations searched in numpy), random
    floors, pooling weights and budgets: the MILP's error equals the exhaustive optimum, in hand-computed bytes."""
    rng = np.random.default_rng(100 + seed)
    num_tables = 6 + seed % 3
    spec, measured = random_instance(rng, num_tables)
    pooling = rng.integers(1, 60, num_tables).astype(float)
    floors = {f"t{i}": DataType(str(rng.choice(["fp16", "int8", "int4"]))) for i in rng.choice(num_tables, seed % 3)}
    constraints = {
        t.name: ParameterConstraints(pooling_factors=(p,), min_data_type=floors.get(t.name))
        for t, p in zip(spec.tables, pooling)
    }
    weights = pooling / pooling.sum()
    errors = {m.table: dict(m.errors) for m in measured}
    allowed = [[d for d in TYPES if t.name not in floors or d.bits >= floors[t.name].bits] for t in spec.tables]
    byte_table = [[hand_bytes(t.num_embeddings, t.embedding_dim, d) for d in a] for t, a in zip(spec.tables, allowed)]
    error_table = [[w * errors[t.name][d] for d in a] for t, w, a in zip(spec.tables, weights, allowed)]
    low, high = sum(min(b) for b in byte_table), sum(max(b) for b in byte_table)
    problem = precision_problem(spec, measured, constraints)
    for budget in (low, int(rng.uniform(low, high)), int(rng.uniform(low, (low + high) / 4))):
        (best_error, _), digits = brute_force_vectorized(byte_table, error_table, budget)
        exact = choose_exact(problem, budget)
        assert exact.error == pytest.approx(best_error, rel=1e-9, abs=1e-12), (budget, digits)
        assert exact.total_bytes == sum(
            hand_bytes(t.num_embeddings, t.embedding_dim, d) for t, d in zip(spec.tables, exact.data_types)
        ) <= budget  # fmt: skip
        assert all(d in a for d, a in zip(exact.data_types, allowed))
        assert choose_greedy(problem, budget).error >= exact.error - 1e-12
    target = float(rng.uniform(best_error, 2 * best_error + 1e-3))
    (fewest, _), _ = brute_force_vectorized(byte_table, error_table, None, error_budget=target)
    assert choose_exact(problem, None, target).total_bytes == fewest


@pytest.mark.parametrize("seed", range(8))
def test_types_and_devices_chosen_jointly_equal_exhaustive_search(seed):
    """5-6 tables x 5 types x 2-3 devices (up to 15^5 = 759,375 combinations): each device's bytes (weights + the
    table's buffers) within its budget, the total within the memory budget; the MILP's error equals the optimum
    (within its reported gap) and its budgets hold in hand-computed bytes."""
    from infer.planner.precision import DeviceBudgets

    rng = np.random.default_rng(500 + seed)
    num_tables, num_devices = (6, 2) if seed % 2 else (5, 3)
    spec, measured = random_instance(rng, num_tables)
    pooling = rng.integers(1, 60, num_tables).astype(float)
    constraints = {t.name: ParameterConstraints(pooling_factors=(p,)) for t, p in zip(spec.tables, pooling)}
    weights = pooling / pooling.sum()
    errors = {m.table: dict(m.errors) for m in measured}
    overheads = {t.name: int(rng.integers(0, 5000)) for t in spec.tables}
    fp32 = [hand_bytes(t.num_embeddings, t.embedding_dim, DataType.FP32) for t in spec.tables]
    int2 = [hand_bytes(t.num_embeddings, t.embedding_dim, DataType.INT2) for t in spec.tables]
    # devices of uneven sizes, between what the smallest choice needs spread evenly and a third of fp32
    budgets = [int(rng.uniform(max(int2) + 5000, max(max(int2) + 5000, sum(fp32) / 3))) for _ in range(num_devices)]
    total = int(rng.uniform(sum(int2), sum(fp32) / 2)) if seed % 4 < 2 else None
    byte_table, error_table = [], []
    for t, w in zip(spec.tables, weights):
        byte_table.append([hand_bytes(t.num_embeddings, t.embedding_dim, d) for d in TYPES for _ in budgets])
        error_table.append([w * errors[t.name][d] for d in TYPES for _ in budgets])
    # per device the overhead counts too: fold it into the bytes checked per device, not into the total
    with_overhead = [[b + overheads[t.name] for b in row] for t, row in zip(spec.tables, byte_table)]
    best = brute_force_placed(with_overhead, byte_table, error_table, budgets, total)
    problem = precision_problem(spec, measured, constraints)
    limits = DeviceBudgets(tuple(budgets), tuple(overheads.items()))
    if best is None:
        with pytest.raises(PlanError) as info:
            choose_exact(problem, total, device_budgets=limits)
        assert info.value.kind == PlanErrorKind.INSUFFICIENT_MEMORY
        return
    exact = choose_exact(problem, total, device_budgets=limits)
    assert exact.gap is not None and exact.gap <= 1e-3
    assert best - 1e-12 <= exact.error <= best + exact.gap * exact.error + 1e-12
    used = [0] * num_devices
    for t, d, k in zip(spec.tables, exact.data_types, exact.devices):
        used[k] += hand_bytes(t.num_embeddings, t.embedding_dim, d) + overheads[t.name]
    assert list(exact.device_bytes) == used and all(u <= b for u, b in zip(used, budgets))
    assert total is None or exact.total_bytes <= total
    # with an error budget: the fewest bytes within it that the devices hold
    target = exact.error * 1.5 + 1e-4
    fewest = brute_force_placed(with_overhead, byte_table, error_table, budgets, total, error_budget=target)
    by_error = choose_exact(problem, total, target, device_budgets=limits)
    assert by_error.error <= target + 1e-9 and by_error.gap is not None
    assert fewest <= by_error.total_bytes <= fewest + by_error.gap * by_error.total_bytes


def brute_force_placed(device_bytes, total_bytes, error_table, device_budgets, total_budget, error_budget=None):
    """The least error over every (type, device) per table, each device's bytes and the total within budget (with
    ``error_budget``: the fewest total bytes with error within it)."""
    sizes = [len(b) for b in device_bytes]
    devices = len(device_budgets)
    combos = int(np.prod(sizes))
    best = None
    for start in range(0, combos, 1 << 18):
        digits = mixed_radix_digits(sizes, start, min(combos, start + (1 << 18)))
        per_device = np.zeros((digits.shape[0], devices), dtype=np.int64)
        nbytes = np.zeros(digits.shape[0], dtype=np.int64)
        error = np.zeros(digits.shape[0])
        rows = np.arange(digits.shape[0])
        for column in range(len(sizes)):
            pick = digits[:, column]
            np.add.at(per_device, (rows, pick % devices), np.asarray(device_bytes[column], dtype=np.int64)[pick])
            nbytes += np.asarray(total_bytes[column], dtype=np.int64)[pick]
            error += np.asarray(error_table[column])[pick]
        feasible = (per_device <= np.asarray(device_budgets)).all(axis=1)
        if total_budget is not None:
            feasible &= nbytes <= total_budget
        if error_budget is not None:
            feasible &= error <= error_budget
        if feasible.any():
            value = float(error[feasible].min()) if error_budget is None else int(nbytes[feasible].min())
            best = value if best is None else min(best, value)
    return best


def test_per_device_budgets_hold_exactly_in_the_tbes_built_per_device():
    """A 3-device CPU topology: the types and devices chosen jointly land in the plan; the sharded model's TBE on
    each device allocates exactly the bytes the choice counted there (less the batch buffers), within the budget;
    and its lookups equal fp32 embedding_bag on each table's dequantized rows."""
    from infer import quantize, shard_model
    from infer.quant.rowwise import dequantize_rows, quantize_rows
    from infer.shard.builder import device_layouts

    shapes = [(3000, 64), (800, 32), (5000, 16), (1200, 64), (400, 128), (2500, 32)]
    spec = ModelSpec(tuple(TableConfig(f"t{i}", rows, dim, (f"f{i}",)) for i, (rows, dim) in enumerate(shapes)))
    weights = make_weights(spec, seed=4)
    constraints = {t.name: ParameterConstraints(pooling_factors=(float(5 + 7 * i),)) for i, t in enumerate(spec.tables)}
    planner = EmbeddingPlanner(Topology(3, ComputeDevice.CPU, (400_000,), mapped_capacity=0), batch_size=64)
    limits = planner.device_budgets(spec, constraints)
    assert limits.budgets == (340_000,) * 3  # 15 % reserved, no dense part
    measured = measure_errors(spec, rows_from_weights(weights), bags=32)
    precision = plan_precision(spec, measured, None, constraints=constraints, device_budgets=limits, frontier_points=0)
    chosen, devices = precision.data_types(), precision.devices()
    assert devices is not None and precision.chosen.device_bytes is not None
    assert len(set(devices.values())) == 3 and len(set(chosen.values())) >= 2  # the budgets bind
    plan = planner.plan(spec, constraints, precision=precision)
    assert {t.table: (t.data_type, t.shards[0].device) for t in plan.tables} == {
        n: (chosen[n], devices[n]) for n in chosen
    }
    model = quantize(spec.with_data_types(overrides=chosen), weights)
    sharded = shard_model(model, plan)
    overheads = dict(limits.overheads)
    for layout, shard in zip(device_layouts(model.spec, plan), sharded.embeddings.shards):
        here = [t for t in spec.tables if devices[t.name] == layout.rank]
        weights_bytes = sum(hand_bytes(t.num_embeddings, t.embedding_dim, chosen[t.name]) for t in here)
        assert shard.tbe.weights_host.numel() == weights_bytes
        counted = precision.chosen.device_bytes[layout.rank]
        assert counted == weights_bytes + sum(overheads[t.name] for t in here) <= limits.budgets[layout.rank]
    generator = torch.Generator().manual_seed(1)
    lengths = {t.feature_names[0]: torch.randint(0, 6, (9,), generator=generator) for t in spec.tables}
    values = {f: torch.randint(0, t.num_embeddings, (int(lengths[f].sum()),), generator=generator)
              for t in spec.tables for f in t.feature_names}  # fmt: skip
    order = [t.feature_names[0] for t in spec.tables]
    with torch.no_grad():
        got = sharded(torch.cat([values[f] for f in order]), torch.cat([lengths[f] for f in order]))
    expected = []
    for t in spec.tables:
        data, scale_bias = quantize_rows(weights[t.name], chosen[t.name])
        table = dequantize_rows(data, scale_bias, chosen[t.name], t.embedding_dim)
        f = t.feature_names[0]
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths[f].cumsum(0)])
        expected.append(torch.nn.functional.embedding_bag(values[f], table, offsets[:-1], mode="sum"))
    torch.testing.assert_close(got, torch.cat(expected, 1), rtol=1e-5, atol=1e-4)


def test_cli_plan_on_several_devices_chooses_types_and_devices_within_each_device(tmp_path, capsys):
    from infer.cli import main

    shapes = [(3000, 64), (800, 32), (5000, 16), (1200, 64), (400, 128), (2500, 32)]
    spec = ModelSpec(tuple(TableConfig(f"t{i}", rows, dim, (f"f{i}",)) for i, (rows, dim) in enumerate(shapes)))
    (tmp_path / "spec.json").write_text(spec.to_json())
    out = tmp_path / "plan.json"
    code = main(["plan", "--spec", str(tmp_path / "spec.json"), "--world-size", "3", "--compute-device", "cpu",
                 "--device-memory", "400000", "--mapped-capacity", "0", "--batch-size", "64",
                 "--memory-budget", "1GB", "--out", str(out)])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    plan = ShardingPlan.from_json(out.read_text())
    chosen = plan.planner["precision"]["chosen"]
    placed = {t.table: t.shards[0].device for t in plan.tables}
    assert [placed[t.name] for t in spec.tables] == chosen["devices"]
    per_device = [0] * 3
    for table in spec.tables:
        data_type = next(t.data_type for t in plan.tables if t.table == table.name)
        per_device[placed[table.name]] += hand_bytes(table.num_embeddings, table.embedding_dim, data_type)
    budget = int(400_000 * 0.85)
    assert all(b <= budget for b in per_device) and max(per_device) > budget // 2
    assert all(u <= budget for u in chosen["device_bytes"])
    assert "devices chosen with the types" in capsys.readouterr().out


def test_the_planner_offers_every_type_on_the_cpu():
    from infer.commands.planning import device_data_types
    from infer.quant.measured_error import MEASURED_DATA_TYPES

    assert device_data_types(Topology(2, ComputeDevice.CPU, (C.GB, C.GB))) == MEASURED_DATA_TYPES


@pytest.mark.gpu
def test_the_planner_leaves_out_a_type_the_gpu_gets_wrong(capsys):
    from infer.commands.planning import device_data_types
    from infer.modules.cuda_probe import kernel_type_error

    offered = device_data_types(Topology(1, ComputeDevice.CUDA, (C.GB,)))
    printed = capsys.readouterr().out
    for data_type in DataType:
        assert (data_type in offered) == (kernel_type_error(data_type, "cuda:0") is None)
        assert (f"{data_type.value}: not offered" in printed) == (data_type not in offered)
