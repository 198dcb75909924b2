"""C++ loader (embserve_run --bench) vs the Python runtime, per-call latency at batch 1.

Workload: 8 INT8 tables x 20,000 rows x D=128, batch 1, 20 ids per bag (SUM), uniform random ids,
256 distinct requests cycled. Cases: an unsharded artifact and one sharded table-wise over 2 CPU
devices. Both sides are measured in the same run, on the same artifact and the same requests:
``embserve_run --bench N`` (C++, one JSON line), ``runtime.lookup`` and the scripted module's
``forward`` called directly (Python). Prints one JSON line per case with the p50/mean latencies and
``ratio`` = C++ p50 / Python ``runtime.lookup`` p50 (target: <= 0.6).

pt2 cases (``--pt2``, or ``--only-pt2``): the same artifacts exported with ``pt2=True`` and, from C++ only,
``embserve_run --backend pt2`` against ``--backend torchscript`` on the same artifact and requests, alternating
backends over ``--rounds`` rounds (best of each): batch-1 p50 latency (``pt2_batch1_*``), and W128-style
throughput (``pt2_w128_*``: 8 INT8 tables x ``--w128-rows`` rows x D=128, batch 2048, 20 ids per bag, 8 distinct
requests cycled). ``ratio`` = pt2 / torchscript (p50 for latency, lookups/s for throughput); compile time and
model.pt2 size are reported beside them. ``--env KEY=VALUE`` sets a variable for both backends' runs (e.g.
``OMP_WAIT_POLICY=passive``: on a busy shared host, OpenMP workers spinning after a parallel region slow both
backends' large batches several-fold and make the numbers noisy); it is printed in each line.

Load cases (``--load-gb G``, or ``--only-load``): one INT8 table of G GB (bench/load.py's ``big_model``, bytes filled
in place) exported embedded (format 2) and mapped (format 3); ``embserve_run ARTIFACT --verify full|none`` (a fresh
process each, warm page cache: every case is run once untimed first), ``--rounds`` rounds interleaved. Each line:
the median ``load_s`` (Model::load, fbgemm's dlopen included), ``ready_s`` (load_s less the dlopen: what a process
that has loaded fbgemm before pays), GB/s of the listed bytes over ``ready_s``, and ``ratio`` = the embedded
format's ``ready_s`` with full verification / this case's (targets for the mapped format: ``ready_s`` <= 0.2 s with
``--verify none``, >= 2.5 GB/s with full). The host's load average (``os.getloadavg``) is printed with each line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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


BENCH_ENV: dict[str, str] = {}  # --env KEY=VALUE, for the pt2 cases' embserve_run calls


def bench_cpp(
    binary: Path, artifact: Path, request_file: Path, calls: int, backend: str, *extra: str
) -> dict[str, float]:
    result = subprocess.run(
        [
            str(binary),
            str(artifact),
            "--backend",
            backend,
            "--requests",
            str(request_file),
            "--bench",
            str(calls),
            *extra,
        ],
        env={**os.environ, **BENCH_ENV},
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def export_pt2_timed(model: torch.nn.Module, folder: Path, plan: object = None) -> tuple[Path, float]:
    started = time.perf_counter()
    artifact = export(model, folder, plan=plan, pt2=True)  # type: ignore[arg-type]
    return artifact, time.perf_counter() - started


def run_pt2_case(
    case: str,
    artifact: Path,
    binary: Path,
    request_file: Path,
    calls: int,
    rounds: int,
    export_s: float,
    shape: dict[str, int],
) -> dict[str, object]:
    """C++ pt2 vs C++ TorchScript on one artifact, backends alternating each round; best round of each."""
    runs: dict[str, list[dict[str, float]]] = {"torchscript": [], "pt2": []}
    latency = shape["batch"] == 1
    one_range: list[dict[str, float]] = []  # pt2 without the loader's batch split (throughput cases)
    for _ in range(rounds):
        for backend in runs:
            runs[backend].append(bench_cpp(binary, artifact, request_file, calls, backend))
        if not latency:
            one_range.append(bench_cpp(binary, artifact, request_file, calls, "pt2", "--kernel-threads", "1"))
    best_ts_p50 = min(r["p50_us"] for r in runs["torchscript"])
    best_pt2_p50 = min(r["p50_us"] for r in runs["pt2"])
    best_ts_rate = max(r["lookups_per_s"] for r in runs["torchscript"])
    best_pt2_rate = max(r["lookups_per_s"] for r in runs["pt2"])
    split = {}
    if one_range:
        best_one = max(r["lookups_per_s"] for r in one_range)
        split = {"pt2_one_range_lookups_per_s": round(best_one), "split_speedup": round(best_pt2_rate / best_one, 3)}
    return {
        "bench": "cpp_loader",
        "case": case,
        **shape,
        "calls": calls,
        "rounds": rounds,
        "torchscript_p50_us": round(best_ts_p50, 2),
        "pt2_p50_us": round(best_pt2_p50, 2),
        "torchscript_mean_us": round(min(r["mean_us"] for r in runs["torchscript"]), 2),
        "pt2_mean_us": round(min(r["mean_us"] for r in runs["pt2"]), 2),
        "torchscript_lookups_per_s": round(best_ts_rate),
        "pt2_lookups_per_s": round(best_pt2_rate),
        "metric": "p50_latency" if latency else "lookups_per_s",
        "ratio": round(best_pt2_p50 / best_ts_p50 if latency else best_pt2_rate / best_ts_rate, 3),
        **split,
        "env": BENCH_ENV,
        "export_with_pt2_s": round(export_s, 1),
        "pt2_bytes": (artifact / "model.pt2").stat().st_size,
        "model_pt_bytes": (artifact / "model.pt").stat().st_size,
    }


def w128_requests(rows: int, count: int = 8) -> list[Request]:
    generator = torch.Generator().manual_seed(2)
    batch = 2048
    return [
        (
            torch.randint(0, rows, (TABLES * batch * IDS_PER_BAG,), generator=generator),
            torch.full((TABLES * batch,), IDS_PER_BAG, dtype=torch.int32),
            None,
        )
        for _ in range(count)
    ]


def pt2_cases(binary: Path, folder: Path, args: argparse.Namespace, batch1: list[Request]) -> None:
    batch1_file = write_requests(folder / "batch1.bin", batch1)
    spec = ModelSpec(
        tuple(TableConfig(f"t{i}", ROWS, DIM, (f"f{i}",), PoolingType.SUM, DataType.INT8) for i in range(TABLES))
    )
    model = quantize(spec, random_weights(spec, seed=0))
    plan = make_plan(spec, 2, {f"t{i}": (ShardingType.TABLE_WISE, (i % 2,)) for i in range(TABLES)})
    shape = {"tables": TABLES, "rows": ROWS, "dim": DIM, "batch": 1, "ids_per_bag": IDS_PER_BAG}
    for case, built, built_plan in (
        ("pt2_batch1_unsharded", model, None),
        ("pt2_batch1_sharded_tw2", shard_model(model, plan), plan),
    ):
        artifact, export_s = export_pt2_timed(built, folder / case, built_plan)
        row = run_pt2_case(case, artifact, binary, batch1_file, args.calls, args.rounds, export_s, shape)
        print(json.dumps(row), flush=True)
        shutil.rmtree(artifact)
    del model
    rows = args.w128_rows
    w128 = ModelSpec(
        tuple(TableConfig(f"t{i}", rows, DIM, (f"f{i}",), PoolingType.SUM, DataType.INT8) for i in range(TABLES))
    )
    w128_model = quantize(w128, random_weights(w128, seed=0))
    w128_file = write_requests(folder / "w128.bin", w128_requests(rows))
    w128_plan = make_plan(w128, 2, {f"t{i}": (ShardingType.TABLE_WISE, (i % 2,)) for i in range(TABLES)})
    shape = {"tables": TABLES, "rows": rows, "dim": DIM, "batch": 2048, "ids_per_bag": IDS_PER_BAG}
    for case, sharded in (("pt2_w128_unsharded", False), ("pt2_w128_sharded_tw2", True)):
        built = shard_model(w128_model, w128_plan) if sharded else w128_model
        artifact, export_s = export_pt2_timed(built, folder / case, w128_plan if sharded else None)
        del built
        row = run_pt2_case(case, artifact, binary, w128_file, args.w128_calls, args.rounds, export_s, shape)
        print(json.dumps(row), flush=True)
        shutil.rmtree(artifact)


def load_cases(binary: Path, folder: Path, gb: float, rounds: int) -> None:
    """C++ load of a G GB artifact, embedded and mapped, --verify full and none (see the module docstring)."""
    from bench.load import big_model

    model = big_model(gb)
    artifacts = {fmt: export(model, folder / fmt, weights=fmt) for fmt in ("embedded", "mapped")}
    del model
    one_id = (torch.zeros(1, dtype=torch.int64), torch.ones(1, dtype=torch.int32), None)
    request = write_requests(folder / "load_request.bin", [one_id])
    cases = [(fmt, verify) for fmt in artifacts for verify in ("full", "none")]

    def once(fmt: str, verify: str) -> dict[str, float]:
        command = [str(binary), str(artifacts[fmt]), "--requests", str(request), "--bench", "1", "--verify", verify]
        result = subprocess.run(command, capture_output=True, text=True, env=bench_env(), timeout=600)
        if result.returncode != 0:
            raise RuntimeError(f"embserve_run failed: {result.stderr[-2000:]}")
        return json.loads(result.stdout.strip().splitlines()[-1])

    for case in cases:  # warm the page cache (and the dynamic loader's) before timing
        once(*case)
    timings: dict[tuple[str, str], list[dict[str, float]]] = {case: [] for case in cases}
    for _ in range(rounds):
        for case in cases:
            timings[case].append(once(*case))
    ready = {case: statistics.median(t["load_s"] - t["library_s"] for t in runs) for case, runs in timings.items()}
    baseline = ready[("embedded", "full")]
    for (fmt, verify), runs in timings.items():
        listed = runs[0]["load_bytes"]
        line = {
            "bench": "cpp_load",
            "format": fmt,
            "verify": verify,
            "gb": round(listed / 1e9, 3),
            "rounds": rounds,
            "load_s": round(statistics.median(t["load_s"] for t in runs), 4),
            "ready_s": round(ready[(fmt, verify)], 4),
            "ready_best_s": round(min(t["load_s"] - t["library_s"] for t in runs), 4),
            "gb_per_s": round(listed / ready[(fmt, verify)] / 1e9, 2),
            "ratio": round(baseline / ready[(fmt, verify)], 2),
            "loadavg": [round(x, 2) for x in os.getloadavg()],
        }
        print(json.dumps(line), flush=True)


def bench_env() -> dict[str, str]:
    return {**os.environ, **BENCH_ENV}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--pt2", action="store_true", help="also the pt2 vs TorchScript cases (C++)")
    parser.add_argument("--only-pt2", action="store_true", help="only the pt2 vs TorchScript cases")
    parser.add_argument("--rounds", type=int, default=2, help="pt2 cases: rounds of both backends, alternating")
    parser.add_argument("--w128-rows", type=int, default=1_000_000, help="pt2 W128 case: rows per table")
    parser.add_argument("--w128-calls", type=int, default=30, help="pt2 W128 case: timed calls per round")
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for the pt2 cases' C++ runs")
    parser.add_argument("--load-gb", type=float, default=0.0, help="also the load cases, on an artifact of G GB")
    parser.add_argument("--only-load", action="store_true", help="only the load cases (--load-gb, default 2.1)")
    args = parser.parse_args()
    BENCH_ENV.update(item.split("=", 1) for item in args.env)
    binary = build_cpp()
    if args.only_load:
        with tempfile.TemporaryDirectory() as tmp:
            load_cases(binary, Path(tmp), args.load_gb or 2.1, args.rounds)
        return
    spec = ModelSpec(
        tuple(TableConfig(f"t{i}", ROWS, DIM, (f"f{i}",), PoolingType.SUM, DataType.INT8) for i in range(TABLES))
    )
    model = quantize(spec, random_weights(spec, seed=0))
    generator = torch.Generator().manual_seed(1)
    requests: list[Request] = [
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
        if not args.only_pt2:
            plan = make_plan(spec, 2, {f"t{i}": (ShardingType.TABLE_WISE, (i % 2,)) for i in range(TABLES)})
            cases = {
                "unsharded": export(model, folder / "unsharded"),
                "sharded_tw2": export(shard_model(model, plan), folder / "sharded", plan=plan),
            }
            for case, artifact in cases.items():
                print(json.dumps(run_case(case, artifact, binary, requests, request_file, args.calls)), flush=True)
        if args.pt2 or args.only_pt2:
            del model
            pt2_cases(binary, folder, args, requests)
        if args.load_gb > 0:
            load_cases(binary, folder, args.load_gb, args.rounds)


if __name__ == "__main__":
    main()
