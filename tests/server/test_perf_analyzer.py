"""Triton's real perf_analyzer binary against ``embserve serve`` on loopback: it reads the model's metadata and
configuration, sends the requests of an input-data file (``bench/perf_analyzer.py`` writes it) and reads the
statistics extension. A short measurement; only that it runs, measures and sees no failure is checked (no speed).
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import pytest

from bench.perf_analyzer import find_perf_analyzer, perf_analyzer_command, read_report, write_input_data
from bench.server import ServerProcess
from infer.artifact.load import load
from tests.server.oip_support import client

BINARY = find_perf_analyzer()
pytestmark = pytest.mark.skipif(BINARY is None, reason="no perf_analyzer (make test installs .venv/bin/perf_analyzer)")
REQUESTS = 100  # per measurement window; perf_analyzer runs a few windows


def test_perf_analyzer_measures_embserve_over_grpc(sparse_artifact: Path, tmp_path: Path):
    assert BINARY is not None
    spec = load(sparse_artifact).spec
    input_data = tmp_path / "input.json"
    write_input_data(spec, input_data, batch_size=4, steps=4)
    settings = argparse.Namespace(
        max_batch_size=64, max_delay_us=500, max_merge_examples=0, forward_threads=1, server_threads=0
    )
    server = ServerProcess(sparse_artifact, settings, tmp_path / "server.log")
    try:
        address = f"127.0.0.1:{server.wait_ready(120)}"
        report = tmp_path / "report.csv"
        command = perf_analyzer_command(BINARY, sparse_artifact.name, address, input_data, 2, REQUESTS, report)
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert "Throughput:" in done.stdout and "Server:" in done.stdout, done.stdout[-3000:]
        measured = read_report(report)
        assert measured["throughput"] > 0 and 0 < measured["p50_us"] <= measured["p99_us"]
        with client("grpc", address) as c:
            (statistics,) = c.get_inference_statistics(sparse_artifact.name).model_stats
        assert statistics.inference_stats.fail.count == 0
        assert statistics.inference_stats.success.count >= REQUESTS
        assert statistics.inference_count == 4 * statistics.inference_stats.success.count  # 4 examples each
    finally:
        assert server.stop() == 0
