# ruff: noqa: E402
"""A lost host under load: how soon the survivors notice, and what the clients see (3 "hosts" on loopback).

Exports one model (``--tables`` INT8 tables, table-wise over 3 hosts) twice: without replicas and with
``--replicas 2``. For each, starts ``embserve serve`` on 3 ranks with ``--collective-timeout-s``, runs
``--clients`` closed-loop Lookup clients on hosts 0 and 1, sends SIGKILL to host 2 (or SIGSTOP: a hang) and
measures:

- without replicas: seconds from the signal to the first UNAVAILABLE answer (detection; target <= 2 x the
  collective timeout), and whether both survivors then exit 1 for the launcher's restart;
- with replicas (SIGKILL and SIGSTOP): seconds from the signal to the survivors' "re-formed" line (detection +
  agreeing on the new members + the new gloo group), the re-form alone (printed by the survivors), failed calls
  after the signal (target 0), the longest call during the failover, every answer compared with the group's
  answers before the loss.

Prints one JSON line per case.

    python bench/multihost_failover.py             # 8 tables x 100k rows, batch 512, 8 clients, timeout 5 s
    python bench/multihost_failover.py --quick     # 10k rows, 4 clients
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# Run as ``python bench/multihost_failover.py``, this folder heads sys.path and bench/server.py would shadow the
# ``server`` package: import the bench helpers as ``bench.multihost_serving`` from the repository root instead.
ROOT = Path(__file__).resolve().parent.parent
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path[0] = str(ROOT)

import grpc
import torch

from bench.multihost_serving import add_model_arguments, table_wise_over_hosts
from infer.features import SparseFeatures
from server.app import SERVING_LINE
from server.client import EmbserveClient
from server.group.members import REFORMED_LINE

HOSTS = 3
VICTIM = 2  # host 0 holds the store (rank 0's TCPStore under env://)


class _Lines:
    """A rank's stdout lines with the time each arrived."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.lines: list[tuple[float, str]] = []
        self.changed = threading.Condition()
        threading.Thread(target=self._read, args=(process,), daemon=True).start()

    def _read(self, process: subprocess.Popen) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            with self.changed:
                self.lines.append((time.monotonic(), line))
                self.changed.notify_all()

    def wait_for(self, text: str, timeout: float) -> tuple[float, str] | None:
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                for when, line in self.lines:
                    if text in line:
                        return when, line
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.changed.wait(left)


class _Clients:
    """Closed-loop Lookup clients; every answer checked against the expected one."""

    def __init__(self, ports: list[int], batches: list[SparseFeatures], expected: list[torch.Tensor], n: int) -> None:
        self.ok = 0
        self.answered_at: list[float] = []  # when each OK call ended
        self.wrong = 0
        self.failed: list[tuple[float, str]] = []  # (when, status) of every failed call
        self.longest_after: float = 0.0  # the longest call that ended after ``mark``
        self.mark = float("inf")
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._run, args=(ports[i % len(ports)], batches[i % len(batches)], want))
            for i, want in ((i, expected[i % len(batches)]) for i in range(n))
        ]
        for thread in self.threads:
            thread.start()

    def _run(self, port: int, batch: SparseFeatures, want: torch.Tensor) -> None:
        with EmbserveClient(f"127.0.0.1:{port}", timeout=120) as stub:
            while not self.stop.is_set():
                began = time.monotonic()
                try:
                    got = stub.lookup(batch)
                    with self._lock:
                        self.ok += 1
                        self.answered_at.append(time.monotonic())
                        self.wrong += 0 if torch.equal(got, want) else 1
                except grpc.RpcError as err:
                    with self._lock:
                        self.failed.append((time.monotonic(), err.code().name))
                    return
                ended = time.monotonic()
                if ended > self.mark:
                    with self._lock:
                        self.longest_after = max(self.longest_after, ended - began)

    def join(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(180)


def _start(artifact: Path, timeout_s: float, master: int) -> tuple[list[subprocess.Popen], list[_Lines], list[int]]:
    command = [sys.executable, "-m", "infer.cli", "serve", str(artifact), "--python", "--host", "127.0.0.1",
               "--port", "0", "--collective-timeout-s", str(timeout_s), "--failure-grace-s", "2"]  # fmt: skip
    processes = [
        subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(HOSTS), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master)),
        )  # fmt: skip
        for r in range(HOSTS)
    ]
    lines = [_Lines(p) for p in processes]
    ports = []
    for rank, reader in enumerate(lines):
        found = reader.wait_for(SERVING_LINE, 300)
        if found is None:
            raise SystemExit(f"rank {rank} did not start serving")
        ports.append(int(found[1].rsplit(" ", 1)[1]))
    return processes, lines, ports


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _case(artifact: Path, replicas: int, signum: signal.Signals, args: argparse.Namespace, batches) -> dict:
    processes, lines, ports = _start(artifact, args.timeout, _free_port())
    try:
        with EmbserveClient(f"127.0.0.1:{ports[0]}", timeout=60) as stub:
            expected = [stub.lookup(b) for b in batches]  # the whole group's answers before the loss
        clients = _Clients(ports[:2], batches, expected, args.clients)
        time.sleep(args.warmup_s)  # bench: steady load before the loss
        before = clients.ok
        lost_at = time.monotonic()
        clients.mark = lost_at
        processes[VICTIM].send_signal(signum)
        result: dict = {
            "case": f"3 hosts, {signum.name} host {VICTIM} under {args.clients} clients, replicas {replicas}",
            "collective_timeout_s": args.timeout,
        }
        if replicas > 1:
            seen = [lines[r].wait_for(REFORMED_LINE, 10 * args.timeout + 60) for r in (0, 1)]
            if any(s is None for s in seen):
                result["reformed"] = False
            else:
                result["reformed"] = True
                done_at = max(s[0] for s in seen if s is not None)
                reform = [float(m.group(1)) for s in seen if s and (m := re.search(r"in ([0-9.]+) s", s[1]))]
                result["reformed_after_s"] = round(done_at - lost_at, 2)
                result["reform_s"] = max(reform)
                result["detection_s"] = round(done_at - lost_at - max(reform), 2)
                result["detection_vs_timeout"] = round(result["detection_s"] / args.timeout, 2)
                later = [t - done_at for t in clients.answered_at if t >= done_at]
                reached = clients.ok
                time.sleep(args.warmup_s)  # bench: serve a while in the re-formed group
                result["calls_after_reform"] = clients.ok - reached
                later = later or [t - done_at for t in clients.answered_at if t >= done_at]
                result["first_answer_after_reform_s"] = round(min(later), 3) if later else None
            clients.join()
            result["calls_before_loss"] = before
            result["failed_calls_after_loss"] = len(clients.failed)
            result["wrong_answers"] = clients.wrong
            result["longest_call_during_failover_s"] = round(clients.longest_after, 2)
            result["target"] = "0 failed calls after detection; detection <= 2 x collective timeout"
            result["met"] = bool(
                result["reformed"] and not clients.failed and not clients.wrong and result["detection_vs_timeout"] <= 2
            )
            processes[0].send_signal(signal.SIGTERM)
            result["exit_codes_after_sigterm"] = [processes[r].wait(120) for r in (0, 1)]
        else:
            deadline = time.monotonic() + 10 * args.timeout + 60
            while not clients.failed and time.monotonic() < deadline:
                time.sleep(0.01)
            clients.join()
            first = min((w for w, code in clients.failed if code == "UNAVAILABLE"), default=None)
            result["detection_s"] = round(first - lost_at, 2) if first is not None else None
            result["detection_vs_timeout"] = round((first - lost_at) / args.timeout, 2) if first else None
            result["failed_codes"] = sorted({code for _, code in clients.failed})
            result["wrong_answers"] = clients.wrong
            result["survivor_exit_codes"] = [processes[r].wait(120) for r in (0, 1)]
            result["target"] = "UNAVAILABLE within 2 x collective timeout, survivors exit 1"
            result["met"] = bool(first is not None and (first - lost_at) <= 2 * args.timeout)
            result["met"] = result["met"] and result["survivor_exit_codes"] == [1, 1]
        return result
    finally:
        for process in processes:
            if process.poll() is None:
                if process.returncode is None:
                    process.send_signal(signal.SIGCONT)
                process.kill()
                process.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    add_model_arguments(parser)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=5.0, help="--collective-timeout-s of the group")
    parser.add_argument("--warmup-s", type=float, default=3.0, help="load before the loss and after the re-form")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--replicas-only", action="store_true", help="only the --replicas 2 case")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.clients, args.warmup_s = 10_000, 4, 1.5

    from infer.artifact.hosts import export_hosts
    from infer.planner.replicas import place_replicas

    spec, model, plan = table_wise_over_hosts(args.tables, args.rows, args.dim, HOSTS)
    batches = [SparseFeatures.random(spec, batch_size=args.batch, ids_per_bag=20, seed=s) for s in range(4)]
    with tempfile.TemporaryDirectory(prefix="embserve-multihost-failover-") as tmp:
        plain = export_hosts(model, Path(tmp) / "plain", plan)
        replicated = export_hosts(model, Path(tmp) / "replicas", place_replicas(plan, 2))
        del model
        cases = [(plain, 1, signal.SIGKILL), (plain, 1, signal.SIGSTOP), (replicated, 2, signal.SIGKILL),
                 (replicated, 2, signal.SIGSTOP)]  # fmt: skip
        for artifact, replicas, signum in cases[2:] if args.replicas_only else cases:
            print(json.dumps(_case(artifact, replicas, signum, args, batches)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
