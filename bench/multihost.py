# ruff: noqa: E402
"""Two "hosts" on loopback (two processes, gloo) against one process, on the same model and batches.

Exports one multi-host artifact per plan (every table table-wise, alternating hosts; every table row-wise over
both hosts) and the one-host artifact of the same plan. The one-process baseline runs the one-host artifact
(``infer.load``, both shards in one process); the two ranks run ``server.distributed.DistributedModel`` (rank 0)
and ``follow`` (rank 1) on the host parts, with the partial outputs combined by ``reduce`` and by ``gather``.
The baseline is measured before and after the group ran; the ratio uses their mean. No gRPC on either side:
the front end is the same in both and ``bench/server.py`` measures it.

Bytes per request (one merged batch; int64 ids, int32 lengths, fp32 weights and outputs), what rank 0
exchanges with the other H - 1 hosts:
    (H - 1) x [56 (header) + 8 x ids + 4 x features x batch (+ 4 x ids when weighted) + 4 x batch x output_dim]
Scale it by requests/s to size a real network; the last term (the partial outputs) dominates at small bags.

Prints one JSON line per case. On a shared 2-core machine both ranks and the baseline compete for the same
cores: the ratio is a floor for hosts with their own cores, not a target.

    python bench/multihost.py                     # 8 tables x 100k rows x D=64, batch 512, 20 ids per bag
    python bench/multihost.py --batch 2048 --iters 40
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Run as ``python bench/multihost.py``, this file's folder heads sys.path and bench/server.py would shadow the
# ``server`` package (hence the imports below this, and E402 off for the file).
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

import torch

from infer.config import ModelSpec, TableConfig
from infer.features import SparseFeatures
from infer.planner.types import ComputeDevice, ShardingPlan, ShardingType, Topology
from infer.shard.plans import make_plan

HOSTS = 2
PLANS = ("table-wise", "row-wise")
COMBINES = ("reduce", "gather")


def _spec(args: argparse.Namespace) -> ModelSpec:
    return ModelSpec(tuple(TableConfig(f"t{i}", args.rows, args.dim, (f"f{i}",)) for i in range(args.tables)))


def _plan(spec: ModelSpec, kind: str, hosts: int) -> ShardingPlan:
    if kind == "table-wise":
        layout = {t.name: (ShardingType.TABLE_WISE, (i % hosts,)) for i, t in enumerate(spec.tables)}
    else:
        layout = {t.name: (ShardingType.ROW_WISE, tuple(range(hosts))) for t in spec.tables}
    plan = make_plan(spec, hosts, layout)
    return dataclasses.replace(plan, topology=Topology(hosts, ComputeDevice.CPU, local_world_size=1))


def _batches(spec: ModelSpec, args: argparse.Namespace) -> list[SparseFeatures]:
    return [
        SparseFeatures.random(spec, batch_size=args.batch, ids_per_bag=args.ids_per_bag, seed=seed)
        for seed in range(args.distinct)
    ]


def _time(run, batches: list[SparseFeatures], iters: int) -> float:
    """Seconds per forward over ``iters`` forwards (batches cycled), after warm-up forwards (TorchScript's
    profiling executor optimises a method after its first calls)."""
    with torch.inference_mode():
        for batch in batches[:5]:
            run(batch.values, batch.lengths, batch.weights)
        started = time.perf_counter()
        for i in range(iters):
            batch = batches[i % len(batches)]
            run(batch.values, batch.lengths, batch.weights)
        return (time.perf_counter() - started) / iters


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rank_main(args: argparse.Namespace) -> int:
    """One rank of the group: every plan's part, reduce then gather; rank 0 writes the timings."""
    import torch.distributed as dist

    from infer.artifact.hosts import load_host_part
    from server.distributed import COMBINE_GATHER, COMBINE_REDUCE, DistributedModel, GroupConfig, follow, join_group

    job = json.loads(Path(args.job).read_text())
    rank = int(os.environ["RANK"])
    batches = [SparseFeatures(tuple(b[0]), b[1], b[2], None) for b in torch.load(job["batches"])]
    timings = {}
    joined = False
    for kind in PLANS:
        # one core per "host": on loopback the hosts share this machine's cores (the baseline: cores // shards)
        part = load_host_part(job["artifacts"][kind], rank, intra_op_threads=max(1, (os.cpu_count() or 1) // HOSTS))
        if not joined:
            device = join_group(part, rank, HOSTS, 120.0)
            joined = True
        if rank != 0:
            if follow(part, device) != 0:
                return 1
            continue
        # rank 0's own partial forward alone (rank 1 waits for the next header meanwhile): what the group adds
        # on top of it is communication, validation on rank 0 and waiting for the slower host
        timings[f"{kind}/rank0-local"] = _time(part.module, batches, job["iters"])
        model = None
        for name, combine in (("reduce", COMBINE_REDUCE), ("gather", COMBINE_GATHER)):
            model = DistributedModel(part, GroupConfig(collective_timeout_s=120.0, combine=combine), device)
            timings[f"{kind}/{name}"] = _time(model, batches, job["iters"])
        assert model is not None
        model.stop_group()
    if rank == 0:
        Path(job["out"]).write_text(json.dumps(timings))
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--ids-per-bag", type=int, default=20)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--distinct", type=int, default=8, help="distinct batches, cycled")
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--job", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank is not None:
        return rank_main(args)

    from infer.artifact.export import export
    from infer.artifact.hosts import export_hosts
    from infer.artifact.load import load
    from infer.quant.quantize import quantize
    from infer.shard.builder import shard_model
    from infer.weights import random_weights
    from server.distributed import request_bytes

    spec = _spec(args)
    model = quantize(spec, random_weights(spec, seed=0))
    batches = _batches(spec, args)
    with tempfile.TemporaryDirectory(prefix="embserve-multihost-") as tmp:
        folder = Path(tmp)
        artifacts, baselines = {}, {}
        for kind in PLANS:
            plan = _plan(spec, kind, HOSTS)
            artifacts[kind] = str(export_hosts(model, folder / f"{kind}-hosts", plan))
            one_host = dataclasses.replace(plan, topology=Topology(HOSTS, ComputeDevice.CPU))
            baselines[kind] = export(shard_model(model, one_host), folder / f"{kind}-one", plan=one_host)
        del model
        torch.save([(list(b.keys), b.values, b.lengths) for b in batches], folder / "batches.pt")
        before = {kind: _time(load(baselines[kind]).module, batches, args.iters) for kind in PLANS}
        job = {"artifacts": artifacts, "batches": str(folder / "batches.pt"), "iters": args.iters,
               "out": str(folder / "timings.json")}  # fmt: skip
        (folder / "job.json").write_text(json.dumps(job))
        port = _free_port()
        processes = []
        for rank in range(HOSTS):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(HOSTS), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port))  # fmt: skip
            script = os.path.abspath(__file__)
            command = [sys.executable, script, "--rank", str(rank), "--job", str(folder / "job.json")]
            processes.append(subprocess.Popen(command, env=env))
        codes = [p.wait(timeout=900) for p in processes]
        if codes != [0] * HOSTS:
            print(json.dumps({"error": f"ranks exited {codes}"}))
            return 1
        timings = json.loads((folder / "timings.json").read_text())
        after = {kind: _time(load(baselines[kind]).module, batches, args.iters) for kind in PLANS}
    ids = sum(b.values.numel() for b in batches) / len(batches)
    lookups = ids  # one lookup per id
    per_request = request_bytes(int(ids), len(spec.features) * args.batch, args.batch, spec.output_dim, False, HOSTS)
    formula = "(H-1) x [56 + 8 x ids + 4 x features x batch + 4 x batch x output_dim]"
    for kind in PLANS:
        one_process = (before[kind] + after[kind]) / 2
        for combine in COMBINES:
            seconds = timings[f"{kind}/{combine}"]
            print(
                json.dumps(
                    {
                        "case": f"{kind} {HOSTS} hosts, {combine}",
                        "batch": args.batch,
                        "ids_per_request": int(ids),
                        "output_dim": spec.output_dim,
                        "multihost_lookups_per_s": round(lookups / seconds),
                        "one_process_lookups_per_s": round(lookups / one_process),
                        "one_process_spread": round(abs(before[kind] - after[kind]) / one_process, 3),
                        "ratio_vs_one_process": round(one_process / seconds, 3),
                        "ms_per_request_multihost": round(1e3 * seconds, 3),
                        "ms_per_request_one_process": round(1e3 * one_process, 3),
                        "ms_rank0_partial_alone": round(1e3 * timings[f"{kind}/rank0-local"], 3),
                        "bytes_per_request": per_request,
                        "bytes_formula": formula,
                    }
                ),
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
