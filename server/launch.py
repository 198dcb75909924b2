"""Start ``embserve serve`` in a subprocess and wait until it serves: for the demo, tests and benchmarks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from infer.errors import EmbserveError
from server.app import SERVING_LINE


def spawn_server(artifact: str | Path, *options: str) -> tuple[subprocess.Popen[str], int]:
    """``embserve serve ARTIFACT --host 127.0.0.1 --port 0 OPTIONS`` in a subprocess; returns it and its
    port once it serves (warmed up). Stop it with SIGTERM; it drains and exits 0."""
    command = [sys.executable, "-m", "infer.cli", "serve", str(artifact), "--host", "127.0.0.1", "--port", "0"]
    process = subprocess.Popen([*command, *options], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line.startswith(SERVING_LINE):
        process.kill()
        process.wait()
        raise EmbserveError(f"the server for {artifact} did not start (it printed {line!r})")
    return process, int(line.rsplit(" ", 1)[1])
