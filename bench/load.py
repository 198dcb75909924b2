"""Verified loads of a large artifact: the old sequential path (whole-file sha256, then ``torch.jit.load``)
against per-chunk sha256 hashed in parallel, on the same file with a warm page cache.

Exports one INT8 table of ``--gb`` GB (bytes filled in place: no fp32 weights to quantize), then hard-links its
model.pt into a second artifact whose manifest has no chunk digests (what exports before chunking wrote), so
both read the same pages. Cases, each timed ``--repeats`` times, interleaved (a drifting host hits all alike):

- ``sequential``: ``infer.load`` of the artifact without chunks (today's path; the baseline);
- ``pool_after_load``: ``infer.load`` with chunks, hashed by this process's threads (after the load: it holds
  the GIL throughout);
- ``overlapped``: ``infer.load`` with chunks, hashed by a child interpreter while ``torch.jit.load`` runs (the
  default);
- bounds: ``sha256_whole`` (one thread), ``chunks_threads`` (the pool alone), ``jit_load`` (no verification);
- ``inspect --verify`` without and with chunks: ``verify_whole``, ``verify_chunks``.

Prints one JSON line per case (median and best seconds, GB/s, ratio to ``sequential`` by median).

    python bench/load.py --gb 2.1
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
from pathlib import Path

import numpy as np
import torch

from infer.artifact import verify
from infer.artifact.export import export
from infer.artifact.fbgemm_libs import load_fbgemm
from infer.artifact.load import load
from infer.artifact.manifest import MANIFEST_FILE, Manifest, sha256_file
from infer.config import DataType, ModelSpec, PoolingType, TableConfig
from infer.modules.collection import EmbserveModel, QuantizedEmbeddingBagCollection

DIM = 124  # + 4 bytes of fp16 scale/bias = 128 bytes a row


def build(gb: float, out: Path) -> Path:
    rows = int(gb * 1e9 / (DIM + 4))
    spec = ModelSpec((TableConfig("big", rows, DIM, ("big_id",), PoolingType.SUM, DataType.INT8),))
    collection = QuantizedEmbeddingBagCollection(spec)
    generator = torch.Generator().manual_seed(0)
    scale_bias = np.array([0.01, -1.25], dtype=np.float16).view(np.uint8)
    with torch.no_grad():
        for data, sb in collection.table_weights():
            for first in range(0, data.shape[0], 1 << 20):  # in slices: no second copy of the table
                data[first : first + (1 << 20)].random_(0, 256, generator=generator)
            if sb is not None:
                sb.copy_(torch.from_numpy(scale_bias).expand_as(sb))
    return export(EmbserveModel(spec, collection), out)


def without_chunks(artifact: Path, out: Path) -> Path:
    """The same files (hard links) under a manifest without chunk digests."""
    out.mkdir(parents=True, exist_ok=True)
    manifest = Manifest.read(artifact)
    for entry in manifest.files:
        target = out / entry.name
        if not target.exists():
            os.link(artifact / entry.name, target)
    data = json.loads((artifact / MANIFEST_FILE).read_text(encoding="utf-8"))
    for entry in data["files"].values():
        entry.pop("chunks", None)
    (out / MANIFEST_FILE).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return out


def hashing_in_threads(run: Callable[[], object]) -> Callable[[], object]:
    def call() -> object:
        verify.USE_SUBPROCESS = False
        try:
            return run()
        finally:
            verify.USE_SUBPROCESS = True

    return call


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=2.1, help="artifact size in GB (default 2.1)")
    parser.add_argument("--repeats", type=int, default=3, help="timings per case (default 3)")
    parser.add_argument("--artifact", default=None, help="reuse an artifact this bench exported (no export)")
    parser.add_argument("--workdir", default=None, help="folder for the artifacts (default: a temporary one)")
    parser.add_argument("--cases", nargs="+", default=None, help="run only these cases (sequential always runs)")
    args = parser.parse_args()
    if args.gb <= 0 or args.repeats < 1:
        parser.error("--gb must be > 0 and --repeats >= 1")

    with tempfile.TemporaryDirectory(prefix="embserve-load-", dir=args.workdir) as tmp:
        chunked = Path(args.artifact) if args.artifact else build(args.gb, Path(tmp) / "chunked")
        legacy = without_chunks(chunked, Path(tmp) / "legacy")
        manifest = Manifest.read(chunked)
        model_path = chunked / manifest.model_file
        total = sum(e.bytes for e in manifest.files)
        entry = manifest.file(manifest.model_file)
        if entry.chunks is None:
            print(f"{model_path} has no chunk digests (under {verify.CHUNKED_MIN_BYTES} bytes?)", file=sys.stderr)
            return 1
        load_fbgemm()
        pool = verify.ThreadPoolExecutor(verify.default_workers())
        cases: dict[str, Callable[[], object]] = {
            "sequential": lambda: load(legacy),
            "pool_after_load": hashing_in_threads(lambda: load(chunked)),
            "overlapped": lambda: load(chunked),
            "sha256_whole": lambda: sha256_file(model_path),
            "chunks_threads": lambda: verify.chunk_digests(model_path, entry.chunks.bytes, pool),  # type: ignore[union-attr]
            "jit_load": lambda: torch.jit.load(str(model_path)),
            "verify_whole": lambda: Manifest.read(legacy).verify_files(legacy),
            "verify_chunks": lambda: manifest.verify_files(chunked),
        }
        if args.cases:
            unknown = sorted(set(args.cases) - set(cases))
            if unknown:
                parser.error(f"unknown cases {unknown}; choose from {sorted(cases)}")
            cases = {name: run for name, run in cases.items() if name == "sequential" or name in args.cases}
        sha256_file(model_path)  # warm the page cache
        load(chunked)
        times: dict[str, list[float]] = {name: [] for name in cases}
        load_average = os.getloadavg()[0]  # other work on the host: parallel hashing needs idle cores
        for _ in range(args.repeats):
            for name, run in cases.items():
                started = time.perf_counter()
                result = run()
                times[name].append(time.perf_counter() - started)
                del result
        pool.shutdown()
    base = statistics.median(times["sequential"])
    for name, seconds in times.items():
        median = statistics.median(seconds)
        print(
            json.dumps(
                {
                    "bench": "load",
                    "case": name,
                    "gb": round(total / 1e9, 3),
                    "chunk_mib": entry.chunks.bytes >> 20,
                    "median_s": round(median, 3),
                    "best_s": round(min(seconds), 3),
                    "gb_per_s": round(total / 1e9 / median, 3),
                    "best_gb_per_s": round(total / 1e9 / min(seconds), 3),
                    "ratio_to_sequential": round(base / median, 3),
                    "repeats": args.repeats,
                    "all_s": [round(t, 3) for t in seconds],
                    "workers": verify.default_workers(),
                    "cpus": os.cpu_count(),
                    "host_load_1m": [round(load_average, 2), round(os.getloadavg()[0], 2)],
                }
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
