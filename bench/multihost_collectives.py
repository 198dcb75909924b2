# ruff: noqa: E402
"""The step loop's collectives on 2 "hosts" (gloo, loopback): ``all_to_all_single`` against paired send/recv
(``batch_isend_irecv``), and the step's three collectives against two (the header folded into the ids exchange).

Sizes are one step of ``bench/multihost_serving.py`` (table-wise, 2 hosts, batch ``--batch``, 8 features, 20 ids
per bag): each host sends the other the ids (int32) and lengths of its half of the features, and gets back
``batch x columns`` float32. Prints one JSON line per case: median microseconds over ``--rounds`` and the ratio
to the baseline of the same run (``all_to_all_single``, or the step's three collectives).

    python bench/multihost_collectives.py            # batch 512, 2000 rounds
    python bench/multihost_collectives.py --quick    # 300 rounds
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

import torch
import torch.distributed as dist

HOSTS = 2


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _time(fn, rounds: int) -> float:
    for _ in range(20):
        fn()
    samples = []
    for _ in range(rounds):
        began = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - began)
    return statistics.median(samples) * 1e6


def _rank(rank: int, port: int, args: argparse.Namespace) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=HOSTS,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    other = 1 - rank
    ids_bytes = args.batch * 4 * 20 * 4 + args.batch * 4 * 4  # 4 of 8 features: int32 ids and lengths
    column_bytes = args.batch * args.columns * 4
    header = torch.zeros(3 + HOSTS, dtype=torch.int64)
    gathered = torch.zeros(HOSTS * len(header), dtype=torch.int64)

    def a2a(size: int):
        splits = [0 if h == rank else size for h in range(HOSTS)]  # nothing to itself, as the step loop
        send = torch.zeros(size, dtype=torch.uint8)
        recv = torch.empty(size, dtype=torch.uint8)
        return lambda: dist.all_to_all_single(recv, send, splits, splits)

    def pair(size: int):
        send = torch.zeros(size, dtype=torch.uint8)
        recv = torch.empty(size, dtype=torch.uint8)

        def run() -> None:
            ops = [dist.P2POp(dist.isend, send, other), dist.P2POp(dist.irecv, recv, other)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        return run

    def header_gather() -> None:
        dist.all_gather_into_tensor(gathered, header)

    def header_a2a() -> None:  # the same exchange as all_to_all_single: each rank's header to every rank
        dist.all_to_all_single(gathered, header.repeat(HOSTS))

    ids_a2a, columns_a2a = a2a(ids_bytes), a2a(column_bytes)
    # the header folded into the ids exchange: its 40 bytes go first in the same buffer (sizes then known from a
    # fixed maximum: the receiver allocates the largest and reads the header for the real length)
    folded = a2a(ids_bytes + 8 * len(header))

    def three() -> None:
        header_gather()
        ids_a2a()
        columns_a2a()

    def two() -> None:
        folded()
        columns_a2a()

    cases = [
        ("ids all_to_all_single", ids_a2a, "ids"),
        ("ids send/recv pair", pair(ids_bytes), "ids"),
        ("columns all_to_all_single", columns_a2a, "columns"),
        ("columns send/recv pair", pair(column_bytes), "columns"),
        ("header all_gather", header_gather, "header"),
        ("header all_to_all_single", header_a2a, "header"),
        ("step: header + ids + columns (3 collectives)", three, "step"),
        ("step: header folded into ids + columns (2 collectives)", two, "step"),
    ]
    results = {}
    for name, fn, _ in cases:
        dist.barrier()
        results[name] = _time(fn, args.rounds)
    if rank == 0:
        baselines = {"ids": "ids all_to_all_single", "columns": "columns all_to_all_single",
                     "header": "header all_gather",
                     "step": "step: header + ids + columns (3 collectives)"}  # fmt: skip
        for name, _, group in cases:
            base = baselines[group]
            line = {"case": name, "median_us": round(results[name], 1), "rounds": args.rounds,
                    "batch": args.batch, "bytes": ids_bytes if group == "ids" else column_bytes if group == "columns"
                    else None}  # fmt: skip
            if base is not None:
                line["ratio_vs_baseline"] = round(results[name] / results[base], 3)
                line["baseline"] = base
            print(json.dumps(line), flush=True)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--columns", type=int, default=256, help="output columns one host computes")
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds = 300
    if args.rank >= 0:
        _rank(args.rank, args.port, args)
        return 0
    import subprocess

    port = _free_port()
    command = [sys.executable, os.path.abspath(__file__), "--batch", str(args.batch), "--columns", str(args.columns),
               "--rounds", str(args.rounds), "--port", str(port)]  # fmt: skip
    ranks = [subprocess.Popen([*command, "--rank", str(r)]) for r in range(HOSTS)]
    return max(p.wait(600) for p in ranks)


if __name__ == "__main__":
    sys.exit(main())
