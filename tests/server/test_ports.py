"""A server owns its ports: a second server on a port that serves is refused at start, naming the port,
while the first keeps serving; the metrics endpoint binds where ``--host`` says."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import server.app as app
from infer.errors import ConfigError
from server.app import create_server
from server.client import EmbserveClient
from tests.conftest import random_batch
from tests.server.support import CALL_TIMEOUT, local_config, serve_in_process

REPO = Path(__file__).resolve().parents[2]


def _port_of(served, role: str) -> int:
    return {"gRPC": served.port, "HTTP": served.running.http_port, "metrics": served.running.metrics_port}[role]


@pytest.mark.parametrize(
    ("role", "flag", "in_process"),
    [("gRPC", "--port", False), ("HTTP", "--http-port", True), ("metrics", "--metrics-port", True)],
)
def test_a_second_server_on_a_serving_port_exits_naming_it(
    start_server, dense_artifact, dense_runtime, spec, role, flag, in_process, capsys
):
    """gRPC's refusal from a real second process; HTTP's and metrics' from ``embserve serve`` in this one (the
    same command-line path, without a second torch import)."""
    first = start_server(dense_artifact, http_port=0, metrics_port=0)
    port = _port_of(first, role)
    args = ["serve", str(dense_artifact), "--python", "--host", "127.0.0.1"]
    args += ["--port", "0", flag, str(port)] if flag != "--port" else ["--port", str(port)]
    if in_process:
        code, stderr = serve_in_process(capsys, *args[1:])
    else:
        command = [sys.executable, "-m", "infer.cli", *args]
        second = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            _, stderr = second.communicate(timeout=60)  # a bound on a hang, not a measurement
        finally:
            if second.poll() is None:
                second.kill()
                second.wait(10)
        code = second.returncode
    assert code != 0
    assert f"{role} port {port} is in use" in stderr and flag in stderr, stderr
    assert "Traceback" not in stderr, stderr
    batch = random_batch(spec, batch_size=3, seed=81)
    with EmbserveClient(first.address, timeout=CALL_TIMEOUT) as client:  # the first still answers
        assert torch.equal(client.lookup(batch), dense_runtime.lookup(batch))


def test_the_grpc_bind_itself_refuses_a_serving_port(start_server, loop_thread, dense_artifact, monkeypatch):
    """Without the check before loading, grpc's own bind refuses too (it shared the port with SO_REUSEPORT)."""
    first = start_server(dense_artifact)
    monkeypatch.setattr(app, "check_ports", lambda config: None)
    with pytest.raises(ConfigError, match=f"gRPC port {first.port} is in use"):
        loop_thread.run(create_server(dense_artifact, local_config(port=first.port)))


def test_two_roles_on_one_port_are_refused(loop_thread, dense_artifact):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        port = holder.getsockname()[1]
    with pytest.raises(ConfigError, match=f"--port and --http-port are both {port}"):
        loop_thread.run(create_server(dense_artifact, local_config(port=port, http_port=port)))


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=CALL_TIMEOUT):
            return True
    except ConnectionRefusedError:
        return False


def test_metrics_bind_follows_host_unless_metrics_host_says_otherwise(start_server, dense_artifact):
    """127.0.0.2 is another loopback address: a socket bound to 127.0.0.1 refuses it, one on 0.0.0.0 accepts."""
    loopback = start_server(dense_artifact, metrics_port=0)  # --host 127.0.0.1, no --metrics-host
    assert _accepts("127.0.0.1", loopback.running.metrics_port)
    assert not _accepts("127.0.0.2", loopback.running.metrics_port)
    everywhere = start_server(dense_artifact, metrics_port=0, metrics_host="0.0.0.0")
    assert _accepts("127.0.0.2", everywhere.running.metrics_port)
