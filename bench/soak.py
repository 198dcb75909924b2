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

    python bench/soak.py --minutes 10
    python bench/soak.py --stop-rounds 5 --clients 16 -- --drain-grace-s 0.5
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
from server import codec
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


def stop_rounds(artifact: Path, runtime, rounds: int, clients: int, options: tuple[str, ...]) -> int:  # type: ignore[no-untyped-def]
    from tests.support.stop_race import cases, race_stop, start_server

    pool = cases(runtime.spec, runtime.lookup)
    total_lost = 0
    for index in range(rounds):
        result = race_stop(start_server(artifact, artifact.parent / f"round{index}.log", *options), pool, clients)
        total_lost += result.lost + (result.exit_code != 0)
        print(
            json.dumps({"bench": "stop_race", "round": index + 1, "clients": clients, **result.summary()}), flush=True
        )
    return 1 if total_lost else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop-rounds", type=int, default=0, help="race the stop this many rounds instead")
    parser.add_argument("serve_options", nargs="*", help="--stop-rounds: more `embserve serve` options (after --)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        spec = demo_spec()
        artifact = export(quantize(spec, random_weights(spec, seed=1)), Path(folder) / "demo")
        runtime = load(artifact)
        if args.stop_rounds:
            return stop_rounds(artifact, runtime, args.stop_rounds, args.clients, tuple(args.serve_options))
        server, port = spawn_server(artifact, "--drain-grace-s", "1")
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
