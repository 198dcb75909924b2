"""Multi-host fixtures: a small model with a dense part, its multi-host artifacts for 2 and 3 hosts (one per
sharding kind), and launching "hosts" as processes on 127.0.0.1 with the environment torchrun would give them."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from infer.artifact.hosts import export_hosts
from infer.config import ModelSpec
from infer.modules.collection import EmbserveModel
from infer.planner.types import ComputeDevice, ShardingPlan, ShardingType, Topology
from infer.quant.quantize import quantize
from infer.shard.plans import make_plan
from infer.weights import random_weights
from tests.conftest import TinyOverArch, mixed_spec

NUM_DENSE = 4
KINDS = ("column", "mixed")  # column: table-wise and column-wise tables (exact); mixed: row-, column-, table-wise
ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def host_plan(spec: ModelSpec, kind: str, hosts: int, devices_per_host: int = 1) -> ShardingPlan:
    """A plan of ``hosts`` x ``devices_per_host`` CPU devices: every table table-wise (round robin), the two
    wide tables column-wise over every device, every table row-wise over every device, or a mix."""
    world = hosts * devices_per_host
    every = tuple(range(world))
    names = [t.name for t in spec.tables]
    layout: dict[str, tuple[ShardingType, tuple[int, ...]]] = {
        name: (ShardingType.TABLE_WISE, (i % world,)) for i, name in enumerate(names)
    }
    if kind == "column":
        layout["t_int8"] = (ShardingType.COLUMN_WISE, every)
        layout["t_int4"] = (ShardingType.COLUMN_WISE, tuple(reversed(every)))
    elif kind == "row":
        layout = {name: (ShardingType.ROW_WISE, every) for name in names}
    elif kind == "mixed":
        layout["t_int8"] = (ShardingType.ROW_WISE, every)
        layout["t_int4"] = (ShardingType.COLUMN_WISE, every[:2])
        layout["t_int2"] = (ShardingType.TABLE_WISE, (world - 1,))
        layout["t_fp16"] = (ShardingType.ROW_WISE, tuple(reversed(every)))
    plan = make_plan(spec, world, layout, column_unit=8)
    return dataclasses.replace(plan, topology=Topology(world, ComputeDevice.CPU, local_world_size=devices_per_host))


@pytest.fixture(scope="session")
def dense_spec() -> ModelSpec:
    spec = mixed_spec()
    torch.manual_seed(0)
    return spec.with_dense_arch(TinyOverArch(NUM_DENSE, spec.output_dim), NUM_DENSE)


@pytest.fixture(scope="session")
def quantized(dense_spec: ModelSpec) -> EmbserveModel:
    return quantize(dense_spec, random_weights(dense_spec, seed=17))


@pytest.fixture(scope="session")
def host_artifacts(quantized: EmbserveModel, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, str], Path]:
    """(hosts, kind) -> artifact; the mixed 2-host plan has 2 devices per host."""
    root = tmp_path_factory.mktemp("hosts")
    artifacts = {}
    for hosts in (2, 3):
        for kind in KINDS:
            devices = 2 if (hosts, kind) == (2, "mixed") else 1
            plan = host_plan(quantized.spec, kind, hosts, devices)
            artifacts[(hosts, kind)] = export_hosts(quantized, root / f"{kind}_{hosts}", plan)
    return artifacts


def group_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """What torchrun gives each worker (one per host, --nproc-per-node 1)."""
    env = dict(os.environ)
    env.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=str(ROOT),
    )  # fmt: skip
    return env


def run_group(job: dict, hosts: int, folder: Path, timeout_s: float = 180) -> None:
    """Run ``tests/distributed/group_worker.py`` on ``hosts`` ranks; every rank must exit 0."""
    job_path = folder / "job.json"
    job_path.write_text(json.dumps(job))
    port = free_port()
    worker = Path(__file__).with_name("group_worker.py")
    logs = [open(folder / f"rank{rank}.log", "w") for rank in range(hosts)]
    processes = [
        subprocess.Popen(
            [sys.executable, str(worker), str(job_path)],
            env=group_env(rank, hosts, port),
            stdout=logs[rank],
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
        for rank in range(hosts)
    ]
    deadline = time.monotonic() + timeout_s
    try:
        for rank, process in enumerate(processes):
            code = process.wait(timeout=max(1.0, deadline - time.monotonic()))
            assert code == 0, f"rank {rank} exited {code}: {(folder / f'rank{rank}.log').read_text()[-3000:]}"
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        for log in logs:
            log.close()
