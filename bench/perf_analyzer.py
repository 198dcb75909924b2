# ruff: noqa: E402
"""Triton's perf_analyzer against ``embserve serve`` on loopback (gRPC), concurrency 1..16, vs the in-process runtime.

Exports bench/server.py's INT8 model, writes a perf_analyzer input-data file of valid requests
(``write_input_data``: per feature its ids, in range, and its bag lengths, each tensor with its shape; the inputs
are ragged, so every request carries its own shapes and no ``--shape`` is needed), starts ``embserve serve`` and
runs ``perf_analyzer -m artifact -i grpc --concurrency-range C:C`` (count windows) for each concurrency. Before
each case the same request batches go through ``Runtime.lookup`` back to back in this process (one thread), so
the ratio compares the server under perf_analyzer with the runtime on the same host in the same spell. One JSON
line per case: requests/s and examples/s, client p50/p99 (perf_analyzer's), the ratio to in-process, and what
the server's statistics extension (which perf_analyzer reads) says it spent per request.

    python bench/perf_analyzer.py                           # batch 64, concurrency 1 2 4 8 16
    python bench/perf_analyzer.py --batch-size 512 --concurrency 1 16 --requests 2000

perf_analyzer comes with ``make test`` (``.venv/bin/perf_analyzer``; the Makefile says from where).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

# Run as ``python bench/perf_analyzer.py``, the repository root replaces this file's folder on sys.path (as in
# bench/server.py, whose helpers are imported from there).
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path[0] = os.path.dirname(sys.path[0])

import numpy as np

from bench.server import ServerProcess, build_artifact
from infer.artifact.load import load
from infer.config import ModelSpec
from infer.features import SparseFeatures
from server.oip_client import infer_request

_NUMPY_TYPES = {"INT32": np.int32, "INT64": np.int64, "FP32": np.float32}


def find_perf_analyzer() -> str | None:
    """The perf_analyzer launcher ``make test`` installs beside this Python, else one on PATH."""
    beside = Path(sys.executable).parent / "perf_analyzer"
    return str(beside) if beside.exists() else shutil.which("perf_analyzer")


def write_input_data(
    spec: ModelSpec, path: Path, batch_size: int, steps: int, ids_per_bag: int = 8, seed: int = 0
) -> list[SparseFeatures]:
    """perf_analyzer's ``--input-data`` file: ``steps`` requests of ``batch_size`` examples, each input (per
    feature ``<f>__values`` and ``<f>__lengths``) with its content and shape. Returns the batches, in order."""
    batches = [SparseFeatures.random(spec, batch_size, ids_per_bag, seed=seed + step) for step in range(steps)]
    data = []
    for batch in batches:
        request = infer_request("", "", batch)
        data.append(
            {
                tensor.name: {
                    "content": np.frombuffer(raw, dtype=_NUMPY_TYPES[tensor.datatype]).tolist(),
                    "shape": list(tensor.shape),
                }
                for tensor, raw in zip(request.inputs, request.raw_input_contents)
            }
        )
    path.write_text(json.dumps({"data": data}))
    return batches


def perf_analyzer_command(
    binary: str,
    model: str,
    url: str,
    input_data: Path,
    concurrency: int,
    requests: int,
    report: Path,
    protocol: str = "grpc",
) -> list[str]:
    """One measurement at one concurrency over ``protocol`` (grpc or http): count windows of ``requests``
    requests; stability is not required (``-s 1000``: a shared host never holds latency within perf_analyzer's
    10 %), so it always ends."""
    return [
        binary, "-m", model, "-i", protocol, "-u", url, "--input-data", str(input_data),
        "--concurrency-range", f"{concurrency}:{concurrency}", "--measurement-mode", "count_windows",
        "--measurement-request-count", str(requests), "-s", "1000", "--max-trials", "3", "--percentile", "99",
        "-f", str(report),
    ]  # fmt: skip


def read_report(report: Path) -> dict[str, float]:
    """perf_analyzer's CSV row (the last one): throughput in requests/s, client latencies and the server's
    per-request times (from the statistics extension), in microseconds."""
    with report.open() as handle:
        rows = list(csv.DictReader(handle))
    if not rows:
        raise RuntimeError(f"perf_analyzer wrote no measurement to {report}")
    row = rows[-1]
    columns = {
        "throughput": "Inferences/Second",
        "p50_us": "p50 latency",
        "p99_us": "p99 latency",
        "server_queue_us": "Server Queue",
        "server_compute_input_us": "Server Compute Input",
        "server_compute_infer_us": "Server Compute Infer",
        "server_compute_output_us": "Server Compute Output",
    }
    return {key: float(row[column]) for key, column in columns.items()}


def in_process_rate(runtime: object, batches: Sequence[SparseFeatures], requests: int) -> float:
    """Requests/s of ``Runtime.lookup`` on ``batches`` (cycled), back to back in this thread."""
    lookup = runtime.lookup  # type: ignore[attr-defined]
    started = time.perf_counter()
    for index in range(requests):
        lookup(batches[index % len(batches)])
    return requests / (time.perf_counter() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200_000, help="rows per table (default 200,000)")
    parser.add_argument("--tables", type=int, default=8, help="INT8 tables, one feature each (default 8)")
    parser.add_argument("--batch-size", type=int, default=64, help="examples per request (default 64)")
    parser.add_argument("--ids-per-bag", type=int, default=20)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--requests", type=int, default=1000, help="requests per measurement window (default 1000)")
    parser.add_argument("--steps", type=int, default=16, help="distinct requests in the input data (default 16)")
    parser.add_argument("--max-delay-us", type=int, default=1000, help="server: batching delay")
    parser.add_argument("--forward-threads", type=int, default=0, help="server: concurrent forwards (0: default)")
    args = parser.parse_args()
    binary = find_perf_analyzer()
    if binary is None:
        parser.error("no perf_analyzer: make test installs it as .venv/bin/perf_analyzer")
    server_args = argparse.Namespace(
        max_batch_size=max(4096, args.batch_size), max_delay_us=args.max_delay_us, max_merge_examples=0,
        forward_threads=args.forward_threads, server_threads=0,
    )  # fmt: skip
    failed = False
    with tempfile.TemporaryDirectory(prefix="embserve-perf-analyzer-") as tmp:
        folder = Path(tmp)
        artifact = build_artifact(args.tables, args.rows, folder)
        runtime = load(artifact, intra_op_threads=1)  # one caller's thread, as bench/server.py's baseline
        input_data = folder / "input.json"
        batches = write_input_data(runtime.spec, input_data, args.batch_size, args.steps, args.ids_per_bag)
        warm_until = time.monotonic() + 2.0  # TorchScript's first calls profile and optimise: not measured
        while time.monotonic() < warm_until:
            in_process_rate(runtime, batches, len(batches))
        server = ServerProcess(artifact, server_args, folder / "server.log")
        try:
            port = server.wait_ready(300)
            for concurrency in args.concurrency:
                baseline = in_process_rate(runtime, batches, max(50, args.requests // 4))
                report = folder / f"report-{concurrency}.csv"
                command = perf_analyzer_command(
                    binary, artifact.name, f"127.0.0.1:{port}", input_data, concurrency, args.requests, report
                )
                done = subprocess.run(command, capture_output=True, text=True, timeout=600)
                if done.returncode != 0:
                    print(done.stdout[-2000:], done.stderr[-2000:], file=sys.stderr)
                    failed = True
                    continue
                measured = read_report(report)
                row = {
                    "case": "perf_analyzer_grpc",
                    "concurrency": concurrency,
                    "batch_size": args.batch_size,
                    "requests_per_s": round(measured["throughput"], 1),
                    "examples_per_s": round(measured["throughput"] * args.batch_size, 1),
                    "p50_ms": round(measured["p50_us"] / 1e3, 3),
                    "p99_ms": round(measured["p99_us"] / 1e3, 3),
                    "inprocess_requests_per_s": round(baseline, 1),
                    "ratio_vs_inprocess": round(measured["throughput"] / baseline, 3),
                    **{k: v for k, v in measured.items() if k.startswith("server_")},
                }
                print(json.dumps(row), flush=True)
        finally:
            exit_code = server.stop()
    print(json.dumps({"case": "summary", "server_exit_code": exit_code, "failed": failed}), flush=True)
    return 1 if failed or exit_code != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
