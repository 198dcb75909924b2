"""`embserve serve` of a multi-host artifact: one process per "host" on 127.0.0.1 with the environment torchrun
gives its workers, every rank serving gRPC on its own port. Served outputs on every front end, SIGTERM to any
rank under load spread over every front end (nothing lost, every rank exits 0), bad input refused on any front
end, and a killed rank under load (NOT_SERVING and UNAVAILABLE within the timeout, exit 1)."""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from infer.shard.builder import shard_model
from server.app import SERVING_LINE
from server.client import EmbserveClient
from server.group.leader import JOINED_LINE
from tests.conftest import random_batch
from tests.distributed.conftest import NUM_DENSE, ROOT, free_port, group_env, host_plan
from tests.server.support import LineReader
from tests.support.stop_race import Server, cases, check_round, race_stop, rest_port

TIMEOUT_S = 4.0  # --collective-timeout-s of these groups
HANG_GUARD_S = 120.0  # waits for an event give up after this long: a hang guard, not a target


def _health(port: int, timeout: float = 10.0) -> int:
    """The overall health status (service "") of the front end on ``port``."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        request = health_pb2.HealthCheckRequest(service="")
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=timeout).status


class _Group:
    def __init__(self, artifact: Path, hosts: int, folder: Path, *options: str, wait: bool = True) -> None:
        self.artifact = artifact
        port = free_port()
        command = [sys.executable, "-m", "infer.cli", "serve", str(artifact), "--python", "--host", "127.0.0.1",
                   "--port", "0", "--collective-timeout-s", str(TIMEOUT_S), *options]  # fmt: skip
        self.logs = [folder / f"rank{rank}.err" for rank in range(hosts)]
        self.processes = [
            subprocess.Popen(
                command,
                env=group_env(rank, hosts, port),
                stdout=subprocess.PIPE,
                stderr=open(self.logs[rank], "w"),
                text=True,
                cwd=ROOT,
            )  # fmt: skip
            for rank in range(hosts)
        ]
        self.readers = [LineReader(p.stdout) for p in self.processes]
        if not wait:
            return
        for reader in self.readers[1:]:
            reader.wait_for(JOINED_LINE, timeout=120)
        lines = [reader.wait_for(SERVING_LINE, timeout=120) for reader in self.readers]
        self.ports = [int(line.rsplit(" ", 1)[1]) for line in lines]  # every rank is a front end
        self.port = self.ports[0]

    def stderr(self, rank: int) -> str:
        return self.logs[rank].read_text()[-3000:]

    def kill(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait()


class SharedGroup:
    """One group a module's tests share while none changes its state (each group costs a torch import and a
    part load per rank): ``use`` gives the running group, ``take`` hands it to a test that stops or kills it (the
    next ``use`` starts another), and ``close`` stops a group no test took: SIGTERM to ``stop_rank``, every rank
    exits 0 having drained, no stack trace. A shared group that exited by itself fails the next ``use``."""

    def __init__(self, start: Callable[[], _Group], stop_rank: int) -> None:
        self._start, self._stop_rank = start, stop_rank
        self._group: _Group | None = None

    def use(self) -> _Group:
        if self._group is None:
            self._group = self._start()
        group = self._group
        codes = [p.poll() for p in group.processes]
        assert codes == [None] * len(codes), (codes, [group.stderr(r) for r in range(len(codes))])
        return group

    def take(self) -> _Group:
        group = self.use()
        self._group = None
        return group

    def close(self) -> None:
        if self._group is None:
            return
        group, self._group = self._group, None
        try:
            group.processes[self._stop_rank].send_signal(signal.SIGTERM)
            codes = [p.wait(timeout=60) for p in group.processes]
            assert codes == [0] * len(codes), (codes, group.stderr(0))
            for rank in range(len(codes)):
                assert "every rank drained" in group.stderr(rank) and "Traceback" not in group.stderr(rank)
        finally:
            group.kill()


class _Load:
    """Clients calling Lookup without pause until stopped; outcomes counted by status code."""

    def __init__(self, ports: list[int], batches, expected, clients: int) -> None:
        self.outcomes: Counter[str] = Counter()
        self.wrong = 0
        self.unavailable = threading.Event()  # a call answered UNAVAILABLE
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self.threads = [
            threading.Thread(
                target=self._run, args=(ports[i % len(ports)], batches[i % len(batches)], expected[i % len(batches)])
            )
            for i in range(clients)
        ]
        for thread in self.threads:
            thread.start()

    def _run(self, port: int, batch, expected) -> None:
        with EmbserveClient(f"127.0.0.1:{port}", timeout=30) as client:
            while not self.stop.is_set():
                try:
                    got = client.lookup(batch)
                    outcome, right = "OK", bool((got - expected).abs().max() <= 1e-6 * float(expected.abs().max()))
                except grpc.RpcError as err:
                    outcome, right = err.code().name, True
                with self._lock:
                    self.outcomes[outcome] += 1
                    self.wrong += 0 if right else 1
                    if outcome == "UNAVAILABLE":
                        self.unavailable.set()
                if outcome == "UNAVAILABLE":
                    return  # a refused client goes elsewhere (and a closed port would spin)

    def wait_for_ok(self, count: int) -> None:
        """Until ``count`` calls were answered OK, or one was not (``HANG_GUARD_S``: a hang guard, not a target)."""
        guard = time.monotonic() + HANG_GUARD_S
        while self.outcomes["OK"] < count and not self.outcomes.keys() - {"OK"}:
            assert time.monotonic() < guard, self.outcomes
            time.sleep(0.02)

    def join(self, timeout: float) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout)
        assert not any(t.is_alive() for t in self.threads), "a client call hung"


def _expected(quantized, kind, hosts, devices, batches):
    reference = shard_model(quantized, host_plan(quantized.spec, kind, hosts, devices))
    with torch.inference_mode():
        return [reference(b.values, b.lengths, b.weights) for b in batches], reference


@pytest.fixture(scope="module")
def column_group(host_artifacts, tmp_path_factory):
    """3 hosts, column plan (served outputs equal the one-process model exactly), REST on every rank: used by the
    bad-input and second-group tests, then taken by the SIGTERM race on rank 0 (or stopped at the module's end)."""
    artifact = host_artifacts[(3, "column")]
    shared = SharedGroup(
        lambda: _Group(artifact, 3, tmp_path_factory.mktemp("column3"), "--http-port", "0", "--drain-grace-s", "0.3"),
        stop_rank=2,
    )
    yield shared
    shared.close()


@pytest.mark.parametrize("stopped", [0, 1], ids=["host0", "host1"])
def test_sigterm_to_any_host_under_load_loses_nothing(host_artifacts, quantized, tmp_path, stopped):
    """2 hosts x 2 devices, mixed plan: gRPC Lookup and Predict on either host's front end equal the one-process
    model; then 8 clients spread over both front ends send without pause through SIGTERM to one host: no call
    CANCELLED, failed or wrong, every rank exits 0 without a stack trace."""
    spec = quantized.spec
    batches = [random_batch(spec, batch_size=4 + i, weighted=i % 2 == 0, seed=300 + i) for i in range(4)]
    expected, reference = _expected(quantized, "mixed", 2, 2, batches)
    group = _Group(host_artifacts[(2, "mixed")], 2, tmp_path, "--drain-grace-s", "0.5", "--max-delay-us", "2000")
    try:
        dense = torch.randn(batches[0].batch_size, NUM_DENSE, generator=torch.Generator().manual_seed(1))
        with torch.inference_mode():
            want_scores = reference.predict(dense, batches[0].values, batches[0].lengths, batches[0].weights)
        for port in group.ports:
            with EmbserveClient(f"127.0.0.1:{port}") as client:
                pooled = client.lookup(batches[0])
                scores = client.predict(batches[0], dense)
            assert (pooled - expected[0]).abs().max() <= 1e-6 * float(expected[0].abs().max())
            assert (scores - want_scores).abs().max() <= 1e-6 * max(1.0, float(want_scores.abs().max()))
        load = _Load(group.ports, batches, expected, clients=8)
        load.wait_for_ok(20)
        group.processes[stopped].send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=60) for p in group.processes]
        load.join(30)
        assert codes == [0, 0], (codes, group.stderr(0), group.stderr(1))
        assert load.outcomes["OK"] > 0 and load.wrong == 0, load.outcomes
        assert set(load.outcomes) <= {"OK", "UNAVAILABLE"}, load.outcomes  # UNAVAILABLE: refused, never accepted
        for rank in (0, 1):
            assert "every rank drained" in group.stderr(rank) and "Traceback" not in group.stderr(rank)
    finally:
        group.kill()


@pytest.mark.parametrize("victim, signum", [(2, signal.SIGKILL), (1, signal.SIGSTOP)], ids=["dies", "hangs"])
def test_failed_rank_under_load_turns_rank0_unavailable(host_artifacts, quantized, tmp_path, victim, signum):
    """3 hosts: one rank dies (SIGKILL) or hangs (SIGSTOP) while 6 clients send: calls answer UNAVAILABLE, health
    says NOT_SERVING, rank 0 exits 1 and the surviving rank exits too; no client call hangs. (How soon, against
    the collective timeout: ``bench/multihost_serving.py --case lost-host``.)"""
    spec = quantized.spec
    batches = [random_batch(spec, batch_size=6, weighted=True, seed=400 + i) for i in range(3)]
    expected, _ = _expected(quantized, "column", 3, 1, batches)
    group = _Group(host_artifacts[(3, "column")], 3, tmp_path, "--failure-grace-s", "3")
    try:
        survivors = [port for rank, port in enumerate(group.ports) if rank != victim]  # a stopped host can't answer
        load = _Load(survivors, batches, expected, clients=6)
        load.wait_for_ok(20)
        assert load.outcomes["OK"] >= 20, (load.outcomes, group.stderr(0))
        group.processes[victim].send_signal(signum)
        # the event itself; the bound only keeps a broken build from hanging the suite
        assert load.unavailable.wait(HANG_GUARD_S), (load.outcomes, group.stderr(0))
        assert _health(group.port, timeout=5) == health_pb2.HealthCheckResponse.NOT_SERVING
        load.join(30)
        assert group.processes[0].wait(timeout=30) == 1, group.stderr(0)
        survivor = 1 if victim == 2 else 2
        assert group.processes[survivor].wait(timeout=TIMEOUT_S + 30) != 0
        assert load.wrong == 0 and set(load.outcomes) <= {"OK", "UNAVAILABLE"}, load.outcomes
        assert "the group failed" in group.stderr(0)
    finally:
        group.kill()


def test_bad_input_is_refused_on_every_front_end_and_the_group_serves_on(column_group, quantized):
    """3 hosts: an id past its table and a negative length sent to each host's front end answer INVALID_ARGUMENT
    naming the feature; a good call on each front end afterwards equals the one-process model. (The group then
    stops cleanly: every rank exits 0, in the SIGTERM race below or at the module's end.)"""
    spec = quantized.spec
    batch = random_batch(spec, batch_size=3, weighted=False, seed=500)
    expected, _ = _expected(quantized, "column", 3, 1, [batch])
    feature = spec.features[1]
    bad_ids = batch.values.clone()
    first_of_feature = int(batch.lengths[: batch.batch_size].sum())  # the second feature's first id
    assert int(batch.lengths[batch.batch_size : 2 * batch.batch_size].sum()) > 0  # the feature has an id to spoil
    bad_ids[first_of_feature] = feature.num_embeddings
    bad_lengths = batch.lengths.clone()
    bad_lengths[batch.batch_size] = -1
    group = column_group.use()
    for port in group.ports:
        with EmbserveClient(f"127.0.0.1:{port}") as client:
            with pytest.raises(grpc.RpcError) as refused:
                client.lookup(dataclasses.replace(batch, values=bad_ids))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert feature.name in refused.value.details()
            with pytest.raises(grpc.RpcError) as refused:
                client.lookup(dataclasses.replace(batch, lengths=bad_lengths))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert feature.name in refused.value.details()
            got = client.lookup(batch)
            assert torch.equal(got, expected[0])
    column_group.use()  # every rank still runs


def test_a_second_group_on_a_serving_port_is_refused_before_loading(host_artifacts, column_group, tmp_path):
    """A second group given the port the first serves on: every rank of it (each checks its own port; here they
    share one machine) says "gRPC port P is in use" before loading its part and exits 2 (no stack); the first
    keeps serving (and stops with exit 0: in the SIGTERM race below or at the module's end)."""
    first = column_group.use()
    second = _Group(host_artifacts[(2, "column")], 2, tmp_path, "--port", str(first.port), wait=False)
    try:
        codes = [p.wait(timeout=60 + TIMEOUT_S) for p in second.processes]
        assert codes == [2, 2], (codes, second.stderr(0), second.stderr(1))
        for rank in (0, 1):
            assert f"gRPC port {first.port} is in use" in second.stderr(rank)
            assert "loaded" not in second.stderr(rank)  # refused before its part loaded
        assert "Traceback" not in second.stderr(0) + second.stderr(1)
        with EmbserveClient(f"127.0.0.1:{first.port}") as client:  # the first group still serves
            client.metadata()
        column_group.use()  # every rank of it still runs
    finally:
        second.kill()


def test_sigterm_on_rank0_under_16_clients_cancels_nothing(column_group, quantized):
    """As one host (tests/server/test_stop_race.py): 16 clients over embserve.v1, OIP gRPC and REST send through
    SIGTERM on rank 0 until it exited: 0 CANCELLED, 0 lost, answers equal the one-process model, every rank
    exits 0. The group is the module's (it served the tests above first, when they ran)."""
    group = column_group.take()
    try:
        _, reference = _expected(quantized, "column", 3, 1, [])

        def lookup(batch):
            with torch.inference_mode():
                return reference(batch.values, batch.lengths, batch.weights)

        server = Server(group.processes[0], group.port, rest_port(group.logs[0]), group.artifact.name, group.logs[0])
        result = race_stop(server, cases(quantized.spec, lookup), clients=16)
        check_round(result, "rank 0 of 3")
        for rank in (1, 2):
            assert group.processes[rank].wait(timeout=60) == 0, group.stderr(rank)
            assert "every rank drained" in group.stderr(rank) and "Traceback" not in group.stderr(rank)
    finally:
        group.kill()
