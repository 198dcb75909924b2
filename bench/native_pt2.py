# ruff: noqa: E402
"""pt2 through embserve-server against TorchScript through it: Lookup throughput at batch 64.

One artifact exported with ``--pt2`` (``--tables`` INT8 tables of ``--rows`` x 64, mapped weight files) is served
twice by the native binary, ``--backend torchscript`` and ``--backend pt2``, with the same flags. ``--clients``
closed-loop embserve.v1 clients send pre-encoded batches of 64 (20 ids per bag); the two servers take turns, round by
round (the order alternating), so the host's noise hits both alike. Before measuring, every batch's answer from each
server must equal ``infer.load(dir, backend=...)``'s lookup of the same backend bit for bit.

One JSON line: requests/s of each, the ratio pt2 / TorchScript (target >= 0.9), whether the outputs matched, and
the load average.

    python bench/native_pt2.py                 # 8 tables x 200,000 rows, 6 rounds of 3 s each
    python bench/native_pt2.py --quick         # 50,000 rows, 3 rounds of 2 s
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# Run as ``python bench/native_pt2.py``, this folder heads sys.path and bench/server.py would shadow the ``server``
# package: the repository root takes its place.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path[0] = os.path.dirname(sys.path[0])

import grpc
import torch

from infer.artifact.export import export
from infer.artifact.load import load
from infer.config import DataType, ModelSpec, TableConfig
from infer.features import SparseFeatures
from infer.quant.quantize import quantize
from server.adapters.v1 import codec
from server.native import find_binary
from server.proto import inference_pb2 as pb

BATCH = 64
TARGET = 0.9  # pt2 / TorchScript requests per second
LOOKUP = "/embserve.v1.InferenceService/Lookup"
BACKENDS = ("torchscript", "pt2")


def build(tables: int, rows: int, workdir: Path) -> Path:
    """The artifact (model.pt and model.pt2), exported once per shape and kept in ``workdir``."""
    folder = workdir / f"{tables}x{rows}"
    if (folder / "manifest.json").is_file():
        return folder
    spec = ModelSpec(tuple(TableConfig(f"t{i}", rows, 64, (f"f{i}",), data_type=DataType.INT8) for i in range(tables)))
    generator = torch.Generator().manual_seed(0)
    weights = {t.name: torch.randn(t.num_embeddings, t.embedding_dim, generator=generator) for t in spec.tables}
    print(f"exporting {tables}x{rows} with model.pt2 (AOTInductor compiles: a minute or more)", file=sys.stderr)
    return export(quantize(spec, weights), folder, pt2=True)


def start(binary: str, artifact: Path, backend: str, log: Path) -> tuple[subprocess.Popen[str], int]:
    command = [binary, str(artifact), "--host", "127.0.0.1", "--port", "0", "--backend", backend,
               "--max-delay-us", "1000", "--verify", "none"]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
    assert process.stdout is not None
    line = process.stdout.readline()
    if "serving on port" not in line:
        process.kill()
        raise RuntimeError(f"embserve-server --backend {backend} did not start: {log.read_text()[-2000:]}")
    return process, int(line.rsplit(" ", 1)[1])


def measure(port: int, requests: list[bytes], clients: int, seconds: float) -> int:
    """Answers in ``seconds`` from ``clients`` closed-loop threads, each on its own channel."""
    stop_at = time.perf_counter() + seconds
    counts = [0] * clients

    def client(index: int) -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary(LOOKUP)  # bytes in, bytes out: no client-side encoding in the loop
            position = index
            while time.perf_counter() < stop_at:
                call(requests[position % len(requests)], timeout=30)
                position += 1
                counts[index] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(counts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=3.0, help="per server per round")
    parser.add_argument("--quick", action="store_true", help="50,000 rows, 3 rounds of 2 s")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "embserve-native-pt2-bench"))
    args = parser.parse_args()
    if args.quick:
        args.rows, args.rounds, args.seconds = 50_000, 3, 2.0
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    artifact = build(args.tables, args.rows, workdir)
    runtimes = {backend: load(artifact, backend=backend) for backend in BACKENDS}
    spec = runtimes["torchscript"].spec
    batches = [SparseFeatures.random(spec, batch_size=BATCH, ids_per_bag=20, seed=seed) for seed in range(16)]
    requests = [pb.LookupRequest(sparse=codec.encode_packed(b)).SerializeToString() for b in batches]
    binary = find_binary()
    servers = {backend: start(binary, artifact, backend, workdir / f"{backend}.log") for backend in BACKENDS}
    try:
        equal = True
        for backend, (_, port) in servers.items():
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = channel.unary_unary(LOOKUP, response_deserializer=pb.LookupResponse.FromString)
                for batch, request in zip(batches, requests):
                    got = codec.decode_embeddings(call(request, timeout=30))
                    equal = equal and torch.equal(got, runtimes[backend].lookup(batch))
        del runtimes
        answered = dict.fromkeys(BACKENDS, 0)
        for _, port in servers.values():  # a warm turn each, not counted
            measure(port, requests, args.clients, 1.0)
        for round_index in range(args.rounds):
            order = BACKENDS if round_index % 2 == 0 else BACKENDS[::-1]
            for backend in order:
                answered[backend] += measure(servers[backend][1], requests, args.clients, args.seconds)
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(60)
    seconds = args.rounds * args.seconds
    rates = {backend: answered[backend] / seconds for backend in BACKENDS}
    ratio = rates["pt2"] / rates["torchscript"]
    print(json.dumps({
        "bench": "native_pt2", "batch": BATCH, "clients": args.clients, "tables": args.tables, "rows": args.rows,
        "rounds": args.rounds, "seconds_each": seconds, "torchscript_rps": round(rates["torchscript"], 1),
        "pt2_rps": round(rates["pt2"], 1), "ratio": round(ratio, 3), "target": TARGET, "outputs_equal": equal,
        "met": ratio >= TARGET and equal, "load_average": [round(v, 2) for v in os.getloadavg()],
    }), flush=True)  # fmt: skip
    return 0 if ratio >= TARGET and equal else 1


if __name__ == "__main__":
    sys.exit(main())
