"""Lookups on a CUDA device: the exported embserve model against TorchRec's quantized EBC and a direct fbgemm TBE
on the same GPU, and the achieved bytes/s of row reads against the device's copy bandwidth.

Prints one JSON line per (workload, batch, case): ms per call (median of CUDA-event timings), M lookups/s, the
ratio to TorchRec's quantized EBC measured in the same rounds, and ``hbm_fraction``: row bytes read per second
(each lookup reads one INT8 row, ``dim + 4`` bytes padded to the 16-byte row alignment) over the bytes/s of a
device-to-device copy measured in the same run (bytes read plus bytes written). ``fbgemm_managed`` and
``fbgemm_managed_caching`` are the same TBE with its rows in host memory mapped into the device (UVM) and in UVM
with a device cache (fbgemm's ``MANAGED`` / ``MANAGED_CACHING``), against device placement.

    python bench/lookup_cuda.py                     # W128 and W64, batch 2048 and 16384, 1M rows per table
    python bench/lookup_cuda.py --rows 100000       # a quick look
    python bench/lookup_cuda.py --device cpu --rows 20000 --rounds 3   # the same code path on CPU (no timing value)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from lookup import Workload, make_index_sets, torchrec_baseline  # noqa: E402

from infer.artifact.export import export  # noqa: E402
from infer.artifact.load import load  # noqa: E402
from infer.config import DataType, ModelSpec, TableConfig  # noqa: E402
from infer.quant.quantize import quantize  # noqa: E402

ROW_ALIGNMENT = 16
WARM_UP_CALLS = 3


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of one call: CUDA events on a GPU, the wall clock on CPU."""
    if device.type != "cuda":
        started = time.perf_counter()
        fn()
        return time.perf_counter() - started
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def copy_bytes_per_s(device: torch.device, size: int = 1 << 30, rounds: int = 10) -> float:
    """Bytes read plus written per second by a device-to-device copy of ``size`` bytes."""
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = statistics.median(timed(lambda: dst.copy_(src), device) for _ in range(rounds))
    return 2 * size / seconds


def fbgemm_tbe(spec: ModelSpec, device: torch.device, location_name: str, model: torch.nn.Module) -> torch.nn.Module:
    """One fbgemm INT8 TBE over ``spec``'s tables at ``location_name``, holding a copy of ``model``'s rows."""
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode, EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen

    location = EmbeddingLocation.HOST if device.type == "cpu" else EmbeddingLocation[location_name]
    tbe = IntNBitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(t.name, t.num_embeddings, t.embedding_dim, SparseType.INT8, location) for t in spec.tables],
        pooling_mode=PoolingMode.SUM,
        device=device,
        bounds_check_mode=BoundsCheckMode.FATAL,
        output_dtype=SparseType.FP32,
        row_alignment=ROW_ALIGNMENT if device.type == "cuda" else None,
    )
    tbe.initialize_weights()
    tbe.assign_embedding_weights(model.embeddings.table_weights())
    return tbe


def build_cases(
    spec: ModelSpec, device: torch.device
) -> tuple[dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]], dict[str, str]]:
    """Every case over the same fp32 tables of ``spec``, each called with (values, lengths, offsets) on ``device``;
    and the cases that could not be built, with why."""
    generator = torch.Generator(device).manual_seed(0)  # drawn on the device: 4 GB of fp32 rows in no time
    weights = {
        t.name: torch.randn(t.num_embeddings, t.embedding_dim, generator=generator, device=device).cpu()
        for t in spec.tables
    }
    model = quantize(spec, weights, device=device)
    with tempfile.TemporaryDirectory() as tmp:
        exported = load(export(model, f"{tmp}/artifact", weights="embedded")).module
    cases: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
        "embserve_exported": lambda v, n, o: exported(v, n, None),
        # the same model with the request checks left out (what the servers call after checking a request)
        "embserve_unchecked": lambda v, n, o: exported.lookup_unchecked(v, n, None),
    }
    errors: dict[str, str] = {}
    for name in ["DEVICE", "MANAGED", "MANAGED_CACHING"] if device.type == "cuda" else ["HOST"]:
        try:
            tbe = fbgemm_tbe(spec, device, name, model)
        except Exception as error:  # noqa: BLE001 - a bench reports what fbgemm refused and goes on
            errors[f"fbgemm_{name.lower()}"] = f"{type(error).__name__}: {error}"[:300]
            continue
        cases[f"fbgemm_{name.lower()}"] = lambda v, n, o, tbe=tbe: tbe(v, o)
    try:
        torchrec = torchrec_baseline(spec, weights, str(device))
    except Exception as error:  # noqa: BLE001
        torchrec, errors["torchrec_qebc"] = None, f"{type(error).__name__}: {error}"[:300]
    if torchrec is not None:
        cases["torchrec_qebc"] = lambda v, n, o: torchrec(v, n)
    return cases, errors


def run(
    w: Workload,
    cases: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]],
    device: torch.device,
    rounds: int,
    index_count: int,
    copy_bw: float,
) -> list[dict[str, object]]:
    sets = [(v.to(device), n.to(device), o.to(device)) for v, n, o in make_index_sets(w, index_count, seed=1)]
    diffs: dict[str, float] = {}
    samples: dict[str, list[float]] = {name: [] for name in cases}
    with torch.inference_mode():
        reference = cases["embserve_exported"](*sets[0])
        for name, fn in cases.items():  # warm-up, and each case's answer against the exported model's
            for _ in range(WARM_UP_CALLS):  # TorchScript's profiling executor optimizes a method on its 2nd-3rd call
                fn(*sets[0])
            diffs[name] = float((fn(*sets[0]).float() - reference).abs().max())
        names = list(cases)
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                samples[name].append(timed(lambda name=name, r=r: cases[name](*sets[r % index_count]), device))
    seconds = {name: statistics.median(s) for name, s in samples.items()}
    lookups = w.num_tables * w.batch_size * w.ids_per_bag
    row_bytes = -(-(w.dim + 4) // ROW_ALIGNMENT) * ROW_ALIGNMENT
    rows: list[dict[str, object]] = []
    for name, secs in seconds.items():
        rows.append(
            {
                "bench": "lookup_cuda",
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "workload": w.name,
                "batch": w.batch_size,
                "rows": w.rows,
                "case": name,
                "ms_per_call": round(1e3 * secs, 4),
                "mlookups_per_s": round(lookups / secs / 1e6, 1),
                "ratio_to_torchrec": round(seconds["torchrec_qebc"] / secs, 3) if "torchrec_qebc" in seconds else None,
                "ratio_to_device_tbe": (
                    round(seconds["fbgemm_device"] / secs, 3) if "fbgemm_device" in seconds else None
                ),
                "row_gbytes_per_s": round(lookups * row_bytes / secs / 1e9, 1),
                "hbm_fraction": round(lookups * row_bytes / secs / copy_bw, 3),
                "copy_gbytes_per_s": round(copy_bw / 1e9, 1),
                "max_abs_diff_vs_embserve": diffs[name],
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def profile(
    w: Workload,
    cases: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]],
    device: torch.device,
) -> None:
    """Where a call of the exported model and of the bare TBE spends its time (torch.profiler, on stderr)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    values, lengths, offsets = (t.to(device) for t in make_index_sets(w, 1, seed=2)[0])
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for name in ("embserve_exported", "fbgemm_device"):
        if name not in cases:
            continue
        with torch.inference_mode(), torch_profile(activities=activities) as prof:
            for _ in range(20):
                cases[name](values, lengths, offsets)
            if device.type == "cuda":
                torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18)
        print(f"--- profile {name} {w.name} batch {w.batch_size} (20 calls)\n{table}", file=sys.stderr, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows per table (default 1,000,000)")
    parser.add_argument("--rounds", type=int, default=50, help="timed rounds per case")
    parser.add_argument("--index-sets", type=int, default=4, help="distinct id batches cycled through")
    parser.add_argument("--batches", default="2048,16384", help="batch sizes, comma-separated")
    parser.add_argument("--device", default="cuda:0", help="the device (default cuda:0; cpu runs the code path)")
    parser.add_argument("--profile", action="store_true", help="also print torch.profiler tables on stderr")
    args = parser.parse_args()
    device = torch.device(args.device)
    copy_bw = copy_bytes_per_s(device, size=(1 << 30) if device.type == "cuda" else (1 << 26))
    for name, dim in (("W128", 128), ("W64", 64)):
        spec = ModelSpec(
            tuple(TableConfig(f"t{i}", args.rows, dim, (f"f{i}",), data_type=DataType.INT8) for i in range(8))
        )
        cases, errors = build_cases(spec, device)
        for case, error in errors.items():
            print(json.dumps({"bench": "lookup_cuda", "workload": name, "case": case, "error": error}), flush=True)
        for batch in (int(b) for b in args.batches.split(",")):
            w = Workload(name, 8, args.rows, dim, batch, 20)
            run(w, cases, device, args.rounds, args.index_sets, copy_bw)
            if args.profile:
                profile(w, cases, device)
        del cases
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
