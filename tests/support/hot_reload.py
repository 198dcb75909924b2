"""Zero-downtime reloads under load: CLIENTS tritonclient threads against ``embserve serve REPO --poll-s`` while a
version lands in the repository. Used by ``tests/server/test_hot_reload.py`` (the load ends once what the test
checks has been seen) and ``bench/soak.py --hot-reload SECONDS`` (the full fixed window).
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from infer.artifact.export import export
from infer.config import ModelSpec, TableConfig
from infer.features import SparseFeatures
from infer.quant.quantize import quantize
from infer.weights import random_weights
from server.launch import spawn_server
from tests.server.oip_support import client, requested, triton_inputs

CLIENTS = 16
LOAD_SECONDS = 30.0  # a cap: the load ends once what the test checks has been seen
CHANGE_AT = 2.0  # seconds into the load: every client has had answers, p99 "before" has a second of calls
# the load goes on this long once the change is visible: the new version alone (after its first answer + 2 s, as
# asserted), or the broken version refused in the index while the old one answers
SETTLE_S = 2.5
MODEL = "emb"
# ~80 MB of INT8 rows per version: a version that is never freed shows in the server's RSS
BIG_SPEC = ModelSpec(
    (
        TableConfig("t0", 400_000, 64, ("f0",)),
        TableConfig("t1", 400_000, 64, ("f1", "f1b")),
        TableConfig("t2", 400_000, 64, ("f2",)),
    )
)


def export_versions(store: Path) -> dict[str, Path]:
    """Versions "1" and "2" of BIG_SPEC (different weights) and "broken": "2" with a model file failing its checksum."""
    from tests.server.test_repository import break_artifact

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


def p99(latencies: list[float]) -> float:
    return float(np.percentile(np.array(latencies), 99)) if latencies else float("nan")


def run_under_load(
    repo: Path,
    change: Callable[[], None],
    expected: dict[str, list[torch.Tensor]],
    batches: list[SparseFeatures],
    seen: Callable[[list[Call], int], bool],
    seconds: float = LOAD_SECONDS,
    after: Callable[[int], None] | None = None,
    server_kind: str = "python",
) -> tuple[list[Call], list[str], float, int, int]:
    """Load the server of ``repo`` from CLIENTS threads; ``change()`` the repository CHANGE_AT s in, and stop the
    load once ``seen(calls so far, port)`` holds (polled every 0.1 s; ``seconds`` caps the load).

    Returns the calls, the failures, when the change was made, and the server's RSS before it and at the end.
    ``after(port)`` runs once the load is over, before the server stops.
    """
    process, port = spawn_server(repo, "--poll-s", "0.25", "--max-delay-us", "1000", f"--{server_kind}")
    calls: list[Call] = []
    failures: list[str] = []
    lock = threading.Lock()
    begin = time.perf_counter()
    stop_at = begin + seconds
    stop = threading.Event()

    def worker(index: int) -> None:
        with client("grpc", f"127.0.0.1:{port}") as c:
            step = index
            while not stop.is_set() and time.perf_counter() < stop_at:
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
        while time.perf_counter() < stop_at:
            with lock:
                so_far = list(calls)
            if seen(so_far, port):
                break
            time.sleep(0.1)
        stop.set()
        joined_by = time.perf_counter() + 30  # one bound for all: a call that never returns does not cost 30 s each
        for thread in threads:
            thread.join(max(0.0, joined_by - time.perf_counter()))
        rss_after = rss_bytes(process.pid)
        if after is not None:
            after(port)
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
        if process.stdout is not None:
            process.stdout.close()
    return calls, failures, changed, rss_before, rss_after


def summary(
    case: str,
    calls: list[Call],
    changed: float,
    swapped: float,
    rss_before: int,
    rss_after: int,
    seconds: float,
    server_kind: str,
) -> dict[str, object]:
    """The case's JSON fields: calls, p99 before the change and from it to 1 s after ``swapped``, RSS before/after."""
    before = [c.latency for c in calls if 1.0 <= c.started < changed]
    during = [c.latency for c in calls if changed <= c.started <= swapped + 1.0]
    return {
        "case": case,
        "server": server_kind,
        "calls": len(calls),
        "clients": CLIENTS,
        "seconds": seconds,
        "p99_before_ms": round(1e3 * p99(before), 2),
        "p99_swap_ms": round(1e3 * p99(during), 2),
        "p99_ratio": round(p99(during) / p99(before), 3),
        "rss_before_mb": round(rss_before / 2**20, 1),
        "rss_after_mb": round(rss_after / 2**20, 1),
    }


def stage(source: Path, repo: Path, version: str) -> None:
    """Copy a version beside the repository's models, then rename it in: the poller never sees half a folder."""
    staging = repo / ".staging" / version
    shutil.copytree(source, staging)
    os.rename(staging, repo / MODEL / version)


def request_batches() -> list[SparseFeatures]:
    return [SparseFeatures.random(BIG_SPEC, batch_size=32, ids_per_bag=10, seed=seed) for seed in range(8)]


def index_rows(port: int, version: str) -> list[dict[str, str]]:
    """The repository index's rows of ``version`` (of any model)."""
    with client("grpc", f"127.0.0.1:{port}") as c:
        rows = c.get_model_repository_index(as_json=True).get("models", [])
    return [r for r in rows if r.get("version") == version]
