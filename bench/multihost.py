# ruff: noqa: E402
"""Several "hosts" on loopback (one process each, gloo) against one process: time per request and bytes per host.

For each host count H (``--hosts 2,3,4``) and plan (every table table-wise, round robin over the hosts; every
table row-wise over all hosts) it exports a multi-host artifact, runs H ranks and times rank 0's distributed
forward (``server.group.leader.DistributedModel``) in the ids all-to-all design (``all-to-all``: each host gets
only the ids its shards own, rank 0 gets back only each host's columns) and in the first design (``broadcast``:
every id to every host, whole partial outputs summed by ``reduce``). Each rank counts the bytes it sent and
received per request (all-to-all: counted by ``server.group.exchange``; broadcast: its formula, below). The
one-process baseline runs the one-host artifact of the same plan (H shards in one process). No gRPC on either
side: ``bench/server.py`` measures the front end.

The target (issue 29): bytes received per host per request <= 1.1 x the ids and outputs it owns, where a host
other than the front end owns the ids (int32), lengths and weights of its shards, and the front end owns the
columns it assembles from the other hosts (float32): ``owned_ratio`` is received / owned, the worst host.

Broadcast bytes per request, per host other than rank 0: receives 56 + 8 x ids + 4 x features x batch
(+ 4 x ids weighted), sends 4 x batch x output_dim; rank 0 sends (H - 1) x that and receives (H - 1) x
4 x batch x output_dim (a gather; gloo's reduce moves at least as much).

Then a model of bytes and time per request vs H, fitted on the measured points and extrapolated to 64 hosts
(one JSON line per design and H), drawn to ``--plot`` (a PNG, matplotlib) when given. On a shared 2-core machine
the ranks compete for the cores: times are an upper bound for hosts with their own cores; bytes are exact.

    python bench/multihost.py --quick                         # small sizes, 2 and 3 hosts
    python bench/multihost.py --plot docs/multihost_scale.png # 8 tables x 100k rows x D=64, batch 512
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

PLANS = ("table-wise", "row-wise")
DESIGNS = ("all-to-all", "broadcast")
SCALE_HOSTS = (2, 4, 8, 16, 32, 64)
PINGS = 20
PING_ROUNDS = 5
# Collectives per request, in round trips of a ping (two collectives): the all-to-all design issues a header
# and two all-to-alls, the broadcast design a header, three broadcasts and a reduce.
ROUND_TRIPS = {"all-to-all": 1.5, "broadcast": 2.5}


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
    """One rank of the group: every plan's part, all-to-all then broadcast; every rank writes its counters."""
    import torch.distributed as dist

    from infer.artifact.hosts import load_host_part
    from server.group.exchange import Exchange
    from server.group.leader import (
        COMBINE_ALL_TO_ALL,
        COMBINE_REDUCE,
        DistributedModel,
        GroupConfig,
        follow,
        join_group,
    )
    from server.group.routing import group_routing

    job = json.loads(Path(args.job).read_text())
    rank, hosts = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    batches = [SparseFeatures(tuple(b[0]), b[1], b[2], None) for b in torch.load(job["batches"])]
    report: dict[str, float] = {}
    joined = False
    for kind in PLANS:
        # the hosts share this machine's cores on loopback: each gets cores // hosts (at least one)
        part = load_host_part(job["artifacts"][kind], rank, intra_op_threads=max(1, (os.cpu_count() or 1) // hosts))
        if not joined:
            device = join_group(part, rank, hosts, 300.0)
            joined = True
        if rank != 0:
            exchange = Exchange(group_routing(part.manifest.spec, part.plan), rank, device)
            for _ in DESIGNS:  # rank 0 runs one DistributedModel per design, each ended by a stop header
                if follow(part, device, exchange) != 0:
                    return 1
            report[f"{kind}/received"] = exchange.bytes_received
            report[f"{kind}/sent"] = exchange.bytes_sent
            continue
        for design, combine in zip(DESIGNS, (COMBINE_ALL_TO_ALL, COMBINE_REDUCE)):
            model = DistributedModel(part, GroupConfig(collective_timeout_s=300.0, combine=combine), device)
            report[f"{kind}/{design}/seconds"] = _time(model, batches, job["iters"])
            report[f"{kind}/{design}/forwards"] = model.forwards
            if combine == COMBINE_ALL_TO_ALL:
                report[f"{kind}/received"] = model.exchange.bytes_received
                report[f"{kind}/sent"] = model.exchange.bytes_sent
                if "ping_seconds" not in report:  # the group's round trip alone: a header and a 1-element reduce
                    rounds = []
                    for _ in range(PING_ROUNDS):  # the fastest round: the least disturbed by other processes
                        started = time.perf_counter()
                        for _ in range(PINGS):
                            model.ping()
                        rounds.append((time.perf_counter() - started) / PINGS)
                    report["ping_seconds"] = min(rounds)
            model.stop_group()
    Path(f"{job['out']}.rank{rank}").write_text(json.dumps(report))
    dist.destroy_process_group()
    return 0


def _owned_bytes(spec: ModelSpec, plan: ShardingPlan, batches: list[SparseFeatures], host: int) -> float:
    """Per request, what host ``host`` owns (see the module docstring), counted from the plan and the ids."""
    size = batches[0].batch_size
    if host == 0:  # the front end: every other host's columns
        columns = sum(s.num_cols for t in plan.tables for s in t.shards if s.device != 0)
        return float(4 * size * columns)
    plans = {t.table: t for t in plan.tables}
    total = 0
    for batch in batches:
        start = 0
        for index, info in enumerate(spec.features):
            count = int(batch.lengths[index * size : (index + 1) * size].sum())
            ids = batch.values[start : start + count]
            start += count
            mine = [s for s in plans[info.table].shards if s.device == host]
            if not mine:
                continue
            owned = sum(int(((ids >= s.row_offset) & (ids < s.row_offset + s.num_rows)).sum()) for s in mine)
            total += 4 * owned + 4 * size
    return total / len(batches)


def _run_group(args: argparse.Namespace, folder: Path, artifacts: dict[str, str], hosts: int) -> list[dict]:
    job = {"artifacts": artifacts, "batches": str(folder / "batches.pt"), "iters": args.iters,
           "out": str(folder / f"report-{hosts}")}  # fmt: skip
    (folder / f"job-{hosts}.json").write_text(json.dumps(job))
    port = _free_port()
    processes = []
    for rank in range(hosts):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(hosts), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))  # fmt: skip
        command = [sys.executable, os.path.abspath(__file__), "--rank", str(rank), "--job",
                   str(folder / f"job-{hosts}.json")]  # fmt: skip
        processes.append(subprocess.Popen(command, env=env))
    codes = [p.wait(timeout=1200) for p in processes]
    if codes != [0] * hosts:
        raise RuntimeError(f"{hosts} ranks exited {codes}")
    return [json.loads(Path(f"{job['out']}.rank{rank}").read_text()) for rank in range(hosts)]


def _bytes_model(design: str, kind: str, hosts: int, ids: float, size: int, features: int, dim: int) -> dict:
    """Bytes per request at ``hosts`` hosts (uniform ids, tables spread evenly), per the two designs' formulas:
    the worst follower's received, rank 0's sent and received."""
    header = 8 * (7 + hosts)
    if design == "broadcast":
        follower = 56 + 8 * ids + 4 * features * size
        return {"follower_received": follower, "rank0_sent": (hosts - 1) * follower,
                "rank0_received": (hosts - 1) * 4 * size * dim}  # fmt: skip
    share = 1 / hosts
    lengths = 4 * size * (features * share if kind == "table-wise" else features)
    follower = header + 4 * ids * share + lengths
    columns = dim * share if kind == "table-wise" else dim
    return {"follower_received": follower, "rank0_sent": (hosts - 1) * follower,
            "rank0_received": (hosts - 1) * 4 * size * columns}  # fmt: skip


def _plot(path: str, measured: dict, model_lines: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for (kind, design), series in sorted(measured.items()):
        hosts = sorted(series)
        right.plot(hosts, [1e3 * series[h] for h in hosts], "o", label=f"{kind} {design} measured")
    by_case: dict[tuple[str, str], list[dict]] = {}
    for line in model_lines:
        by_case.setdefault((line["plan"], line["design"]), []).append(line)
    for (kind, design), lines in sorted(by_case.items()):
        hosts = [line["hosts"] for line in lines]
        left.plot(
            hosts, [line["follower_received_bytes"] / 1e3 for line in lines], label=f"{kind} {design} follower in"
        )
        left.plot(hosts, [line["rank0_sent_and_received_bytes"] / 1e3 for line in lines], "--",
                  label=f"{kind} {design} rank 0 in+out")  # fmt: skip
        right.plot(hosts, [line["ms_per_request_model"] for line in lines], label=f"{kind} {design} model")
    for axis, title, unit in ((left, "bytes per request per host", "kB"), (right, "time per request", "ms")):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("hosts")
        axis.set_ylabel(unit)
        axis.set_title(title)
        axis.legend(fontsize=6)
    figure.tight_layout()
    figure.savefig(path, dpi=80)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--ids-per-bag", type=int, default=20)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--distinct", type=int, default=8, help="distinct batches, cycled")
    parser.add_argument("--hosts", default="2,3,4", help="host counts to measure, comma-separated")
    parser.add_argument("--link-gbps", type=float, default=25.0, help="the scaling model's network link")
    parser.add_argument("--plot", default=None, help="write the scaling model's plot to this PNG")
    parser.add_argument("--quick", action="store_true", help="small sizes: 10k rows, batch 128, 10 iters, 2,3 hosts")
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--job", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank is not None:
        return rank_main(args)
    if args.quick:
        args.rows, args.batch, args.iters, args.distinct, args.hosts = 10_000, 128, 10, 4, "2,3"

    from infer.artifact.export import export
    from infer.artifact.hosts import export_hosts
    from infer.artifact.load import load
    from infer.quant.quantize import quantize
    from infer.shard.builder import shard_model
    from infer.weights import random_weights

    spec = _spec(args)
    model = quantize(spec, random_weights(spec, seed=0))
    batches = _batches(spec, args)
    ids = sum(b.values.numel() for b in batches) / len(batches)
    host_counts = [int(h) for h in args.hosts.split(",")]
    measured: dict[tuple[str, str], dict[int, float]] = {}
    with tempfile.TemporaryDirectory(prefix="embserve-multihost-") as tmp:
        folder = Path(tmp)
        torch.save([(list(b.keys), b.values, b.lengths) for b in batches], folder / "batches.pt")
        # H = 1: the whole model in one process, every table in one kernel (the single-host baseline)
        plan = dataclasses.replace(_plan(spec, "table-wise", 1), topology=Topology(1, ComputeDevice.CPU))
        one = export(shard_model(model, plan), folder / "one-process", plan=plan)
        one_seconds = _time(load(one).module, batches, args.iters)
        one_process = dict.fromkeys(PLANS, one_seconds)
        measured[("whole model", "one process")] = {1: one_seconds}
        pings: dict[int, float] = {}
        for hosts in host_counts:
            artifacts = {}
            plans = {kind: _plan(spec, kind, hosts) for kind in PLANS}
            for kind, plan in plans.items():
                artifacts[kind] = str(export_hosts(model, folder / f"{kind}-{hosts}", plan))
            reports = _run_group(args, folder, artifacts, hosts)
            pings[hosts] = reports[0]["ping_seconds"]
            print(json.dumps({"case": f"ping {hosts} hosts", "ms_per_ping": round(1e3 * pings[hosts], 3)}), flush=True)
            for kind, plan in plans.items():
                forwards = reports[0][f"{kind}/all-to-all/forwards"]
                received = [r[f"{kind}/received"] / forwards for r in reports]
                sent = [r[f"{kind}/sent"] / forwards for r in reports]
                owned = [_owned_bytes(spec, plan, batches, h) for h in range(hosts)]
                worst = max(range(hosts), key=lambda h: received[h] / owned[h])
                broadcast = _bytes_model("broadcast", kind, hosts, ids, args.batch, len(spec.features), spec.output_dim)
                for design in DESIGNS:
                    seconds = reports[0][f"{kind}/{design}/seconds"]
                    measured.setdefault((kind, design), {})[hosts] = seconds
                    line: dict = {"case": f"{kind} {hosts} hosts, {design}", "batch": args.batch,
                                  "ids_per_request": int(ids), "output_dim": spec.output_dim,
                                  "ms_per_request": round(1e3 * seconds, 3),
                                  "ms_one_process": round(1e3 * one_process[kind], 3),
                                  "ratio_vs_one_process": round(one_process[kind] / seconds, 3)}  # fmt: skip
                    if design == "all-to-all":
                        line.update(
                            bytes_received_per_host=[round(b) for b in received],
                            bytes_sent_per_host=[round(b) for b in sent],
                            bytes_owned_per_host=[round(b) for b in owned],
                            owned_ratio=round(received[worst] / owned[worst], 4),
                            owned_ratio_host=worst,
                            target_owned_ratio=1.1,
                            met=received[worst] / owned[worst] <= 1.1,
                        )
                    else:
                        line.update(
                            bytes_received_per_host=[round(broadcast["rank0_received"])]
                            + [round(broadcast["follower_received"])] * (hosts - 1),
                            bytes_sent_rank0=round(broadcast["rank0_sent"]),
                            owned_ratio=round(broadcast["follower_received"] / max(owned[1:]), 4),
                            bytes_counted="formula",
                        )
                    print(json.dumps(line), flush=True)
    # Time per request at H hosts with their own cores: the lookups split evenly (one process's time / H), the
    # collectives' round trips (a ping costs c x (H - 1), c the least per-peer cost measured: on a shared
    # machine the others are inflated by waiting for the cores), and rank 0's bytes over one link of
    # --link-gbps (rank 0's link is the bottleneck of both designs).
    per_peer = min(seconds / (hosts - 1) for hosts, seconds in pings.items())
    model_lines = []
    for kind in PLANS:
        for design in DESIGNS:
            for hosts in SCALE_HOSTS:
                bytes_at = _bytes_model(design, kind, hosts, ids, args.batch, len(spec.features), spec.output_dim)
                rank0_bytes = bytes_at["rank0_sent"] + bytes_at["rank0_received"]
                ping = per_peer * (hosts - 1)
                seconds = (
                    one_process[kind] / hosts + ROUND_TRIPS[design] * ping + rank0_bytes / (args.link_gbps * 1.25e8)
                )
                line = {"model": "scale", "plan": kind, "design": design, "hosts": hosts,
                        "follower_received_bytes": round(bytes_at["follower_received"]),
                        "rank0_sent_and_received_bytes": round(rank0_bytes),
                        "ms_per_request_model": round(1e3 * seconds, 3),
                        "ms_ping_model": f"{1e3 * per_peer:.3f} x (H - 1)",
                        "link_gbps": args.link_gbps}  # fmt: skip
                model_lines.append(line)
                print(json.dumps(line), flush=True)
    if args.plot:
        _plot(args.plot, measured, model_lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
