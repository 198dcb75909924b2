"""Verified loads of a large artifact: the old sequential path (whole-file sha256, then ``torch.jit.load``)
against per-chunk sha256 hashed in parallel, and the mapped format (weights in a file beside ``model.pt``,
mapped read-only), on the same weights with a warm page cache, in a process that has imported torch and fbgemm.

Exports one INT8 table of ``--gb`` GB (bytes filled in place: no fp32 weights to quantize) twice, embedded and
mapped, then hard-links the embedded model.pt into a third artifact whose manifest has no chunk digests (what
exports before chunking wrote). Cases, each timed ``--repeats`` times, interleaved (a drifting host hits all
alike):

- ``sequential``: ``infer.load`` of the artifact without chunks (today's path; the baseline);
- ``pool_after_load``: ``infer.load`` with chunks, hashed by this process's threads (after the load: it holds
  the GIL throughout);
- ``overlapped``: ``infer.load`` with chunks, hashed by a child interpreter while ``torch.jit.load`` runs (the
  default);
- bounds: ``sha256_whole`` (one thread), ``chunks_threads`` (the pool alone), ``jit_load`` (no verification);
- ``inspect --verify`` without and with chunks: ``verify_whole``, ``verify_chunks``;
- ``mapped_none``: ``infer.load(mapped, verify="none")`` (sizes checked, the file mapped: load to ready);
- ``mapped_full``: ``infer.load(mapped)``: every 8 MiB chunk hashed by a thread pool, started before the model
  loads; ``mapped_chunks_<n>mib``: the pool alone over the weight file in chunks of n MiB (the chunk size's bound).

Prints one JSON line per case (median and best seconds, GB/s, ratio to ``sequential`` and to ``overlapped``, the
embedded format's default load, by median). Then ``pss_two_processes``: two processes load the mapped artifact and
read every weight; the proportional set size of their mappings of the weight file (``/proc/<pid>/smaps``) is
summed and divided by the file's bytes (1.0: one copy between them).

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

from infer.artifact.export import export
from infer.artifact.fbgemm_libs import load_fbgemm
from infer.artifact.load import load
from infer.artifact.manifest import MANIFEST_FILE, Manifest, sha256_file
from infer.config import DataType, ModelSpec, PoolingType, TableConfig
from infer.modules.collection import EmbserveModel, QuantizedEmbeddingBagCollection
from infer.storage import checksums as verify

DIM = 124  # + 4 bytes of fp16 scale/bias = 128 bytes a row


def build(gb: float, out: Path, weights: str = "embedded") -> Path:
    return export(big_model(gb), out, weights=weights)


def big_model(gb: float) -> EmbserveModel:
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
    return EmbserveModel(spec, collection)


_HOLDER = """
import sys
from infer.artifact.kernels import model_tbes
from infer.artifact.load import load
runtime = load(sys.argv[1], verify="none")
print(all(int(tbe.weights_host[::4096].sum()) >= 0 for tbe in model_tbes(runtime.module)), flush=True)  # a byte a page
sys.stdin.readline()
"""


def pss_of_mappings(pid: int, path: Path) -> int:
    """Bytes of proportional set size of process ``pid``'s mappings of ``path``."""
    total, inside = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header line
            inside = len(fields) >= 6 and fields[-1] == str(path.resolve())
        elif inside and fields[0] == "Pss:":
            total += int(fields[1]) * 1024
    return total


def pss_two_processes(artifact: Path) -> dict[str, object]:
    """Two processes hold the mapped artifact with every weight read: their weight mappings' PSS summed."""
    import subprocess

    manifest = Manifest.read(artifact)
    names = sorted({k.weights.file for k in manifest.kernels if k.weights is not None})
    weight_bytes = sum(manifest.file(name).bytes for name in names)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH")])),
    )
    holders = [
        subprocess.Popen(
            [sys.executable, "-c", _HOLDER, str(artifact)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        for holder in holders:
            assert holder.stdout is not None
            if holder.stdout.readline().strip() != "True":
                error = holder.communicate("\n")[1][-2000:]
                return {"bench": "load", "case": "pss_two_processes", "returncode": holder.returncode, "error": error}
        pss = [sum(pss_of_mappings(h.pid, artifact / name) for name in names) for h in holders]
    finally:
        for holder in holders:
            if holder.poll() is None:
                holder.communicate("\n")
    return {
        "bench": "load",
        "case": "pss_two_processes",
        "weight_bytes": weight_bytes,
        "pss_bytes": pss,
        "sum_over_weight_bytes": round(sum(pss) / weight_bytes, 3),
        "host_load_1m": round(os.getloadavg()[0], 2),
    }


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
    parser.add_argument("--no-pss", action="store_true", help="skip the two-process PSS measurement")
    args = parser.parse_args()
    if args.gb <= 0 or args.repeats < 1:
        parser.error("--gb must be > 0 and --repeats >= 1")

    with tempfile.TemporaryDirectory(prefix="embserve-load-", dir=args.workdir) as tmp:
        if args.artifact:
            chunked = Path(args.artifact)
            mapped = Path(args.artifact + "-mapped")
        else:
            model = big_model(args.gb)
            chunked = export(model, Path(tmp) / "chunked", weights="embedded")
            mapped = export(model, Path(tmp) / "mapped", weights="mapped")
            del model
        legacy = without_chunks(chunked, Path(tmp) / "legacy")
        weights_path = mapped / "weights-0.bin"
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
            "mapped_none": lambda: load(mapped, verify="none"),
            "mapped_full": lambda: load(mapped),
            **{
                f"mapped_chunks_{mib}mib": (lambda mib=mib: verify.chunk_digests(weights_path, mib << 20, pool))
                for mib in (4, 8, 32)
            },
        }
        if args.cases:
            unknown = sorted(set(args.cases) - set(cases))
            if unknown:
                parser.error(f"unknown cases {unknown}; choose from {sorted(cases)}")
            cases = {name: run for name, run in cases.items() if name == "sequential" or name in args.cases}
        sha256_file(model_path)  # warm the page cache
        sha256_file(weights_path)
        load(chunked)
        load(mapped)
        times: dict[str, list[float]] = {name: [] for name in cases}
        load_average = os.getloadavg()[0]  # other work on the host: parallel hashing needs idle cores
        for _ in range(args.repeats):
            for name, run in cases.items():
                started = time.perf_counter()
                result = run()
                times[name].append(time.perf_counter() - started)
                del result
        pool.shutdown()
        pss = None if args.no_pss else pss_two_processes(mapped)
    base = statistics.median(times["sequential"])
    embedded = statistics.median(times["overlapped"]) if "overlapped" in times else None
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
                    "ratio_to_overlapped": round(embedded / median, 3) if embedded else None,
                    "repeats": args.repeats,
                    "all_s": [round(t, 3) for t in seconds],
                    "workers": verify.default_workers(),
                    "cpus": os.cpu_count(),
                    "host_load_1m": [round(load_average, 2), round(os.getloadavg()[0], 2)],
                }
            ),
            flush=True,
        )
    if pss is not None:
        print(json.dumps(pss), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
