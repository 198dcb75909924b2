# ruff: noqa: E402
"""Every host a front end: 2 "hosts" on loopback serving gRPC against one process serving the whole model.

Exports one model (``--tables`` INT8 tables) twice with the same table-wise plan: a 2-host artifact (host h
holds every other table) and the one-host artifact of the same 2 shards (one process, same cores). Runs
``embserve serve`` on each in turn and, with ``--clients`` closed-loop client threads (spread evenly over both
hosts' front ends for the group), sends Lookup of batch ``--batch`` for ``--seconds``; the one process is
measured before and after the group and the ratio uses their mean. Every answer of a check pass is compared
with the one process's answer bit for bit. Then SIGTERM goes to host 1: every rank must exit 0.

Prints one JSON line: lookups/s of both, the ratio (target >= 0.8) and the checks.

    python bench/multihost_serving.py                 # 8 tables x 100k rows, batch 512, 16 clients, 10 s
    python bench/multihost_serving.py --quick         # 2 s, 4 clients
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

import torch

from infer.config import DataType, ModelSpec, TableConfig
from infer.features import SparseFeatures
from infer.planner.types import ComputeDevice, ShardingPlan, ShardingType, Topology
from infer.shard.plans import make_plan
from server.app import SERVING_LINE
from server.client import EmbserveClient
from server.launch import spawn_server

HOSTS = 2


def _load(ports: list[int], batches: list[SparseFeatures], clients: int, seconds: float) -> tuple[float, int]:
    """Lookups per second of ``clients`` closed-loop threads (client i on ``ports[i % len(ports)]``), errors."""
    done = [0] * clients
    errors = [0] * clients
    start = threading.Barrier(clients + 1)
    stop = threading.Event()

    def client(index: int) -> None:
        with EmbserveClient(f"127.0.0.1:{ports[index % len(ports)]}", timeout=60) as stub:
            stub.lookup(batches[index % len(batches)])  # connect and warm before the clock
            start.wait()
            while not stop.is_set():
                batch = batches[(index + done[index]) % len(batches)]
                try:
                    stub.lookup(batch)
                    done[index] += batch.values.numel()
                except Exception:  # noqa: BLE001 - counted, reported
                    errors[index] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join(120)
    return sum(done) / (time.perf_counter() - began), sum(errors)


def _answers(port: int, batches: list[SparseFeatures]) -> list[torch.Tensor]:
    with EmbserveClient(f"127.0.0.1:{port}", timeout=60) as stub:
        return [stub.lookup(batch) for batch in batches]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """``--tables --rows --dim`` (``table_wise_over_hosts``) and ``--batch``, the examples per request."""
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=512)


def table_wise_over_hosts(tables: int, rows: int, dim: int, hosts: int) -> tuple[ModelSpec, Any, ShardingPlan]:
    """``tables`` INT8 tables of ``rows`` x ``dim`` (random weights, seed 0), table ``i`` on host ``i % hosts``:
    the spec, the quantized model and the plan of one CPU device per host."""
    from infer.quant.quantize import quantize
    from infer.weights import random_weights

    spec = ModelSpec(tuple(TableConfig(f"t{i}", rows, dim, (f"f{i}",), data_type=DataType.INT8) for i in range(tables)))
    model = quantize(spec, random_weights(spec, seed=0))
    layout = {t.name: (ShardingType.TABLE_WISE, (i % hosts,)) for i, t in enumerate(spec.tables)}
    plan = make_plan(spec, hosts, layout)
    return spec, model, dataclasses.replace(plan, topology=Topology(hosts, ComputeDevice.CPU, local_world_size=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    add_model_arguments(parser)
    parser.add_argument("--ids-per-bag", type=int, default=20)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.clients, args.rows = 2.0, 4, 10_000

    from infer.artifact.export import export
    from infer.artifact.hosts import export_hosts
    from infer.shard.builder import shard_model

    spec, model, hosts_plan = table_wise_over_hosts(args.tables, args.rows, args.dim, HOSTS)
    batches = [
        SparseFeatures.random(spec, batch_size=args.batch, ids_per_bag=args.ids_per_bag, seed=s) for s in range(8)
    ]
    with tempfile.TemporaryDirectory(prefix="embserve-multihost-serving-") as tmp:
        folder = Path(tmp)
        group_artifact = export_hosts(model, folder / "hosts", hosts_plan)
        one_plan = dataclasses.replace(hosts_plan, topology=Topology(HOSTS, ComputeDevice.CPU))
        one_artifact = export(shard_model(model, one_plan), folder / "one", plan=one_plan)
        del model

        def one_process() -> tuple[float, int, list[torch.Tensor]]:
            process, port = spawn_server(one_artifact, "--python")  # the baseline: the group's server, on one host
            try:
                answers = _answers(port, batches)
                rate, errors = _load([port], batches, args.clients, args.seconds)
            finally:
                process.send_signal(signal.SIGTERM)
                process.wait(60)
            return rate, errors, answers

        before, errors_before, reference = one_process()
        master = _free_port()
        command = [
            sys.executable,
            "-m",
            "infer.cli",
            "serve",
            str(group_artifact),
            "--python",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
        ]
        processes = [
            subprocess.Popen(
                command,
                stdout=subprocess.PIPE,
                text=True,
                env=dict(
                    os.environ, RANK=str(rank), WORLD_SIZE=str(HOSTS), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master)
                ),
            )  # fmt: skip
            for rank in range(HOSTS)
        ]
        ports = []
        for process in processes:
            assert process.stdout is not None
            for line in process.stdout:
                if line.startswith(SERVING_LINE):
                    ports.append(int(line.rsplit(" ", 1)[1]))
                    break
        equal = all(torch.equal(got, want) for port in ports for got, want in zip(_answers(port, batches), reference))
        group_rate, group_errors = _load(ports, batches, args.clients, args.seconds)
        processes[1].send_signal(signal.SIGTERM)
        codes = [p.wait(120) for p in processes]
        after, errors_after, _ = one_process()
    baseline = (before + after) / 2
    print(
        json.dumps(
            {
                "case": f"table-wise {HOSTS} hosts, every host a front end, batch {args.batch}, {args.clients} clients",
                "group_lookups_per_s": round(group_rate),
                "one_process_lookups_per_s": round(baseline),
                "one_process_spread": round(abs(before - after) / baseline, 3),
                "ratio_vs_one_process": round(group_rate / baseline, 3),
                "target_ratio": 0.8,
                "met": group_rate / baseline >= 0.8,
                "outputs_bit_equal": equal,
                "errors": group_errors + errors_before + errors_after,
                "exit_codes_after_sigterm_to_host1": codes,
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
