"""Helpers of the server tests (no fixtures: those are in conftest.py)."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from infer.artifact.load import load
from infer.artifact.runtime import Runtime
from infer.cli import main as cli_main
from infer.features import SparseFeatures
from server.adapters.v1 import codec
from server.app import SERVICE_NAME, RunningServer, ServerConfig, create_server
from server.proto import inference_pb2 as pb
from server.proto import inference_pb2_grpc as pb_grpc

T = TypeVar("T")
NUM_DENSE = 5
CALL_TIMEOUT = 10.0  # every RPC of the suite is bounded


class LoopThread:
    """One asyncio loop in a daemon thread; ``run`` executes a coroutine there and waits (bounded)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="server-loop", daemon=True)
        self.thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        return self.submit(coro).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class Channels:
    """Blocking client helpers of a server at ``self.address`` (the Python one here, embserve-server in
    ``native_support``): channels closed together, the v1 stub, health checks."""

    address: str
    _channels: list[grpc.Channel]

    def channel(self, **kwargs: Any) -> grpc.Channel:
        channel = grpc.insecure_channel(self.address, **kwargs)
        self._channels.append(channel)
        return channel

    def stub(self) -> pb_grpc.InferenceServiceStub:
        return pb_grpc.InferenceServiceStub(self.channel())

    def health(self, service: str = SERVICE_NAME) -> int:
        stub = health_pb2_grpc.HealthStub(self.channel())
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=CALL_TIMEOUT).status

    def close_channels(self) -> None:
        for channel in self._channels:
            channel.close()
        self._channels.clear()


class Served(Channels):
    """A running server plus blocking helpers to talk to it."""

    def __init__(self, loop: LoopThread, running: RunningServer, config: ServerConfig) -> None:
        self.loop = loop
        self.running = running
        self.config = config
        self.port = running.port
        self.address = f"127.0.0.1:{running.port}"
        self._channels: list[grpc.Channel] = []

    @classmethod
    def start(cls, loop: LoopThread, artifact: Path | Runtime, config: ServerConfig) -> Served:
        return cls(loop, loop.run(create_server(artifact, config)), config)

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        value = self.running.metrics.registry.get_sample_value(name, labels or {})
        return 0.0 if value is None else value

    def stop(self, grace: float | None = 5.0) -> None:
        self.loop.run(self.running.stop(grace))


class GatedModule:
    """The real scripted model behind a gate: a forward waits until the test opens it.

    Lets a test hold a batch inside the model (to fill the queue, or to cancel mid-forward)
    deterministically; the numbers are still the model's own.
    """

    def __init__(self, module: torch.jit.ScriptModule) -> None:
        self.module = module
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()  # set when a forward reaches the gate

    def _wait(self) -> None:
        self.entered.set()
        if not self.gate.wait(30):
            raise RuntimeError("the test never opened the gate")

    def __call__(self, *args: Any) -> torch.Tensor:
        self._wait()
        return self.module(*args)

    def predict(self, *args: Any) -> torch.Tensor:
        self._wait()
        return self.module.predict(*args)

    def lookup_and_predict(self, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        self._wait()
        return self.module.lookup_and_predict(*args)

    def lookup_unchecked(self, *args: Any) -> torch.Tensor:  # the server's entry (it validated already)
        self._wait()
        return self.module.lookup_unchecked(*args)

    def lookup_and_predict_unchecked(self, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        self._wait()
        return self.module.lookup_and_predict_unchecked(*args)

    def __getattr__(self, name: str) -> Any:  # the model's attributes (embeddings, ...) as they are
        return getattr(self.module, name)

    def hold(self) -> None:
        """From now on, forwards wait at the gate."""
        self.entered.clear()
        self.gate.clear()

    def release(self) -> None:
        self.gate.set()

    def wait_entered(self, timeout: float = 10.0) -> None:
        assert self.entered.wait(timeout), "no forward reached the gate"


def local_config(**overrides: Any) -> ServerConfig:
    settings: dict[str, Any] = {"host": "127.0.0.1", "port": 0, "warmup_batches": 1}  # metrics follow the host
    settings.update(overrides)
    return ServerConfig(**settings)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def lookup_request(features: SparseFeatures, typed: bool = False, fp16: bool = False) -> pb.LookupRequest:
    sparse = codec.encode_typed(features) if typed else codec.encode_packed(features)
    return pb.LookupRequest(sparse=sparse, output_type=pb.OUTPUT_TYPE_FP16 if fp16 else pb.OUTPUT_TYPE_FP32)


def rpc_error(call: Callable[[], Any]) -> grpc.RpcError:
    """The error a call raises (failing the test when it succeeds)."""
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


def wait_until(condition: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)


def warm_up_port(caplog: pytest.LogCaptureFixture, timeout: float = 60.0) -> int:
    """The port of a server started on port 0, read from its "warming up on port N" log line (create_server
    returns only once warm-up is done; a port picked in advance could be taken by then)."""

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith("warming up on port ")]

    wait_until(lambda: bool(lines()), timeout, what="the server's 'warming up on port' log line")
    return int(lines()[-1].split()[4])


def manifest_json(artifact: Path) -> dict[str, Any]:
    return json.loads((artifact / "manifest.json").read_text())


def gated_runtime(artifact: Path) -> tuple[Runtime, GatedModule]:
    """A fresh load of ``artifact`` whose model waits at a gate (open until the test closes it)."""
    runtime = load(artifact)
    gated = GatedModule(runtime.module)
    return Runtime(runtime.path, runtime.manifest, gated), gated  # type: ignore[arg-type]


class LineReader:
    """Collects a subprocess's stdout lines in a thread, so waiting for one is bounded."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        self._stream = stream
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in self._stream:
            self.lines.append(line)

    def wait_for(self, text: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.lines:
                if text in line:
                    return line
            time.sleep(0.02)
        raise AssertionError(f"{text!r} not printed within {timeout} s; got {self.lines}")


def scrape_metrics(port: int) -> dict[str, list[Any]]:
    """The samples of every metric family on ``http://127.0.0.1:<port>/metrics``, by family name."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=CALL_TIMEOUT) as response:
        assert response.status == 200
        text = response.read().decode()
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def serve_in_process(capsys, *args: str) -> tuple[int, str]:
    """``embserve serve --python ARGS`` refused in this process (``--python``: the default would replace this process
    with embserve-server): its exit code and stderr (``capsys``'s). For the tests of a
    refusal that comes before any model loads or port is served (a port in use, a repository with --workers),
    where a second interpreter (torch's import, 2-3 CPU-s) is not what they check; each such test file keeps
    one real ``python -m infer.cli serve`` refusal. The signal handlers ``serve`` installs are put back."""
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    capsys.readouterr()
    try:
        code = cli_main(["serve", "--python", *args])
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    return code, capsys.readouterr().err
