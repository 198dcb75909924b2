"""Zero-downtime reloads under load: 16 tritonclient threads for 30 s against ``embserve serve REPO --poll-s``
while a new version lands in the repository (then, in a second test, 16 s while a broken one lands), on both
servers (``--native``: embserve-server).

The server runs in a subprocess so that its RSS is its own. Every answer must equal the in-process
runtime of the version its ``model_version`` names; no call may fail. The latency percentiles
before and during the swap are printed as one JSON line (numbers for the note, not asserted).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from infer.artifact.export import export
from infer.artifact.load import load
from infer.config import ModelSpec, TableConfig
from infer.features import SparseFeatures
from infer.quant.quantize import quantize
from infer.weights import random_weights
from server.launch import spawn_server
from tests.server.native_support import SERVER_KINDS, native_binary
from tests.server.oip_support import client, requested, triton_inputs
from tests.server.test_repository import break_artifact

CLIENTS = 16
LOAD_SECONDS = 30.0
CHANGE_AT = 8.0  # seconds into the load
# a broken version fails its load within about a second of landing: half the load shows it changed nothing
BROKEN_LOAD_SECONDS = 16.0
MODEL = "emb"
# ~80 MB of INT8 rows per version: a version that is never freed shows in the server's RSS
BIG_SPEC = ModelSpec(
    (
        TableConfig("t0", 400_000, 64, ("f0",)),
        TableConfig("t1", 400_000, 64, ("f1", "f1b")),
        TableConfig("t2", 400_000, 64, ("f2",)),
    )
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def big_versions(tmp_path_factory) -> dict[str, Path]:
    store = tmp_path_factory.mktemp("big-versions")
    found = {}
    for version, seed in (("1", 1), ("2", 2)):
        found[version] = export(quantize(BIG_SPEC, random_weights(BIG_SPEC, seed=seed)), store / f"v{version}")
    found["broken"] = break_artifact(found["2"], store / "broken")
    return found


@dataclass(frozen=True)
class Call:
    started: float  # seconds since the load began
    latency: float
    version: str


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _p99(latencies: list[float]) -> float:
    return float(np.percentile(np.array(latencies), 99)) if latencies else float("nan")


def run_under_load(
    repo: Path,
    change: Callable[[], None],
    expected: dict[str, list[torch.Tensor]],
    batches: list[SparseFeatures],
    seconds: float = LOAD_SECONDS,
    after: Callable[[int], None] | None = None,
    server_kind: str = "python",
) -> tuple[list[Call], list[str], float, int, int]:
    """Load the server of ``repo`` from CLIENTS threads for ``seconds``; ``change()`` the repository CHANGE_AT s in.

    Returns the calls, the failures, when the change was made, and the server's RSS before it and at the end.
    ``after(port)`` runs once the load is over, before the server stops.
    """
    native = ("--native",) if server_kind == "native" else ()
    process, port = spawn_server(repo, "--poll-s", "0.25", "--max-delay-us", "1000", *native)
    calls: list[Call] = []
    failures: list[str] = []
    lock = threading.Lock()
    begin = time.perf_counter()
    stop_at = begin + seconds

    def worker(index: int) -> None:
        with client("grpc", f"127.0.0.1:{port}") as c:
            step = index
            while time.perf_counter() < stop_at:
                which = step % len(batches)
                step += 1
                started = time.perf_counter()
                try:
                    result = c.infer(
                        MODEL, triton_inputs("grpc", batches[which]), outputs=requested("grpc", "embeddings")
                    )
                    version = result.get_response().model_version
                    got = torch.from_numpy(np.array(result.as_numpy("embeddings")))
                    if version not in expected or not torch.equal(got, expected[version][which]):
                        raise AssertionError(f"answer of version {version!r} differs from that version's runtime")
                except Exception as err:  # noqa: BLE001 - every failure is collected and reported
                    with lock:
                        failures.append(f"{type(err).__name__}: {err}")
                    continue
                with lock:
                    calls.append(Call(started - begin, time.perf_counter() - started, version))

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(CLIENTS)]
    try:
        for thread in threads:
            thread.start()
        time.sleep(CHANGE_AT)
        rss_before = rss_bytes(process.pid)
        changed = time.perf_counter() - begin
        change()
        for thread in threads:
            thread.join(seconds + 30)
        rss_after = rss_bytes(process.pid)
        if after is not None:
            after(port)
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
        if process.stdout is not None:
            process.stdout.close()
    return calls, failures, changed, rss_before, rss_after


def _report(
    case: str,
    calls: list[Call],
    changed: float,
    swapped: float,
    rss_before: int,
    rss_after: int,
    seconds: float,
    server_kind: str,
) -> None:
    before = [c.latency for c in calls if 2.0 <= c.started < changed]
    during = [c.latency for c in calls if changed <= c.started <= swapped + 1.0]
    line = {
        "case": case,
        "server": server_kind,
        "calls": len(calls),
        "clients": CLIENTS,
        "seconds": seconds,
        "p99_before_ms": round(1e3 * _p99(before), 2),
        "p99_swap_ms": round(1e3 * _p99(during), 2),
        "p99_ratio": round(_p99(during) / _p99(before), 3),
        "rss_before_mb": round(rss_before / 2**20, 1),
        "rss_after_mb": round(rss_after / 2**20, 1),
    }
    print(json.dumps(line))


def _stage(source: Path, repo: Path, version: str) -> None:
    """Copy a version beside the repository's models, then rename it in: the poller never sees half a folder."""
    staging = repo / ".staging" / version
    shutil.copytree(source, staging)
    os.rename(staging, repo / MODEL / version)


def _batches() -> list[SparseFeatures]:
    return [SparseFeatures.random(BIG_SPEC, batch_size=32, ids_per_bag=10, seed=seed) for seed in range(8)]


@pytest.fixture(params=SERVER_KINDS)
def server_kind(request) -> str:
    if request.param == "native":
        native_binary()  # skips when embserve-server is not built
    return str(request.param)


def test_a_new_version_swaps_in_under_load(tmp_path, big_versions, server_kind):
    repo = tmp_path / "repo"
    shutil.copytree(big_versions["1"], repo / MODEL / "1")
    batches = _batches()
    expected = {v: [load(big_versions[v]).lookup(b) for b in batches] for v in ("1", "2")}
    calls, failures, changed, rss_before, rss_after = run_under_load(
        repo, lambda: _stage(big_versions["2"], repo, "2"), expected, batches, server_kind=server_kind
    )
    assert failures == []
    first_new = min(c.started for c in calls if c.version == "2")
    assert {c.version for c in calls} == {"1", "2"}
    assert all(c.version == "2" for c in calls if c.started > first_new + 2.0)  # then only the new version
    assert rss_after <= 1.10 * rss_before, f"RSS {rss_before / 2**20:.0f} MB -> {rss_after / 2**20:.0f} MB"
    _report("new_version", calls, changed, first_new, rss_before, rss_after, LOAD_SECONDS, server_kind)


def test_a_broken_version_changes_nothing_under_load(tmp_path, big_versions, server_kind):
    repo = tmp_path / "repo"
    shutil.copytree(big_versions["2"], repo / MODEL / "2")
    batches = _batches()
    expected = {"2": [load(big_versions["2"]).lookup(b) for b in batches]}
    refusals: list[dict[str, str]] = []

    def refused(port: int) -> None:  # the server did see version 3, and refused it
        with client("grpc", f"127.0.0.1:{port}") as c:
            rows = c.get_model_repository_index(as_json=True).get("models", [])
        refusals.extend(r for r in rows if r.get("version") == "3")

    calls, failures, changed, rss_before, rss_after = run_under_load(
        repo,
        lambda: _stage(big_versions["broken"], repo, "3"),
        expected,
        batches,
        BROKEN_LOAD_SECONDS,
        refused,
        server_kind,
    )
    assert [r.get("state") for r in refusals] == ["UNAVAILABLE"], refusals
    assert "fails its sha256 check" in refusals[0].get("reason", ""), refusals
    assert failures == []
    assert {c.version for c in calls} == {"2"}
    assert rss_after <= 1.10 * rss_before, f"RSS {rss_before / 2**20:.0f} MB -> {rss_after / 2**20:.0f} MB"
    _report("broken_version", calls, changed, changed + 1.0, rss_before, rss_after, BROKEN_LOAD_SECONDS, server_kind)
