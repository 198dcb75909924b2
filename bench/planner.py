"""Planner speed and quality on synthetic table sets.

Prints one JSON line per (tables, devices) case: planning seconds, bottleneck cost / lower bound,
and per-device memory use. Tables: rows log-uniform in [1e3, 3e7], dims in {32, ..., 256}, INT8.

    python bench/planner.py
    python bench/planner.py --tables 500 --devices 16
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time

from infer.config import ModelSpec, TableConfig
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tables", type=int, action="append", help="table counts (default 26 100 500 1000)")
    parser.add_argument("--devices", type=int, action="append", help="device counts (default 8 16 64)")
    parser.add_argument("--device-memory-gb", type=float, default=80.0)
    args = parser.parse_args()
    memory = int(args.device_memory_gb * C.GB)
    for tables in args.tables or [26, 100, 500, 1000]:
        for devices in args.devices or [8, 16, 64]:
            print(json.dumps(run_case(tables, devices, memory)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
