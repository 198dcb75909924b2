"""Triton's real perf_analyzer binary against ``embserve serve`` on loopback, over gRPC and HTTP: it reads the
model's metadata and configuration, sends the requests of an input-data file (``bench/perf_analyzer.py`` writes
it) and reads the statistics extension. A short measurement; only that it runs, measures and sees no failure is
checked (no speed).
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bench.perf_analyzer import find_perf_analyzer, perf_analyzer_command, read_report, write_input_data
from infer.artifact.load import load
from tests.server.oip_support import PROTOCOLS, client
from tests.server.support import LineReader, free_port

BINARY = find_perf_analyzer()
pytestmark = pytest.mark.skipif(BINARY is None, reason="no perf_analyzer (make test installs .venv/bin/perf_analyzer)")
REPO = Path(__file__).resolve().parents[2]
REQUESTS = 100  # per measurement window; perf_analyzer runs a few windows
BATCH = 4


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_perf_analyzer_measures_embserve(protocol: str, sparse_artifact: Path, tmp_path: Path):
    assert BINARY is not None
    input_data = tmp_path / "input.json"
    write_input_data(load(sparse_artifact).spec, input_data, batch_size=BATCH, steps=4)
    http_port = free_port()
    command = [
        sys.executable, "-m", "infer.cli", "serve", str(sparse_artifact), "--host", "127.0.0.1", "--port", "0",
        "--http-port", str(http_port), "--max-delay-us", "500", "--forward-threads", "1",
    ]  # fmt: skip
    with (tmp_path / "server.log").open("w") as log:
        server = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        grpc_address = f"127.0.0.1:{LineReader(server.stdout).wait_for('serving on port', 120).split()[-1]}"
        address = grpc_address if protocol == "grpc" else f"127.0.0.1:{http_port}"
        report = tmp_path / "report.csv"
        command = perf_analyzer_command(
            BINARY, sparse_artifact.name, address, input_data, 2, REQUESTS, report, protocol
        )
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert "Throughput:" in done.stdout and "Successful request count" in done.stdout, done.stdout[-3000:]
        measured = read_report(report)
        assert measured["throughput"] > 0 and 0 < measured["p50_us"] <= measured["p99_us"]
        with client("grpc", grpc_address) as c:
            (statistics,) = c.get_inference_statistics(sparse_artifact.name).model_stats
        assert statistics.inference_stats.fail.count == 0
        assert statistics.inference_stats.success.count >= REQUESTS
        assert statistics.inference_count == BATCH * statistics.inference_stats.success.count
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0
