"""``model.pt2`` (torch.export + AOTInductor) against the TorchScript artifact: batch-1 latency, W128 throughput,
compile time, artifact sizes and memory after load (anonymous vs file-backed), unsharded and table-wise over 2
CPU devices.

Prints one JSON line per case with ratios to the TorchScript artifact measured in the same run on the same
batches (W128's index sets from bench/lookup.py, cycled; cases interleaved round by round so machine noise
hits all alike). Both backends run through ``runtime.module(values, lengths, None)``, the server's path,
validation included; ``pt2_program_only`` is the compiled program alone (int64 inputs, ones weights: what
the C++ loader calls), ``pt2_two_threads`` two Python threads each running the program on half the batch
(does the call release the GIL?), ``pt2_own_copy_program_only`` the program of an embedded export (its tables
inside model.pt2, copied into RAM at load) and ``pt2_mapped_vs_own_copy`` the mapped program's speed over it
(target >= 0.97, the issue's mapped-vs-copied bar). Memory: a fresh process's RssAnon and RssFile growth across
``load`` and after a lookup reading every table page (a mapped artifact's model.pt2 reads the weight files: no
anonymous copy).

    python bench/pt2.py            # W128 at 1,000,000 rows per table
    python bench/pt2.py --small    # 100,000 rows, fewer rounds: a quick look
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# Run as ``python bench/pt2.py``, this folder heads sys.path and bench/server.py would shadow the ``server``
# package: import the bench helpers as ``bench.lookup`` from the repository root instead.
ROOT = Path(__file__).resolve().parent.parent
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path[0] = str(ROOT)

import torch  # noqa: E402

from bench.lookup import Workload, make_index_sets, measure, sharding_plan  # noqa: E402
from infer.artifact.export import export  # noqa: E402
from infer.artifact.load import load  # noqa: E402
from infer.config import DataType, ModelSpec, TableConfig  # noqa: E402
from infer.quant.quantize import quantize  # noqa: E402
from infer.shard.builder import shard_model  # noqa: E402

VARIANTS = ("unsharded", "table_wise_2")


class _CompileTime(logging.Handler):
    """Catches export's "compiled model.pt2 in X s" record."""

    seconds: float | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("compiled model.pt2"):
            self.seconds = float(record.args[1])  # type: ignore[index]


def _rss_after_load(path: Path, backend: str) -> dict[str, float]:
    """Anonymous and file-backed resident memory (MB, /proc/self/status RssAnon, RssFile) a fresh process gains
    by ``load(path, backend)`` (torch and fbgemm imported first), and after one lookup reading every page of
    every table (ids 16 rows apart, built before the first reading): a copy of the tables is anonymous memory,
    a mapping's pages are file-backed."""
    script = (
        "import sys, torch, infer, fbgemm_gpu\n"
        "from infer.artifact.manifest import Manifest\n"
        "from infer.features import SparseFeatures\n"
        "from infer.storage.memory import memory_use\n"
        "def status():\n"
        "    use = memory_use()\n"
        "    return [use.rss_anon / 2**20, use.rss_file / 2**20]\n"
        "from pathlib import Path\n"
        f"spec = Manifest.read(Path({str(path)!r})).spec\n"
        "ids = [torch.arange(0, f.num_embeddings, 16) for f in spec.features]\n"
        "batch = SparseFeatures(spec.feature_names, torch.cat(ids), torch.tensor([len(i) for i in ids]))\n"
        f"before = status(); runtime = infer.load({str(path)!r}, backend={backend!r}); loaded = status()\n"
        "runtime.lookup(batch); touched = status()\n"
        "print(*(b - a for a, b in zip(before, loaded)), *(b - a for a, b in zip(before, touched)), flush=True)\n"
        # measured: skip the interpreter's teardown (a kernel thread still joinable there can abort the child)
        "import os; os._exit(0)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    if result.returncode != 0:
        raise RuntimeError(f"measuring memory after load ({backend}) failed: {result.stderr[-1500:]}")
    anon, file, anon_touched, file_touched = (round(float(x), 1) for x in result.stdout.split()[-4:])
    return {
        "anon_growth_mb": anon,
        "file_growth_mb": file,
        "anon_growth_mb_after_lookup": anon_touched,
        "file_growth_mb_after_lookup": file_touched,
    }


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bench_variant(variant: str, w: Workload, rounds: int, index_count: int, latency_calls: int, workdir: Path) -> None:
    spec = ModelSpec(
        tuple(TableConfig(f"t{i}", w.rows, w.dim, (f"f{i}",), data_type=DataType.INT8) for i in range(w.num_tables))
    )
    generator = torch.Generator().manual_seed(0)
    weights = {t.name: torch.randn(t.num_embeddings, t.embedding_dim, generator=generator) for t in spec.tables}
    model = quantize(spec, weights)
    plan = None
    if variant == "table_wise_2":
        plan = sharding_plan("table_wise", spec, 2, w)
        model = shard_model(model, plan)
    catcher = _CompileTime()
    logging.getLogger("infer.artifact.formats.pt2_export").addHandler(catcher)
    logging.getLogger("infer.artifact.formats.pt2_export").setLevel(logging.INFO)
    started = time.perf_counter()
    path = export(model, workdir / variant, plan=plan, pt2=True)
    export_s = time.perf_counter() - started
    # the same model with its tables inside model.pt2 (an embedded artifact): the program on its own copy in RAM
    own_copy = export(model, workdir / f"{variant}_own_copy", plan=plan, pt2=True, weights="embedded")
    del model
    sizes = {name: (path / name).stat().st_size for name in ("model.pt", "model.pt2")}
    memory = {backend: _rss_after_load(path, backend) for backend in ("torchscript", "pt2")}
    scripted = load(path)
    pt2 = load(path, backend="pt2")
    sets = make_index_sets(w, index_count, seed=1)
    program = pt2.module.program
    own_program = load(own_copy, backend="pt2").module.program
    ones = torch.ones(sets[0][0].numel())
    sets64 = [(values, lengths.to(torch.int64)) for values, lengths, _ in sets]

    def two_threads(i: int) -> object:
        values, lengths = sets[i][0], sets[i][1]
        half_ids, half_bags = values.numel() // 2, lengths.numel() // 2  # equal bags: every feature's first half
        per_feature = w.batch_size // 2
        outputs: list[torch.Tensor] = []

        def run(first: int) -> None:
            picked = torch.cat(
                [
                    values[f * w.batch_size * w.ids_per_bag :][first * w.ids_per_bag :][: per_feature * w.ids_per_bag]
                    for f in range(w.num_tables)
                ]
            )
            local = torch.full((half_bags,), w.ids_per_bag, dtype=torch.int64)
            outputs.append(program(picked, local, ones[:half_ids]))

        worker = threading.Thread(target=run, args=(0,))
        worker.start()
        run(per_feature)
        worker.join()
        return outputs

    cases = {
        "torchscript": lambda i: scripted.module(sets[i][0], sets[i][1], None),
        "pt2": lambda i: pt2.module(sets[i][0], sets[i][1], None),
        "pt2_program_only": lambda i: program(sets64[i][0], sets64[i][1], ones),
        "pt2_two_threads": two_threads,
        "pt2_own_copy_program_only": lambda i: own_program(sets64[i][0], sets64[i][1], ones),
    }
    with torch.inference_mode():
        equal = all(
            torch.equal(pt2.module(v, lengths, None), scripted.module(v, lengths, None)) for v, lengths, _ in sets
        )
        seconds = measure(cases, index_count, rounds, {})
    lookups = w.num_tables * w.batch_size * w.ids_per_bag
    common = {"bench": "pt2", "variant": variant, "workload": w.name, "rows": w.rows, "batch": w.batch_size}
    for name, secs in seconds.items():
        row = {
            **common,
            "case": name,
            "ms_per_call": round(1e3 * secs, 3),
            "mlookups_per_s": round(lookups / secs / 1e6, 2),
            "ratio_to_torchscript": round(seconds["torchscript"] / secs, 3),
            "outputs_equal": equal,
            "kernel_threads": scripted.threads,
        }
        print(json.dumps(row), flush=True)
    # the program reading the mapped weight files against the same program on its own copy in RAM, same rounds
    mapped_ratio = seconds["pt2_own_copy_program_only"] / seconds["pt2_program_only"]
    print(
        json.dumps({**common, "case": "pt2_mapped_vs_own_copy", "ratio": round(mapped_ratio, 3), "target": 0.97}),
        flush=True,
    )
    # batch-1 latency: p50 of many single calls, the two backends alternating
    singles = [make_index_sets(Workload(w.name, w.num_tables, w.rows, w.dim, 1, w.ids_per_bag), 64, seed=2)]
    batch1 = singles[0]
    latency: dict[str, list[float]] = {"torchscript": [], "pt2": [], "pt2_program_only": []}
    batch1_64 = [(values, lengths.to(torch.int64), torch.ones(values.numel())) for values, lengths, _ in batch1]
    runners = {
        "torchscript": lambda i: scripted.module(batch1[i][0], batch1[i][1], None),
        "pt2": lambda i: pt2.module(batch1[i][0], batch1[i][1], None),
        # the same request already int64, with its ones: the program's own time (what C++ pays) plus the call
        "pt2_program_only": lambda i: program(*batch1_64[i]),
    }
    with torch.inference_mode():
        for run in runners.values():
            run(0)
        for call in range(latency_calls):
            for name, run in runners.items():
                started = time.perf_counter()
                run(call % len(batch1))
                latency[name].append(time.perf_counter() - started)
    p50 = {name: statistics.median(s) for name, s in latency.items()}
    for name, samples in latency.items():
        print(
            json.dumps(
                {
                    **common,
                    "batch": 1,
                    "case": f"{name}_batch1_latency",
                    "p50_us": round(1e6 * p50[name], 1),
                    "p99_us": round(1e6 * _percentile(samples, 0.99), 1),
                    "calls": len(samples),
                    "ratio_to_torchscript": round(p50["torchscript"] / p50[name], 3),
                }
            ),
            flush=True,
        )
    table_bytes = sum(t.num_embeddings * (t.embedding_dim + 4) for t in spec.tables)
    print(
        json.dumps(
            {
                **common,
                "case": "artifact",
                "export_s": round(export_s, 1),
                "compile_s": round(catcher.seconds, 1) if catcher.seconds is not None else None,
                "int8_table_bytes": table_bytes,
                "model_pt_bytes": sizes["model.pt"],
                "model_pt2_bytes": sizes["model.pt2"],
                "pt2_to_pt_size": round(sizes["model.pt2"] / sizes["model.pt"], 3),
                **{f"{key}_{backend}": value for backend, grown in memory.items() for key, value in grown.items()},
                "torch": torch.__version__,
            }
        ),
        flush=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="100,000 rows per table, fewer rounds and calls")
    parser.add_argument("--rows", type=int, default=None, help="rows per table (default 1,000,000; --small 100,000)")
    parser.add_argument("--rounds", type=int, default=None, help="timed W128 rounds per case (default 30; --small 8)")
    parser.add_argument("--index-sets", type=int, default=8, help="distinct id batches cycled through")
    parser.add_argument("--latency-calls", type=int, default=None, help="batch-1 calls per backend (2000; --small 300)")
    parser.add_argument("--variant", choices=VARIANTS, action="append", help="run only these variants")
    args = parser.parse_args()
    rows = args.rows or (100_000 if args.small else 1_000_000)
    rounds = args.rounds or (8 if args.small else 30)
    latency_calls = args.latency_calls or (300 if args.small else 2000)
    w = Workload("W128", 8, rows, 128, 2048, 20)
    with tempfile.TemporaryDirectory() as tmp:
        for variant in args.variant or VARIANTS:
            bench_variant(variant, w, rounds, args.index_sets, latency_calls, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
