# ruff: noqa: E402
"""How long a model version takes to come in (load + warm-up: the hot swap's delay), by phase, the new way against
the old way in the same run.

Per case, two versions of one model with different weights (tables and dense part: a retrained model, so each
``model.pt`` is a structure of its own) and a third that is the second's files again (hard links: same structure,
the repository copies it). A fresh process per way and repeat builds a ``server.repository.Repository`` of
version 1 (the first version of a process: fbgemm's libraries load then), then brings in version 2 (a new
structure) and version 3 (a known one), each as a poll finds it. One JSON line per case and version: the median
total and CPU seconds of each way, their ratio, and each phase's median seconds (the server logs the same split
and exports it as ``embserve_model_load_seconds{phase}``). The target (the demo's versions in at most 1 s) holds
on a quiet host: on a busy one the loader thread runs at the lowest CPU priority by design, and the CPU seconds
are the better guide (``host_quiet``: 1-minute load average under half the cores; the exit code is 1 only when
the host was quiet and the target missed).

The old way, measured in the same run: the whole ``fbgemm_gpu`` package imported (not only its operator
libraries), and the model's methods run through TorchScript's optimizing executor (three calls each to settle).
Steady-state forward time of the two ways is printed too (``forward`` lines: median ms of a batch of 512 through
lookup+predict, after the warm-up), since the new way runs the model unoptimized on CPU.

    python bench/warmup.py                      # the demo model (0.21 GB mapped), unsharded and 2 CPU shards
    python bench/warmup.py --quick              # 1/10 of the demo's rows, 1 repeat
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Run as ``python bench/warmup.py``, this folder heads sys.path and would shadow the ``server`` package.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path[0] = os.path.dirname(sys.path[0])

from bench.soak import link_version

MODEL = "demo"
WAYS = ("new", "old")
TARGET_S = 1.0  # issue 39: a version of the demo model warms in at most 1 s on a quiet host


def export_versions(store: Path, quick: bool) -> dict[str, tuple[Path, Path]]:
    """case -> (version 1, version 2) artifact folders (kept in ``store`` for the next run)."""
    import dataclasses

    from infer import ComputeDevice, Topology, export, plan_for_inference, quantize, random_weights, shard_model
    from infer.demo import demo_spec

    found: dict[str, list[Path]] = {"demo": [], "demo_2_shards": []}
    for seed in (1, 2):
        spec = demo_spec(seed)
        if quick:
            tables = tuple(dataclasses.replace(t, num_embeddings=max(100, t.num_embeddings // 10)) for t in spec.tables)
            spec = dataclasses.replace(spec, tables=tables)
        targets = {case: store / f"{case}{'-quick' if quick else ''}-seed{seed}" for case in found}
        if not all((t / "manifest.json").is_file() for t in targets.values()):
            model = quantize(spec, random_weights(spec, seed=seed))
            if not (targets["demo"] / "manifest.json").is_file():
                export(model, targets["demo"])
            if not (targets["demo_2_shards"] / "manifest.json").is_file():
                plan = plan_for_inference(spec, Topology(2, ComputeDevice.CPU))
                export(shard_model(model, plan), targets["demo_2_shards"], plan=plan)
            del model
        for case, target in targets.items():
            found[case].append(target)
    return {case: (paths[0], paths[1]) for case, paths in found.items()}


def child(way: str, first: Path, second: Path, workdir: Path) -> dict[str, Any]:
    """In a fresh process: bring in versions 1, 2 (new structure) and 3 (version 2's structure) one at a time."""
    import torch

    import infer.artifact.fbgemm_libs as fbgemm_libs
    import infer.artifact.runtime as runtime_module

    if way == "old":
        fbgemm_libs.OPERATORS_ONLY = False
        runtime_module.PLAIN_EXECUTION_ON_CPU = False
    from infer.features import SparseFeatures
    from server.metrics import ServerMetrics
    from server.repository import BatchSettings, Repository

    with tempfile.TemporaryDirectory(dir=workdir) as folder:
        repo = Path(folder) / "repo"
        (repo / MODEL).mkdir(parents=True)
        link_version(first, repo, 1, MODEL)
        settings = BatchSettings(max_batch_size=4096, max_delay_s=0.001, max_queue=64, workers=2)

        async def run() -> dict[str, Any]:
            repository = Repository(repo, settings, ServerMetrics())
            found: dict[str, Any] = {}
            for version, bring_in in (("1", repository.load_all), ("2", repository.poll_once), ("3", None)):
                if version == "2":
                    link_version(second, repo, 2, MODEL)
                if version == "3":
                    link_version(second, repo, 3, MODEL)
                    bring_in = repository.poll_once
                started, cpu = time.perf_counter(), time.process_time()
                assert bring_in is not None
                await bring_in()
                total, cpu = time.perf_counter() - started, time.process_time() - cpu
                found[version] = {"total_s": total, "cpu_s": cpu, "phases": repository.load_phases(MODEL, version)}
                await repository.retired()
            runtime = repository.find(MODEL, "3").runtime
            batch = SparseFeatures.random(runtime.spec, batch_size=512, ids_per_bag=10, seed=7).validate(runtime.spec)
            dense = torch.randn(512, runtime.spec.num_dense_features, generator=torch.Generator().manual_seed(8))
            times = []
            for _ in range(40):
                started = time.perf_counter()
                runtime.lookup_and_predict_unchecked(dense, batch.values, batch.lengths, batch.weights)
                times.append(time.perf_counter() - started)
            found["forward_ms"] = 1e3 * statistics.median(times[10:])
            await repository.close()
            return found

        return asyncio.run(run())


def run_child(way: str, first: Path, second: Path, workdir: Path) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", way, str(first), str(second), "--workdir", str(workdir)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the {way} way's process exited {done.returncode}: {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def median_phases(runs: list[dict[str, Any]]) -> dict[str, float]:
    names = list(dict.fromkeys(name for run in runs for name in run["phases"]))
    return {name: round(statistics.median(run["phases"].get(name, 0.0) for run in runs), 4) for name in names}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per way (medians are printed)")
    parser.add_argument("--quick", action="store_true", help="1/10 of the demo's rows, one repeat")
    parser.add_argument("--cases", default="demo,demo_2_shards", help="comma-separated: demo, demo_2_shards")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "embserve-warmup-bench"),
                        help="where the versions are exported (kept for the next run)")  # fmt: skip
    parser.add_argument("--child", nargs=3, metavar=("WAY", "V1", "V2"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    if args.child:
        way, first, second = args.child
        print(json.dumps(child(way, Path(first), Path(second), workdir)), flush=True)
        return 0
    repeats = 1 if args.quick else args.repeats
    versions = export_versions(workdir, args.quick)
    met = True
    for case in args.cases.split(","):
        first, second = versions[case]
        runs: dict[str, list[dict[str, Any]]] = {way: [] for way in WAYS}
        for _ in range(repeats):
            for way in WAYS:  # interleaved: a neighbour's burst lands on both ways alike
                runs[way].append(run_child(way, first, second, workdir))
        for version, what in (("1", "first version"), ("2", "new structure"), ("3", "known structure")):
            line: dict[str, Any] = {"bench": "warmup", "case": case, "version": what, "repeats": repeats}
            for way in WAYS:
                line[f"{way}_s"] = round(statistics.median(r[version]["total_s"] for r in runs[way]), 4)
                line[f"{way}_cpu_s"] = round(statistics.median(r[version]["cpu_s"] for r in runs[way]), 4)
            line["ratio"] = round(line["new_s"] / line["old_s"], 3)
            line["cpu_ratio"] = round(line["new_cpu_s"] / line["old_cpu_s"], 3)
            if case == "demo" and not args.quick:
                # the target is for a quiet host: elsewhere the loader, at the lowest priority, waits its turn
                line["target_s"] = TARGET_S
                line["met"] = line["new_s"] <= TARGET_S
                line["host_quiet"] = os.getloadavg()[0] < 0.5 * (os.cpu_count() or 1)
                met &= line["met"] or not line["host_quiet"]
            for way in WAYS:
                line[f"{way}_phases_s"] = median_phases([r[version] for r in runs[way]])
            line["load_average"] = [round(v, 2) for v in os.getloadavg()]
            print(json.dumps(line), flush=True)
        forward = {way: statistics.median(r["forward_ms"] for r in runs[way]) for way in WAYS}
        print(json.dumps({
            "bench": "warmup", "case": case, "version": "forward after warm-up (batch 512, lookup+predict)",
            "new_ms": round(forward["new"], 3), "old_ms": round(forward["old"], 3),
            "ratio": round(forward["new"] / forward["old"], 3), "load_average": [round(v, 2) for v in os.getloadavg()],
        }), flush=True)  # fmt: skip
    shutil.rmtree(workdir / "repo", ignore_errors=True)
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
