"""A model repository behind the server: versions, policies, load/unload on demand, broken versions, memory check,
and the hot swap of mapped versions (a call in flight ends on the old version, whose weight files are then unmapped,
read from /proc/<pid>/maps).

One suite, two servers: the tests that take ``server_kind`` run against ``embserve serve`` and embserve-server,
over gRPC and REST. Real servers on 127.0.0.1 port 0,
talked to with tritonclient; expected values come from runtimes loaded in-process from the same version folders.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from tritonclient.utils import InferenceServerException

from infer.artifact.export import export
from infer.artifact.load import load
from infer.artifact.manifest import Manifest
from infer.artifact.runtime import Runtime
from infer.errors import ConfigError
from infer.quant.quantize import quantize
from infer.weights import random_weights
from server import repository as repository_module
from server.client import EmbserveClient
from server.metrics import ServerMetrics
from server.repository import BatchSettings, Repository, VersionPolicy
from tests.conftest import TinyOverArch, random_batch
from tests.server.oip_support import client, requested, triton_inputs
from tests.server.support import CALL_TIMEOUT, NUM_DENSE, GatedModule

MODEL = "ctr"


def start_repository(start_any: Any, server_kind: str, root: Path, **config: Any) -> Any:
    """A server of ``server_kind`` on the repository ``root``, with gRPC and REST."""
    config.setdefault("http_port", 0)
    return start_any(root, **config)


def transports(served: Any) -> list[tuple[str, str]]:
    """(protocol, address) of each OIP transport ``served`` speaks: gRPC and REST."""
    return [("grpc", served.address), ("http", f"127.0.0.1:{served.running.http_port}")]


def wait_until(done: Callable[[], bool], what: str, timeout: float = 4 * CALL_TIMEOUT) -> None:
    """Wait for something the server does in the background (a poll, a release): a bound, not a measure."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.05)


def freed(served: Any) -> None:
    """Wait until the versions the server retired are freed (the Python server says when; the binary frees a
    version when its last call returns, which a test checks in /proc/<pid>/maps)."""
    if served.kind == "python":
        served.loop.run(served.running.oip.repository.retired())


def break_artifact(source: Path, target: Path) -> Path:
    """A copy of ``source`` whose model file no longer matches its manifest's checksum."""
    shutil.copytree(source, target)
    model = target / "model.pt"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0xFF
    model.write_bytes(bytes(data))
    return target


@pytest.fixture(scope="module")
def versions(tmp_path_factory, spec) -> dict[str, Path]:
    """Two good versions of one dense model (different weights) and a broken copy of the second."""
    store = tmp_path_factory.mktemp("versions")
    dense_spec = spec.with_dense_arch(TinyOverArch(NUM_DENSE, spec.output_dim), NUM_DENSE)
    found = {}
    for version, seed in (("1", 11), ("2", 12)):
        torch.manual_seed(seed)
        model = quantize(dense_spec, random_weights(dense_spec, seed=seed))
        found[version] = export(model, store / f"v{version}")
    found["broken"] = break_artifact(found["2"], store / "broken")
    return found


@pytest.fixture(scope="module")
def runtimes(versions) -> dict[str, Runtime]:
    return {v: load(versions[v]) for v in ("1", "2")}


def make_repository(root: Path, layout: dict[str, dict[str, Path]]) -> Path:
    for model, model_versions in layout.items():
        for version, source in model_versions.items():
            shutil.copytree(source, root / model / version)
    return root


def _embeddings(c: Any, protocol: str, batch: Any, version: str = "") -> tuple[torch.Tensor, str]:
    result = c.infer(
        MODEL, triton_inputs(protocol, batch), model_version=version, outputs=requested(protocol, "embeddings")
    )
    response = result.get_response(as_json=True) if protocol == "grpc" else result.get_response()
    return torch.from_numpy(np.array(result.as_numpy("embeddings"))), response["model_version"]


def test_a_new_version_is_loaded_on_demand_and_replaces_the_old(
    tmp_path, server_kind, start_any, versions, runtimes, spec
):
    root = make_repository(tmp_path / "repo", {MODEL: {"1": versions["1"]}})
    served = start_repository(start_any, server_kind, root)
    batch = random_batch(spec, batch_size=8, seed=40)
    with client("grpc", served.address) as c:
        assert c.get_model_metadata(MODEL, as_json=True)["versions"] == ["1"]
        got, version = _embeddings(c, "grpc", batch)
        assert version == "1" and torch.equal(got, runtimes["1"].lookup(batch))

        shutil.copytree(versions["2"], root / MODEL / "2")
        c.load_model(MODEL)
        assert c.get_model_metadata(MODEL, as_json=True)["versions"] == ["2"]  # policy latest:1
        got, version = _embeddings(c, "grpc", batch)
        assert version == "2" and torch.equal(got, runtimes["2"].lookup(batch))
        with pytest.raises(InferenceServerException) as caught:
            _embeddings(c, "grpc", batch, version="1")
        assert "StatusCode.NOT_FOUND" in str(caught.value.status())
    # embserve.v1 follows the repository's newest version too
    with EmbserveClient(served.address, timeout=CALL_TIMEOUT) as v1:
        assert torch.equal(v1.lookup(batch), runtimes["2"].lookup(batch))
    for protocol, address in transports(served)[1:]:
        with client(protocol, address) as c:
            got, version = _embeddings(c, protocol, batch)
            assert version == "2" and torch.equal(got, runtimes["2"].lookup(batch))
    freed(served)  # the old version's batchers are gone


def test_an_explicit_version_list_serves_each_version(tmp_path, server_kind, start_any, versions, runtimes, spec):
    root = make_repository(tmp_path / "repo", {MODEL: {"1": versions["1"], "2": versions["2"]}})
    served = start_any(root, version_policy="versions:1,2")
    batch = random_batch(spec, batch_size=5, seed=41)
    with client("grpc", served.address) as c:
        assert c.get_model_metadata(MODEL, as_json=True)["versions"] == ["1", "2"]
        for version in ("1", "2"):
            got, answered = _embeddings(c, "grpc", batch, version=version)
            assert answered == version and torch.equal(got, runtimes[version].lookup(batch))
        got, answered = _embeddings(c, "grpc", batch)
        assert answered == "2"  # no version asked: the newest


def test_embserve_v1_calls_name_a_model_and_version(tmp_path, server_kind, start_any, versions, runtimes, spec):
    root = make_repository(
        tmp_path / "repo", {MODEL: {"1": versions["1"], "2": versions["2"]}, "zzz": {"1": versions["1"]}}
    )
    served = start_any(root, version_policy="versions:1,2")
    batch = random_batch(spec, batch_size=4, weighted=True, seed=45)
    dense = torch.randn(4, NUM_DENSE, generator=torch.Generator().manual_seed(4))
    for version in ("1", "2"):
        with EmbserveClient(served.address, timeout=CALL_TIMEOUT, model=MODEL, version=version) as v1:
            assert torch.equal(v1.lookup(batch), runtimes[version].lookup(batch))
            assert torch.equal(v1.predict(batch, dense), runtimes[version].predict(batch, dense))
            assert v1.metadata().model_version == runtimes[version].manifest.file("model.pt").sha256[:16]
    with EmbserveClient(served.address, timeout=CALL_TIMEOUT, model="zzz") as v1:
        assert torch.equal(v1.lookup(batch), runtimes["1"].lookup(batch))
    with EmbserveClient(served.address, timeout=CALL_TIMEOUT) as v1:  # the default: first model, newest version
        assert torch.equal(v1.lookup(batch), runtimes["2"].lookup(batch))
    with EmbserveClient(served.address, timeout=CALL_TIMEOUT, model="nobody") as v1:
        with pytest.raises(grpc.RpcError) as caught:
            v1.lookup(batch)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND and "unknown model 'nobody'" in caught.value.details()


def test_a_broken_version_never_replaces_a_good_one(tmp_path, server_kind, start_any, versions, runtimes, spec):
    root = make_repository(tmp_path / "repo", {MODEL: {"1": versions["1"]}})
    served = start_repository(start_any, server_kind, root)
    batch = random_batch(spec, batch_size=6, seed=42)
    shutil.copytree(versions["broken"], root / MODEL / "2")
    for protocol, address in transports(served):
        with client(protocol, address) as c:
            with pytest.raises(InferenceServerException) as caught:
                c.load_model(MODEL)
            message = caught.value.message()
            assert "version 2: ctr/2/model.pt fails its sha256 check" in message and str(tmp_path) not in message
            got, version = _embeddings(c, protocol, batch)
            assert version == "1" and torch.equal(got, runtimes["1"].lookup(batch))
    # tritonclient.grpc parses with Triton's proto, which lacks the spec's `properties`: read them with ours
    from server.proto import open_inference_grpc_pb2 as pb
    from server.proto import open_inference_grpc_pb2_grpc as pb_grpc

    stub = pb_grpc.GRPCInferenceServiceStub(served.channel())
    properties = stub.ModelMetadata(pb.ModelMetadataRequest(name=MODEL), timeout=CALL_TIMEOUT).properties
    failed_versions = json.loads(properties["failed_versions"])
    assert list(failed_versions) == ["2"] and "fails its sha256 check" in failed_versions["2"]
    # REST's metadata says the same: the loaded versions and the failed one with why
    with urllib.request.urlopen(
        f"http://{dict(transports(served))['http']}/v2/models/{MODEL}", timeout=CALL_TIMEOUT
    ) as got:
        rest = json.load(got)
    assert rest["versions"] == ["1"] and rest["properties"]["failed_versions"] == properties["failed_versions"]
    loads = len(transports(served))  # one explicit load of the broken version per transport
    assert served.metric("embserve_requests_total", {"method": "model load", "code": "FAILED"}) == loads


def test_a_repository_whose_newest_version_is_broken_starts_on_the_one_before(
    tmp_path, server_kind, start_any, versions, runtimes, spec
):
    root = make_repository(tmp_path / "repo", {MODEL: {"1": versions["1"], "2": versions["broken"]}})
    served = start_any(root)
    batch = random_batch(spec, batch_size=3, seed=43)
    with client("grpc", served.address) as c:
        got, version = _embeddings(c, "grpc", batch)
    assert version == "1" and torch.equal(got, runtimes["1"].lookup(batch))


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_models_unload_and_load_on_demand(tmp_path, server_kind, start_any, versions, spec, protocol):
    root = make_repository(tmp_path / "repo", {MODEL: {"1": versions["1"]}, "other": {"1": versions["2"]}})
    served = start_repository(start_any, server_kind, root)
    not_found = "404" if protocol == "http" else "StatusCode.NOT_FOUND"
    with client(protocol, dict(transports(served))[protocol]) as c:
        assert c.is_model_ready("other")
        c.unload_model("other")
        assert not c.is_model_ready("other")
        with pytest.raises(InferenceServerException) as caught:
            c.infer("other", triton_inputs(protocol, random_batch(spec, batch_size=2, seed=44)))
        assert caught.value.status() == not_found
        c.load_model("other")
        assert c.is_model_ready("other")
        with pytest.raises(InferenceServerException) as caught:
            c.load_model("no_such_model")
        assert caught.value.status() == not_found
        (root / "empty").mkdir()
        with pytest.raises(InferenceServerException) as caught:
            c.load_model("empty")
        assert "model 'empty' has no version" in caught.value.message()


def _index(c: Any, protocol: str) -> list[tuple[str, str, str, str]]:
    """The repository index as tritonclient returns it, as sorted (name, version, state, reason) rows."""
    if protocol == "grpc":
        rows = c.get_model_repository_index(as_json=True).get("models", [])
    else:
        rows = c.get_model_repository_index()  # tritonclient.http sends no body: every model
    return sorted((r["name"], r.get("version", ""), r.get("state", ""), r.get("reason", "")) for r in rows)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_the_repository_index_lists_every_model_version_and_its_state(
    tmp_path, server_kind, start_any, versions, runtimes, spec, protocol
):
    """Triton's get_model_repository_index: loaded versions READY, a broken version and an unloaded model
    UNAVAILABLE with the reason; a load of a served model succeeds and changes nothing."""
    layout = {MODEL: {"1": versions["1"], "2": versions["broken"]}, "other": {"1": versions["2"]}}
    root = make_repository(tmp_path / "repo", layout)
    (root / "empty").mkdir()
    served = start_repository(start_any, server_kind, root)
    address = dict(transports(served))[protocol]
    with client(protocol, address) as c:
        rows = _index(c, protocol)
        assert [r[:3] for r in rows] == [
            (MODEL, "1", "READY"),
            (MODEL, "2", "UNAVAILABLE"),  # broken: the server fell back to version 1
            ("empty", "", "UNAVAILABLE"),
            ("other", "1", "READY"),
        ]
        assert "ctr/2/model.pt fails its sha256 check" in rows[1][3] and str(tmp_path) not in rows[1][3]
        assert rows[0][3] == rows[3][3] == "" and "not loaded" in rows[2][3]

        c.load_model("other")  # already served: a reload with nothing new is a no-op that succeeds
        batch = random_batch(spec, batch_size=3, seed=46)
        result = c.infer("other", triton_inputs(protocol, batch), outputs=requested(protocol, "embeddings"))
        assert torch.equal(torch.from_numpy(np.array(result.as_numpy("embeddings"))), runtimes["2"].lookup(batch))

        c.unload_model("other")
        rows = _index(c, protocol)
        assert ("other", "", "UNAVAILABLE") in [r[:3] for r in rows]
        assert [r[:3] for r in rows if r[2] == "READY"] == [(MODEL, "1", "READY")]
    if protocol == "grpc":
        import tritonclient.grpc as triton_grpc

        with triton_grpc.InferenceServerClient(served.address) as c:
            request = triton_grpc.service_pb2.RepositoryIndexRequest(ready=True)
            only_ready = c._client_stub.RepositoryIndex(request, timeout=CALL_TIMEOUT)
        assert [(m.name, m.version, m.state) for m in only_ready.models] == [(MODEL, "1", "READY")]
    else:
        request = urllib.request.Request(f"http://{address}/v2/repository/index", data=b'{"ready": true}')
        with urllib.request.urlopen(request, timeout=CALL_TIMEOUT) as response:
            assert json.loads(response.read()) == [{"name": MODEL, "version": "1", "state": "READY", "reason": ""}]


def test_unloading_embserve_v1s_model_moves_v1_to_the_next_model(
    tmp_path, server_kind, start_any, versions, runtimes, spec
):
    """The default model of embserve.v1 (the first by name) may be unloaded: v1 then serves the next model;
    the last model cannot be unloaded (FAILED_PRECONDITION, saying why)."""
    root = make_repository(tmp_path / "repo", {MODEL: {"1": versions["1"]}, "other": {"1": versions["2"]}})
    served = start_any(root)
    batch = random_batch(spec, batch_size=4, seed=47)
    with EmbserveClient(served.address, timeout=CALL_TIMEOUT) as v1:
        assert torch.equal(v1.lookup(batch), runtimes["1"].lookup(batch))  # MODEL sorts first
        with client("grpc", served.address) as c:
            c.unload_model(MODEL)
            assert torch.equal(v1.lookup(batch), runtimes["2"].lookup(batch))  # now "other"
            with pytest.raises(InferenceServerException) as caught:
                c.unload_model("other")
            assert "StatusCode.FAILED_PRECONDITION" in str(caught.value.status())
            assert "only model" in caught.value.message()
            c.load_model(MODEL)
            assert c.is_model_ready(MODEL)
        assert torch.equal(v1.lookup(batch), runtimes["2"].lookup(batch))  # v1 stays where it moved
    freed(served)


def test_the_index_of_one_artifact_and_a_load_of_it(server_kind, start_any, dense_artifact, dense_runtime, spec):
    served = start_repository(start_any, server_kind, dense_artifact)
    batch = random_batch(spec, batch_size=2, seed=48)
    for protocol, address in transports(served):
        with client(protocol, address) as c:
            assert _index(c, protocol) == [("dense", "1", "READY", "")]
            c.load_model("dense")  # Triton: a load of a loaded model reloads it; one artifact: a no-op
            result = c.infer("dense", triton_inputs(protocol, batch), outputs=requested(protocol, "embeddings"))
            got = torch.from_numpy(np.array(result.as_numpy("embeddings")))
            assert torch.equal(got, dense_runtime.lookup(batch))
            with pytest.raises(InferenceServerException) as caught:
                c.unload_model("dense")
            assert "serves one artifact" in caught.value.message()


def test_memory_for_a_new_version_is_checked_before_loading(tmp_path, loop_thread, versions, monkeypatch):
    root = make_repository(tmp_path / "repo", {MODEL: {"1": versions["1"]}})
    monkeypatch.setattr(repository_module, "available_memory_bytes", lambda: 1024)
    settings = BatchSettings(max_batch_size=64, max_delay_s=0.0005, max_queue=16, workers=1)

    async def open_it() -> None:
        repo = Repository(root, settings, ServerMetrics())
        try:
            await repo.load_all()
        finally:
            await repo.close()

    with pytest.raises(ConfigError) as caught:
        loop_thread.run(open_it())
    assert f"model '{MODEL}' version 1 needs about" in str(caught.value)
    assert "free memory, unload a version or narrow the version policy" in str(caught.value)


def test_serve_names_a_missing_manifest_and_where_it_looked(tmp_path, sparse_artifact, capsys):
    """`embserve serve DIR` of an artifact whose manifest.json is gone, of a repository whose version lost it, and
    of an empty folder: each says which manifest.json is missing and where it was looked for (issue 39 item 6)."""
    from infer.cli import main

    artifact = tmp_path / "art"
    shutil.copytree(sparse_artifact, artifact)
    (artifact / "manifest.json").unlink()
    repo = tmp_path / "repo"
    shutil.copytree(artifact, repo / "m" / "1")
    (tmp_path / "empty").mkdir()
    expected = {
        artifact: [f"{artifact / 'manifest.json'} is missing: {artifact} holds an artifact's files (", "re-export"],
        repo: [
            f"model repository {repo} has no loadable model: looked for "
            f"{repo / '<model>' / '<version>' / 'manifest.json'} (model folders: ['m'])",
            f"{repo / 'm' / '1' / 'manifest.json'} is missing",
        ],
        tmp_path / "empty": ["(model folders: none) and found no version folder", "manifest.json is missing too"],
    }
    for folder, fragments in expected.items():
        assert main(["serve", str(folder), "--python", "--host", "127.0.0.1", "--port", "0"]) == 2
        message = capsys.readouterr().err
        assert all(fragment in message for fragment in fragments), message


def test_version_policies_parse_and_select():
    assert VersionPolicy.parse("latest:2").select([1, 3, 2]) == [2, 3]
    assert VersionPolicy.parse("versions:1,3").select([1, 2, 3, 4]) == [1, 3]
    with pytest.raises(ConfigError):
        VersionPolicy.parse("newest")
    with pytest.raises(ConfigError):
        VersionPolicy(latest=0)


def test_the_memory_a_version_needs_leaves_out_its_mapped_weight_files(tmp_path, spec):
    """Mapped weight files live in the page cache (shared, evictable), so the free-memory check before a load
    counts every other file; an embedded artifact's model.pt holds the tables and counts whole."""
    model = quantize(spec, random_weights(spec, seed=5))
    mapped = export(model, tmp_path / "mapped", weights="mapped")
    embedded = export(model, tmp_path / "embedded", weights="embedded")
    weight_files = sorted(p for p in mapped.iterdir() if p.name.startswith("weights-"))
    assert weight_files
    every_file = sum(p.stat().st_size for p in mapped.iterdir())
    assert repository_module.artifact_bytes(mapped) == every_file - sum(p.stat().st_size for p in weight_files)
    assert repository_module.artifact_bytes(embedded) == sum(p.stat().st_size for p in embedded.iterdir())


def mapped_files(folder: Path, pid: int | None = None) -> set[str]:
    """The files under ``folder`` that process ``pid`` (default: this one) maps now."""
    prefix = f"{folder.resolve()}/"
    with open(f"/proc/{pid or os.getpid()}/maps") as handle:
        paths = {line.split(maxsplit=5)[5].strip() for line in handle if len(line.split(maxsplit=5)) == 6}
    return {p for p in paths if p.startswith(prefix)}


def weight_files(folder: Path) -> set[str]:
    manifest = Manifest.read(folder)
    return {str((folder / k.weights.file).resolve()) for k in manifest.kernels if k.weights is not None}


class Gate:
    """Holds the forwards of one version's model (a ``GatedModule``) without holding the model itself, so the
    test keeps no reference that would keep its mapping alive."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def wrap(self, runtime: Runtime) -> Runtime:
        gated = GatedModule(runtime.module)
        gated.gate, gated.entered = self.gate, self.entered
        return Runtime(runtime.path, runtime.manifest, gated)  # type: ignore[arg-type]


def _infer(address: str, batch: Any) -> tuple[torch.Tensor, str]:
    with client("grpc", address) as c:
        return _embeddings(c, "grpc", batch)


def test_a_call_in_flight_ends_on_the_old_version_and_then_its_weight_files_are_unmapped(
    tmp_path, start_server, versions, runtimes, spec, monkeypatch
):
    root = make_repository(tmp_path / "repo", {MODEL: {"1": versions["1"]}})
    old = root / MODEL / "1"
    old_weights = weight_files(old)
    assert old_weights, "the versions must be format 3 artifacts with mapped weight files"
    gate = Gate()

    def load_gating_version_1(folder: Path, verify: str = "full", structures: Any = None) -> Runtime:
        runtime = load(folder, verify=verify, structures=structures)
        return gate.wrap(runtime) if Path(folder).name == "1" else runtime

    monkeypatch.setattr(repository_module, "load", load_gating_version_1)
    served = start_server(root)
    batch = random_batch(spec, batch_size=8, seed=60)
    assert mapped_files(old) == old_weights
    # embserve.v1 calls bind the version too (the default servicer and a per-version view)
    for version in ("", "1"):
        with EmbserveClient(served.address, timeout=CALL_TIMEOUT, model=MODEL, version=version) as v1:
            assert torch.equal(v1.lookup(batch), runtimes["1"].lookup(batch))

    gate.gate.clear()
    gate.entered.clear()
    in_flight: Future[tuple[torch.Tensor, str]] = Future()
    caller = threading.Thread(target=lambda: in_flight.set_result(_infer(served.address, batch)), daemon=True)
    caller.start()
    assert gate.entered.wait(CALL_TIMEOUT), "the call never reached version 1's model"

    shutil.copytree(versions["2"], root / MODEL / "2")
    with client("grpc", served.address) as c:
        c.load_model(MODEL)  # returns once version 2 serves (policy latest:1 retires version 1)
        assert c.get_model_metadata(MODEL, as_json=True)["versions"] == ["2"]
    got, version = _infer(served.address, batch)
    assert version == "2" and torch.equal(got, runtimes["2"].lookup(batch))
    assert mapped_files(old) == old_weights  # the call on version 1 still holds it
    assert not in_flight.done()

    gate.gate.set()
    got, version = in_flight.result(CALL_TIMEOUT)
    assert version == "1" and torch.equal(got, runtimes["1"].lookup(batch))
    served.loop.run(served.running.oip.repository.retired())
    assert mapped_files(old) == set()
    assert mapped_files(root / MODEL / "2") == weight_files(root / MODEL / "2")
    with EmbserveClient(served.address, timeout=CALL_TIMEOUT, model=MODEL) as v1:
        assert torch.equal(v1.lookup(batch), runtimes["2"].lookup(batch))


def test_a_swap_under_calls_answers_each_call_from_its_version_then_unmaps_the_old(
    tmp_path, server_kind, start_any, versions, runtimes, spec
):
    """Callers keep calling while version 2 is loaded beside version 1 and swapped in: no call fails, each answer
    equals the runtime of the version it names, and once the calls on version 1 are done its weight files leave
    the server's /proc/<pid>/maps while version 2's are mapped."""
    root = make_repository(tmp_path / "repo", {MODEL: {"1": versions["1"]}})
    old, new = root / MODEL / "1", root / MODEL / "2"
    served = start_any(root)
    assert mapped_files(old, served.pid) == weight_files(old)
    batches = [random_batch(spec, batch_size=8, seed=80 + i) for i in range(4)]
    stop = threading.Event()
    answers: list[tuple[int, torch.Tensor, str]] = []
    failures: list[str] = []

    def call_until_stopped(index: int) -> None:
        with client("grpc", served.address) as c:
            while not stop.is_set():
                try:
                    answers.append((index, *_embeddings(c, "grpc", batches[index])))
                except Exception as err:  # noqa: BLE001 - every failure is collected and reported
                    failures.append(f"{type(err).__name__}: {err}")

    callers = [threading.Thread(target=call_until_stopped, args=(i,), daemon=True) for i in range(len(batches))]
    for caller in callers:
        caller.start()
    try:
        wait_until(lambda: len(answers) >= 8, "calls on version 1")
        shutil.copytree(versions["2"], new)
        with client("grpc", served.address) as c:
            c.load_model(MODEL)  # returns once version 2 serves (policy latest:1 retires version 1)
        # each caller may have had one call on version 1 in flight when the load returned (its answer appended
        # after the others' next ones, under load): after that call, its answers are all version 2's
        before = Counter(index for index, _, _ in list(answers))
        wait_until(lambda: len(answers) >= sum(before.values()) + len(callers) + 8, "calls on version 2")
    finally:
        stop.set()
        for caller in callers:
            caller.join(CALL_TIMEOUT)
    assert failures == []
    assert {version for _, _, version in answers} == {"1", "2"}
    assert all(torch.equal(got, runtimes[version].lookup(batches[i])) for i, got, version in answers)
    for index in range(len(callers)):
        versions = [version for i, _, version in answers if i == index]
        assert all(version == "2" for version in versions[before[index] + 1 :]), (index, before[index], versions)
    freed(served)
    wait_until(lambda: mapped_files(old, served.pid) == set(), "version 1's weight files unmapped")
    assert mapped_files(new, served.pid) == weight_files(new)


def corrupt_weight_file(source: Path, target: Path) -> Path:
    """A copy of ``source`` one of whose mapped weight files no longer matches its manifest's checksum."""
    shutil.copytree(source, target)
    name = sorted(weight_files(target))[0]
    data = bytearray(Path(name).read_bytes())
    data[len(data) // 3] ^= 0xFF
    Path(name).write_bytes(bytes(data))
    return target


def test_a_version_whose_weight_file_fails_its_checksum_leaves_the_old_one_serving(
    tmp_path, server_kind, start_any, versions, runtimes, spec, caplog
):
    """The poller finds version 2, whose weight file fails its checksum: it is refused (logged and in the index with
    its error's kind and file), version 1 keeps serving, and nothing of version 2 stays mapped."""
    root = make_repository(tmp_path / "repo", {MODEL: {"1": versions["1"]}})
    served = start_any(root, poll_s=0.1)
    batch = random_batch(spec, batch_size=5, seed=61)
    broken = corrupt_weight_file(versions["2"], tmp_path / "broken")
    broken_file = f"{MODEL}/2/{Path(sorted(weight_files(broken))[0]).name}"

    def refused() -> bool:
        with client("grpc", served.address) as c:
            return (MODEL, "2", "UNAVAILABLE") in [row[:3] for row in _index(c, "grpc")]

    with caplog.at_level(logging.ERROR, logger=repository_module.__name__):
        os.rename(broken, root / MODEL / "2")  # whole: the poller never sees half a folder
        wait_until(refused, "version 2 refused")
    if served.kind == "python":
        logged = [r.getMessage() for r in caplog.records if r.name == repository_module.__name__]
    else:
        logged = served.log().splitlines()
    assert any("ArtifactError(kind=checksum)" in line and broken_file in line for line in logged), logged
    got, version = _infer(served.address, batch)
    assert version == "1" and torch.equal(got, runtimes["1"].lookup(batch))
    with client("grpc", served.address) as c:
        index = {(row[0], row[1]): row for row in _index(c, "grpc")}
    assert index[(MODEL, "1")][2] == "READY"
    assert "ArtifactError(kind=checksum)" in index[(MODEL, "2")][3]
    assert broken_file in index[(MODEL, "2")][3]
    assert mapped_files(root / MODEL / "2", served.pid) == set()  # nothing of the failed version stays mapped


class UncheckedOnly:
    """A version's model whose checked entries fail: only the unchecked ones (the server validated already) run."""

    def __init__(self, module: Any) -> None:
        self.module = module

    def _checked(self, *args: Any) -> Any:
        raise AssertionError("a repository version ran the model's checked entry after the server's validation")

    __call__ = predict = lookup_and_predict = _checked

    def lookup_unchecked(self, *args: Any) -> torch.Tensor:
        return self.module.lookup_unchecked(*args)

    def lookup_and_predict_unchecked(self, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.module.lookup_and_predict_unchecked(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.module, name)


def test_repository_versions_run_the_unchecked_entries_after_the_servers_one_validation(
    tmp_path, server_kind, start_any, spec, monkeypatch
):
    """Good calls to a repository model equal the fp32 reference through the model's unchecked entries alone (the
    Python server's checked entries fail here; embserve-server runs only the unchecked ones); a bad one is
    INVALID_ARGUMENT naming the feature (the server's validation, per version's spec)."""
    from infer.features import SparseFeatures
    from tests.support.call_contract import Reference, assert_matches

    dense_spec = spec.with_dense_arch(TinyOverArch(NUM_DENSE, spec.output_dim), NUM_DENSE)
    torch.manual_seed(31)
    quantized = quantize(dense_spec, random_weights(dense_spec, seed=31))
    root = tmp_path / "repo"
    export(quantized, root / MODEL / "1")
    reference = Reference(dense_spec, quantized)

    def load_unchecked_only(folder: Path, verify: str = "full", structures: Any = None) -> Runtime:
        runtime = load(folder, verify=verify, structures=structures)
        return Runtime(runtime.path, runtime.manifest, UncheckedOnly(runtime.module))  # type: ignore[arg-type]

    monkeypatch.setattr(repository_module, "load", load_unchecked_only)
    served = start_any(root)
    batch = random_batch(spec, batch_size=6, seed=70)
    dense = torch.randn(6, NUM_DENSE, generator=torch.Generator().manual_seed(71))
    with torch.no_grad():
        expected_scores = dense_spec.dense_arch(dense, reference.pooled(batch))
    bad = SparseFeatures(spec.feature_names, torch.tensor([0, 0, 0, 999_999, 0, 0]), torch.ones(6, dtype=torch.int32))
    for protocol in ("v1", "oip"):
        with EmbserveClient(served.address, timeout=CALL_TIMEOUT, protocol=protocol, model=MODEL) as c:
            assert_matches(c.lookup(batch), reference.pooled(batch))
            assert_matches(c.predict(batch, dense), expected_scores)
            with pytest.raises(grpc.RpcError) as caught:
                c.lookup(bad)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
            assert "f_int2" in caught.value.details() and "999999" in caught.value.details(), caught.value.details()
