"""C++ loader (embserve_run --bench) vs the Python runtime, per-call latency at batch 1.

Workload: 8 INT8 tables x 20,000 rows x D=128, batch 1, 20 ids per bag (SUM), uniform random ids,
256 distinct requests cycled. Cases: an unsharded artifact and one sharded table-wise over 2 CPU
devices. Both sides are measured in the same run, on the same artifact and the same requests:
``embserve_run --bench N`` (C++, one JSON line), ``runtime.lookup`` and the scripted module's
``forward`` called directly (Python). Prints one JSON line per case with the p50/mean latencies and
``ratio`` = C++ p50 / Python ``runtime.lookup`` p50 (target: <= 0.6).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from infer.artifact.cpp_io import Request, write_requests  # noqa: E402
from infer.artifact.export import export  # noqa: E402
from infer.artifact.load import load  # noqa: E402
from infer.config import DataType, ModelSpec, PoolingType, TableConfig  # noqa: E402
from infer.features import SparseFeatures  # noqa: E402
from infer.planner.types import ShardingType  # noqa: E402
from infer.quant.quantize import quantize  # noqa: E402
from infer.shard.builder import shard_model  # noqa: E402
from infer.shard.plans import make_plan  # noqa: E402
from infer.weights import random_weights  # noqa: E402

TABLES, ROWS, DIM, IDS_PER_BAG, REQUESTS = 8, 20_000, 128, 20, 256


def build_cpp() -> Path:
    build = ROOT / "cpp_loader" / "build"
    if not (build / "CMakeCache.txt").is_file():
        subprocess.run(
            [
                "cmake",
                "-S",
                str(build.parent),
                "-B",
                str(build),
                "-DCMAKE_BUILD_TYPE=Release",
                f"-DEMBSERVE_PYTHON={sys.executable}",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    subprocess.run(["cmake", "--build", str(build), "-j2"], check=True, stdout=subprocess.DEVNULL)
    return build / "embserve_run"


def time_calls(call: Callable[[int], object], calls: int) -> tuple[float, float]:
    for i in range(min(calls, 100)):
        call(i)
    latencies = []
    for i in range(calls):
        started = time.perf_counter()
        call(i)
        latencies.append((time.perf_counter() - started) * 1e6)
    return statistics.median(latencies), statistics.fmean(latencies)


def run_case(
    case: str, artifact: Path, binary: Path, requests: list[Request], request_file: Path, calls: int
) -> dict[str, object]:
    runtime = load(artifact)
    batches = [SparseFeatures(runtime.feature_names, v, lengths, w) for v, lengths, w in requests]
    py_p50, py_mean = time_calls(lambda i: runtime.lookup(batches[i % REQUESTS]), calls)

    def scripted(i: int) -> object:
        values, lengths, _ = requests[i % REQUESTS]
        with torch.inference_mode():
            return runtime.module(values, lengths, None)

    script_p50, script_mean = time_calls(scripted, calls)
    result = subprocess.run(
        [str(binary), str(artifact), "--requests", str(request_file), "--bench", str(calls)],
        check=True,
        capture_output=True,
        text=True,
    )
    cpp = json.loads(result.stdout.strip().splitlines()[-1])
    ratio = cpp["p50_us"] / py_p50
    return {
        "bench": "cpp_loader",
        "case": case,
        "tables": TABLES,
        "rows": ROWS,
        "dim": DIM,
        "batch": 1,
        "ids_per_bag": IDS_PER_BAG,
        "calls": calls,
        "cpp_p50_us": round(cpp["p50_us"], 2),
        "cpp_mean_us": round(cpp["mean_us"], 2),
        "cpp_lookups_per_s": round(cpp["lookups_per_s"]),
        "python_runtime_p50_us": round(py_p50, 2),
        "python_runtime_mean_us": round(py_mean, 2),
        "python_scripted_p50_us": round(script_p50, 2),
        "python_scripted_mean_us": round(script_mean, 2),
        "ratio": round(ratio, 3),
        "ratio_mean": round(cpp["mean_us"] / py_mean, 3),
        "ratio_vs_scripted": round(cpp["p50_us"] / script_p50, 3),
        "target_ratio": 0.6,
        "meets_target": ratio <= 0.6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=3000)
    args = parser.parse_args()
    binary = build_cpp()
    spec = ModelSpec(
        tuple(TableConfig(f"t{i}", ROWS, DIM, (f"f{i}",), PoolingType.SUM, DataType.INT8) for i in range(TABLES))
    )
    model = quantize(spec, random_weights(spec, seed=0))
    generator = torch.Generator().manual_seed(1)
    requests = [
        (
            torch.randint(0, ROWS, (TABLES * IDS_PER_BAG,), generator=generator),
            torch.full((TABLES,), IDS_PER_BAG, dtype=torch.int32),
            None,
        )
        for _ in range(REQUESTS)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        request_file = write_requests(folder / "requests.bin", requests)
        plan = make_plan(spec, 2, {f"t{i}": (ShardingType.TABLE_WISE, (i % 2,)) for i in range(TABLES)})
        cases = {
            "unsharded": export(model, folder / "unsharded"),
            "sharded_tw2": export(shard_model(model, plan), folder / "sharded", plan=plan),
        }
        for case, artifact in cases.items():
            print(json.dumps(run_case(case, artifact, binary, requests, request_file, args.calls)), flush=True)


if __name__ == "__main__":
    main()
