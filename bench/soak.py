# ruff: noqa: E402
"""Soak: N minutes of mixed load on a real ``embserve serve`` (loopback), one JSON line per minute.

C client threads send, back to back, a mix of Lookups (batch 1..64, weighted or not, packed or typed
form), Predicts, and malformed requests (bad ids, lengths, undecodable bytes, unknown features).
Every valid answer is compared with the in-process runtime on the same batch (lookups bit for bit,
predictions to fp32 rounding: the dense part's GEMMs may block differently in a merged batch); a malformed request must
come back INVALID_ARGUMENT. Anything else counts as an error. Each minute prints calls, errors, p50/p99
latency of the valid calls and the server's RSS; the summary line has the RSS drift between the first
and the last minute, and the server's exit code after SIGTERM (not run in CI).

``--stop-rounds R`` races the stop instead: per round a fresh server (gRPC and REST), C clients
(embserve.v1, OIP gRPC, OIP REST in turn) sending until the process has exited after SIGTERM, and one
JSON line of every call's outcome (OK, UNAVAILABLE, HTTP 503, connection refused, CANCELLED, ...), the
calls lost (anything but OK or a retryable refusal) and the exit code (``tests/support/stop_race.py``).

``--swap`` measures the repository's hot swap instead: a server of a repository whose model (``--tables`` x
``--rows`` x D=128 INT8, mapped: ~0.53 GB at the defaults) swaps ``--rounds`` times between two versions with
different weights (each round a new version folder of hard links to one of the two exports, then an explicit
RepositoryModelLoad), while ``--clients`` closed-loop OIP gRPC clients call it. A call starts in a swap window from
the load's request until the old version's weight files are gone from the server's ``/proc/<pid>/maps`` (plus
0.2 s); steady calls start at least 1 s after a window closes. One JSON line: steady p99, p99 during the swaps,
their ratio (target <= 1.5; <= 1.2 with ``--native``), failed calls (an error, or an answer that differs from its
version's in-process runtime; target 0), the load's and the unmap's median seconds, the slowest unmap after the old
version's last answered call (target <= 1 s), and the load average. ``--native`` serves with embserve-server
(``embserve serve --native``, ``make server`` builds it).

    python bench/soak.py --minutes 10
    python bench/soak.py --stop-rounds 5 --clients 16 -- --drain-grace-s 0.5
    python bench/soak.py --stop-rounds 10 --clients 16 --stop-graces 0,0.2,1   # tests/server/test_stop_race.py x 10/3
    python bench/soak.py --swap --clients 16 --rounds 12          # --quick: 100,000 rows per table, 3 rounds
    python bench/soak.py --swap --native --clients 16 --quick
    python bench/soak.py --hot-reload 30 [--native]  # tests/server/test_hot_reload.py's full 30 s windows

``--hot-reload SECONDS`` runs ``tests/server/test_hot_reload.py``'s two cases for a fixed window each (the test ends
its load once what it checks has been seen): 16 tritonclient threads against ``embserve serve REPO --poll-s 0.25``
while version 2 lands CHANGE_AT s in (then, on a fresh server, a version failing its checksum). One JSON line per
case: calls, failed calls (target 0), the versions answered, p99 before and during the change, RSS before and at
the end (target <= 1.10x), and for the broken version its state in the index (target UNAVAILABLE).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

# Run as ``python bench/soak.py``, this folder heads sys.path and would shadow the ``server`` package;
# the repository root takes its place (``tests.support`` holds the stop race's clients).
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path[0] = os.path.dirname(sys.path[0])

import grpc
import torch

from infer.artifact.export import export
from infer.artifact.load import load
from infer.demo import demo_spec
from infer.features import SparseFeatures
from infer.quant.quantize import quantize
from infer.weights import random_weights
from server.adapters.v1 import codec
from server.launch import spawn_server
from server.proto import inference_pb2 as pb
from server.proto import inference_pb2_grpc as pb_grpc

LOOKUP = "/embserve.v1.InferenceService/Lookup"


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class Soak:
    def __init__(self, address: str, runtime, seed: int) -> None:  # type: ignore[no-untyped-def]
        self.runtime = runtime
        self.spec = runtime.spec
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.InferenceServiceStub(self.channel)
        self.raw = self.channel.unary_unary(
            LOOKUP, request_serializer=None, response_deserializer=pb.LookupResponse.FromString
        )
        self.lock = threading.Lock()
        self.calls: Counter[str] = Counter()
        self.errors: list[str] = []
        self.latencies: list[float] = []
        self.stop = threading.Event()
        # a pool of batches with their expected answers (computed once, in process)
        rng = random.Random(seed)
        self.pool = []
        for i in range(64):
            batch = SparseFeatures.random(
                self.spec, batch_size=rng.randrange(1, 65), ids_per_bag=rng.randrange(1, 12), seed=i
            )
            if i % 2:
                batch = SparseFeatures(batch.keys, batch.values, batch.lengths, torch.rand(batch.values.numel()))
            dense = torch.randn(
                batch.batch_size, self.spec.num_dense_features, generator=torch.Generator().manual_seed(i)
            )
            self.pool.append((batch, self.runtime.lookup(batch), dense, self.runtime.predict(batch, dense)))

    def client(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stop.is_set():
            batch, pooled, dense, scores = rng.choice(self.pool)
            kind = rng.choice(["lookup", "lookup_typed", "predict", "bad_id", "bad_lengths", "garbage", "unknown"])
            started = time.perf_counter()
            try:
                if kind in ("lookup", "lookup_typed"):
                    sparse = codec.encode_typed(batch) if kind == "lookup_typed" else codec.encode_packed(batch)
                    got = codec.decode_embeddings(self.stub.Lookup(pb.LookupRequest(sparse=sparse), timeout=30))
                    ok = torch.equal(got, pooled)
                elif kind == "predict":
                    request = pb.PredictRequest(
                        sparse=codec.encode_packed(batch), dense_features=dense.numpy().tobytes()
                    )
                    response = self.stub.Predict(request, timeout=30)
                    got_scores = torch.frombuffer(bytearray(response.scores), dtype=torch.float32)
                    # the dense part's GEMMs may block differently for a merged batch: equal to fp32 rounding
                    ok = torch.allclose(got_scores, scores, rtol=1e-5, atol=1e-6)
                else:
                    self._bad(kind, batch)
                    ok = True
                    kind = "rejected"
            except grpc.RpcError as err:
                with self.lock:
                    self.errors.append(f"{kind}: {err.code().name}: {err.details()[:120]}")
                continue
            elapsed = time.perf_counter() - started
            with self.lock:
                self.calls[kind] += 1
                if kind != "rejected":
                    self.latencies.append(elapsed)
                if not ok:
                    self.errors.append(f"{kind}: wrong answer")

    def _bad(self, kind: str, batch: SparseFeatures) -> None:
        packed = codec.encode_packed(batch).packed
        if kind == "bad_id":
            values = batch.values.clone()
            values[-1] = 1 << 30
            packed.ids = values.to(torch.int64).numpy().tobytes()
            packed.id_type = pb.ID_TYPE_INT64
        elif kind == "bad_lengths":
            packed.lengths = packed.lengths[:-4]
        elif kind == "unknown":
            packed.feature_order[0] = "no_such_feature"
        data = (
            b"\xff\xfe garbage"
            if kind == "garbage"
            else pb.LookupRequest(sparse=pb.SparseFeatures(packed=packed)).SerializeToString()
        )
        try:
            self.raw(data, timeout=30)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.INVALID_ARGUMENT:
                raise
            return
        raise grpc.RpcError(f"{kind} was answered")  # pragma: no cover - counted as an error by the caller

    def take_minute(self) -> tuple[Counter[str], list[str], list[float]]:
        with self.lock:
            calls, errors, latencies = self.calls, self.errors, self.latencies
            self.calls, self.errors, self.latencies = Counter(), [], []
        return calls, errors, latencies


def stop_rounds(  # type: ignore[no-untyped-def]
    artifact: Path, runtime, rounds: int, clients: int, options: tuple[str, ...], graces: tuple[str, ...] = ()
) -> int:
    """``rounds`` stop races; with ``graces``, round i adds ``--drain-grace-s graces[i % len(graces)]``."""
    from tests.support.stop_race import cases, race_stop, start_server

    pool = cases(runtime.spec, runtime.lookup)
    options = options if "--native" in options else ("--python", *options)  # the Python server unless asked
    total_lost = 0
    for index in range(rounds):
        grace = ("--drain-grace-s", graces[index % len(graces)]) if graces else ()
        server = start_server(artifact, artifact.parent / f"round{index}.log", *options, *grace)
        result = race_stop(server, pool, clients)
        total_lost += result.lost + (result.exit_code != 0)
        line = {"bench": "stop_race", "round": index + 1, "clients": clients, "grace_s": grace[1] if grace else None}
        print(json.dumps({**line, **result.summary()}), flush=True)
    return 1 if total_lost else 0


# ------------------------------------------------------------------------------------------------------- swap
SWAP_MODEL = "emb"
SWAP_DIM = 128
SWAP_TARGET = 1.5  # p99 during the swaps / steady p99
SWAP_TARGET_NATIVE = 1.2  # the same, for embserve-server
UNMAP_TARGET_S = 1.0  # the old version's files leave /proc/<pid>/maps within this of its last call


def swap_spec(tables: int, rows: int):  # type: ignore[no-untyped-def]
    from infer.config import ModelSpec, TableConfig

    return ModelSpec(tuple(TableConfig(f"t{i}", rows, SWAP_DIM, (f"f{i}",)) for i in range(tables)))


def export_swap_version(spec, seed: int, out: Path) -> Path:  # type: ignore[no-untyped-def]
    """A mapped export of random N(0,1) tables, made chunk by chunk (bounded memory), seeded per chunk."""
    from infer.artifact.stream import export_streaming
    from infer.storage.sources import CallableSource

    def rows_of(table: int):  # type: ignore[no-untyped-def]
        def rows(start: int, end: int) -> torch.Tensor:
            generator = torch.Generator().manual_seed(seed * 1_000_003 + table * 10_007 + start)
            return torch.randn(end - start, SWAP_DIM, generator=generator)

        return rows

    if not (out / "manifest.json").is_file():
        export_streaming(spec, CallableSource(spec, {t.name: rows_of(i) for i, t in enumerate(spec.tables)}), out)
    return out


def link_version(source: Path, repo: Path, version: int, model: str = SWAP_MODEL) -> None:
    """REPO/<model>/<version>/ as hard links to ``source``'s files (staged, then renamed in)."""
    staging = repo / ".staging" / str(version)
    for path in source.rglob("*"):
        if path.is_file():
            target = staging / path.relative_to(source)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.link(path, target)
    os.rename(staging, repo / model / str(version))


def maps_under(pid: int, folder: Path) -> bool:
    prefix = f"{folder.resolve()}/"
    return prefix in Path(f"/proc/{pid}/maps").read_text()


def p99(latencies: list[float]) -> float:
    ordered = sorted(latencies)
    return ordered[int(0.99 * (len(ordered) - 1))] if ordered else float("nan")


def swap_case(args: argparse.Namespace) -> int:
    from tritonclient.grpc import InferenceServerClient

    from tests.server.oip_support import requested, triton_inputs

    rows = 100_000 if args.quick else args.rows
    rounds = 3 if args.quick else args.rounds
    spec = swap_spec(args.tables, rows)
    store = Path(args.workdir)
    store.mkdir(parents=True, exist_ok=True)
    sources = [export_swap_version(spec, seed, store / f"{args.tables}x{rows}-seed{seed}") for seed in (1, 2)]
    weights_bytes = sum(p.stat().st_size for p in sources[0].glob("weights-*.bin"))
    batches = [SparseFeatures.random(spec, batch_size=32, ids_per_bag=10, seed=seed) for seed in range(16)]
    expected = []
    for source in sources:
        runtime = load(source, verify="none")
        expected.append([runtime.lookup(b) for b in batches])
        del runtime
    with tempfile.TemporaryDirectory(dir=store) as folder:
        repo = Path(folder) / "repo"
        (repo / SWAP_MODEL).mkdir(parents=True)
        link_version(sources[0], repo, 1)
        kind = "--native" if args.native else "--python"
        server, port = spawn_server(repo, "--max-delay-us", "1000", kind, *args.serve_options)
        address = f"127.0.0.1:{port}"
        calls: list[tuple[float, float]] = []  # (started, latency) of every answered call
        last_answer: dict[int, float] = {}  # version -> when its last answer arrived
        failures: list[str] = []
        lock = threading.Lock()
        stop = threading.Event()
        begin = time.perf_counter()

        def worker(index: int) -> None:
            with InferenceServerClient(address) as c:
                step = index
                while not stop.is_set():
                    which = step % len(batches)
                    step += 1
                    started = time.perf_counter()
                    try:
                        result = c.infer(
                            SWAP_MODEL, triton_inputs("grpc", batches[which]), outputs=requested("grpc", "embeddings")
                        )
                        version = int(result.get_response().model_version)
                        got = torch.from_numpy(result.as_numpy("embeddings").copy())
                        if not torch.equal(got, expected[(version - 1) % 2][which]):
                            raise AssertionError(f"version {version}'s answer differs from its runtime's")
                    except Exception as err:  # noqa: BLE001 - every failure is counted and the first ones printed
                        with lock:
                            failures.append(f"{type(err).__name__}: {str(err)[:200]}")
                        continue
                    ended = time.perf_counter()
                    with lock:
                        calls.append((started - begin, ended - started))
                        last_answer[version] = max(last_answer.get(version, 0.0), ended)

        threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(args.clients)]
        windows: list[tuple[float, float]] = []
        load_seconds, unmap_seconds, unmap_after_last_call = [], [], []
        try:
            for thread in threads:
                thread.start()
            with InferenceServerClient(address) as control:
                for version in range(2, rounds + 2):
                    time.sleep(args.steady_s)
                    link_version(sources[(version - 1) % 2], repo, version)
                    opened = time.perf_counter()
                    control.load_model(SWAP_MODEL)  # returns once the new version serves
                    loaded = time.perf_counter()
                    old = repo / SWAP_MODEL / str(version - 1)
                    while maps_under(server.pid, old):  # the old version goes when its last call is done
                        time.sleep(0.005)
                    unmapped = time.perf_counter()
                    with lock:
                        last_old = last_answer.get(version - 1, opened)
                    unmap_after_last_call.append(max(0.0, unmapped - last_old))
                    windows.append((opened - begin, unmapped - begin + 0.2))
                    load_seconds.append(loaded - opened)
                    unmap_seconds.append(unmapped - opened)
            time.sleep(args.steady_s)
        finally:
            stop.set()
            for thread in threads:
                thread.join(60)
            server.send_signal(signal.SIGTERM)
            code = server.wait(timeout=120)

    def in_swap(t: float) -> bool:
        return any(lo <= t <= hi for lo, hi in windows)

    def steady(t: float) -> bool:
        return t >= 2.0 and not any(lo - 0.0 <= t <= hi + 1.0 for lo, hi in windows)

    during = [latency for started, latency in calls if in_swap(started)]
    before = [latency for started, latency in calls if steady(started)]
    ratio = p99(during) / p99(before)
    target = SWAP_TARGET_NATIVE if args.native else SWAP_TARGET
    unmap_max = max(unmap_after_last_call)
    met = ratio <= target and not failures and (unmap_max <= UNMAP_TARGET_S or not args.native)
    print(json.dumps({
        "bench": "swap", "server": "native" if args.native else "python", "rounds": rounds, "clients": args.clients,
        "tables": args.tables, "rows": rows,
        "weights_gb": round(weights_bytes / 1e9, 3), "calls_steady": len(before), "calls_swap": len(during),
        "p50_steady_ms": round(1e3 * statistics.median(before), 3) if before else None,
        "p99_steady_ms": round(1e3 * p99(before), 3), "p99_swap_ms": round(1e3 * p99(during), 3),
        "p99_ratio": round(ratio, 3), "target_ratio": target, "failed_calls": len(failures),
        "first_failures": failures[:3], "load_s_median": round(statistics.median(load_seconds), 3),
        "unmap_s_median": round(statistics.median(unmap_seconds), 3),
        "unmap_after_last_call_s_max": round(unmap_max, 3), "unmap_target_s": UNMAP_TARGET_S,
        "server_exit_code": code, "met": met, "load_average": [round(v, 2) for v in os.getloadavg()],
    }), flush=True)  # fmt: skip
    return 0 if met else 1


# ------------------------------------------------------------------------------------------------- hot reload
def hot_reload_case(seconds: float, native: bool) -> int:
    """tests/server/test_hot_reload.py's new and broken version cases, each under load for ``seconds``."""
    import shutil

    from tests.support import hot_reload as hr

    kind = "native" if native else "python"
    batches = hr.request_batches()
    failed = 0
    with tempfile.TemporaryDirectory() as folder:
        versions = hr.export_versions(Path(folder) / "versions")
        expected = {v: [load(versions[v]).lookup(b) for b in batches] for v in ("1", "2")}
        for case, first, landing, number in (("new_version", "1", "2", "2"), ("broken_version", "2", "broken", "3")):
            repo = Path(folder) / f"repo-{case}"
            shutil.copytree(versions[first], repo / hr.MODEL / first)
            rows: list[dict[str, str]] = []
            calls, failures, changed, rss_before, rss_after = hr.run_under_load(
                repo,
                lambda repo=repo, landing=landing, number=number: hr.stage(versions[landing], repo, number),
                {v: expected[v] for v in ("1", "2") if v == first or landing == v},
                batches,
                lambda calls, port: False,  # the whole window
                seconds,
                lambda port, number=number, rows=rows: rows.extend(hr.index_rows(port, number)),
                kind,
            )
            new = [c.started for c in calls if c.version == number]
            swapped = min(new) if new else changed + 1.0
            met = not failures and rss_after <= 1.10 * rss_before
            if case == "new_version":
                met = met and bool(new) and all(c.version == number for c in calls if c.started > swapped + 2.0)
            else:
                met = met and [r.get("state") for r in rows] == ["UNAVAILABLE"] and {c.version for c in calls} == {"2"}
            line = hr.summary(case, calls, changed, swapped, rss_before, rss_after, seconds, kind)
            print(json.dumps({  # one line per case: the latencies and RSS with the outcome
                "bench": "hot_reload", **line, "failed": len(failures), "first_failures": failures[:3],
                "versions": sorted({c.version for c in calls}), "index": rows,
                "rss_ratio": round(rss_after / rss_before, 3), "load_avg": os.getloadavg()[0], "met": met,
            }), flush=True)  # fmt: skip
            failed += not met
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop-rounds", type=int, default=0, help="race the stop this many rounds instead")
    parser.add_argument(
        "--stop-graces", default="", help="--stop-rounds: comma-separated --drain-grace-s values, one per round in turn"
    )
    parser.add_argument(
        "--hot-reload", type=float, default=0.0, metavar="SECONDS", help="test_hot_reload's cases, SECONDS each"
    )
    parser.add_argument("--swap", action="store_true", help="measure the repository's hot swap instead")
    parser.add_argument("--rounds", type=int, default=12, help="--swap: swaps")
    parser.add_argument("--tables", type=int, default=4, help="--swap: tables of D=128 INT8")
    parser.add_argument("--rows", type=int, default=1_000_000, help="--swap: rows per table")
    parser.add_argument("--steady-s", type=float, default=3.0, help="--swap: seconds between swaps")
    parser.add_argument("--quick", action="store_true", help="--swap: 100,000 rows per table, 3 rounds")
    parser.add_argument("--native", action="store_true", help="--swap, --hot-reload: serve with embserve-server")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "embserve-swap-bench"),
                        help="--swap: where the two versions are exported (kept for the next run)")  # fmt: skip
    parser.add_argument(
        "serve_options", nargs="*", help="--stop-rounds, --swap: more `embserve serve` options (after --)"
    )
    args = parser.parse_args()
    if args.hot_reload:
        return hot_reload_case(args.hot_reload, args.native)
    if args.swap:
        return swap_case(args)
    with tempfile.TemporaryDirectory() as folder:
        spec = demo_spec()
        artifact = export(quantize(spec, random_weights(spec, seed=1)), Path(folder) / "demo")
        runtime = load(artifact)
        if args.stop_rounds:
            graces = tuple(g for g in args.stop_graces.split(",") if g)
            return stop_rounds(artifact, runtime, args.stop_rounds, args.clients, tuple(args.serve_options), graces)
        server, port = spawn_server(artifact, "--python", "--drain-grace-s", "1")
        soak = Soak(f"127.0.0.1:{port}", runtime, args.seed)
        threads = [
            threading.Thread(target=soak.client, args=(args.seed + i,), daemon=True) for i in range(args.clients)
        ]
        for thread in threads:
            thread.start()
        minutes = max(1, round(args.minutes))
        window = args.minutes * 60 / minutes
        rss, total_errors = [], 0
        for minute in range(minutes):
            time.sleep(window)
            calls, errors, latencies = soak.take_minute()
            rss.append(rss_bytes(server.pid))
            total_errors += len(errors)
            latencies.sort()
            print(json.dumps({
                "bench": "soak", "minute": minute + 1, "calls": sum(calls.values()), "by_kind": dict(calls),
                "errors": len(errors), "first_errors": errors[:3],
                "p50_ms": round(1e3 * statistics.median(latencies), 3) if latencies else None,
                "p99_ms": round(1e3 * latencies[int(0.99 * (len(latencies) - 1))], 3) if latencies else None,
                "server_rss_mb": round(rss[-1] / 2**20, 1),
            }), flush=True)  # fmt: skip
        soak.stop.set()
        for thread in threads:
            thread.join(60)
        soak.channel.close()
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=120)
        drift = (rss[-1] - rss[0]) / rss[0] if rss and rss[0] else 0.0
        print(json.dumps({
            "bench": "soak_summary", "minutes": args.minutes, "clients": args.clients, "errors": total_errors,
            "rss_first_mb": round(rss[0] / 2**20, 1), "rss_last_mb": round(rss[-1] / 2**20, 1),
            "rss_drift": round(drift, 4), "server_exit_code": code,
            "met": total_errors == 0 and abs(drift) < 0.05 and code == 0,
        }), flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
