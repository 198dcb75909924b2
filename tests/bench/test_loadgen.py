"""``bench/loadgen.py`` for a few seconds: MLPerf LoadGen drives a real ``embserve serve`` on loopback over embserve.v1
and the Open Inference Protocol, Server and Offline scenarios. Every sample LoadGen issued is answered once, and
every answer LoadGen logged equals the in-process runtime's on the same query (no timing is checked)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from infer.artifact.export import export
from infer.artifact.load import load
from infer.quant.quantize import quantize
from infer.weights import random_weights
from tests.conftest import TinyOverArch, mixed_spec

pytest.importorskip("mlperf_loadgen")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
NUM_DENSE = 5
POOL, BATCH = 16, 64


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    """A small model of the demo's shape: mixed dtypes and poolings, a dense part (Predict)."""
    torch.manual_seed(0)
    spec = mixed_spec().with_dense_arch(TinyOverArch(NUM_DENSE, mixed_spec().output_dim), NUM_DENSE)
    return export(quantize(spec, random_weights(spec, seed=3)), tmp_path_factory.mktemp("loadgen") / "small")


def loadgen_detail(folder: Path) -> dict[str, object]:
    """LoadGen's detail log (``:::MLLOG {json}`` lines) as key -> value."""
    entries = [
        json.loads(line[len(":::MLLOG ") :]) for line in (folder / "mlperf_log_detail.txt").read_text().splitlines()
    ]
    return {entry["key"]: entry["value"] for entry in entries}


def test_loadgen_answers_every_sample_with_the_runtimes_output(artifact, tmp_path):
    command = [
        sys.executable, "bench/loadgen.py", "--quick", "--artifact", str(artifact), "--pool", str(POOL),
        "--batch-size", str(BATCH), "--server-qps", "40", "--offline-expected-qps", "40", "--ceiling-s", "0.05",
        "--log-dir", str(tmp_path / "logs"),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    cases = {(row["protocol"], row["scenario"]): row for row in rows if row["bench"] == "loadgen"}
    assert set(cases) == {(p, s) for p in ("v1", "oip") for s in ("server", "offline")}, done.stderr[-4000:]
    assert rows[-1]["server_exit_code"] == 0

    from bench.loadgen import make_queries  # the inputs only: the expected outputs come from the runtime

    runtime = load(artifact)
    queries = make_queries(runtime.spec, POOL, BATCH, seed=0)
    for case, row in cases.items():
        folder = Path(row["log_dir"])
        detail = loadgen_detail(folder)
        # the queries LoadGen issued (result_query_count: a max duration may cut its generated schedule short)
        issued = int(detail["result_query_count"]) * int(detail["generated_samples_per_query"])
        logged = json.loads((folder / "mlperf_log_accuracy.json").read_text())
        assert issued > 0 and detail["num_errors"] == 0, case
        # accuracy_log_probability 1: one entry per completed sample, each sequence number once
        assert sorted(entry["seq_id"] for entry in logged) == list(range(issued)), case
        for entry in logged:
            query = queries[entry["qsl_idx"]]
            got = torch.frombuffer(bytearray(bytes.fromhex(entry["data"])), dtype=torch.float32)
            # scores: the server may merge requests, and the dense GEMMs of a merged batch may round differently
            torch.testing.assert_close(got, runtime.predict(query.features, query.dense), rtol=1e-5, atol=1e-6)
        assert row["errors"] == 0 and row["issued"] == row["completed"] == issued, case


def test_the_server_qps_search_doubles_past_a_first_passing_probe_then_bisects():
    """A fake server that meets the p99 bound up to 100 queries/s: from 30, the probes are (by hand) 30 and 60 pass,
    120 misses, then 90 passes, 105 misses, 97.5 passes (105 - 97.5 <= 0.1 x 105): the best is 97.5."""
    from types import SimpleNamespace

    from bench.loadgen import search_server_qps

    search = search_server_qps(lambda qps: SimpleNamespace(meets_bound=qps <= 100, p99_ms=1.0), 30.0, 0.1, 10)
    assert [probe[0] for probe in search.probes] == [30.0, 60.0, 120.0, 90.0, 105.0, 97.5]
    assert search.best == 97.5
