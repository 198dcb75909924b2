"""``embserve serve --workers 2``: one instance, two real server processes on one loopback port.

Answers over embserve.v1 and OIP gRPC equal the fp32 reference (``F.embedding_bag`` on the dequantized tables,
the dense part on that); calls land on both workers (each worker's own /metrics counts them); the instance owns
its port (a second ``embserve serve`` there is refused); SIGTERM drains every worker with nothing lost; a worker
that dies fails the instance; bad requests are still INVALID_ARGUMENT naming the feature; the workers' mappings
of the weights share one copy (PSS).

The tests that only call an instance share one (``shared``, REST on): they count each worker's calls from their
own start. A test that stops, kills or starts its own settings starts its own (``start``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from infer.artifact.export import export
from infer.features import SparseFeatures
from infer.quant.quantize import quantize
from infer.weights import random_weights
from server.client import EmbserveClient
from server.launch import spawn_server
from server.workers import WORKER_LINE
from tests.conftest import TinyOverArch, random_batch
from tests.server.oip_support import client, requested, triton_inputs
from tests.server.support import (
    CALL_TIMEOUT,
    NUM_DENSE,
    free_port,
    rpc_error,
    scrape_metrics,
    serve_in_process,
    wait_until,
)
from tests.support.call_contract import Reference, assert_matches

REPO = Path(__file__).resolve().parents[2]
WORKERS = 2
# new connections until both workers got calls: 2 workers leave all of them on one with odds 2^-(n-1)
MAX_CONNECTIONS = 64


@dataclass(frozen=True)
class Model:
    artifact: Path
    reference: Reference
    spec: Any


@pytest.fixture(scope="module")
def model(tmp_path_factory, spec) -> Model:
    torch.manual_seed(0)
    dense_spec = spec.with_dense_arch(TinyOverArch(NUM_DENSE, spec.output_dim), NUM_DENSE)
    quantized = quantize(dense_spec, random_weights(dense_spec, seed=29))
    artifact = export(quantized, tmp_path_factory.mktemp("workers") / "dense")  # mapped weights (the default)
    return Model(artifact, Reference(dense_spec, quantized), dense_spec)


def _scores(model: Model, batch: SparseFeatures, dense: torch.Tensor) -> torch.Tensor:
    """The dense part (TinyOverArch: ``[B]``) on the reference's pooled embeddings."""
    with torch.no_grad():
        return model.spec.dense_arch(dense, model.reference.pooled(batch))


@dataclass
class Instance:
    process: subprocess.Popen[str]
    port: int
    pids: list[int]
    metrics_ports: list[int]
    http_port: int | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def served(self) -> list[float]:
        """Model calls each worker answered, from its own /metrics."""
        return [_requests(port) for port in self.metrics_ports]


def _samples(metrics_port: int, family_name: str, sample_name: str) -> list[float]:
    """The values of ``sample_name`` in metric family ``family_name`` on one worker's /metrics."""
    return [sample.value for sample in scrape_metrics(metrics_port).get(family_name, []) if sample.name == sample_name]


def _requests(metrics_port: int) -> float:
    return sum(_samples(metrics_port, "embserve_requests", "embserve_requests_total"))


def _start(artifact: Path, *options: str, http_port: int | None = None) -> Instance:
    http = ["--http-port", str(http_port)] if http_port is not None else []
    process, port = spawn_server(
        artifact, "--python", "--workers", str(WORKERS), "--metrics-port", "0", *http, *options
    )
    assert process.stdout is not None
    pids, metrics_ports = [], []
    for index in range(WORKERS):  # "<WORKER_LINE> <index> pid <pid> metrics port <port>"
        words = process.stdout.readline().split()
        assert " ".join(words[:2]) == WORKER_LINE and int(words[2]) == index, words
        pids.append(int(words[4]))
        metrics_ports.append(int(words[-1]))
    return Instance(process, port, pids, metrics_ports, http_port)


def _stop(instance: Instance) -> None:
    if instance.process.poll() is None:
        instance.process.send_signal(signal.SIGTERM)
    instance.process.wait(timeout=60)


@pytest.fixture
def start() -> Iterator:
    started: list[Instance] = []

    def start_instance(artifact: Path, *options: str) -> Instance:
        instance = _start(artifact, *options)
        started.append(instance)
        return instance

    yield start_instance
    for instance in started:
        _stop(instance)


@pytest.fixture(scope="module")
def shared(model) -> Iterator[Instance]:
    """One instance, REST on, for the tests that only call it (each counts the calls from its own start)."""
    instance = _start(model.artifact, "--max-delay-us", "500", http_port=free_port())
    yield instance
    _stop(instance)


def _served_since(instance: Instance, before: list[float]) -> list[float]:
    """Model calls each worker answered since ``before`` (an earlier ``instance.served()``)."""
    return [now - then for now, then in zip(instance.served(), before, strict=True)]


def _on_both_workers(instance: Instance, call) -> None:
    """``call(client)`` on new connections (one client each) until both workers answered some of them."""
    before = instance.served()
    for _ in range(MAX_CONNECTIONS):
        with EmbserveClient(instance.address, timeout=CALL_TIMEOUT) as client:
            call(client)
        if all(count > 0 for count in _served_since(instance, before)):
            return
    raise AssertionError(f"{MAX_CONNECTIONS} connections all landed on one worker: {_served_since(instance, before)}")


def test_two_workers_answer_concurrent_calls_of_both_protocols_on_both_workers(shared, model):
    instance = shared
    before = instance.served()
    batches = [random_batch(model.spec, batch_size=1 + seed % 7, seed=seed) for seed in range(48)]
    dense = [
        torch.randn(b.batch_size, NUM_DENSE, generator=torch.Generator().manual_seed(i)) for i, b in enumerate(batches)
    ]

    def call(index: int) -> None:
        protocol = "oip" if index % 2 else "v1"
        name = model.artifact.name if protocol == "oip" else None
        with EmbserveClient(instance.address, timeout=CALL_TIMEOUT, protocol=protocol, model=name) as client:
            for step in range(3):
                batch = batches[(index + step) % len(batches)]
                assert_matches(client.lookup(batch), model.reference.pooled(batch))
                scores = client.predict(batch, dense[(index + step) % len(batches)])
                assert_matches(scores, _scores(model, batch, dense[(index + step) % len(batches)]))

    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(call, range(32)))  # 32 clients, each its own connection
    per_worker = _served_since(instance, before)
    assert sum(per_worker) >= 32 * 3 * 2 and all(count > 0 for count in per_worker), per_worker
    assert len(set(instance.pids)) == WORKERS and instance.process.pid not in instance.pids


def test_bad_requests_are_invalid_argument_naming_the_feature_on_every_worker(shared, model):
    instance = shared
    bad = SparseFeatures(model.spec.feature_names, torch.tensor([1000] + [0] * 5), torch.ones(6, dtype=torch.int32))

    def refused(client: EmbserveClient) -> None:
        oip = EmbserveClient(instance.address, timeout=CALL_TIMEOUT, protocol="oip", model=model.artifact.name)
        with oip:
            for protocol_client in (client, oip):
                err = rpc_error(lambda c=protocol_client: c.lookup(bad))
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
                assert "f_int8" in err.details() and "1000" in err.details(), err.details()
        good = random_batch(model.spec, batch_size=3, seed=5)
        assert_matches(client.lookup(good), model.reference.pooled(good))  # still serving

    _on_both_workers(instance, refused)
    assert instance.process.poll() is None


@pytest.mark.parametrize(
    ("workers", "role", "flag", "in_process"),
    [("1", "gRPC", "--port", True), ("2", "gRPC", "--port", True), ("1", "HTTP", "--http-port", True)]
    + [("2", "HTTP", "--http-port", False)],  # one real second process: a refusal from the command line
)
def test_a_second_serve_on_the_instances_port_is_refused(shared, model, workers, role, flag, in_process, capsys):
    instance = shared
    port = instance.port if role == "gRPC" else instance.http_port
    args = ["serve", str(model.artifact), "--python", "--host", "127.0.0.1"]
    args += ["--workers", workers, *(["--port", str(port)] if role == "gRPC" else ["--port", "0", flag, str(port)])]
    if in_process:
        code, stderr = serve_in_process(capsys, *args[1:])
    else:
        command = [sys.executable, "-m", "infer.cli", *args]
        second = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)  # a bound on a hang
        code, stderr = second.returncode, second.stderr
    assert code != 0
    assert f"{role} port {port} is in use" in stderr and flag in stderr, stderr
    assert "Traceback" not in stderr, stderr
    batch = random_batch(model.spec, batch_size=4, seed=8)
    _on_both_workers(instance, lambda client: assert_matches(client.lookup(batch), model.reference.pooled(batch)))


def test_rest_calls_land_on_both_workers_and_equal_the_reference(shared, model):
    instance = shared
    batch = random_batch(model.spec, batch_size=5, seed=12)
    expected = model.reference.pooled(batch)
    before = instance.served()
    for _ in range(MAX_CONNECTIONS):
        with client("http", f"127.0.0.1:{instance.http_port}") as rest:  # a connection of its own
            result = rest.infer(
                model.artifact.name, triton_inputs("http", batch), outputs=requested("http", "embeddings")
            )
            assert_matches(torch.from_numpy(np.array(result.as_numpy("embeddings"))), expected)
        if all(count > 0 for count in _served_since(instance, before)):
            return
    raise AssertionError(f"{MAX_CONNECTIONS} REST connections all landed on one worker: {instance.served()}")


def _in_flight(metrics_port: int) -> float:
    return _samples(metrics_port, "embserve_in_flight", "embserve_in_flight")[0]


def test_sigterm_drains_every_worker_and_answers_every_accepted_call(start, model):
    # every request waits (up to 30 s) for company: the calls are surely in flight when SIGTERM comes
    instance = start(model.artifact, "--batch-wait", "always", "--max-delay-us", "30000000", "--drain-grace-s", "0.2")
    batches = [random_batch(model.spec, batch_size=2, seed=100 + i) for i in range(24)]
    clients = [EmbserveClient(instance.address, timeout=120) for _ in batches]
    pool = ThreadPoolExecutor(max_workers=len(batches))
    try:
        futures = [pool.submit(c.lookup, b) for c, b in zip(clients, batches, strict=True)]
        wait_until(
            lambda: sum(map(_in_flight, instance.metrics_ports)) == len(batches), timeout=60, what="all in flight"
        )
        in_flight = [_in_flight(p) for p in instance.metrics_ports]
        instance.process.send_signal(signal.SIGTERM)
        for future, batch in zip(futures, batches, strict=True):
            assert_matches(future.result(timeout=120), model.reference.pooled(batch))
        assert instance.process.wait(timeout=120) == 0
    finally:
        pool.shutdown()
        for client in clients:
            client.close()
    assert all(count > 0 for count in in_flight), in_flight  # both workers had calls to drain
    for pid in instance.pids:  # every worker exited (the instance waited for each)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_worker_that_dies_stops_the_instance_with_exit_1(start, model):
    instance = start(model.artifact, "--drain-grace-s", "0.2")
    os.kill(instance.pids[0], signal.SIGKILL)
    assert instance.process.wait(timeout=120) == 1
    with pytest.raises(ProcessLookupError):
        os.kill(instance.pids[1], 0)  # the other drained and exited: nothing serves on alone


def _weights_mapping(pid: int, path: Path) -> tuple[int, int]:
    """(Rss, Pss) in bytes of ``pid``'s mappings of ``path``."""
    rss = pss = 0
    inside = False
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if len(fields) >= 5 and "-" in fields[0] and ":" in fields[3]:  # a mapping's header line
                inside = fields[-1] == str(path)
            elif inside and fields[0] == "Rss:":
                rss += int(fields[1]) * 1024
            elif inside and fields[0] == "Pss:":
                pss += int(fields[1]) * 1024
    return rss, pss


def test_the_workers_map_one_copy_of_the_weights(shared, model):
    """Every row of every table looked up on both workers: each maps all the weights (Rss), yet their Pss
    adds up to one copy at most (copies would add up to two)."""
    instance = shared
    every_row = SparseFeatures(
        model.spec.feature_names,
        torch.cat([torch.arange(t.num_embeddings) for t in model.spec.tables for _ in t.feature_names]),
        torch.tensor([t.num_embeddings for t in model.spec.tables for _ in t.feature_names], dtype=torch.int32),
    )
    _on_both_workers(instance, lambda c: assert_matches(c.lookup(every_row), model.reference.pooled(every_row)))
    [weights] = sorted(model.artifact.glob("weights-*.bin"))
    size = weights.stat().st_size
    mappings = [_weights_mapping(pid, weights.resolve()) for pid in instance.pids]
    for rss, _ in mappings:
        assert rss >= size, (mappings, size)  # each worker has every page of the weights mapped
    assert sum(pss for _, pss in mappings) <= size + 4096 * WORKERS, (mappings, size)


def test_a_model_repository_with_workers_is_refused_naming_the_flag(model, tmp_path, capsys):
    (tmp_path / "repo" / "dense").mkdir(parents=True)
    (tmp_path / "repo" / "dense" / "1").symlink_to(model.artifact)
    code, stderr = serve_in_process(
        capsys, str(tmp_path / "repo"), "--host", "127.0.0.1", "--port", "0", "--workers", "2"
    )
    assert code == 2, stderr
    assert "--workers 2" in stderr and "model repository" in stderr, stderr
    assert "Traceback" not in stderr, stderr


def _exited(pid: int) -> bool:
    """Gone, or a zombie nobody reaped yet (the workers of a killed instance are orphans)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def test_the_workers_of_a_killed_instance_drain_and_exit(start, model):
    instance = start(model.artifact, "--drain-grace-s", "0.2")
    instance.process.kill()  # SIGKILL: the instance cannot pass anything on
    instance.process.wait(timeout=60)
    for pid in instance.pids:
        wait_until(lambda pid=pid: _exited(pid), timeout=120, what=f"worker {pid} exited")
