# ruff: noqa: E402
"""Open Inference Protocol REST, closed loop: the Python server (``embserve serve --http-port``) against the native
one (``embserve serve --native --http-port``, embserve-server) on the same model, batches and host.

The DLRM-style demo model (``infer.demo``: mixed-dtype tables and an MLP over-arch on 13 dense features), Predict
(the ``scores`` output) at batch B by C client processes (each its own keep-alive connection and interpreter), every
request encoded once up front as tritonclient.http sends it (JSON header + binary tensors, binary outputs). The
servers take turns in rounds (Python, native, native, Python, ...) so both see the same spells of a shared host.
Before the load every pooled batch goes once to each server and to an in-process ``Runtime.predict`` (all three on
one intra-op thread, so the dense part rounds alike): the scores must be bit-equal.

Prints one JSON line per server and a summary line: examples/s, p50/p99, server CPU per request, errors, the
native/Python throughput ratio (target >= 3x at batch 64, 8 clients), bit-equality, the CPU of the same predict
in this process (the forward both servers pay: a bound on how far the native server can pull ahead) and the load
average.

    python bench/rest.py                              # batch 64, 8 clients, 4 rounds of 4 s per server
    python bench/rest.py --batch-size 512 --clients 16 --seconds 3
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path[0] = os.path.dirname(sys.path[0])

import numpy as np
import torch

from bench.served import HOST, ServedProcess, free_port
from infer.artifact.export import export
from infer.artifact.load import load
from infer.demo import demo_spec
from infer.features import SparseFeatures
from infer.quant.quantize import quantize
from infer.weights import random_weights

MODEL = "artifact"  # the artifact's folder name
HEADER_LENGTH = "Inference-Header-Content-Length"


def random_request(spec, batch_size: int, seed: int, ids_per_bag: int) -> tuple[SparseFeatures, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 2 * ids_per_bag + 1, (len(spec.features) * batch_size,), generator=generator)
    per_feature = lengths.view(len(spec.features), batch_size).sum(1).tolist()
    values = torch.cat(
        [torch.randint(0, f.num_embeddings, (int(n),), generator=generator) for f, n in zip(spec.features, per_feature)]
    )
    dense = torch.randn(batch_size, spec.num_dense_features, generator=generator)
    return SparseFeatures(spec.feature_names, values, lengths.to(torch.int32)), dense


def encode(batch: SparseFeatures, dense: torch.Tensor) -> tuple[bytes, str]:
    """The body and header length of a binary-extension infer request asking for binary scores."""
    inputs, blobs = [], []

    def add(name: str, datatype: str, array: np.ndarray) -> None:
        raw = np.ascontiguousarray(array).tobytes()
        inputs.append(
            {
                "name": name,
                "datatype": datatype,
                "shape": list(array.shape),
                "parameters": {"binary_data_size": len(raw)},
            }
        )
        blobs.append(raw)

    size = batch.batch_size
    position = 0
    for index, key in enumerate(batch.keys):
        lengths = batch.lengths[index * size : (index + 1) * size]
        count = int(lengths.sum())
        add(f"{key}__values", "INT64", batch.values[position : position + count].numpy())
        add(f"{key}__lengths", "INT32", lengths.numpy())
        position += count
    add("dense_features", "FP32", dense.numpy())
    header = json.dumps(
        {"inputs": inputs, "outputs": [{"name": "scores", "parameters": {"binary_data": True}}]}, separators=(",", ":")
    ).encode()
    return header + b"".join(blobs), str(len(header))


def post(connection: http.client.HTTPConnection, body: bytes, header_length: str) -> bytes:
    connection.request(
        "POST",
        f"/v2/models/{MODEL}/infer",
        body=body,
        headers={HEADER_LENGTH: header_length, "Content-Type": "application/octet-stream"},
    )
    response = connection.getresponse()
    payload = response.read()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {payload[:200]!r}")
    split = int(response.getheader(HEADER_LENGTH) or len(payload))
    return payload[split:]


def client_loop(port: int, requests: list[tuple[bytes, str]], start_at: float, stop_at: float, out) -> None:
    """One client process: send back to back between start_at and stop_at; report latencies and errors."""
    connection = http.client.HTTPConnection(HOST, port, timeout=30)
    latencies, errors, index = [], 0, 0
    while time.time() < start_at:
        time.sleep(0.001)
    while True:
        sent = time.perf_counter()
        if time.time() >= stop_at:
            break
        body, header_length = requests[index % len(requests)]
        index += 1
        try:
            post(connection, body, header_length)
            latencies.append(time.perf_counter() - sent)
        except Exception:  # noqa: BLE001 - counted, the connection reopened
            errors += 1
            connection.close()
            connection = http.client.HTTPConnection(HOST, port, timeout=30)
    connection.close()
    out.put((latencies, errors))


class Server(ServedProcess):
    """``embserve serve --python`` or ``--native`` (``kind``) on free loopback ports, REST on ``http_port``."""

    def __init__(self, artifact: Path, kind: str, args: argparse.Namespace, log: Path) -> None:
        self.kind = kind
        self.http_port = free_port()
        command = [
            sys.executable, "-m", "infer.cli", "serve", str(artifact), "--host", HOST, "--port", "0",
            "--http-port", str(self.http_port), "--max-delay-us", str(args.max_delay_us),
            "--intra-op-threads", "1", "--drain-seconds", "5", f"--{kind}",  # "python" or "native"
        ]  # fmt: skip
        super().__init__(command, log)
        self.wait_ready(300)


def run_round(server: Server, requests: list[tuple[bytes, str]], clients: int, seconds: float) -> dict:
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    start_at = time.time() + 0.5
    processes = [
        context.Process(
            target=client_loop,
            args=(server.http_port, requests[i::clients] or requests, start_at, start_at + seconds, out),
        )
        for i in range(clients)
    ]
    for p in processes:
        p.start()
    cpu_before = None
    while time.time() < start_at:
        time.sleep(0.001)
    cpu_before = server.cpu_seconds()
    results = [out.get(timeout=seconds + 120) for _ in processes]
    cpu = server.cpu_seconds() - cpu_before
    for p in processes:
        p.join()
    latencies = [x for got, _ in results for x in got]
    return {"latencies": latencies, "errors": sum(e for _, e in results), "seconds": seconds, "cpu": cpu}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=4.0, help="seconds per round and server")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per server (ABBA order)")
    parser.add_argument("--pool", type=int, default=16, help="distinct request batches")
    parser.add_argument("--ids-per-bag", type=int, default=10, help="mean ids per bag")
    parser.add_argument("--max-delay-us", type=int, default=1000)
    args = parser.parse_args()

    torch.set_num_threads(1)  # as the servers' --intra-op-threads 1: the dense part rounds alike
    with tempfile.TemporaryDirectory(prefix="embserve-bench-rest-") as tmp:
        spec = demo_spec()
        artifact = export(quantize(spec, random_weights(spec, seed=0)), Path(tmp) / MODEL)
        runtime = load(artifact)
        batches = [random_request(spec, args.batch_size, seed, args.ids_per_bag) for seed in range(args.pool)]
        requests = [encode(batch, dense) for batch, dense in batches]
        servers = {kind: Server(artifact, kind, args, Path(tmp) / f"{kind}.log") for kind in ("python", "native")}
        try:
            equal = True
            for (batch, dense), (body, header_length) in zip(batches, requests):
                expected = runtime.predict(batch, dense).numpy().tobytes()
                for server in servers.values():
                    connection = http.client.HTTPConnection(HOST, server.http_port, timeout=60)
                    equal = equal and post(connection, body, header_length) == expected
                    connection.close()
            # the floor both servers share: the checked forward in this process, one batch at a time
            cpu_started, forwards = time.process_time(), 0
            while time.process_time() - cpu_started < 1.0:
                batch, dense = batches[forwards % len(batches)]
                runtime.predict(batch, dense)
                forwards += 1
            forward_ms = 1000 * (time.process_time() - cpu_started) / forwards
            totals = {kind: {"latencies": [], "errors": 0, "seconds": 0.0, "cpu": 0.0} for kind in servers}
            order = ["python", "native", "native", "python"]
            for round_index in range(args.rounds):
                for kind in (order[(2 * round_index) % 4], order[(2 * round_index + 1) % 4]):
                    got = run_round(servers[kind], requests, args.clients, args.seconds)
                    total = totals[kind]
                    total["latencies"] += got["latencies"]
                    total["errors"] += got["errors"]
                    total["seconds"] += got["seconds"]
                    total["cpu"] += got["cpu"]
        finally:
            codes = {kind: server.stop() for kind, server in servers.items()}
    rates = {}
    for kind, total in totals.items():
        latencies = sorted(total["latencies"])
        requests_done = len(latencies)
        rates[kind] = requests_done * args.batch_size / total["seconds"] if total["seconds"] else 0.0
        print(
            json.dumps(
                {
                    "bench": "rest_predict",
                    "server": kind,
                    "batch_size": args.batch_size,
                    "clients": args.clients,
                    "requests": requests_done,
                    "examples_per_s": round(rates[kind], 1),
                    "p50_ms": round(1000 * latencies[len(latencies) // 2], 3) if latencies else None,
                    "p99_ms": round(1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 3)
                    if latencies
                    else None,
                    "server_cpu_ms_per_request": round(1000 * total["cpu"] / requests_done, 3)
                    if requests_done
                    else None,
                    "errors": total["errors"],
                    "exit_code": codes[kind],
                }
            )
        )
    ratio = rates["native"] / rates["python"] if rates["python"] else float("nan")
    print(
        json.dumps(
            {
                "bench": "rest_predict_summary",
                "batch_size": args.batch_size,
                "clients": args.clients,
                "native_over_python": round(ratio, 2),
                "inprocess_predict_cpu_ms_per_request": round(forward_ms, 3),
                "target": 3.0,
                "meets_target": ratio >= 3.0,
                "bit_equal": equal,
                "errors": sum(t["errors"] for t in totals.values()),
                "loadavg": [round(x, 2) for x in os.getloadavg()],
            }
        )
    )
    return 0 if equal and not any(t["errors"] for t in totals.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
