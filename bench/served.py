"""A server a bench starts as a subprocess and stops: ``embserve serve`` (Python or native) on loopback, its stderr
in a log file, its stdout read by a thread (the pipe never fills; waiting for the "serving on port N" line has a
timeout), its CPU read from /proc, SIGTERM to stop it (killed when it does not exit in time)."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

HOST = "127.0.0.1"


def free_port() -> int:
    """A loopback port free now (for a flag that takes a port number, e.g. ``--http-port``)."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its children (``embserve serve --workers N``: the instance
    and its workers; Linux /proc); NaN elsewhere."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        total = 0.0
        for each in [pid, *map(int, children)]:
            fields = Path(f"/proc/{each}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return total
    except OSError:
        return float("nan")


class ServedProcess:
    """``command`` started with ``env`` (default: this process's), stderr to ``log_path``; ``wait_ready`` waits for
    its "serving on port N" line."""

    def __init__(self, command: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None) -> None:
        self.log_path = log_path
        self._log = log_path.open("wb")
        self.process = subprocess.Popen(
            list(command), stdout=subprocess.PIPE, stderr=self._log, text=True, env=dict(env or os.environ)
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read_stdout, daemon=True).start()
        self.port = 0

    def _read_stdout(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(line)

    def wait_ready(self, timeout_s: float) -> int:
        """The port from the server's "serving on port N" line (printed once it is warm)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self._lines.get(timeout=0.2)
            except queue.Empty:
                if self.process.poll() is not None:
                    raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log_tail()}") from None
                continue
            if "serving on port" in line:
                self.port = int(line.rsplit(" ", 1)[1])
                return self.port
        raise TimeoutError(f"server not serving after {timeout_s:.0f} s:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.process.poll() is None

    def cpu_seconds(self) -> float:
        """User + system CPU of the server process and of its worker processes (``process_cpu_seconds``)."""
        return process_cpu_seconds(self.process.pid)

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM, then wait; a server that does not exit in time is killed and reported as None."""
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
        try:
            code: int | None = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
            code = None
        self._log.close()
        return code

    def log_tail(self, lines: int = 20) -> str:
        if not self._log.closed:
            self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
