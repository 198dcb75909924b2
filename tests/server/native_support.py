"""The native server (``embserve-server``) for the server tests: started as a subprocess, driven like ``Served``.

"One suite, two servers": the protocol, contract, bad-request, auth and drain tests take a server of either kind
(``SERVER_KINDS``) and assert the same answers, codes and words, so a difference between them fails a test.
Without a built binary (``make server``), the native cases skip and say how to build it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.conftest import sanitizer_reported
from tests.server.support import Channels, LineReader, scrape_metrics

SERVER_KINDS = ("python", "native")
# the ServerConfig fields the binary takes, and its flag for each
_FLAGS = {
    "max_batch_size": "--max-batch-size",
    "max_merge_examples": "--max-merge-examples",
    "max_delay_us": "--max-delay-us",
    "max_queue": "--max-queue",
    "forward_threads": "--forward-threads",
    "intra_op_threads": "--intra-op-threads",
    "threads": "--threads",
    "max_message_bytes": "--max-message-bytes",
    "drain_grace_s": "--drain-grace-s",
    "drain_quiet_s": "--drain-quiet-s",
    "drain_seconds": "--drain-seconds",
    "warmup_batches": "--warmup-batches",
    "model_name": "--model-name",
    "verify": "--verify",
    "batch_wait": "--batch-wait",
    "tls_cert": "--tls-cert",
    "tls_key": "--tls-key",
    "http_port": "--http-port",
    "http_host": "--http-host",
    "version_policy": "--version-policy",
    "poll_s": "--poll-s",
    "backend": "--backend",
    "hot_rows_file": "--hot-rows-file",
    "prefetch": "--prefetch",
}


@dataclass(frozen=True)
class NativeRunning:
    """The ports embserve-server reported, as ``Served.running`` holds the Python server's."""

    metrics_port: int
    http_port: int | None  # None: no --http-port


def native_binary() -> str:
    """The binary under test ($EMBSERVE_SERVER_BIN, e.g. the sanitizer build, else `make server`'s); skips
    the test when none is built."""
    from infer.errors import ConfigError
    from server.native import find_binary

    try:
        return find_binary()
    except ConfigError as err:
        pytest.skip(str(err))


class NativeServed(Channels):
    """A running embserve-server with ``Served``'s helpers (address, stub, health, metric, stop)."""

    kind = "native"

    def __init__(self, artifact: Path | str, **config: Any) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="embserve-native-")
        command = [native_binary(), str(artifact), "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0"]
        config.setdefault("warmup_batches", 1)
        for key, value in config.items():
            if key == "auth_token":
                token_file = Path(self._dir.name) / "token"
                token_file.write_text(value)
                command += ["--auth-token-file", str(token_file)]
            elif key in _FLAGS:
                command += [_FLAGS[key], str(value)]
            else:
                raise AssertionError(f"the native server has no setting {key}")
        self.stderr_path = Path(self._dir.name) / "stderr.txt"
        self._stderr = self.stderr_path.open("w")
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self._stderr, text=True)
        try:
            line = LineReader(self.process.stdout).wait_for("serving on port", timeout=120)
        except AssertionError:
            self.process.kill()
            self.process.wait(10)
            raise AssertionError(f"embserve-server did not start: {self.stderr_path.read_text()[-3000:]}") from None
        self.port = int(line.split()[-1])
        self.address = f"127.0.0.1:{self.port}"
        log = self.stderr_path.read_text()
        self.metrics_port = int(log.split("metrics on port ")[1].split()[0].rstrip(",)"))
        http_port = int(log.split("HTTP on port ")[1].split()[0].rstrip(",)")) if "HTTP on port " in log else None
        self.running = NativeRunning(self.metrics_port, http_port)
        self._channels: list[grpc.Channel] = []

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        """A sample of /metrics (0 when absent), as ``Served.metric`` reads the Python server's registry."""
        wanted = labels or {}
        for samples in scrape_metrics(self.metrics_port).values():
            for sample in samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in wanted.items()):
                    return float(sample.value)
        return 0.0

    def stop(self, grace: float | None = 5.0) -> int:
        """SIGTERM, then the exit code (0: drained)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        self._stderr.close()
        if self.process.stdout is not None:
            self.process.stdout.close()
        code = self.process.returncode
        sanitizer = sanitizer_reported(self.log())
        self._dir.cleanup()
        assert not sanitizer, "the sanitizers reported an error (see the server's stderr above)"
        return code

    @property
    def pid(self) -> int:
        """The process whose /proc/<pid>/maps shows what the server maps."""
        return self.process.pid

    def log(self) -> str:
        return self.stderr_path.read_text() if self.stderr_path.exists() else ""


def start_kind(kind: str, loop_thread: Any, artifact: Path, **config: Any) -> Any:
    """A server of ``kind`` ("python": server.app in this process; "native": embserve-server)."""
    if kind == "native":
        return NativeServed(artifact, **config)
    from tests.server.support import Served, local_config

    if config.pop("backend", "torchscript") != "torchscript":  # the Python server serves a runtime loaded so
        from infer.artifact.load import load

        artifact = load(artifact, backend="pt2")  # type: ignore[assignment]
    served = Served.start(loop_thread, artifact, local_config(**config))
    served.kind = "python"  # type: ignore[attr-defined]
    served.pid = os.getpid()  # type: ignore[attr-defined]
    return served
