"""The ONNX model on onnxruntime against the TBE (TorchScript) artifact: throughput, export time, file sizes.

For W64 and W128 (8 INT8 tables, 20 ids per bag, SUM; rows reduced with ``--rows`` to fit the time)
prints one JSON line per case with M lookups/s and the ratio to the TorchScript artifact measured in
the same run on the same batches (cycled so the touched rows exceed the cache), through the same
``Runtime.lookup`` (validation included). Cases: every ONNX pooling design (``padded``, ``padded_reduce``,
``prefix_sum``, ``scatter``) at onnxruntime's default threads, the default design on one thread, and the
default design's bare ``session.run`` (no validation); the TBE artifact runs with ``--torch-threads`` (1).
Then one line per workload and design with export seconds and file sizes against ``model.pt``. Cases
are interleaved round by round so machine noise hits all alike.

    python bench/onnx.py                       # 200,000 rows per table
    python bench/onnx.py --rows 50000 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from infer.artifact.export import export
from infer.artifact.formats.onnx_export import DEFAULT_POOLING, POOLINGS, export_onnx
from infer.artifact.load import load
from infer.artifact.runtime import Runtime
from infer.config import DataType, ModelSpec, TableConfig
from infer.features import SparseFeatures
from infer.quant.quantize import quantize
from infer.weights import random_weights


@dataclass(frozen=True)
class Workload:
    name: str
    num_tables: int
    rows: int
    dim: int
    batch_size: int
    ids_per_bag: int

    def spec(self) -> ModelSpec:
        return ModelSpec(
            tuple(
                TableConfig(f"t{i}", self.rows, self.dim, (f"f{i}",), data_type=DataType.INT8)
                for i in range(self.num_tables)
            )
        )


def _batches(spec: ModelSpec, w: Workload, count: int) -> list[SparseFeatures]:
    return [SparseFeatures.random(spec, w.batch_size, w.ids_per_bag, seed=100 + i) for i in range(count)]


def _time(run: Callable[[SparseFeatures], object], batches: list[SparseFeatures], min_seconds: float) -> float:
    """Seconds per batch: cycles the batches for at least ``min_seconds`` (and at least one full cycle)."""
    run(batches[0])  # warm-up
    calls = 0
    started = time.perf_counter()
    while True:
        for batch in batches:
            run(batch)
            calls += 1
        elapsed = time.perf_counter() - started
        if elapsed >= min_seconds:
            return elapsed / calls


def _file_bytes(folder: Path, names: list[str]) -> int:
    return sum((folder / name).stat().st_size for name in names)


def bench_workload(w: Workload, rounds: int, min_seconds: float, poolings: list[str], workdir: Path) -> None:
    spec = w.spec()
    model = quantize(spec, random_weights(spec, seed=0))
    started = time.perf_counter()
    ts_path = export(model, workdir / f"{w.name}-ts")
    ts_export = time.perf_counter() - started
    runtimes: dict[str, Runtime] = {"tbe_torchscript": load(ts_path)}
    onnx_exports: dict[str, float] = {}
    sizes: dict[str, int] = {}
    for pooling in poolings:
        scratch = workdir / f"{w.name}-{pooling}-onnx-only"
        scratch.mkdir()
        started = time.perf_counter()
        export_onnx(model, scratch, pooling)  # the ONNX part of export(onnx=True) alone, timed
        onnx_exports[pooling] = time.perf_counter() - started
        sizes[pooling] = _file_bytes(scratch, ["model.onnx", "model.onnx.data"])
        path = export(model, workdir / f"{w.name}-{pooling}", onnx=True, onnx_pooling=pooling)
        runtimes[f"ort_{pooling}"] = load(path, backend="onnxruntime")
        if pooling == DEFAULT_POOLING:
            runtimes[f"ort_{pooling}_1thread"] = load(path, backend="onnxruntime", intra_op_threads=1)
    del model
    batches = _batches(spec, w, 4)
    lookups = w.num_tables * w.batch_size * w.ids_per_bag
    runs: dict[str, Callable[[SparseFeatures], object]] = {name: rt.lookup for name, rt in runtimes.items()}
    if DEFAULT_POOLING in poolings:
        session = runtimes[f"ort_{DEFAULT_POOLING}"].module.session
        feeds = [{"values": b.values.numpy(), "lengths": b.lengths.numpy()} for b in batches]
        by_id = {id(b): f for b, f in zip(batches, feeds)}
        runs[f"ort_{DEFAULT_POOLING}_session_run"] = lambda b: session.run(["embeddings"], by_id[id(b)])
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            # the scatter design is orders of magnitude slower: one cycle of batches is enough for it
            seconds[name].append(_time(run, batches, 0.0 if "scatter" in name else min_seconds))
    baseline = lookups / statistics.median(seconds["tbe_torchscript"]) / 1e6
    for name, values in seconds.items():
        rate = lookups / statistics.median(values) / 1e6
        record = {
            "bench": "onnx",
            "workload": w.name,
            "case": name,
            "rows": w.rows,
            "dim": w.dim,
            "batch": w.batch_size,
            "ids_per_bag": w.ids_per_bag,
            "m_lookups_per_s": round(rate, 2),
            "ms_per_batch": round(1e3 * statistics.median(values), 3),
            "ratio_to_tbe": round(rate / baseline, 3),
        }
        print(json.dumps(record), flush=True)
    pt_bytes = _file_bytes(ts_path, ["model.pt"])
    for pooling in poolings:
        record = {
            "bench": "onnx_export",
            "workload": w.name,
            "pooling": pooling,
            "torchscript_export_s": round(ts_export, 2),
            "onnx_export_s": round(onnx_exports[pooling], 2),
            "model_pt_bytes": pt_bytes,
            "onnx_bytes": sizes[pooling],
            "onnx_over_pt": round(sizes[pooling] / pt_bytes, 4),
        }
        print(json.dumps(record), flush=True)


def main() -> None:
    # this file is named onnx.py: its folder must not shadow the onnx package, imported lazily by export
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000, help="rows per table (W64/W128 use 1,000,000)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--min-seconds", type=float, default=1.0, help="per case and round")
    parser.add_argument("--workloads", default="W64,W128")
    parser.add_argument("--poolings", default=",".join(POOLINGS))
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads for the TBE artifact (one TBE call runs on one core; more threads only "
        "add OpenMP barriers to its small validation ops, which a loaded machine punishes)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.torch_threads)
    chosen = args.workloads.split(",")
    all_workloads = [Workload("W64", 8, args.rows, 64, 512, 20), Workload("W128", 8, args.rows, 128, 2048, 20)]
    with tempfile.TemporaryDirectory(prefix="bench-onnx-") as tmp:
        for w in all_workloads:
            if w.name in chosen:
                bench_workload(w, args.rounds, args.min_seconds, args.poolings.split(","), Path(tmp))


if __name__ == "__main__":
    main()
