"""Planner speed and quality on synthetic table sets.

Prints one JSON line per (tables, devices) case: planning seconds, bottleneck cost / lower bound,
and per-device memory use. Tables: rows log-uniform in [1e3, 3e7], dims in {32, ..., 256}, INT8.

    python bench/planner.py
    python bench/planner.py --tables 500 --devices 16
    python bench/planner.py --precision          # issue 28: DLRM-v2 shapes, precision under a budget
    python bench/planner.py --blocks             # issue 43: the same with precision blocks per table
    python bench/planner.py --eval --blocks      # issue 43: the trained DLRM with blocks at 40 % of INT8
    python bench/planner.py --eval --blocks --eval-ids zipf   # the same on Zipf(1.05) ids, tables of 1k-1M rows

``--eval-ids zipf`` (issue 43's AUC case) trains a DLRM whose ids are Zipf(1.05) over a fixed permutation of each
table's rows (``zipf_ids``), eight tables of 1,000 to 1,000,000 rows at dim 64 (``--eval-dim``), four carrying the
signal (weight 1) and four a little (0.25), 6000 steps of 1024; the default ``--eval`` (uniform ids, dim 16) is issue
28's model, unchanged. The blocks are planned from the training ids (``--sample-examples N``: the first N examples';
repeatable, 0 all), never the test set, and served through the quantized model's real TBE.

``--precision`` prints one JSON line per case: DLRM-v2's 26 tables (dim 128, synthetic N(0,1) rows generated
per sampled id, never materialized; Zipf(1.05) ids over a random permutation of each table's rows, with
DLRM-v2's multi-hot sizes per example) at a 16 GB budget and at uniform INT4's bytes: the exact choice's
read-weighted error against greedy and uniform INT4/INT8, measuring and planning seconds; then the choice
alone for 500 tables x 5 types. ``ratio_lp_relaxation_to_uniform_int4`` is the same budget with fractional
tables: at uniform INT4's bytes the exact (gap 0) choice gives 0.5185x and the relaxation 0.476x, so the 0.5x
target is out of reach of whole-table types on these shapes: the six 40M-row tables move in 1.28 GB steps.
FP8 (fbgemm's CPU TBE has it: D bytes a row, no scale/bias, ~2.7 % pooled error for e4m3 on N(0,1)) changes
nothing: it saves 4 of INT8's 132 bytes a row for 4.5x INT8's error, far above the INT4-INT8 hull.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from infer.config import DataType, ModelSpec, TableConfig
from infer.planner import constants as C
from infer.planner.planner import EmbeddingPlanner
from infer.planner.types import Topology

DIMS = (32, 64, 96, 128, 192, 256)


def synthetic_spec(num_tables: int, seed: int = 0) -> ModelSpec:
    rng = random.Random(seed)
    tables = []
    for i in range(num_tables):
        rows = int(math.exp(rng.uniform(math.log(1e3), math.log(3e7))))
        tables.append(TableConfig(f"t{i:04d}", rows, rng.choice(DIMS), (f"f{i:04d}",)))
    return ModelSpec(tuple(tables))


def run_case(num_tables: int, devices: int, device_memory: int) -> dict[str, object]:
    spec = synthetic_spec(num_tables)
    topology = Topology(devices, device_memory=(device_memory,))
    started = time.perf_counter()
    plan = EmbeddingPlanner(topology).plan(spec)
    seconds = time.perf_counter() - started
    usable = plan.planner["usable_device_memory"]
    use = [s.device / cap for s, cap in zip(plan.device_storage(), usable)]
    costs = plan.device_costs()
    types: dict[str, int] = {}
    for table in plan.tables:
        types[table.sharding_type.value] = types.get(table.sharding_type.value, 0) + 1
    return {
        "bench": "planner",
        "tables": num_tables,
        "devices": devices,
        "device_memory_gb": device_memory / C.GB,
        "planning_seconds": round(seconds, 3),
        "bottleneck_us": round(plan.bottleneck_cost * 1e6, 3),
        "lower_bound_us": round(plan.lower_bound * 1e6, 3),
        "ratio_to_lower_bound": round(plan.bottleneck_cost / plan.lower_bound, 4),
        "min_device_cost_us": round(min(costs) * 1e6, 3),
        "memory_use_min": round(min(use), 3),
        "memory_use_max": round(max(use), 3),
        "total_table_gb": round(sum(s.device for s in plan.device_storage()) / C.GB, 2),
        "sharding_types": types,
        "proposer": plan.planner["proposer"],
        "proposals": plan.planner["proposals_evaluated"],
    }


DLRM_V2_ROWS = (
    40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209, 11938, 155, 4,
    976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36,
)  # fmt: skip
DLRM_V2_MULTI_HOT = (3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1)


def zipf_ids(rows: int, count: int, alpha: float, rng: np.random.Generator) -> np.ndarray:
    """Bounded Zipf(alpha) ranks by inverse CDF (continuous approximation), scattered over the rows by a fixed
    affine permutation (hot rows spread out, as hashed ids are)."""
    import numpy as np

    u = rng.random(count)
    ranks = np.floor(((rows ** (1 - alpha) - 1) * u + 1) ** (1 / (1 - alpha))).astype(np.int64) - 1
    ranks = np.clip(ranks, 0, rows - 1)
    return (ranks * zipf_step(rows) + rows // 3) % rows


def zipf_step(rows: int) -> int:
    """The stride of ``zipf_ids``'s permutation of ranks over rows."""
    step = 2_654_435_761 % rows or 1
    while math.gcd(step, rows) != 1:
        step += 1
    return step


def zipf_probability(rows: int, alpha: float, ids: np.ndarray) -> np.ndarray:
    """Each row id's probability under ``zipf_ids``'s traffic: its rank (the permutation undone), then the inverse
    CDF's mass of that rank, ``P(rank < k) = (1 - (k + 1)^(1 - alpha)) / (1 - rows^(1 - alpha))``."""
    inverse = pow(zipf_step(rows), -1, rows)
    rank = ((ids.astype(np.int64) - rows // 3) % rows * inverse) % rows
    scale = 1 - rows ** (1 - alpha)
    below = (1 - (rank + 1.0) ** (1 - alpha)) / scale
    return (1 - (rank + 2.0) ** (1 - alpha)) / scale - below


def true_block_shares(rows: int, alpha: float, sample_ids: np.ndarray, bounds: Sequence[int]) -> list[float]:
    """The share of ``zipf_ids``'s traffic (the generating distribution, not a sample) that the rows ranked
    ``[bounds[j], bounds[j + 1])`` by the whole sample take, as export ranks them (``rank_rows``: most sampled
    first, ties and unseen rows in id order): what the blocks chosen from the sample get in the traffic."""
    seen, counts = np.unique(sample_ids, return_counts=True)
    ranked = seen[np.lexsort((seen, -counts))]
    mass = np.concatenate([[0.0], np.cumsum(zipf_probability(rows, alpha, ranked))])

    def first(m: int) -> float:  # the traffic share of the first m rows of the ranking
        if m <= ranked.size:
            return float(mass[m])
        total, need, start = float(mass[-1]), m - ranked.size, 0
        while need > 0:  # unseen rows in id order, in chunks
            chunk = np.arange(start, min(start + (1 << 22), rows))
            chunk = chunk[~np.isin(chunk, seen, assume_unique=True)][:need]
            total += float(zipf_probability(rows, alpha, chunk).sum())
            need -= chunk.size
            start += 1 << 22
        return total

    prefix = [first(b) for b in bounds]
    return [b - a for a, b in zip(prefix[:-1], prefix[1:])]


def true_error(problem: Sequence[Any], spec: ModelSpec, measured: Sequence[Any], sample: Any, choice: Any,
               alpha: float) -> float:  # fmt: skip
    """``choice``'s read-weighted error on the generating traffic: each block table's blocks mixed by the traffic
    share they take (``true_block_shares``), the planner's weights and measured errors otherwise."""
    by_name = {m.table: m for m in measured}
    blocks = choice.blocks or tuple(() for _ in spec.tables)
    total = 0.0
    for table, choices, data_type, table_blocks in zip(spec.tables, problem, choice.data_types, blocks):
        error = by_name[table.name].error(data_type)
        if table_blocks:
            bounds = [sum(b.rows for b in table_blocks[:j]) for j in range(len(table_blocks) + 1)]
            shares = true_block_shares(table.num_embeddings, alpha, sample.table_ids(table), bounds)
            shares[-1] = max(0.0, 1.0 - sum(shares[:-1]))  # the coldest block: the rest of the traffic
            measured_table = by_name[table.name]
            error = math.sqrt(sum(h * measured_table.error(b.data_type) ** 2 for h, b in zip(shares, table_blocks)))
        total += choices.weight * error
    return total


def dlrm_v2_sample(examples: int) -> tuple[ModelSpec, Any]:
    """DLRM-v2's 26 tables (dim 128) and an ``AccessSample`` of ``examples`` examples' Zipf(1.05) ids (DLRM-v2's
    multi-hot sizes)."""
    from infer.planner.access import sample_from_ids

    tables = tuple(TableConfig(f"t{i:02d}", rows, 128, (f"f{i:02d}",)) for i, rows in enumerate(DLRM_V2_ROWS))
    spec = ModelSpec(tables)
    rng = np.random.default_rng(0)
    ids = {t.feature_names[0]: zipf_ids(t.num_embeddings, examples * hot, 1.05, rng)
           for t, hot in zip(tables, DLRM_V2_MULTI_HOT)}  # fmt: skip
    return spec, sample_from_ids(ids, spec, source=f"Zipf(1.05) ids of {examples} examples")


def precision_cases(examples: int = 1000, budget_gb: float = 16.0) -> list[dict[str, object]]:

    from infer.planner.precision import choose_exact, choose_greedy, choose_uniform, plan_precision
    from infer.quant.measured_error import measure_errors, synthetic_normal_rows

    spec, sample = dlrm_v2_sample(examples)
    started = time.perf_counter()
    measured = measure_errors(spec, synthetic_normal_rows(0), sample)
    measure_seconds = time.perf_counter() - started
    cases = []
    budget = int(budget_gb * C.GB)
    started = time.perf_counter()
    precision = plan_precision(spec, measured, budget, sample=sample, frontier_points=0)
    seconds = time.perf_counter() - started
    problem = precision.problem
    int4, int8 = choose_uniform(problem, DataType.INT4), choose_uniform(problem, DataType.INT8)
    for name, limit in (("16GB", budget), ("uniform_int4_bytes", int4.total_bytes)):
        exact = precision.chosen if limit == budget else choose_exact(problem, limit)
        greedy = precision.greedy if limit == budget else choose_greedy(problem, limit)
        cases.append({
            "bench": "precision_dlrm_v2",
            "budget": name,
            "budget_gb": round(limit / C.GB, 3),
            "chosen_gb": round(exact.total_bytes / C.GB, 3),
            "chosen_error": round(exact.error, 6),
            "greedy_error": round(greedy.error, 6),
            "uniform_int4_error": round(int4.error, 6),
            "uniform_int4_gb": round(int4.total_bytes / C.GB, 3),
            "uniform_int8_error": round(int8.error, 6),
            "uniform_int8_gb": round(int8.total_bytes / C.GB, 3),
            "ratio_chosen_to_uniform_int4": round(exact.error / int4.error, 4),
            # the same budget with fractional tables (LP relaxation): what per-table types cannot go below
            "ratio_lp_relaxation_to_uniform_int4": round(lp_relaxation_error(problem, limit) / int4.error, 4),
            "ratio_greedy_to_chosen": round(greedy.error / exact.error, 4) if exact.error else None,
            "gap": exact.gap,
            "dtypes": {d.value: sum(1 for x in exact.data_types if x == d) for d in set(exact.data_types)},
            "measure_seconds": round(measure_seconds, 2),
            "plan_seconds_with_greedy_and_uniform": round(seconds, 3) if limit == budget else None,
            "choice_seconds": round(exact.seconds, 4),
        })  # fmt: skip
    cases.append(choice_speed_case(measured))
    cases += [choice_placed_case(measured, slack=0.02), choice_placed_case(measured, with_total=False)]
    return cases


def block_cases(examples: int = 10**6, budget_gb: float = 16.0, three_blocks: bool = False) -> list[dict[str, object]]:
    """Issue 43: the planner choosing precision blocks (a hot block precise, the rest small) on DLRM-v2's shapes
    with Zipf(1.05) ids, at uniform INT4's bytes and at 16 GB: error against uniform INT4 and the whole-table
    optimum, and the planner's seconds (hot shares, options, MILP). The targets are judged on the generating
    traffic (``ratio_chosen_to_uniform_int4_on_traffic``): the planner's own figure is its cross-validated estimate,
    rows ranked on half the sample, and lies above what the served ranking (the whole sample's) gets. How many hot
    rows a sample can rank is what limits blocks here (measured on traffic at uniform INT4's bytes: 20k examples
    0.39x, 100k 0.36x, 400k 0.31x, 1M 0.29x; 0.2385x with the true Zipf shares). A packed 1.25-byte remap in place
    of the dense 4-byte one reaches 0.287x at 400k examples but costs lookups (branch blockcode, issue 43's note)."""

    from infer.planner.blocks import block_problem
    from infer.planner.precision import choose_exact, choose_uniform, precision_problem
    from infer.quant.measured_error import measure_errors, synthetic_normal_rows

    spec, sample = dlrm_v2_sample(examples)
    measured = measure_errors(spec, synthetic_normal_rows(0), sample)
    whole = precision_problem(spec, measured, sample=sample)
    int4 = choose_uniform(whole, DataType.INT4)
    cases = []
    for name, limit in (("uniform_int4_bytes", int4.total_bytes), ("16GB", int(budget_gb * C.GB))):
        started = time.perf_counter()
        problem = block_problem(spec, measured, sample, three_blocks=three_blocks)
        chosen = choose_exact(problem, limit)
        seconds = time.perf_counter() - started
        best_whole = choose_exact(whole, limit)
        blocks = {t.name: [[b.rows, b.data_type.value] for b in bs] for t, bs in zip(spec.tables, chosen.blocks) if bs}
        cases.append({
            "bench": "precision_blocks_dlrm_v2",
            "budget": name,
            "examples_sampled": examples,
            "ids_sampled": int(sum(sample.table_ids(t).size for t in spec.tables)),
            "three_blocks": three_blocks,
            "budget_gb": round(limit / C.GB, 3),
            "chosen_gb": round(chosen.total_bytes / C.GB, 3),
            "chosen_error": round(chosen.error, 6),
            "uniform_int4_error": round(int4.error, 6),
            "whole_table_error": round(best_whole.error, 6),
            "ratio_chosen_to_uniform_int4": round(chosen.error / int4.error, 4),
            # the same choice on the generating Zipf traffic, blocks filled by the whole sample's ranking (the
            # planner's own figure is cross-validated on halves of the sample)
            "ratio_chosen_to_uniform_int4_on_traffic": round(
                true_error(problem, spec, measured, sample, chosen, 1.05) / int4.error, 4
            ),
            # issue 43: <= 0.3x at uniform INT4's bytes, <= half of issue 28's 0.2552 at 16 GB
            "target": 0.3 if name == "uniform_int4_bytes" else round(0.5 * 0.2552, 4),
            "ratio_whole_table_to_uniform_int4": round(best_whole.error / int4.error, 4),
            # the bound of any choice of these options (fractional choices): below it only other options go
            "ratio_lp_relaxation_to_uniform_int4": round(lp_relaxation_error(problem, limit) / int4.error, 4),
            "planner_seconds": round(seconds, 3),
            "gap": chosen.gap,
            "block_tables": blocks,
            "host_load_1m": round(os.getloadavg()[0], 2),
        })  # fmt: skip
    return cases


def block_speed_case(num_tables: int = 500, examples: int = 2000, ids_per_example: int = 10) -> dict[str, object]:
    """Issue 43: the planner with blocks on many tables (``synthetic_spec``: 1e3 to 3e7 rows), Zipf(1.05) ids of
    ``examples`` examples per table, measured DLRM-v2-like error profiles: seconds for the hot shares, the options
    and the exact MILP at uniform INT4's bytes."""
    from infer.planner.access import sample_from_ids
    from infer.planner.blocks import block_problem
    from infer.planner.precision import choose_exact, choose_uniform
    from infer.quant.measured_error import TableError

    spec = synthetic_spec(num_tables)
    rng = np.random.default_rng(2)
    ids = {t.feature_names[0]: zipf_ids(t.num_embeddings, examples * ids_per_example, 1.05, rng) for t in spec.tables}
    sample = sample_from_ids(ids, spec, source="Zipf(1.05)")
    base = {DataType.FP32: 0.0, DataType.FP16: 2e-4, DataType.INT8: 5e-3, DataType.INT4: 9e-2, DataType.INT2: 0.45}
    errors = [TableError(t.name, tuple((d, e * float(rng.uniform(0.8, 1.2))) for d, e in base.items()), 0, 0)
              for t in spec.tables]  # fmt: skip
    started = time.perf_counter()
    problem = block_problem(spec, errors, sample)
    options_seconds = time.perf_counter() - started
    int4 = choose_uniform(problem, DataType.INT4)
    chosen = choose_exact(problem, int4.total_bytes, time_limit_s=120.0)
    seconds = time.perf_counter() - started
    return {
        "bench": "precision_blocks_speed",
        "tables": num_tables,
        "sampled_ids": examples * ids_per_example * num_tables,
        "options": sum(len(t.options) for t in problem),
        "options_seconds": round(options_seconds, 3),
        "planner_seconds": round(seconds, 3),
        "ratio_chosen_to_uniform_int4": round(chosen.error / int4.error, 4),
        "gap": chosen.gap,
        "host_load_1m": round(os.getloadavg()[0], 2),
    }


def lp_relaxation_error(problem: Sequence[object], budget: int) -> float:
    """The least weighted error with each table's choice fractional (a mix of types, as if its rows could be
    split between them): the bound that the integral choice approaches; the difference is what whole-table
    granularity costs."""
    import numpy as np
    from scipy.optimize import linprog

    from infer.planner.precision import TableChoices

    tables = [t for t in problem if isinstance(t, TableChoices)]
    sizes = [len(t.options) for t in tables]
    cost = np.array([t.weight * o.error for t in tables for o in t.options])
    nbytes = np.array([[o.bytes / budget for t in tables for o in t.options]])
    one_each = np.zeros((len(tables), sum(sizes)))
    for row, start in enumerate(np.cumsum([0, *sizes[:-1]])):
        one_each[row, start : start + sizes[row]] = 1.0
    outcome = linprog(cost, A_ub=nbytes, b_ub=[1.0], A_eq=one_each, b_eq=np.ones(len(tables)), bounds=(0, 1))
    return float(outcome.fun)


def choice_speed_case(measured: Sequence[object], num_tables: int = 500) -> dict[str, object]:
    """The exact choice alone for many tables: measured DLRM-v2 error profiles scaled per table."""
    import numpy as np

    from infer.planner.precision import choose_exact, precision_problem
    from infer.quant.measured_error import TableError

    rng = np.random.default_rng(1)
    spec = synthetic_spec(num_tables)
    profiles = [m for m in measured if isinstance(m, TableError)]
    errors = []
    for table in spec.tables:
        profile = profiles[int(rng.integers(len(profiles)))]
        scale = float(rng.uniform(0.5, 2.0))
        errors.append(TableError(table.name, tuple((d, e * scale) for d, e in profile.errors), 0, 0))
    problem = precision_problem(spec, errors)
    low = sum(t.options[0].bytes for t in problem)
    high = sum(t.options[-1].bytes for t in problem)
    choice = choose_exact(problem, int(low + 0.2 * (high - low)))
    return {
        "bench": "precision_choice_speed",
        "tables": num_tables,
        "data_types": 5,
        "choice_seconds": round(choice.seconds, 4),
        "gap": choice.gap,
    }


def choice_placed_case(
    measured: Sequence[object], num_tables: int = 500, devices: int = 16, slack: float = 0.02, with_total: bool = True
) -> dict[str, object]:
    """Types and devices in one MILP: 500 tables x 5 types x 16 devices, each device's budget 1/16 of the total
    plus ``slack``, the total at 20 % of the way from the smallest choice to fp32; against the total-only optimum."""
    import numpy as np

    from infer.planner.precision import DeviceBudgets, choose_exact, precision_problem
    from infer.quant.measured_error import TableError

    rng = np.random.default_rng(2)
    spec = synthetic_spec(num_tables, seed=1)
    profiles = [m for m in measured if isinstance(m, TableError)]
    errors = []
    for table in spec.tables:
        profile = profiles[int(rng.integers(len(profiles)))]
        scale = float(rng.uniform(0.5, 2.0))
        errors.append(TableError(table.name, tuple((d, e * scale) for d, e in profile.errors), 0, 0))
    problem = precision_problem(spec, errors)
    low = sum(t.options[0].bytes for t in problem)
    high = sum(t.options[-1].bytes for t in problem)
    total = int(low + 0.2 * (high - low))
    overheads = tuple((t.name, 2048 * 4 * (1 + t.embedding_dim)) for t in spec.tables)  # ids + fp32 outputs
    per_device = int((total + sum(o for _, o in overheads)) / devices * (1 + slack))
    limits = DeviceBudgets((per_device,) * devices, overheads)
    if not with_total:  # the devices' budgets alone: the aggregate is exactly their sum, nothing to spare
        total = per_device * devices - sum(o for _, o in overheads)
    unplaced = choose_exact(problem, total)
    placed = choose_exact(problem, total if with_total else None, device_budgets=limits)
    assert placed.device_bytes is not None
    return {
        "bench": "precision_placed_choice",
        "tables": num_tables,
        "data_types": 5,
        "devices": devices,
        "device_budget_gb": round(per_device / C.GB, 3),
        "device_slack": slack,
        "total_budget": with_total,
        "max_device_use": round(max(placed.device_bytes) / per_device, 4),
        "choice_seconds": round(placed.seconds, 3),
        "target_seconds": 10.0,
        "gap": placed.gap,
        "target_gap": 0.005,
        "error": placed.error,
        "ratio_to_total_only_optimum": round(placed.error / unplaced.error, 6) if unplaced.error else None,
        "total_only_seconds": round(unplaced.seconds, 3),
    }


@dataclass(frozen=True)
class EvalModel:
    """The ``--eval`` model's shape: its tables (name, rows, weight of the table's hidden value in the labels'
    logit), embedding dim, and how an example's ids are drawn (``uniform`` over the rows, or ``zipf``: Zipf(1.05)
    ranks over a fixed permutation of each table's rows, ``zipf_ids``, as recsys traffic is)."""

    tables: tuple[tuple[str, int, float], ...]
    dim: int
    ids: str = "uniform"

    @property
    def names(self) -> list[str]:
        return [n for n, _, _ in self.tables]


# issue 28's model: two tables carry the signal, six larger ones barely; uniform ids (its figures must not move)
EVAL_MODEL = EvalModel((("s0", 20_000, 2.0), ("s1", 5_000, 2.0)) + tuple((f"n{i}", 60_000, 0.05) for i in range(6)), 16)
# issue 43's: Zipf(1.05) ids over tables of 1k to 1M rows, four carrying the signal and four a little of it, dim 64
# (INT8 68 bytes a row, INT4 36, INT2 20 and the remap 4: at 40 % of INT8 a table in INT2 + remap has room for a
# hot block; at dim 16 INT2 alone is 40 %)
EVAL_ZIPF_TABLES = (
    ("s0", 1_000_000, 1.0), ("s1", 200_000, 1.0), ("s2", 50_000, 1.0), ("s3", 5_000, 1.0),
    ("n0", 500_000, 0.25), ("n1", 100_000, 0.25), ("n2", 20_000, 0.25), ("n3", 1_000, 0.25),
)  # fmt: skip
EVAL_ZIPF_DIM = 64
EVAL_ALPHA = 1.05
EVAL_DENSE = 13


def eval_model(ids: str = "uniform", dim: int | None = None) -> EvalModel:
    """``--eval-ids`` and ``--eval-dim``'s model: issue 28's tables with uniform ids, issue 43's with zipf."""
    if ids == "uniform":
        return EvalModel(EVAL_MODEL.tables, dim or EVAL_MODEL.dim, "uniform")
    if ids == "zipf":
        return EvalModel(EVAL_ZIPF_TABLES, dim or EVAL_ZIPF_DIM, "zipf")
    raise ValueError(f"--eval-ids {ids!r}: choose uniform or zipf")


def _eval_ids(model: EvalModel, count: int, seed: int, generator: Any) -> dict[str, Any]:
    """``count`` ids per table: uniform from ``generator``, or Zipf(1.05) (``zipf_ids``, numpy, seeded per table)."""
    import torch

    if model.ids == "uniform":
        return {name: torch.randint(0, rows, (count,), generator=generator) for name, rows, _ in model.tables}
    return {name: torch.from_numpy(zipf_ids(rows, count, EVAL_ALPHA, np.random.default_rng([seed, i])))
            for i, (name, rows, _) in enumerate(model.tables)}  # fmt: skip


def _eval_examples(
    count: int, hidden: dict[str, Any], dense_weight: Any, seed: int, model: EvalModel = EVAL_MODEL
) -> tuple[Any, Any, Any]:
    """Synthetic examples: one id per table (``model.ids``); logit = each table's weight x its hidden value of the
    id (issue 28's: 2 for the signal tables, 0.05 for the noise ones) + the dense features' share; labels drawn
    from it."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    ids = _eval_ids(model, count, seed, generator)
    dense = torch.randn(count, EVAL_DENSE, generator=generator)
    labels = torch.bernoulli(torch.sigmoid(_eval_logit(ids, dense, hidden, dense_weight, model)), generator=generator)
    return ids, dense, labels


def _eval_logit(ids: dict[str, Any], dense: Any, hidden: dict[str, Any], dense_weight: Any, model: EvalModel) -> Any:
    """The labels' generating logit (``_eval_examples``): its AUC is the most any model can reach."""
    logit = dense @ dense_weight
    for name, _, weight in model.tables:
        logit = logit + weight * hidden[name][ids[name]]
    return logit


def eval_cases(
    steps: int = 1500,
    batch: int = 1024,
    budget_share: float = 0.5,
    block_shares: Sequence[float] = (),
    model: EvalModel = EVAL_MODEL,
    sample_examples: Sequence[int | None] = (None,),
    three_blocks: bool = False,
) -> list[dict[str, object]]:
    """Issue 28's --eval target: a TorchRec DLRM trained here on synthetic data where two tables carry the signal
    and six larger ones little; at ``budget_share`` of its INT8 bytes the choice by log loss on an evaluation
    sample keeps AUC (on a separate test set, real TBE) within 0.001 of uniform INT8; beside it the choice by
    the pooled measure, greedy by log loss, uniform INT4/INT2. With ``block_share`` (issue 43's target) also a
    case at that share of INT8's bytes: precision blocks planned by the pooled measure from the training ids (the
    sample; per ``sample_examples``: the first that many training examples' ids, None all), the served model's
    rows ranked hottest first by them, against INT8 and the whole-table choices."""
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.models.dlrm import DLRM

    import infer
    from infer.interop.torchrec import from_torchrec
    from infer.planner.precision import choose_exact, choose_greedy, choose_uniform, precision_problem
    from infer.quant.eval_error import EvalSample, measure_eval_errors, roc_auc
    from infer.quant.measured_error import measure_errors, rows_from_weights

    torch.manual_seed(0)
    torch.set_num_threads(1)  # one core: measured 14x faster per step than two threads on a loaded 2-core host
    names = model.names
    configs = [EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=model.dim, feature_names=[n])
               for n, r, _ in model.tables]  # fmt: skip
    hidden = {n: torch.randn(r) for n, r, _ in model.tables}
    dense_weight = torch.randn(EVAL_DENSE) * 0.3
    ebc = EmbeddingBagCollection(tables=configs)
    for bag in ebc.embedding_bags.values():
        bag.sparse = True  # sparse gradients: an optimizer step touches only the rows of the batch
        torch.nn.init.normal_(bag.weight, std=0.05)
    dlrm = DLRM(embedding_bag_collection=ebc, dense_in_features=EVAL_DENSE, dense_arch_layer_sizes=[32, model.dim],
                over_arch_layer_sizes=[32, 1])  # fmt: skip
    sparse_params = [p for n, p in dlrm.named_parameters() if "embedding_bags" in n]
    dense_params = [p for n, p in dlrm.named_parameters() if "embedding_bags" not in n]
    optimizers = [torch.optim.SparseAdam(sparse_params, lr=0.02), torch.optim.Adam(dense_params, lr=0.003)]
    loss_fn = torch.nn.BCEWithLogitsLoss()

    def kjt(ids: dict[str, torch.Tensor]) -> KeyedJaggedTensor:
        count = len(next(iter(ids.values())))
        return KeyedJaggedTensor.from_lengths_sync(
            keys=names,
            values=torch.cat([ids[n] for n in names]),
            lengths=torch.ones(count * len(names), dtype=torch.long),
        )

    started = time.perf_counter()
    train_ids, train_dense, train_labels = _eval_examples(steps * batch, hidden, dense_weight, 1, model)
    dlrm.train()
    for step in range(steps):
        part = slice(step * batch, (step + 1) * batch)
        logits = dlrm(train_dense[part], kjt({n: train_ids[n][part] for n in names})).reshape(-1)
        loss = loss_fn(logits, train_labels[part])
        for optimizer in optimizers:
            optimizer.zero_grad()
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
    train_seconds = time.perf_counter() - started
    dlrm.eval()
    imported = from_torchrec(dlrm)
    spec = imported.spec
    weights = dict(imported.weights)

    def sample_of(ids, dense, labels) -> EvalSample:
        ones = torch.ones(len(labels), dtype=torch.int64)
        return EvalSample({n: (ids[n], ones) for n in names}, dense, labels)

    measure_sample = sample_of(*_eval_examples(8000, hidden, dense_weight, 2, model))
    test_ids, test_dense, test_labels = _eval_examples(50_000, hidden, dense_weight, 3, model)

    def test_auc(data_types: Sequence[DataType], blocks: tuple[Any, ...] = (), orders: Any = None) -> float:
        typed = spec.with_data_types(overrides=dict(zip(names, data_types)))
        if blocks:
            typed = ModelSpec(tuple(t.with_blocks(b) for t, b in zip(typed.tables, blocks)), typed.num_dense_features,
                              typed.dense_arch)  # fmt: skip
        model = infer.quantize(typed, weights, block_orders=orders)
        values = torch.cat([test_ids[n] for n in names])
        lengths = torch.ones(len(values), dtype=torch.int32)
        with torch.no_grad():
            scores = model.predict(test_dense, values, lengths, None)
        return roc_auc(scores, test_labels)

    started = time.perf_counter()
    by_model = measure_eval_errors(spec, rows_from_weights(weights), measure_sample, "logloss")
    measure_seconds = time.perf_counter() - started
    by_pooled = measure_errors(spec, rows_from_weights(weights))
    model_problem = precision_problem(spec, by_model, model_level=True)
    pooled_problem = precision_problem(spec, by_pooled)
    int8 = choose_uniform(model_problem, DataType.INT8)
    budget = int(budget_share * int8.total_bytes)
    choices = {
        "chosen_logloss": choose_exact(model_problem, budget),
        "chosen_pooled": choose_exact(pooled_problem, budget),
        "greedy_logloss": choose_greedy(model_problem, budget),
        "uniform_int8": int8,
        "uniform_int4": choose_uniform(model_problem, DataType.INT4),
        "uniform_int2": choose_uniform(model_problem, DataType.INT2),
    }
    fp32_auc = test_auc([DataType.FP32] * len(names))
    oracle_auc = roc_auc(_eval_logit(test_ids, test_dense, hidden, dense_weight, model), test_labels)
    aucs = {name: test_auc(c.data_types) for name, c in choices.items()}
    case: dict[str, object] = {
        "bench": "precision_eval_dlrm",
        "ids": model.ids,
        "dim": model.dim,
        "tables": len(names),
        "train_steps": steps,
        "train_seconds": round(train_seconds, 1),
        "measure_seconds": round(measure_seconds, 2),
        "budget_bytes": budget,
        "budget_share_of_int8": budget_share,
        "fp32_auc": round(fp32_auc, 5),
        "generating_logit_auc": round(oracle_auc, 5),  # the labels' own logit: what fp32 could reach
        "target_auc_drop_vs_int8": 0.001,
        "auc_drop_chosen_vs_int8": round(aucs["uniform_int8"] - aucs["chosen_logloss"], 5),
    }
    for name, choice in choices.items():
        case[f"{name}_auc"] = round(aucs[name], 5)
        case[f"{name}_bytes"] = choice.total_bytes
        case[f"{name}_dtypes"] = " ".join(d.value for d in choice.data_types)
    smallest = choose_uniform(model_problem, DataType.INT2).total_bytes
    cases = [case]
    for examples, share in itertools.product(sample_examples, block_shares):
        if share * int8.total_bytes < smallest:  # below every table at INT2: no choice, whole or in blocks, fits
            cases.append({"bench": "precision_eval_dlrm_blocks", "budget_share_of_int8": share, "feasible": False,
                          "smallest_share_of_int8": round(smallest / int8.total_bytes, 4),
                          "uniform_int4_share": round(choices["uniform_int4"].total_bytes / int8.total_bytes, 4),
                          "dim": model.dim, "ids": model.ids})  # fmt: skip
            continue
        block_case = {"ids": model.ids, "dim": model.dim}
        sampled = {n: train_ids[n][:examples] for n in names}
        block_case |= _eval_block_case(
            spec, weights, sampled, test_ids, share, int8, aucs, test_auc, by_model, three_blocks
        )
        logloss = choose_exact(model_problem, int(share * int8.total_bytes))  # the whole-table choice by log loss
        logloss_auc = test_auc(logloss.data_types)
        block_case["whole_table_logloss_auc"] = round(logloss_auc, 5)
        block_case["auc_drop_whole_table_logloss_vs_int8"] = round(aucs["uniform_int8"] - logloss_auc, 5)
        block_case["whole_table_logloss_dtypes"] = " ".join(d.value for d in logloss.data_types)
        best_whole = max(round(logloss_auc, 5), block_case["whole_table_pooled_auc"])  # type: ignore[call-overload]
        block_case["best_whole_table_auc"] = best_whole
        block_case["auc_drop_best_whole_table_vs_int8"] = round(aucs["uniform_int8"] - best_whole, 5)
        block_case["host_load"] = [round(x, 2) for x in os.getloadavg()]
        cases.append(block_case)
    return cases


def _eval_block_case(spec: ModelSpec, weights: Any, train_ids: Any, test_ids: Any, share: float, int8: Any,
                     aucs: dict[str, float], test_auc: Any, by_logloss: Any,
                     three_blocks: bool = False) -> dict[str, object]:  # fmt: skip
    """Issue 43's --eval target: at ``share`` of INT8's bytes, blocks planned by the pooled measure from the
    training ids ``train_ids`` (each table's rows ranked by them, as export ranks them), the served model's test
    AUC against INT8's and the whole-table choices (pooled and log loss) at the same bytes; per block table the
    share of the test set's reads its hot blocks take. Beside them (not what ``embserve`` plans: with ``--eval`` it
    keeps whole tables) blocks priced by the log-loss errors ``by_logloss`` (each table's types measured on the
    evaluation sample, mixed by the same hot shares; every table here is read once an example, so the read
    weights the MILP puts on them are equal and change nothing)."""
    import torch

    from infer.planner.access import sample_from_ids
    from infer.planner.blocks import block_orders_from_sample, block_problem
    from infer.planner.precision import choose_exact, precision_problem
    from infer.quant.measured_error import measure_errors, rows_from_weights

    names = [t.name for t in spec.tables]
    started = time.perf_counter()
    sample = sample_from_ids({n: train_ids[n].numpy() for n in names}, spec, source="training ids")
    measured = measure_errors(spec, rows_from_weights(weights), sample)
    budget = int(share * int8.total_bytes)
    problem = block_problem(spec, measured, sample, three_blocks=three_blocks)
    chosen = choose_exact(problem, budget)
    whole_pooled = choose_exact(precision_problem(spec, measured, sample=sample), budget)
    plan_seconds = time.perf_counter() - started
    blocks = chosen.blocks or tuple(() for _ in names)
    blocked = ModelSpec(tuple(t.with_blocks(b) for t, b in zip(spec.tables, blocks)), spec.num_dense_features,
                        spec.dense_arch)  # fmt: skip
    orders = block_orders_from_sample(blocked, sample)
    block_auc = test_auc(chosen.data_types, blocks, orders)
    whole_pooled_auc = test_auc(whole_pooled.data_types)
    by_loss = choose_exact(block_problem(spec, by_logloss, sample, three_blocks=three_blocks), budget)
    loss_blocks = by_loss.blocks or tuple(() for _ in names)
    loss_spec = ModelSpec(tuple(t.with_blocks(b) for t, b in zip(spec.tables, loss_blocks)), spec.num_dense_features,
                          spec.dense_arch)  # fmt: skip
    by_loss_auc = test_auc(by_loss.data_types, loss_blocks, block_orders_from_sample(loss_spec, sample))
    hot_reads = {}
    for name, table_blocks in zip(names, blocks):
        if table_blocks:  # the test reads of every block but the coldest
            hot = orders[name][: sum(b.rows for b in table_blocks[:-1])]
            hot_reads[name] = round(float(torch.isin(test_ids[name], hot).float().mean()), 4)
    return {
        "bench": "precision_eval_dlrm_blocks",
        "budget_share_of_int8": share,
        "feasible": True,
        "budget_bytes": budget,
        "sample": f"training ids ({sample.ids[names[0]].size} examples)",
        "three_blocks": three_blocks,  # of the first table: one id an example
        "target_auc_drop_vs_int8": 0.001,
        "uniform_int8_auc": round(aucs["uniform_int8"], 5),
        "blocks_auc": round(block_auc, 5),
        "blocks_bytes": chosen.total_bytes,
        "auc_drop_blocks_vs_int8": round(aucs["uniform_int8"] - block_auc, 5),
        "whole_table_pooled_auc": round(whole_pooled_auc, 5),
        "whole_table_pooled_bytes": whole_pooled.total_bytes,
        "auc_drop_whole_table_pooled_vs_int8": round(aucs["uniform_int8"] - whole_pooled_auc, 5),
        "auc_gain_blocks_vs_whole_table_pooled": round(block_auc - whole_pooled_auc, 5),
        "plan_seconds": round(plan_seconds, 2),
        "block_tables": {n: [[b.rows, b.data_type.value] for b in bs] for n, bs in zip(names, blocks) if bs},
        "whole_table_dtypes": " ".join(d.value for d in whole_pooled.data_types),
        "blocks_cold_dtypes": " ".join(d.value for d in chosen.data_types),
        "hot_share_of_test_reads": hot_reads,
        "blocks_by_logloss_auc": round(by_loss_auc, 5),
        "auc_drop_blocks_by_logloss_vs_int8": round(aucs["uniform_int8"] - by_loss_auc, 5),
        "blocks_by_logloss_bytes": by_loss.total_bytes,
        "block_tables_by_logloss": {
            n: [[b.rows, b.data_type.value] for b in bs] for n, bs in zip(names, loss_blocks) if bs
        },
        "blocks_by_logloss_cold_dtypes": " ".join(d.value for d in by_loss.data_types),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tables", type=int, action="append", help="table counts (default 26 100 500 1000)")
    parser.add_argument("--devices", type=int, action="append", help="device counts (default 8 16 64)")
    parser.add_argument("--device-memory-gb", type=float, default=80.0)
    parser.add_argument("--precision", action="store_true", help="the precision planner on DLRM-v2's shapes")
    parser.add_argument("--eval", action="store_true", help="the precision planner by log loss on a trained DLRM")
    parser.add_argument("--blocks", action="store_true", help="the precision planner with blocks (issue 43)")
    parser.add_argument("--examples", type=int, default=1_000_000, help="--blocks: examples of sampled ids")
    parser.add_argument(
        "--three-blocks", action="store_true", help="--blocks: also price three-block options (and --eval)"
    )
    parser.add_argument("--blocks-speed", action="store_true", help="--blocks: also 500 tables")
    parser.add_argument("--steps", type=int, help="--eval: training steps (default 1500 uniform, 6000 zipf)")
    parser.add_argument(
        "--sample-examples",
        type=int,
        action="append",
        help="--eval --blocks: plan from the first N training examples (default 0: all; repeatable)",
    )
    parser.add_argument(
        "--block-share",
        type=float,
        action="append",
        help="--eval --blocks: shares of INT8's bytes (default 0.4 0.41 0.45 0.5; zipf 0.4 0.45 0.5)",
    )
    parser.add_argument(
        "--eval-ids",
        choices=("uniform", "zipf"),
        default="uniform",
        help="--eval: the examples' ids, uniform (issue 28's model) or Zipf(1.05) (issue 43's)",
    )
    parser.add_argument("--eval-dim", type=int, help="--eval: embedding dim (default 16 uniform, 64 zipf)")
    args = parser.parse_args()
    if args.eval:  # with --blocks also issue 43's case: blocks at --block-share of INT8's bytes
        model = eval_model(args.eval_ids, args.eval_dim)
        default_shares = [0.4, 0.41, 0.45, 0.5] if model.ids == "uniform" else [0.4, 0.45, 0.5]
        shares = (args.block_share or default_shares) if args.blocks else []
        steps = args.steps or (1500 if model.ids == "uniform" else 6000)
        samples = [n or None for n in args.sample_examples or [0]]  # 0: every training example
        for case in eval_cases(
            steps, block_shares=shares, model=model, sample_examples=samples, three_blocks=args.three_blocks
        ):
            print(json.dumps(case), flush=True)
        return 0
    if args.blocks:
        for case in block_cases(args.examples, three_blocks=args.three_blocks):
            print(json.dumps(case), flush=True)
        if args.blocks_speed:
            print(json.dumps(block_speed_case()), flush=True)
        return 0
    if args.precision:
        for case in precision_cases():
            print(json.dumps(case), flush=True)
        return 0
    memory = int(args.device_memory_gb * C.GB)
    for tables in args.tables or [26, 100, 500, 1000]:
        for devices in args.devices or [8, 16, 64]:
            print(json.dumps(run_case(tables, devices, memory)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
