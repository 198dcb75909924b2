"""SIGTERM to the launcher of either host (``python -m server.group.launch``, torchrun's arguments), 2 hosts on
127.0.0.1 under load on both front ends: every call answered, every rank and both launchers exit 0, no stack
trace printed (plain torchrun exits 1 and prints a SignalException / DistNetworkError stack)."""

from __future__ import annotations

import gc
import multiprocessing
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
from server.group.launch import CHECKED_OUT, linger, serves_store
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
               "-m", "infer.cli", "serve", str(artifact), "--python", "--host", "127.0.0.1", "--port", "0",
               *serve]  # fmt: skip
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


class _SlowAfterCheckOut:
    """A store client that pauses ``delay_s`` after its check-out is answered (a busy machine), and records every
    request of its that failed (torch's client then prints a DistNetworkError stack)."""

    def __init__(self, store: TCPStore, delay_s: float) -> None:
        self.store, self.delay_s = store, delay_s
        self.failed: list[str] = []
        self.checked_out = float("inf")  # when its check-out was answered

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)
        if not callable(method) or name in ("timeout", "set_timeout"):
            return method

        def call(*args: Any) -> Any:
            try:
                result = method(*args)
            except Exception as err:
                self.failed.append(f"{name}{args}: {type(err).__name__}")
                raise
            if name == "add" and args[0] == CHECKED_OUT:
                self.checked_out = time.monotonic()
                time.sleep(self.delay_s)
            return result

        return call


def _exit_barrier(host_agent: SimpleNamespace):  # type: ignore[no-untyped-def]
    """torchrun's agent exit barrier with the check-out, ``host_agent`` the one that hosts the store."""
    return linger(SimpleElasticAgent._exit_barrier, hosts_store=lambda agent: agent is host_agent)


def test_the_store_host_leaves_the_exit_barrier_after_every_other_agent():
    """The store's host reaches torchrun's exit barrier last; the other agent's answer comes 0.5 s late. Its host
    must not return (and close the store: pytorch/pytorch#69520) before that answer came."""
    host_store = TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    other = _SlowAnswers(TCPStore("127.0.0.1", host_store.port, 2, is_master=False), delay_s=0.5)
    host = _agent(host_store)
    exit_barrier = _exit_barrier(host)
    waiting = threading.Thread(target=exit_barrier, args=(_agent(other),))
    waiting.start()
    time.sleep(0.2)  # the other agent waits in the barrier
    exit_barrier(host)
    host_left = time.monotonic()
    waiting.join(30)
    assert not waiting.is_alive()
    assert other.answered <= host_left, f"the host left {other.answered - host_left:.3f} s before the answer came"


def test_after_the_host_leaves_no_other_agent_has_a_request_in_flight():
    """The other agent pauses 0.5 s after its check-out; its host leaves the barrier and closes the store at once
    (torch's TCPStore server stops with its object). The other agent must have had its check-out answered before
    the host left, and send nothing the closed store would leave unanswered (before: it then waited for a key
    that said every agent had checked out, and that wait failed: "recvValueWithTimeout failed ... Connection
    was likely closed", with a stack, in a launcher's log)."""
    host_store = TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    other = _SlowAfterCheckOut(TCPStore("127.0.0.1", host_store.port, 2, is_master=False), delay_s=0.5)
    host = _agent(host_store)
    exit_barrier = _exit_barrier(host)
    waiting = threading.Thread(target=exit_barrier, args=(_agent(other),))
    waiting.start()
    time.sleep(0.2)  # the other agent waits in the barrier
    exit_barrier(host)
    # as the store's server saw it when the host left: both check-outs counted (so the other agent's was answered
    # or its answer was on the way; a lost answer would show in other.failed). The other agent's own clock is no
    # measure: under load its thread can record the answer long after the host left.
    counted_when_host_left = host_store.add(CHECKED_OUT, 0)
    host._store = None
    del host_store
    gc.collect()  # the store's server stops: the host has left
    waiting.join(30)
    assert not waiting.is_alive()
    assert counted_when_host_left == 2, "the host left before the other agent's check-out was counted"
    assert other.checked_out < float("inf"), "the other agent's check-out was never answered"
    assert other.failed == [], other.failed


def test_serves_store_tells_the_host_from_a_client():
    """True for the store whose server runs in this process (and a PrefixStore over it), False for a client of
    a store served by another process."""
    from torch.distributed import PrefixStore

    here = TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    assert serves_store(here) and serves_store(PrefixStore("run", here))
    parent, child = multiprocessing.get_context("fork").Pipe()  # fork: no second torch import
    other = multiprocessing.get_context("fork").Process(target=_serve_a_store, args=(child,))
    other.start()
    try:
        port = parent.recv()
        client = TCPStore("127.0.0.1", port, 1, is_master=False)
        assert client.add("k", 1) == 1  # connected
        assert not serves_store(client) and not serves_store(PrefixStore("run", client))
    finally:
        parent.send("stop")
        other.join(30)


def _serve_a_store(pipe: Any) -> None:
    """A TCPStore served by this (forked) process until ``pipe`` says stop."""
    store = TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    pipe.send(store.port)
    pipe.recv()


def _stop_under_load(launchers: list[subprocess.Popen[str]], ports: list[int], batches, expected, logs: list[Path],
                     stopped: int) -> None:  # fmt: skip
    """6 clients over both front ends send without pause through SIGTERM to launcher ``stopped``: every call
    answered (OK and equal to the one-process model, or refused UNAVAILABLE), every launcher exits 0, no stack
    trace (``Traceback``, ``DistNetworkError``) in a launcher's log, every rank drained."""
    load = _Load(ports, batches, expected, clients=6)
    load.wait_for_ok(20)  # traffic through both front ends before the stop
    assert not load.outcomes.keys() - {"OK"}, load.outcomes
    launchers[stopped].send_signal(signal.SIGTERM)
    codes = [p.wait(timeout=120) for p in launchers]
    load.join(30)
    errors = [log.read_text() for log in logs]
    assert codes == [0, 0], (codes, errors[0][-2000:], errors[1][-2000:])
    assert load.wrong == 0 and set(load.outcomes) <= {"OK", "UNAVAILABLE"}, load.outcomes
    for text in errors:
        assert "Traceback" not in text and "DistNetworkError" not in text, text[-3000:]
        assert "every rank drained" in text


def test_sigterm_to_either_launcher_exits_0_everywhere(host_artifacts, quantized, tmp_path):
    """``_stop_under_load`` with SIGTERM to host 0's launcher (static rendezvous); host 1's: the killed-worker
    test [static] below, after its restart (each group start costs 4 torch imports)."""
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
        _stop_under_load(launchers, ports, batches, expected, logs, stopped=0)
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


@pytest.mark.parametrize("rendezvous, stopped", [("static", 1), ("c10d", 0)], ids=["static", "c10d"])
def test_a_killed_worker_is_restarted_and_the_group_serves_again(host_artifacts, quantized, tmp_path, rendezvous,
                                                                 stopped):  # fmt: skip
    """2 hosts under ``server.group.launch --max-restarts 1`` (static rendezvous: fixed node ranks; c10d): SIGKILL
    to host 1's worker makes host 0's worker go NOT_SERVING and exit 1; both launchers restart their workers, which
    join a new group and serve again: a Lookup on each new front end equals the one-process model; SIGTERM to
    launcher ``stopped`` under load then stops both launchers with exit 0 (``_stop_under_load``). (Before: the
    restarted workers read the dead ones' gloo addresses from torchrun's agent store, kept across restarts, and
    failed with "Connection refused".)"""
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
        _stop_under_load(launchers, ports, [batch], expected, logs, stopped)
        assert "NOT_SERVING" in logs[0].read_text() or "NOT_SERVING" in logs[1].read_text()
    finally:
        for process in launchers:
            for pid in worker_pids(process.pid):
                subprocess.run(["kill", "-9", str(pid)], check=False)
            if process.poll() is None:
                process.kill()
                process.wait()
