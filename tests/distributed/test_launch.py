"""SIGTERM to the launcher of either host (``python -m server.group.launch``, torchrun's arguments), 2 hosts on
127.0.0.1 under load on both front ends: every call answered, every rank and both launchers exit 0, no stack
trace printed (plain torchrun exits 1 and prints a SignalException / DistNetworkError stack)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.distributed import TCPStore
from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

from server.app import SERVING_LINE
from server.group.launch import linger
from tests.conftest import random_batch
from tests.distributed.conftest import ROOT, free_port, group_env
from tests.distributed.test_serving import _expected, _Load
from tests.server.support import LineReader


def _static(host: int, port: int) -> list[str]:
    """torchrun's static rendezvous: fixed node ranks, host 0's store at ``port``."""
    return ["--node-rank", str(host), "--master-addr", "127.0.0.1", "--master-port", str(port)]


def _launcher(
    host: int, port: int, launch: list[str], artifact: Path, serve: list[str], log: Path
) -> subprocess.Popen[str]:
    """Host ``host``'s ``server.group.launch`` (torchrun's arguments: 2 nodes of 1 worker, then ``launch``) of
    ``embserve serve artifact`` on a free port with ``serve``; stdout piped, stderr to ``log``."""
    env = group_env(host, 2, port)
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(name)  # torchrun sets them for its worker
    command = [sys.executable, "-m", "server.group.launch", "--nnodes", "2", "--nproc-per-node", "1", *launch,
               "-m", "infer.cli", "serve", str(artifact), "--host", "127.0.0.1", "--port", "0", *serve]  # fmt: skip
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True, cwd=ROOT)


class _SlowAnswers:
    """A store client whose first wait (the exit barrier's) gets its answer ``delay_s`` late, as on a busy machine."""

    def __init__(self, store: TCPStore, delay_s: float) -> None:
        self.store, self.delay_s = store, delay_s
        self.answered = float("inf")  # when its first wait returned

    def wait(self, keys: list[str]) -> None:
        self.store.wait(keys)
        if self.answered == float("inf"):
            time.sleep(self.delay_s)
            self.answered = time.monotonic()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def _agent(store: Any) -> SimpleNamespace:
    """What torchrun's ``SimpleElasticAgent._exit_barrier`` reads of its agent."""
    group = SimpleNamespace(group_world_size=2, state="SUCCEEDED")
    return SimpleNamespace(_store=store, _worker_group=group, _exit_barrier_timeout=30.0, _in_exit_barrier=False)


def test_the_store_host_leaves_the_exit_barrier_after_every_other_agent():
    """The store's host reaches torchrun's exit barrier last; the other agent's answer comes 0.5 s late. Its host
    must not return (and close the store: pytorch/pytorch#69520) before that answer came."""
    host_store = TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    other = _SlowAnswers(TCPStore("127.0.0.1", host_store.port, 2, is_master=False), delay_s=0.5)
    exit_barrier = linger(SimpleElasticAgent._exit_barrier)
    waiting = threading.Thread(target=exit_barrier, args=(_agent(other),))
    waiting.start()
    time.sleep(0.2)  # the other agent waits in the barrier
    exit_barrier(_agent(host_store))
    host_left = time.monotonic()
    waiting.join(30)
    assert not waiting.is_alive()
    assert other.answered <= host_left, f"the host left {other.answered - host_left:.3f} s before the answer came"


@pytest.mark.parametrize("stopped", [0, 1], ids=["host0", "host1"])
def test_sigterm_to_either_launcher_exits_0_everywhere(host_artifacts, quantized, tmp_path, stopped):
    artifact = host_artifacts[(2, "column")]
    batches = [random_batch(quantized.spec, batch_size=5, weighted=i == 1, seed=600 + i) for i in range(2)]
    expected, _ = _expected(quantized, "column", 2, 1, batches)
    port = free_port()
    logs = [tmp_path / f"launcher{h}.err" for h in range(2)]
    serve = ["--collective-timeout-s", "10", "--drain-grace-s", "0.3"]
    launchers = [_launcher(host, port, _static(host, port), artifact, serve, logs[host]) for host in range(2)]
    try:
        readers = [LineReader(p.stdout) for p in launchers]
        ports = [int(r.wait_for(SERVING_LINE, timeout=180).rsplit(" ", 1)[1]) for r in readers]
        load = _Load(ports, batches, expected, clients=6)
        while load.outcomes["OK"] < 20:  # observe traffic through both front ends before the stop
            time.sleep(0.05)
        launchers[stopped].send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=120) for p in launchers]
        load.join(30)
        errors = [log.read_text() for log in logs]
        assert codes == [0, 0], (codes, errors[0][-2000:], errors[1][-2000:])
        assert load.wrong == 0 and set(load.outcomes) <= {"OK", "UNAVAILABLE"}, load.outcomes
        for text in errors:
            assert "Traceback" not in text and "DistNetworkError" not in text, text[-3000:]
            assert "every rank drained" in text
    finally:
        for process in launchers:
            if process.poll() is None:
                process.kill()
                process.wait()


def _nth_line(reader: LineReader, text: str, n: int, guard_s: float = 240.0) -> str:
    """The ``n``-th line holding ``text`` (``guard_s``: a hang guard, not a target)."""
    guard = time.monotonic() + guard_s
    while True:
        found = [line for line in list(reader.lines) if text in line]
        if len(found) >= n:
            return found[n - 1]
        assert time.monotonic() < guard, f"{text!r} printed {len(found)} times, not {n}: {reader.lines}"
        time.sleep(0.05)


@pytest.mark.parametrize("rendezvous", ["static", "c10d"])
def test_a_killed_worker_is_restarted_and_the_group_serves_again(host_artifacts, quantized, tmp_path, rendezvous):
    """2 hosts under ``server.group.launch --max-restarts 1`` (static rendezvous: fixed node ranks; c10d): SIGKILL
    to host 1's worker makes host 0's worker go NOT_SERVING and exit 1; both launchers restart their workers, which
    join a new group and serve again: a Lookup on each new front end equals the one-process model; SIGTERM then
    stops both launchers with exit 0. (Before: the restarted workers read the dead ones' gloo addresses from
    torchrun's agent store, kept across restarts, and failed with "Connection refused".)"""
    from server.client import EmbserveClient
    from server.group.launch import worker_pids

    artifact = host_artifacts[(2, "column")]
    batch = random_batch(quantized.spec, batch_size=5, weighted=True, seed=650)
    expected, _ = _expected(quantized, "column", 2, 1, [batch])
    port = free_port()
    logs = [tmp_path / f"launcher{h}.err" for h in range(2)]
    c10d = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "restart-test"]
    restarts = ["--max-restarts", "1", "--monitor-interval", "0.5"]
    serve = ["--collective-timeout-s", "4", "--failure-grace-s", "1", "--drain-grace-s", "0.3"]

    def launch(host: int) -> list[str]:
        return [*(_static(host, port) if rendezvous == "static" else c10d), *restarts]

    launchers = [_launcher(host, port, launch(host), artifact, serve, logs[host]) for host in range(2)]
    workers: list[int] = []
    try:
        readers = [LineReader(p.stdout) for p in launchers]
        for reader in readers:
            _nth_line(reader, SERVING_LINE, 1)
        workers = worker_pids(launchers[1].pid)
        assert len(workers) == 1, workers
        subprocess.run(["kill", "-9", str(workers[0])], check=True)
        ports = [int(_nth_line(reader, SERVING_LINE, 2).rsplit(" ", 1)[1]) for reader in readers]
        for served in ports:
            with EmbserveClient(f"127.0.0.1:{served}") as client:
                assert torch.equal(client.lookup(batch), expected[0])
        launchers[0].send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=120) for p in launchers]
        errors = [log.read_text() for log in logs]
        assert codes == [0, 0], (codes, errors[0][-2000:], errors[1][-2000:])
        assert "NOT_SERVING" in errors[0] or "NOT_SERVING" in errors[1]
    finally:
        for process in launchers:
            for pid in worker_pids(process.pid):
                subprocess.run(["kill", "-9", str(pid)], check=False)
            if process.poll() is None:
                process.kill()
                process.wait()
