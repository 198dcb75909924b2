"""DLRM-v2 at full size (or ``--scale``d): streaming export through the callable source, then serving from the
mapped artifact.

MLPerf's DLRM-v2 has 26 tables of dim 128 (204,184,588 rows: fp32 104.5 GB, INT8 ~27 GB) and multi-hot features
(214 ids per sample). Its tables are made on demand, seeded by (table, block of 65,536 rows), so any row can be
made again to check what the artifact serves. Cases, one JSON line each, every line with the load average:

- ``export``: a fresh process exports the tables INT8 through ``CallableSource`` (``export_streaming``): seconds,
  rows/s, weight bytes, the process's peak resident set (VmHWM) and peak anonymous resident set (sampled as each
  chunk is encoded);
- ``load``: ``infer.load`` with ``verify="none"`` (load to ready) and ``"full"`` (every chunk hashed), the resident
  set after load (anonymous and file-backed), with the weight file's pages dropped from the page cache first
  (``posix_fadvise(DONTNEED)`` after ``fsync``: the serving passes start cold);
- ``lookups_<mode>_<pass>``: batches of 64 samples, each feature's bag as long as DLRM-v2's multi-hot size, ids
  Zipf(1.05) over a per-table permutation of the rows (hot rows scattered, as hashed ids are; the permutation is
  ``(a * rank + b) mod rows`` with ``a`` coprime to ``rows``), all batches made before timing; each serving mode in
  a process of its own, from an evicted page cache, the same batches twice (``cold``, then ``warm``): lookups/s,
  major faults and pages read from storage per lookup (``/proc/self/io``: the misses, readahead included).
  Modes: ``plain`` (the mapping as is: prefetch off), ``prefetch`` (``prefetch="on"``), ``cache`` (prefetch and a
  ``--cache-mib`` hot-row cache chosen from ``--sample-batches`` other batches of the same law), ``resident`` (the
  plain kernel on pages made resident first: the resident rate). ``--ram-budget-mib`` runs every mode but
  ``resident`` in a memory cgroup of that size (page cache included: the RAM budget);
- ``target_prefetch``: the prefetch mode's cold rate against the bound ``min(resident lookups/s, disk reads/s at
  depth 16 / misses per lookup)`` (target >= 0.5); ``target_cache``: misses per lookup of the warm pass with the
  cache over those of the same mapping without it (target <= 0.5 at the same RAM budget);
- ``disk``: the weight file's disk, read ``O_DIRECT`` (no page cache): random 4 KiB reads/s at queue depth 1 and
  16 (threads calling ``os.preadv`` into page-aligned buffers), sequential GB/s in 1 MiB reads;
- ``spot_check``: rows served (one-id bags) against the row made again and quantized by the row codec (must be
  equal) and against its fp32 values (max abs error).

- ``served_<server>_<pass>`` (``--servers python,native``): the same batches sent over embserve.v1 by
  ``--clients`` client threads (this process, outside the cgroup) to ``embserve serve`` and ``embserve serve
  --native``, each started from an evicted page cache inside the ``--ram-budget-mib`` cgroup (the server's own
  memory, its hot-row cache and the page cache all count) as the ``cache`` mode serves (``--prefetch on``, and
  ``--hot-rows`` chosen from the same sample: the rows chosen in Python for both): lookups/s, the server's major faults
  and pages read per lookup, its resident set; ``target_native``: the native server's warm (and cold) lookups/s
  over the Python server's (target >= 1) and whether their answers to the first batches are bit-equal.

The artifact is deleted at the end unless ``--keep``. Full size needs ~28 GB of disk and minutes:

    python bench/large.py --scale 0.05
    python bench/large.py               # the full-size model (~27 GB artifact)
    python bench/large.py --modes "" --servers python,native --ram-budget-mib 1024  # the two servers, 1 GiB
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import mmap
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

# Run as ``python bench/large.py``, this file's folder heads sys.path and bench/server.py would shadow the ``server``
# package (the --servers clients): the repository root instead
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path[0] = os.path.dirname(sys.path[0])

DLRM_V2_ROWS = (
    40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209, 11938, 155, 4,
    976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36,
)  # fmt: skip
DLRM_V2_MULTI_HOT = (3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1)
DIM = 128
# rows made per seeded generator (a row's values do not depend on how it is asked for); the export's 64 MiB chunks
# of 128-dim fp32 rows are 2^17 rows, so each chunk is one block, handed over without a copy
BLOCK_ROWS = 1 << 17
ZIPF_ALPHA = 1.05
BATCH = 64
PAGE = 4096


def scaled_rows(scale: float) -> list[int]:
    """DLRM-v2's rows times ``scale``; a table keeps at least min(rows, 64) rows."""
    return [max(min(rows, 64), round(rows * scale)) for rows in DLRM_V2_ROWS]


def dlrm_spec(scale: float) -> Any:
    from infer.config import DataType, ModelSpec, TableConfig

    return ModelSpec(
        tuple(
            TableConfig(f"t{t}", rows, DIM, (f"f{t}",), data_type=DataType.INT8)
            for t, rows in enumerate(scaled_rows(scale))
        )
    )


def make_block(seed: int, table: int, block: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + table * 10_007 + block)
    return torch.randn(BLOCK_ROWS, DIM, generator=generator)


def table_rows(seed: int, table: int, total: int) -> Any:
    """The callable of one table: rows ``start .. end`` (a slice of one block, or the blocks' slices in turn)."""

    def piece(block: int, start: int, end: int) -> torch.Tensor:
        first = block * BLOCK_ROWS
        return make_block(seed, table, block)[max(start, first) - first : min(end, first + BLOCK_ROWS, total) - first]

    def rows(start: int, end: int) -> Any:
        blocks = range(start // BLOCK_ROWS, (end - 1) // BLOCK_ROWS + 1)
        if len(blocks) == 1:
            return piece(blocks[0], start, end)
        return (piece(block, start, end) for block in blocks)

    return rows


def load_average() -> list[float]:
    return [round(value, 2) for value in os.getloadavg()]


def emit(case: str, **fields: Any) -> None:
    print(json.dumps({"case": case, **fields, "load_average": load_average()}), flush=True)


# ------------------------------------------------------------------------------------------------------- export


def export_child(args: argparse.Namespace) -> int:
    """The export, in a process of its own (its VmHWM is the export's)."""
    from infer.artifact.stream import export_streaming
    from infer.storage.sources import CallableSource

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("infer").setLevel(logging.INFO)  # a line per table, and the summary
    spec = dlrm_spec(args.scale)
    source = CallableSource(
        spec, {t.name: table_rows(args.seed, i, t.num_embeddings) for i, t in enumerate(spec.tables)}
    )
    done = export_streaming(spec, source, args.out, chunk_bytes=args.chunk_mib << 20)
    print(
        json.dumps(
            {
                "seconds": round(done.seconds, 2),
                "rows": done.rows,
                "rows_per_s": round(done.rows / done.seconds),
                "weight_bytes": done.weight_bytes,
                "peak_rss_gb": round(done.peak_rss_bytes / 1e9, 3),
                "peak_rss_anon_gb": round(done.peak_rss_anon_bytes / 1e9, 3),
                "rss_anon_at_start_gb": round(done.start_rss_anon_bytes / 1e9, 3),
                "fp32_gb": round(done.rows * DIM * 4 / 1e9, 2),
            }
        ),
        flush=True,
    )
    return 0


def run_export(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    command = [sys.executable, __file__, "--phase", "export", "--scale", str(args.scale), "--seed", str(args.seed)]
    command += ["--chunk-mib", str(args.chunk_mib), "--out", str(out)]
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True)  # its log lines go to our stderr
    if done.returncode != 0:
        raise SystemExit(f"export failed (status {done.returncode})")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


# ------------------------------------------------------------------------------------------------------- serving


def drop_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def zipf_ranks(rng: np.random.Generator, rows: int, count: int) -> np.ndarray:
    """``count`` ranks in [0, rows) with P(rank r) ~ (r + 1)^-alpha (inverse CDF of the continuous bounded law)."""
    u = rng.random(count)
    exponent = 1.0 - ZIPF_ALPHA
    top = float(rows + 1) ** exponent
    ranks = np.floor((1.0 + u * (top - 1.0)) ** (1.0 / exponent)) - 1
    return np.clip(ranks, 0, rows - 1).astype(np.int64)


def permutation(rng: np.random.Generator, rows: int) -> tuple[int, int]:
    """``(a, b)`` of the permutation ``rank -> (a * rank + b) mod rows`` (``a`` coprime to ``rows``)."""
    while True:
        a = int(rng.integers(1, max(rows, 2)))
        if math.gcd(a, rows) == 1:
            return a, int(rng.integers(0, rows))


def make_batches(spec: Any, count: int, seed: int, ids_seed: int | None = None) -> list[Any]:
    """``count`` batches; the tables' permutations come from ``seed``, the ids from ``ids_seed`` (default the same:
    a sample of requests for the hot-row cache uses another ``ids_seed``, the same permutations)."""
    from infer.features import SparseFeatures

    rng = np.random.default_rng(seed)
    perms = [permutation(rng, t.num_embeddings) for t in spec.tables]
    if ids_seed is not None:
        rng = np.random.default_rng(ids_seed)
    names = [f.name for f in spec.features]
    batches = []
    for _ in range(count):
        values, lengths = [], []
        for table, hot, (a, b) in zip(spec.tables, DLRM_V2_MULTI_HOT, perms):
            ranks = zipf_ranks(rng, table.num_embeddings, BATCH * hot)
            values.append((ranks * a + b) % table.num_embeddings)
            lengths.append(np.full(BATCH, hot, dtype=np.int32))
        batches.append(
            SparseFeatures.from_tensors(
                names, torch.from_numpy(np.concatenate(values)), torch.from_numpy(np.concatenate(lengths))
            )
        )
    return batches


def storage_read_bytes() -> int:
    """Bytes this process caused to be read from storage (``/proc/self/io``; page faults and their readahead
    included), 0 where it is not readable."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def run_pass(runtime: Any, batches: list[Any]) -> tuple[float, int, int, int]:
    """Seconds, ids looked up, major faults and bytes read from storage of one pass over ``batches``."""
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
    read = storage_read_bytes()
    started = time.perf_counter()
    ids = 0
    for batch in batches:
        runtime.lookup(batch)
        ids += batch.values.numel()
    seconds = time.perf_counter() - started
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_majflt - faults
    return seconds, ids, faults, storage_read_bytes() - read


# ------------------------------------------------------------------------------------------------------- disk


def random_reads(path: Path, depth: int, seconds: float) -> float:
    """Random 4 KiB ``O_DIRECT`` reads/s of ``path`` with ``depth`` threads each keeping one read in flight."""
    pages = path.stat().st_size // PAGE
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    counts = [0] * depth
    stop = time.perf_counter() + seconds

    def reader(index: int) -> None:
        buffer = mmap.mmap(-1, PAGE)  # page-aligned, as O_DIRECT needs
        rng = random.Random(index)
        done = 0
        while time.perf_counter() < stop:
            os.preadv(fd, [buffer], rng.randrange(pages) * PAGE)
            done += 1
        counts[index] = done
        buffer.close()

    try:
        started = time.perf_counter()
        threads = [threading.Thread(target=reader, args=(i,)) for i in range(depth)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return sum(counts) / (time.perf_counter() - started)
    finally:
        os.close(fd)


def sequential_read(path: Path, seconds: float) -> float:
    """GB/s of 1 MiB ``O_DIRECT`` reads from the start of ``path`` (for ``seconds`` at most)."""
    size = path.stat().st_size // (1 << 20) * (1 << 20)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buffer = mmap.mmap(-1, 1 << 20)
    try:
        started = time.perf_counter()
        offset = 0
        while offset < size and time.perf_counter() - started < seconds:
            offset += os.preadv(fd, [buffer], offset)
        return offset / (time.perf_counter() - started) / 1e9
    finally:
        buffer.close()
        os.close(fd)


# ------------------------------------------------------------------------------------------------------- checks


def spot_check(runtime: Any, spec: Any, seed: int, count: int) -> dict[str, Any]:
    """One-id bags of ``count`` random (table, row) pairs against the row made again."""
    from infer.features import SparseFeatures
    from infer.quant.rowwise import dequantize_rows, quantize_rows

    rng = random.Random(seed)
    names = [f.name for f in spec.features]
    equal, worst = 0, 0.0
    for _ in range(count):
        t = rng.randrange(len(spec.tables))
        table = spec.tables[t]
        row = rng.randrange(table.num_embeddings)
        block = make_block(seed, t, row // BLOCK_ROWS)
        fp32 = block[row % BLOCK_ROWS : row % BLOCK_ROWS + 1]
        data, scale_bias = quantize_rows(fp32, table.data_type)
        expected = dequantize_rows(data, scale_bias, table.data_type, DIM)[0]
        lengths = torch.zeros(len(names), dtype=torch.int32)
        lengths[t] = 1
        served = runtime.lookup(SparseFeatures.from_tensors(names, torch.tensor([row]), lengths))[0]
        got = served[t * DIM : (t + 1) * DIM]
        equal += int(torch.equal(got, expected))
        worst = max(worst, float((got - fp32[0]).abs().max()))
    return {"rows": count, "equal_to_dequantized": equal, "max_abs_error_vs_fp32": round(worst, 5)}


MODES = ("resident", "plain", "prefetch", "cache")


def memory_cgroup(limit_bytes: int) -> Path | None:
    """A new memory cgroup below this process's own, limited to ``limit_bytes`` (page cache included): cgroup v2
    ``memory.max`` or v1 ``memory.limit_in_bytes``; None where neither can be made here."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, where = line.split(":", 2)
        if controllers == "memory":
            parent, limit_file = Path("/sys/fs/cgroup/memory") / where.lstrip("/"), "memory.limit_in_bytes"
            break
    else:
        where = Path("/proc/self/cgroup").read_text().splitlines()[-1].split(":", 2)[2]
        parent, limit_file = Path("/sys/fs/cgroup") / where.lstrip("/"), "memory.max"
    group = parent / f"embserve-large-{os.getpid()}"
    try:
        group.mkdir()
        (group / limit_file).write_text(str(limit_bytes))
    except OSError as err:
        print(f"no memory cgroup ({err}); the RAM budget is the host's", file=sys.stderr)
        return None
    return group


def serve_child(args: argparse.Namespace) -> int:
    """One serving mode in a process of its own (its own memory cgroup when ``--cgroup``): two passes over the
    same batches from an evicted page cache; prints one JSON line per pass."""
    if args.cgroup:
        (Path(args.cgroup) / "cgroup.procs").write_text(str(os.getpid()))
    import infer
    from infer.artifact.fbgemm_libs import load_fbgemm
    from infer.artifact.paged import choose_hot_rows
    from infer.storage.memory import memory_use

    load_fbgemm()
    path = Path(args.out)
    spec = dlrm_spec(args.scale)
    batches = make_batches(spec, args.batches, args.seed + 1)
    hot_rows = None
    if args.mode == "cache":
        sample = make_batches(spec, args.sample_batches, args.seed + 1, ids_seed=args.seed + 2)
        ids: dict[str, list[torch.Tensor]] = {}
        for batch in sample:
            per_feature = batch.lengths.view(len(spec.features), -1).sum(1).tolist()
            for feature, piece in zip(spec.features, torch.split(batch.values, [int(n) for n in per_feature])):
                ids.setdefault(feature.table, []).append(piece)
        max_rows = (args.cache_mib << 20) // (DIM + 4)
        hot_rows = choose_hot_rows(spec, {name: torch.cat(pieces) for name, pieces in ids.items()}, max_rows)
    prefetch = "off" if args.mode == "plain" else "on"
    runtime = infer.load(path, verify="none", prefetch=prefetch, hot_rows=hot_rows)
    for file in sorted(path.glob("weights-*.bin")):
        drop_from_page_cache(file)
    passes = ("cold", "warm")
    if args.mode == "resident":  # warm the pages with prefetch, then time the plain kernel on them
        run_pass(runtime, batches)
        runtime.module.prefetcher = None
        passes = ("resident",)
    for name in passes:
        seconds, ids_done, faults, read = run_pass(runtime, batches)
        memory = memory_use()
        print(
            json.dumps(
                {
                    "mode": args.mode,
                    "pass": name,
                    "lookups": ids_done,
                    "lookups_per_s": round(ids_done / seconds),
                    "major_faults_per_lookup": round(faults / ids_done, 5),
                    "pages_read_per_lookup": round(read / PAGE / ids_done, 5),
                    "storage_read_gb": round(read / 1e9, 3),
                    "rss_anon_gb": round(memory.rss_anon / 1e9, 3),
                    "rss_file_gb": round(memory.rss_file / 1e9, 3),
                    "cache_rows": int(sum(h.numel() for h in hot_rows.values())) if hot_rows else 0,
                    "cache_mb": round(runtime.module.cache.weight_bytes / 1e6, 1) if hot_rows else 0,
                }
            ),
            flush=True,
        )
    return 0


def run_mode(args: argparse.Namespace, path: Path, mode: str, cgroup: Path | None) -> dict[str, dict[str, Any]]:
    command = [sys.executable, __file__, "--phase", "serve", "--mode", mode, "--out", str(path)]
    command += ["--scale", str(args.scale), "--seed", str(args.seed), "--batches", str(args.batches)]
    command += ["--sample-batches", str(args.sample_batches), "--cache-mib", str(args.cache_mib)]
    if cgroup is not None and mode != "resident":
        command += ["--cgroup", str(cgroup)]
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise SystemExit(f"serving mode {mode} failed (status {done.returncode})")
    results = {}
    for line in done.stdout.strip().splitlines():
        result = json.loads(line)
        results[result["pass"]] = result
        emit(f"lookups_{mode}_{result['pass']}", scale=args.scale, batch=BATCH, batches=args.batches, **result)
    return results


def serve(args: argparse.Namespace, path: Path) -> None:
    import infer
    from infer.artifact.fbgemm_libs import load_fbgemm
    from infer.storage.memory import memory_use

    load_fbgemm()
    spec = dlrm_spec(args.scale)
    weights = sorted(path.glob("weights-*.bin"))
    weight_bytes = sum(p.stat().st_size for p in weights)
    timings = {}
    for mode in ("full", "none") if not args.skip_full_verify else ("none",):
        for file in weights:
            drop_from_page_cache(file)
        started = time.perf_counter()
        runtime = infer.load(path, verify=mode)
        timings[mode] = time.perf_counter() - started
    after = memory_use()
    emit(
        "load",
        scale=args.scale,
        weight_gb=round(weight_bytes / 1e9, 3),
        verify_none_s=round(timings["none"], 3),
        verify_full_s=round(timings["full"], 2) if "full" in timings else None,
        verify_full_gb_per_s=round(weight_bytes / timings["full"] / 1e9, 2) if "full" in timings else None,
        rss_gb=round(after.rss / 1e9, 3),
        rss_anon_gb=round(after.rss_anon / 1e9, 3),
        rss_file_gb=round(after.rss_file / 1e9, 3),
    )
    depth1 = random_reads(weights[0], 1, args.probe_seconds)
    depth16 = random_reads(weights[0], 16, args.probe_seconds)
    sequential = sequential_read(weights[0], args.probe_seconds)
    emit(
        "disk",
        file=str(weights[0]),
        random_4k_reads_per_s_qd1=round(depth1),
        random_4k_reads_per_s_qd16=round(depth16),
        sequential_gb_per_s=round(sequential, 3),
    )
    cgroup = memory_cgroup(args.ram_budget_mib << 20) if args.ram_budget_mib else None
    try:
        runs = {mode: run_mode(args, path, mode, cgroup) for mode in args.modes.split(",") if mode}
        if args.servers:
            serve_servers(args, path, cgroup)
    finally:
        if cgroup is not None:
            cgroup.rmdir()
    budget = f"{args.ram_budget_mib} MiB memory cgroup" if cgroup is not None else "the host's RAM"
    if "resident" in runs and "prefetch" in runs:
        resident = runs["resident"]["resident"]
        cold = runs["prefetch"]["cold"]
        misses = cold["pages_read_per_lookup"]
        bound = min(resident["lookups_per_s"], depth16 / misses) if misses > 0 else resident["lookups_per_s"]
        emit(
            "target_prefetch",
            scale=args.scale,
            ram_budget=budget,
            resident_lookups_per_s=resident["lookups_per_s"],
            resident_pass_read_nothing=resident["storage_read_gb"] == 0,
            disk_qd16_reads_per_s=round(depth16),
            misses_per_lookup=misses,
            bound_lookups_per_s=round(bound),
            prefetch_cold_lookups_per_s=cold["lookups_per_s"],
            plain_cold_lookups_per_s=runs["plain"]["cold"]["lookups_per_s"] if "plain" in runs else None,
            ratio_to_bound=round(cold["lookups_per_s"] / bound, 3),
            target=0.5,
        )
    if "cache" in runs and "prefetch" in runs:
        cached = runs["cache"]["warm"]["pages_read_per_lookup"]
        paged = runs["prefetch"]["warm"]["pages_read_per_lookup"]
        plain = runs["plain"]["warm"]["pages_read_per_lookup"] if "plain" in runs else None
        emit(
            "target_cache",
            scale=args.scale,
            ram_budget=budget,
            cache_mb=runs["cache"]["warm"]["cache_mb"],
            misses_per_lookup_cache=cached,
            misses_per_lookup_page_cache=paged,  # the same mapping with MADV_RANDOM, no cache
            misses_per_lookup_plain=plain,  # no advice: each fault reads a readahead window
            cache_lookups_per_s=runs["cache"]["warm"]["lookups_per_s"],
            page_cache_lookups_per_s=runs["prefetch"]["warm"]["lookups_per_s"],
            ratio=round(cached / paged, 3) if paged > 0 else None,
            target=0.5,
        )
    emit("spot_check", scale=args.scale, **spot_check(runtime, spec, args.seed, args.spot_checks))


# ------------------------------------------------------------------------------------------------------- servers


def write_hot_rows_sample(args: argparse.Namespace, spec: Any, path: Path) -> int:
    """The ``cache`` mode's sample (``--sample-batches`` batches of the same law) as ``--hot-rows-sample`` JSON
    ``{feature: [ids]}``; returns the rows ``--cache-mib`` holds (``--hot-rows N``)."""
    sample = make_batches(spec, args.sample_batches, args.seed + 1, ids_seed=args.seed + 2)
    ids: dict[str, list[np.ndarray]] = {}
    for batch in sample:
        per_feature = batch.lengths.view(len(spec.features), -1).sum(1).tolist()
        for feature, piece in zip(spec.features, torch.split(batch.values, [int(n) for n in per_feature])):
            ids.setdefault(feature.name, []).append(piece.numpy())
    path.write_text(json.dumps({name: np.concatenate(pieces).tolist() for name, pieces in ids.items()}))
    return (args.cache_mib << 20) // (DIM + 4)


def process_counters(pid: int) -> tuple[int, int]:
    """(major faults, bytes read from storage) of process ``pid`` so far (0, 0 where unreadable)."""
    try:
        faults = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[9])
        read = 0
        for line in Path(f"/proc/{pid}/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                read = int(line.split()[1])
        return faults, read
    except (OSError, IndexError, ValueError):
        return 0, 0


def start_server(args: argparse.Namespace, path: Path, kind: str, sample: Path, hot_rows: int, cgroup: Path | None):
    """``embserve serve`` (``--native`` for the binary) of the artifact with the hot-row cache, in ``cgroup``;
    returns (process, port) once it serves."""
    from server.workers import SERVING_LINE

    command = [sys.executable, "-m", "infer.cli", "serve", str(path), "--host", "127.0.0.1", "--port", "0"]
    command += ["--verify", "none", "--hot-rows", str(hot_rows), "--hot-rows-sample", str(sample)]
    command += ["--prefetch", args.server_prefetch]
    if kind == "native":
        command.append("--native")

    def enter_cgroup() -> None:  # in the child before exec: the server and all it maps count against the budget
        if cgroup is not None:
            (cgroup / "cgroup.procs").write_text(str(os.getpid()))

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, preexec_fn=enter_cgroup, env=env, cwd=root)
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line.startswith(SERVING_LINE):
        process.kill()
        raise SystemExit(f"the {kind} server did not start (status {process.wait()})")
    return process, int(line.rsplit(" ", 1)[1])


def served_pass(address: str, batches: list[Any], clients: int, pid: int) -> dict[str, Any]:
    """One pass of ``batches`` over ``clients`` threads (batch i by thread i % clients): lookups/s and the server's
    faults and reads per lookup."""
    from concurrent.futures import ThreadPoolExecutor

    from server.client import EmbserveClient

    stubs = [EmbserveClient(address, timeout=600.0) for _ in range(clients)]
    try:
        faults, read = process_counters(pid)
        started = time.perf_counter()

        def run(index: int) -> None:
            for batch in batches[index::clients]:
                stubs[index].lookup(batch)

        with ThreadPoolExecutor(clients) as pool:
            list(pool.map(run, range(clients)))
        seconds = time.perf_counter() - started
    finally:
        for stub in stubs:
            stub.close()
    faults_after, read_after = process_counters(pid)
    ids = sum(int(batch.values.numel()) for batch in batches)
    return {
        "lookups": ids,
        "lookups_per_s": round(ids / seconds),
        "major_faults_per_lookup": round((faults_after - faults) / ids, 5),
        "pages_read_per_lookup": round((read_after - read) / PAGE / ids, 5),
    }


def serve_servers(args: argparse.Namespace, path: Path, cgroup: Path | None) -> None:
    """Each server in turn in the RAM budget, the same batches twice (cold, warm); then the native/python ratio."""
    from infer.storage.memory import memory_use
    from server.client import EmbserveClient

    spec = dlrm_spec(args.scale)
    batches = make_batches(spec, args.batches, args.seed + 1)
    sample = Path(tempfile.mkdtemp(prefix="embserve-hot-")) / "sample.json"
    hot_rows = write_hot_rows_sample(args, spec, sample)
    budget = f"{args.ram_budget_mib} MiB memory cgroup" if cgroup is not None else "the host's RAM"
    results: dict[str, dict[str, Any]] = {}
    answers: dict[str, list[torch.Tensor]] = {}
    try:
        for kind in args.servers.split(","):
            for file in sorted(path.glob("weights-*.bin")):
                drop_from_page_cache(file)
            process, port = start_server(args, path, kind, sample, hot_rows, cgroup)
            try:
                for file in sorted(path.glob("weights-*.bin")):  # what start-up read (the cache's copy) goes too
                    drop_from_page_cache(file)
                for name in ("cold", "warm"):
                    result = served_pass(f"127.0.0.1:{port}", batches, args.clients, process.pid)
                    memory = memory_use(process.pid)
                    result.update(
                        rss_anon_gb=round(memory.rss_anon / 1e9, 3), rss_file_gb=round(memory.rss_file / 1e9, 3)
                    )
                    results[f"{kind}_{name}"] = result
                    emit(f"served_{kind}_{name}", scale=args.scale, ram_budget=budget, clients=args.clients,
                         batch=BATCH, batches=args.batches, hot_rows=hot_rows, **result)  # fmt: skip
                with EmbserveClient(f"127.0.0.1:{port}", timeout=600.0) as client:
                    answers[kind] = [client.lookup(batch) for batch in batches[:3]]
            finally:
                process.send_signal(signal.SIGTERM)
                process.wait(timeout=120)
    finally:
        shutil.rmtree(sample.parent, ignore_errors=True)
    if "python" in answers and "native" in answers:
        emit(
            "target_native",
            scale=args.scale,
            ram_budget=budget,
            clients=args.clients,
            python_warm_lookups_per_s=results["python_warm"]["lookups_per_s"],
            native_warm_lookups_per_s=results["native_warm"]["lookups_per_s"],
            ratio_warm=round(results["native_warm"]["lookups_per_s"] / results["python_warm"]["lookups_per_s"], 3),
            ratio_cold=round(results["native_cold"]["lookups_per_s"] / results["python_cold"]["lookups_per_s"], 3),
            outputs_bit_equal=all(torch.equal(a, b) for a, b in zip(answers["python"], answers["native"])),
            target=1.0,
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=float, default=1.0, help="rows times this (0.05: a ~1.4 GB artifact)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chunk-mib", type=int, default=64, help="fp32 MiB read per chunk")
    parser.add_argument("--batches", type=int, default=100, help="batches of 64 per pass")
    parser.add_argument("--probe-seconds", type=float, default=3.0, help="seconds per disk probe")
    parser.add_argument("--spot-checks", type=int, default=64)
    parser.add_argument("--skip-full-verify", action="store_true", help="load with verify='none' only")
    parser.add_argument("--out", default=None, help="artifact folder (default: a temporary folder here)")
    parser.add_argument("--reuse", action="store_true", help="serve the artifact already in --out (no export)")
    parser.add_argument("--keep", action="store_true", help="keep the artifact")
    parser.add_argument("--modes", default=",".join(MODES), help=f"serving modes, of {list(MODES)}")
    parser.add_argument("--ram-budget-mib", type=int, default=0, help="serve in a memory cgroup this size (0: none)")
    parser.add_argument("--cache-mib", type=int, default=256, help="hot-row cache size (mode 'cache')")
    parser.add_argument(
        "--sample-batches", type=int, default=200, help="batches of the sample the cache is chosen from"
    )
    parser.add_argument(
        "--servers", default="", help="also serve through these servers, of python,native (embserve serve [--native])"
    )
    parser.add_argument("--clients", type=int, default=4, help="client threads per server pass (--servers)")
    parser.add_argument(
        "--server-prefetch", choices=("auto", "on", "off"), default="on", help="the servers' --prefetch (--servers)"
    )
    parser.add_argument("--phase", choices=("all", "export", "serve"), default="all", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, default="plain", help=argparse.SUPPRESS)
    parser.add_argument("--cgroup", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase == "export":
        return export_child(args)
    if args.phase == "serve":
        return serve_child(args)
    folder = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="embserve-large-"))
    out = folder / "artifact"
    try:
        if not (args.reuse and (out / "manifest.json").exists()):
            exported = run_export(args, out)
            emit("export", scale=args.scale, tables=len(DLRM_V2_ROWS), dtype="int8", **exported)
        serve(args, out)
    finally:
        if not args.keep:
            shutil.rmtree(folder if not args.out else out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
