"""CPU sharded plans against TorchRec's scripted quantized EBC and our unsharded model, in the same rounds.

For each workload (W128, W64) and each plan (row-wise and column-wise over 2 CPU devices, table-wise x2 for
comparison; ``--four`` adds the 4-device plans) the sharded model is exported (mapped weights, the default)
and loaded, then timed round by round against TorchRec's QEBC on the same weights and our unsharded export.
One JSON line per (workload, plan): M lookups/s, ``ratio_to_torchrec`` (the issue's target: RW x2 >= 1.3,
CW x2 >= 1.5), ``ratio_to_unsharded``, the weight files' bytes against the unsharded model's, and the load
average.

    python bench/sharding.py                 # full size: 8 tables x 1,000,000 rows
    python bench/sharding.py --rows 100000   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

# Run as ``python bench/sharding.py``, this folder heads sys.path and bench/server.py would shadow the ``server``
# package: put the repository root there instead (``bench.lookup`` is imported from it).
ROOT = Path(__file__).resolve().parent.parent
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path[0] = str(ROOT)

os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # as bench/lookup.py: idle OpenMP workers skew ratios

import torch  # noqa: E402

from bench.lookup import Workload, make_index_sets, measure, sharding_plan, torchrec_baseline, workloads  # noqa: E402
from infer.artifact.export import export  # noqa: E402
from infer.artifact.load import load  # noqa: E402
from infer.config import DataType, ModelSpec, TableConfig  # noqa: E402
from infer.quant.quantize import quantize  # noqa: E402
from infer.shard.builder import shard_model  # noqa: E402


def weight_file_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("weights-*.bin"))


def run_workload(w: Workload, rounds: int, index_count: int, plans: list[tuple[str, int]]) -> list[dict[str, object]]:
    spec = ModelSpec(
        tuple(TableConfig(f"t{i}", w.rows, w.dim, (f"f{i}",), data_type=DataType.INT8) for i in range(w.num_tables))
    )
    generator = torch.Generator().manual_seed(0)
    weights = {t.name: torch.randn(t.num_embeddings, t.embedding_dim, generator=generator) for t in spec.tables}
    model = quantize(spec, weights)
    torchrec = torchrec_baseline(spec, weights)
    del weights  # fp32 tables: 4 GB at W128 full size
    if torchrec is None:
        raise SystemExit("torchrec is not installed: the target is a ratio to TorchRec's QEBC")
    sets = make_index_sets(w, index_count, seed=1)
    keep = tempfile.TemporaryDirectory()
    unsharded_folder = Path(keep.name) / "unsharded"
    unsharded = load(export(model, unsharded_folder)).module
    unsharded_bytes = weight_file_bytes(unsharded_folder)
    lookups = w.num_tables * w.batch_size * w.ids_per_bag
    rows: list[dict[str, object]] = []
    for kind, shards in plans:
        plan = sharding_plan(kind, spec, shards, w)
        folder = Path(keep.name) / f"{kind}_{shards}"
        runtime = load(export(shard_model(model, plan), folder, plan=plan))
        sharded = runtime.module
        cases: dict[str, Callable[[int], object]] = {
            "torchrec_qebc": lambda i: torchrec(sets[i][0], sets[i][1]),
            "unsharded": lambda i: unsharded(sets[i][0], sets[i][1], None),
            "sharded": lambda i, module=sharded: module(sets[i][0], sets[i][1], None),
        }
        with torch.inference_mode():
            reference = cases["torchrec_qebc"](0)
            got = cases["sharded"](0)
            assert isinstance(reference, torch.Tensor) and isinstance(got, torch.Tensor)
            max_diff = float((reference - got).abs().max())
            seconds = measure(cases, index_count, rounds, {})
        rows.append(
            {
                "bench": "sharding",
                "workload": w.name,
                "case": f"{kind}_{shards}",
                "mlookups_per_s": round(lookups / seconds["sharded"] / 1e6, 2),
                "torchrec_mlookups_per_s": round(lookups / seconds["torchrec_qebc"] / 1e6, 2),
                "unsharded_mlookups_per_s": round(lookups / seconds["unsharded"] / 1e6, 2),
                "ratio_to_torchrec": round(seconds["torchrec_qebc"] / seconds["sharded"], 3),
                "ratio_to_unsharded": round(seconds["unsharded"] / seconds["sharded"], 3),
                "max_abs_diff_vs_torchrec": max_diff,
                "weight_file_bytes": weight_file_bytes(folder),
                "unsharded_weight_file_bytes": unsharded_bytes,
                "kernels": len(runtime.manifest.kernels),
                "kernel_threads": runtime.threads,
                "load_1m": round(os.getloadavg()[0], 2),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
        del runtime, sharded, cases
    keep.cleanup()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows per table (default 1,000,000)")
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds per case (W64: x4, smaller batches)")
    parser.add_argument("--index-sets", type=int, default=8, help="distinct id batches cycled through")
    parser.add_argument("--workload", choices=["W128", "W64"], action="append", help="run only these workloads")
    parser.add_argument("--four", action="store_true", help="also the 4-device row- and column-wise plans")
    args = parser.parse_args()
    plans = [("row_wise", 2), ("column_wise", 2), ("table_wise", 2)]
    if args.four:
        plans += [("row_wise", 4), ("column_wise", 4)]
    for w in workloads(args.rows):
        if args.workload and w.name not in args.workload:
            continue
        run_workload(w, args.rounds * max(1, 2048 // w.batch_size), args.index_sets, plans)
    return 0


if __name__ == "__main__":
    sys.exit(main())
