"""Zero-downtime reloads under load: 16 tritonclient threads against ``embserve serve REPO --poll-s`` while a new
version lands in the repository (then, in a second test, while a broken one lands), on both servers (``--native``:
embserve-server).

The load runs until what each test checks has been seen: the new version answering for SETTLE_S (alone after its
first 2 s), or the server's index refusing the broken one and SETTLE_S more of load (LOAD_SECONDS caps both). The
server runs in a subprocess so that its RSS is its own. Every answer must equal the in-process runtime of the
version its ``model_version`` names; no call may fail. The latency percentiles before and during the swap are
printed as one JSON line (numbers for the note, not asserted). The full 30 s runs this test made before are a bench:
``python bench/soak.py --hot-reload 30`` (``--native`` for embserve-server).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from infer.artifact.load import load
from tests.server.native_support import SERVER_KINDS, native_binary
from tests.support.hot_reload import (
    MODEL,
    SETTLE_S,
    Call,
    export_versions,
    index_rows,
    request_batches,
    run_under_load,
    stage,
    summary,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def big_versions(tmp_path_factory) -> dict[str, Path]:
    return export_versions(tmp_path_factory.mktemp("big-versions"))


@pytest.fixture(params=SERVER_KINDS)
def server_kind(request) -> str:
    if request.param == "native":
        native_binary()  # skips when embserve-server is not built
    return str(request.param)


def _new_version_settled(calls: list[Call], port: int) -> bool:
    """Calls of version 2 started SETTLE_S after its first answer (the assertion's window is 2 s)."""
    started = [c.started for c in calls if c.version == "2"]
    return bool(started) and max(started) >= min(started) + SETTLE_S


def test_a_new_version_swaps_in_under_load(tmp_path, big_versions, server_kind):
    repo = tmp_path / "repo"
    shutil.copytree(big_versions["1"], repo / MODEL / "1")
    batches = request_batches()
    expected = {v: [load(big_versions[v]).lookup(b) for b in batches] for v in ("1", "2")}
    calls, failures, changed, rss_before, rss_after = run_under_load(
        repo,
        lambda: stage(big_versions["2"], repo, "2"),
        expected,
        batches,
        _new_version_settled,
        server_kind=server_kind,
    )
    assert failures == []
    first_new = min(c.started for c in calls if c.version == "2")
    assert {c.version for c in calls} == {"1", "2"}
    late = [c for c in calls if c.started > first_new + 2.0]
    assert late and all(c.version == "2" for c in late)  # then only the new version
    assert rss_after <= 1.10 * rss_before, f"RSS {rss_before / 2**20:.0f} MB -> {rss_after / 2**20:.0f} MB"
    seconds = max(c.started for c in calls)
    print(json.dumps(summary("new_version", calls, changed, first_new, rss_before, rss_after, seconds, server_kind)))


def test_a_broken_version_changes_nothing_under_load(tmp_path, big_versions, server_kind):
    repo = tmp_path / "repo"
    shutil.copytree(big_versions["2"], repo / MODEL / "2")
    batches = request_batches()
    expected = {"2": [load(big_versions["2"]).lookup(b) for b in batches]}
    refused_at: list[float] = []
    refusals: list[dict[str, str]] = []

    def settled(calls: list[Call], port: int) -> bool:
        """The index refuses version 3, and SETTLE_S of load has run since (a broken load fails in about 1 s)."""
        if not refused_at:
            if not any(r.get("state") == "UNAVAILABLE" for r in index_rows(port, "3")):
                return False
            refused_at.append(time.perf_counter())
        return time.perf_counter() >= refused_at[0] + SETTLE_S

    def refused(port: int) -> None:  # the server did see version 3, and refused it
        refusals.extend(index_rows(port, "3"))

    calls, failures, changed, rss_before, rss_after = run_under_load(
        repo,
        lambda: stage(big_versions["broken"], repo, "3"),
        expected,
        batches,
        settled,
        after=refused,
        server_kind=server_kind,
    )
    assert [r.get("state") for r in refusals] == ["UNAVAILABLE"], refusals
    assert "fails its sha256 check" in refusals[0].get("reason", ""), refusals
    assert failures == []
    assert {c.version for c in calls} == {"2"}
    assert max(c.started for c in calls) >= changed + SETTLE_S  # the old version answered on after the refusal
    assert rss_after <= 1.10 * rss_before, f"RSS {rss_before / 2**20:.0f} MB -> {rss_after / 2**20:.0f} MB"
    seconds = max(c.started for c in calls)
    line = summary("broken_version", calls, changed, changed + 1.0, rss_before, rss_after, seconds, server_kind)
    print(json.dumps(line))
