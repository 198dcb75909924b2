"""A version's load and warm-up in the repository: a retrained version (new tables and dense part, so a structure
of its own) swaps in and answers as the independent reference does, unsharded and over 2 CPU shards; a version
that fails its warm-up, or answers it in the wrong shape or with non-finite embeddings, is refused while the good
one keeps serving; each version's phases are recorded (log, ``load_phases``, ``embserve_model_load_seconds``).
The last two tests run the swap and the refused warm-up through either server (``server_kind``: embserve-server
too), polled, over gRPC.

Expected values: ``F.embedding_bag`` on the exported model's dequantized tables and its dense part on that
(``tests.support.call_contract.Reference``), never the runtime under test.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from infer import ComputeDevice, Topology, plan_for_inference, shard_model
from infer.artifact.export import export
from infer.quant.quantize import quantize
from infer.weights import random_weights
from server import repository as repository_module
from server.metrics import ServerMetrics
from server.repository import BatchSettings, Repository
from tests.conftest import random_batch
from tests.support.call_contract import NUM_DENSE, ColumnScores, Reference, assert_matches, contract_spec

MODEL = "ctr"
SETTINGS = BatchSettings(max_batch_size=64, max_delay_s=0.0005, max_queue=16, workers=1)


class FailsOnLargeBatches(torch.nn.Module):
    """A dense part that passes export's probes (batches of 2 and 3) and fails on the warm-up's batch of 64."""

    def __init__(self, num_dense: int, pooled_dim: int) -> None:
        super().__init__()
        self.scores = ColumnScores(num_dense, pooled_dim)

    def forward(self, dense_features: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        if dense_features.shape[0] > 8:
            raise RuntimeError("this dense part serves batches of at most 8 examples")
        return self.scores(dense_features, pooled)


def _export(folder: Path, seed: int, shards: int = 1, dense_arch: torch.nn.Module | None = None) -> tuple[Path, Any]:
    """A version of the contract's model (its own tables and dense weights by ``seed``) and its reference."""
    torch.manual_seed(seed)
    spec = contract_spec(dense_arch or ColumnScores(NUM_DENSE, contract_spec().output_dim))
    model = quantize(spec, random_weights(spec, seed=seed))
    if shards == 1:
        return export(model, folder), Reference(spec, model)
    plan = plan_for_inference(spec, Topology(shards, ComputeDevice.CPU))
    return export(shard_model(model, plan), folder, plan=plan), Reference(spec, model)


def _stage(source: Path, root: Path, version: str) -> None:
    shutil.copytree(source, root / MODEL / version)


async def _answers(repo: Repository, seed: int) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(batch, dense, embeddings, scores) answered by the newest version's batchers, as a request's would be."""
    model = repo.find(MODEL, "")
    batch = random_batch(model.spec, 6, max_len=5, weighted=True, seed=seed)
    dense = torch.randn(6, NUM_DENSE, generator=torch.Generator().manual_seed(seed))
    embeddings = await model.lookups.submit(batch)
    assert model.predictions is not None
    scores = await model.predictions.submit(batch, dense)
    return batch, dense, embeddings, scores


def _loads(metrics: ServerMetrics, phase: str) -> float | None:
    return metrics.registry.get_sample_value("embserve_model_load_seconds_count", {"phase": phase})


@pytest.mark.parametrize("shards", [1, 2], ids=["unsharded", "2_cpu_shards"])
def test_a_retrained_version_swaps_in_and_answers_as_the_reference(tmp_path, loop_thread, shards, caplog):
    first, first_reference = _export(tmp_path / "v1", seed=21, shards=shards)
    second, second_reference = _export(tmp_path / "v2", seed=22, shards=shards)
    root = tmp_path / "repo"
    _stage(first, root, "1")
    metrics = ServerMetrics()

    async def scenario() -> list[tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]]:
        repo = Repository(root, SETTINGS, metrics)
        try:
            await repo.load_all()
            before = await _answers(repo, seed=1)
            _stage(second, root, "2")
            await repo.poll_once()
            assert repo.versions(MODEL) == ["2"]
            after = await _answers(repo, seed=2)
            phases = repo.load_phases(MODEL, "2")
        finally:
            await repo.close()
        # the split of a version's arrival: the load's own phases, then its batchers and each kind of warm call
        for phase in ("manifest", "libraries", "model", "checksums", "batchers", "warm-up lookup", "warm-up both"):
            assert phase in phases and phases[phase] >= 0.0, (phase, phases)
        return [before, after]

    with caplog.at_level(logging.INFO, logger="server.repository"):
        before, after = loop_thread.run(scenario(), timeout=120)
    for (batch, dense, embeddings, scores), reference in ((before, first_reference), (after, second_reference)):
        assert_matches(embeddings, reference.pooled(batch))
        assert_matches(scores, reference.scores(batch, dense))
    assert _loads(metrics, "total") == 2 and _loads(metrics, "warm-up predict") == 2
    ready = [r.getMessage() for r in caplog.records if "version 2 ready in" in r.getMessage()]
    assert len(ready) == 1 and "warm-up lookup" in ready[0] and "checksums" in ready[0], ready


def _refused_beside_the_good_one(tmp_path: Path, loop_thread: Any, broken: Path) -> tuple[str, float]:
    """Version 1 serves; ``broken`` lands as version 2 and is refused: returns why, and the failed-load count.
    Version 1 must still answer as its reference does."""
    good, reference = _export(tmp_path / "v1", seed=31)
    root = tmp_path / "repo"
    _stage(good, root, "1")
    metrics = ServerMetrics()

    async def scenario() -> tuple[str, tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]]:
        repo = Repository(root, SETTINGS, metrics)
        try:
            await repo.load_all()
            _stage(broken, root, "2")
            await repo.poll_once()
            assert repo.versions(MODEL) == ["1"]
            return repo.failures(MODEL)["2"], await _answers(repo, seed=3)
        finally:
            await repo.close()

    why, (batch, dense, embeddings, scores) = loop_thread.run(scenario(), timeout=120)
    assert_matches(embeddings, reference.pooled(batch))
    assert_matches(scores, reference.scores(batch, dense))
    failed = metrics.registry.get_sample_value("embserve_requests_total", {"method": "model load", "code": "FAILED"})
    return why, failed or 0.0


def test_a_version_that_fails_its_warm_up_is_refused(tmp_path, loop_thread):
    torch.manual_seed(32)
    failing = FailsOnLargeBatches(NUM_DENSE, contract_spec().output_dim)
    broken, _ = _export(tmp_path / "v2", seed=32, dense_arch=failing)
    why, failed = _refused_beside_the_good_one(tmp_path, loop_thread, broken)
    assert "this dense part serves batches of at most 8 examples" in why and failed == 1


@pytest.mark.parametrize("answer", ["one_column_short", "nan_embeddings"])
def test_a_version_whose_warm_lookup_answers_wrong_is_refused(tmp_path, loop_thread, monkeypatch, answer):
    second, _ = _export(tmp_path / "v2", seed=33)
    real = repository_module.run_lookup

    def wrong(runtime: Any, *args: Any) -> torch.Tensor:
        out = real(runtime, *args)
        if runtime.path.name != "2":  # version 1 answers right
            return out
        if answer == "one_column_short":
            return out[:, :-1]
        return out.index_fill(1, torch.tensor([0]), float("nan"))

    monkeypatch.setattr(repository_module, "run_lookup", wrong)
    why, failed = _refused_beside_the_good_one(tmp_path, loop_thread, second)
    assert f"model '{MODEL}' version 2: its warm-up lookup answered" in why and failed == 1
    assert ("non-finite embeddings" in why) == (answer == "nan_embeddings"), why
    assert "re-export the version" in why


# ------------------------------------------------------------------------------------------ through either server
def _version_answers(address: str, spec: Any, seed: int) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(batch, dense, embeddings, scores) of the newest version, over embserve.v1 naming the model."""
    from server.client import EmbserveClient
    from tests.server.support import CALL_TIMEOUT

    batch = random_batch(spec, 6, max_len=5, weighted=True, seed=seed)
    dense = torch.randn(6, NUM_DENSE, generator=torch.Generator().manual_seed(seed))
    with EmbserveClient(address, timeout=CALL_TIMEOUT, model=MODEL) as v1:
        return batch, dense, v1.lookup(batch), v1.predict(batch, dense)


def _index_rows(address: str) -> list[tuple[str, str, str, str]]:
    from tests.server.oip_support import client

    with client("grpc", address) as c:
        rows = c.get_model_repository_index(as_json=True).get("models", [])
    return sorted((r["name"], r.get("version", ""), r.get("state", ""), r.get("reason", "")) for r in rows)


def _until(done: Any, what: str) -> None:
    import time

    deadline = time.monotonic() + 60
    while not done():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.05)


def _land(source: Path, root: Path, version: str) -> None:
    """A version renamed in whole: the poller never sees half a folder."""
    staging = root / ".staging" / version
    shutil.copytree(source, staging)
    staging.rename(root / MODEL / version)


@pytest.mark.parametrize("shards", [1, 2], ids=["unsharded", "2_cpu_shards"])
def test_a_retrained_version_polled_in_answers_as_the_reference_on_either_server(
    tmp_path, server_kind, start_any, shards
):
    first, first_reference = _export(tmp_path / "v1", seed=21, shards=shards)
    second, second_reference = _export(tmp_path / "v2", seed=22, shards=shards)
    root = tmp_path / "repo"
    _stage(first, root, "1")
    served = start_any(root, poll_s=0.1)
    spec = contract_spec()
    before = _version_answers(served.address, spec, seed=1)
    _land(second, root, "2")
    _until(lambda: [r[:3] for r in _index_rows(served.address)] == [(MODEL, "2", "READY")], "version 2 alone")
    after = _version_answers(served.address, spec, seed=2)
    for (batch, dense, embeddings, scores), reference in ((before, first_reference), (after, second_reference)):
        assert_matches(embeddings, reference.pooled(batch))
        assert_matches(scores, reference.scores(batch, dense))


def test_a_version_that_fails_its_warm_up_is_refused_on_either_server(tmp_path, server_kind, start_any):
    good, reference = _export(tmp_path / "v1", seed=31)
    torch.manual_seed(32)
    broken, _ = _export(tmp_path / "v2", seed=32, dense_arch=FailsOnLargeBatches(NUM_DENSE, contract_spec().output_dim))
    root = tmp_path / "repo"
    _stage(good, root, "1")
    served = start_any(root, poll_s=0.1)
    _land(broken, root, "2")
    _until(lambda: (MODEL, "2", "UNAVAILABLE") in [r[:3] for r in _index_rows(served.address)], "version 2 refused")
    rows = {r[:2]: r for r in _index_rows(served.address)}
    assert rows[(MODEL, "1")][2] == "READY"
    assert "this dense part serves batches of at most 8 examples" in rows[(MODEL, "2")][3]
    assert served.metric("embserve_requests_total", {"method": "model load", "code": "FAILED"}) == 1
    batch, dense, embeddings, scores = _version_answers(served.address, contract_spec(), seed=3)
    assert_matches(embeddings, reference.pooled(batch))
    assert_matches(scores, reference.scores(batch, dense))
