"""embserve-server beside the Python server: the same metadata and configuration byte for byte, which server
``embserve serve`` runs (the binary by default, the Python server for what only it serves), the command line's
refusals of what the binary lacks, a port in use refused, and the batcher merging concurrent calls.

The protocol, contract, bad-request, auth and drain tests run against both servers in their own files
(``tests/server/native_support.py``); this file holds what only the native server has to show.
"""

from __future__ import annotations

import dataclasses
import shutil
import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from google.protobuf import json_format

from infer.artifact.manifest import Manifest
from infer.cli import build_parser
from infer.errors import ConfigError
from server import native
from server.adapters.v1 import codec
from server.native import native_command, runs_native
from server.proto import inference_pb2 as pb
from server.proto import open_inference_grpc_pb2 as oip_pb
from server.proto import open_inference_grpc_pb2_grpc as oip_grpc
from tests.conftest import random_batch
from tests.server.native_support import NativeServed, native_binary, start_kind
from tests.server.support import CALL_TIMEOUT, lookup_request

MODEL = "dense"


@pytest.fixture(scope="module")
def both(loop_thread, dense_artifact):
    """The dense model on the Python server and on embserve-server, same settings."""
    servers = [start_kind(kind, loop_thread, dense_artifact, max_delay_us=700) for kind in ("python", "native")]
    yield servers
    for served in servers:
        served.close_channels()
        served.stop(grace=1.0)


def _as_dict(message) -> dict:
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def test_metadata_and_configuration_equal_the_python_servers(both):
    python, native = both
    answers = []
    for served in (python, native):
        v1 = served.stub().GetModelMetadata(pb.GetModelMetadataRequest(), timeout=CALL_TIMEOUT)
        oip = oip_grpc.GRPCInferenceServiceStub(served.channel())
        metadata = oip.ModelMetadata(oip_pb.ModelMetadataRequest(name=MODEL), timeout=CALL_TIMEOUT)
        config = oip.ModelConfig(oip_pb.ModelConfigRequest(name=MODEL), timeout=CALL_TIMEOUT)
        answers.append((_as_dict(v1), _as_dict(metadata), _as_dict(config)))
    assert answers[0] == answers[1]


def test_concurrent_calls_are_merged_and_each_gets_its_own_rows(both, dense_runtime, spec):
    """16 callers at once: every answer equals the in-process lookup of its own batch, and the batcher merged
    calls (embserve_batch_requests counts more than one request in some forward)."""
    _, native = both
    batches = [random_batch(spec, batch_size=1 + i % 5, weighted=i % 2 == 0, seed=500 + i) for i in range(64)]
    stubs = [native.stub() for _ in range(16)]

    def call(index: int) -> bool:
        response = stubs[index % 16].Lookup(lookup_request(batches[index]), timeout=CALL_TIMEOUT)
        return torch.equal(codec.decode_embeddings(response), dense_runtime.lookup(batches[index]))

    with ThreadPoolExecutor(max_workers=16) as pool:
        assert all(pool.map(call, range(64)))
    forwards = native.metric("embserve_batch_requests_count")
    merged_requests = native.metric("embserve_batch_requests_sum")
    assert merged_requests >= 64 and forwards >= 1


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--workers", "2"], "embserve-server has no --workers"),
        (["--profile"], "embserve-server has no --profile"),
        (["--backend", "onnxruntime"], "embserve-server runs --backend torchscript or pt2, not onnxruntime"),
    ],
)
def test_serve_native_refuses_what_the_binary_lacks_naming_it(dense_artifact, flags, fragment):
    native_binary()
    args = build_parser().parse_args(["serve", str(dense_artifact), "--native", *flags])
    with pytest.raises(ConfigError) as refused:
        native_command(args)
    assert fragment in str(refused.value)


def _serve_args(*argv: str):  # type: ignore[no-untyped-def]
    return build_parser().parse_args(["serve", *argv])


def test_serve_runs_the_native_binary_by_default_and_the_python_server_when_asked(dense_artifact, capsys):
    native_binary()
    assert runs_native(_serve_args(str(dense_artifact), "--http-port", "0", "--backend", "pt2", "--poll-s", "1"))
    assert runs_native(_serve_args(str(dense_artifact), "--native"))
    assert not runs_native(_serve_args(str(dense_artifact), "--python", "--workers", "2"))
    assert capsys.readouterr().err == ""  # no word when the binary runs or the server is named
    with pytest.raises(SystemExit):  # one server or the other
        _serve_args(str(dense_artifact), "--python", "--native")
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--workers", "2"], "--workers"),
        (["--profile"], "--profile"),
        (["--backend", "onnxruntime"], "--backend onnxruntime"),
        (["--collective-timeout-s", "5"], "--collective-timeout-s"),
    ],
)
def test_serve_runs_the_python_server_for_what_only_it_serves_saying_why(dense_artifact, flags, named, capsys):
    native_binary()
    assert not runs_native(_serve_args(str(dense_artifact), *flags))
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        f"embserve serve: the Python server runs: embserve-server does not take {named} (--python says so and "
        "drops this line)"
    ]


def test_serve_runs_hot_rows_natively_on_one_cpu_kernel_and_on_python_for_a_sharded_artifact(
    dense_artifact, tmp_path, capsys
):
    """The native server caches hot rows and reads ahead for an artifact of one CPU kernel; a sharded one (several
    kernels, as its manifest lists them) runs on the Python server, which says why."""
    native_binary()
    flags = ("--hot-rows", "5", "--hot-rows-sample", "sample.json")
    assert runs_native(_serve_args(str(dense_artifact), *flags))
    assert runs_native(_serve_args(str(dense_artifact), "--prefetch", "on"))
    assert capsys.readouterr().err == ""
    manifest = Manifest.read(dense_artifact)
    assert len(manifest.kernels) == 1
    sharded = dataclasses.replace(manifest, kernels=(manifest.kernels[0], manifest.kernels[0]))
    (tmp_path / "manifest.json").write_text(sharded.to_json())
    for extra in (flags, ("--prefetch", "on")):
        assert not runs_native(_serve_args(str(tmp_path), *extra))
        said = capsys.readouterr().err
        assert "embserve-server does not take --hot-rows or --prefetch on for a sharded artifact" in said
    assert runs_native(_serve_args(str(tmp_path)))  # nothing cached: the binary serves it


def test_serve_runs_a_multi_host_artifact_on_the_python_server(dense_artifact, tmp_path, capsys):
    native_binary()
    manifest = Manifest.read(dense_artifact)  # the real writer's words for a two-host artifact
    two_hosts = dataclasses.replace(manifest, host_parts=("hosts/0", "hosts/1"), devices_per_host=1)
    (tmp_path / "manifest.json").write_text(two_hosts.to_json())
    assert not runs_native(_serve_args(str(tmp_path)))
    assert "embserve-server does not take multi-host artifacts" in capsys.readouterr().err
    assert runs_native(_serve_args(str(tmp_path / "missing")))  # unreadable: the binary reports it


def test_serve_runs_the_python_server_where_the_binary_is_not_built(dense_artifact, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("EMBSERVE_SERVER_BIN", raising=False)
    monkeypatch.setattr(native, "BUILT", tmp_path / "build" / "embserve-server")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert not runs_native(_serve_args(str(dense_artifact)))
    assert capsys.readouterr().err.splitlines() == [
        "embserve serve: the Python server runs: embserve-server is not built (`make server` builds it; --python "
        "drops this line)"
    ]
    with pytest.raises(ConfigError, match="make server"):  # --native says how to build it
        native_command(_serve_args(str(dense_artifact), "--native"))
    monkeypatch.setenv("EMBSERVE_SERVER_BIN", str(tmp_path / "nothing"))  # a binary named and missing: an error
    with pytest.raises(ConfigError, match="is not an executable file"):
        runs_native(_serve_args(str(dense_artifact)))


def test_serve_native_passes_the_flags_it_shares(dense_artifact):
    binary = native_binary()
    args = build_parser().parse_args(
        ["serve", str(dense_artifact), "--native", "--port", "0", "--max-delay-us", "250", "--verify", "none"]
        + ["--http-port", "0", "--http-host", "127.0.0.1"]
    )
    assert native_command(args) == [
        binary,
        str(dense_artifact),
        "--port",
        "0",
        "--max-delay-us",
        "250",
        "--http-port",
        "0",
        "--http-host",
        "127.0.0.1",
        "--verify",
        "none",
    ]


def test_a_port_in_use_is_refused_before_loading(dense_artifact):
    binary = native_binary()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = subprocess.run(
            [binary, str(dense_artifact), "--host", "127.0.0.1", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 2
    assert f"gRPC port {port} is in use" in result.stderr and "--port" in result.stderr, result.stderr


def test_an_http_port_in_use_is_refused_before_loading(dense_artifact):
    binary = native_binary()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = subprocess.run(
            [binary, str(dense_artifact), "--host", "127.0.0.1", "--port", "0", "--http-port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 2
    assert f"HTTP port {port} is in use" in result.stderr and "--http-port" in result.stderr, result.stderr


def test_a_second_native_server_on_a_serving_port_is_refused(dense_artifact):
    """SO_REUSEPORT is off unless --reuse-port: a second server does not share the first one's port."""
    first = NativeServed(dense_artifact)
    try:
        result = subprocess.run(
            [native_binary(), str(dense_artifact), "--host", "127.0.0.1", "--port", str(first.port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 2 and f"gRPC port {first.port} is in use" in result.stderr, result.stderr
        channel = first.channel()
        assert grpc.channel_ready_future(channel).result(timeout=CALL_TIMEOUT) is None
    finally:
        first.close_channels()
        assert first.stop() == 0


def test_a_repository_with_no_loadable_model_is_refused_naming_where_it_looked(tmp_path, sparse_artifact):
    """As `embserve serve REPO` (test_repository.py's test_serve_names_a_missing_manifest...): which manifest.json is
    missing and where the binary looked, exit code 2."""
    repo = tmp_path / "repo"
    shutil.copytree(sparse_artifact, repo / "m" / "1")
    (repo / "m" / "1" / "manifest.json").unlink()
    (tmp_path / "empty").mkdir()
    expected = {
        repo: [
            f"model repository {repo} has no loadable model: looked for "
            f"{repo / '<model>' / '<version>' / 'manifest.json'} (model folders: ['m'])",
            f"{repo / 'm' / '1' / 'manifest.json'} is missing",
        ],
        tmp_path / "empty": ["(model folders: none) and found no version folder", "manifest.json is missing too"],
    }
    for folder, fragments in expected.items():
        completed = subprocess.run(
            [native_binary(), str(folder), "--host", "127.0.0.1", "--port", "0"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert completed.returncode == 2, completed.stderr
        assert all(fragment in completed.stderr for fragment in fragments), completed.stderr


def test_a_block_artifact_answers_as_the_runtime(tmp_path):
    """Tables held in precision blocks (issue 43) served by embserve-server: every Lookup (weighted or not, empty
    bags, ids hot and cold) equals infer.load(...).lookup of the same batch, bit for bit."""
    from infer.artifact.export import export
    from infer.artifact.load import load
    from infer.config import PoolingType
    from infer.features import SparseFeatures
    from infer.quant.blocks import rank_rows
    from infer.quant.quantize import quantize
    from infer.weights import random_weights
    from tests.modules.test_blocks import any_ids, block_spec, random_request

    spec = block_spec(PoolingType.MEAN)
    orders = {t.name: rank_rows(t.num_embeddings, [3, 3, 7, 1]) for t in spec.tables if t.blocks}
    artifact = export(quantize(spec, random_weights(spec, seed=9), block_orders=orders), tmp_path / "blocks")
    runtime = load(artifact)
    batches = [
        SparseFeatures(runtime.feature_names, *random_request(spec, batch, any_ids, seed, seed % 2 == 1))
        for seed, batch in enumerate([1, 6, 17, 32])
    ]
    served = NativeServed(artifact)
    try:
        stub = served.stub()
        for batch in batches:
            response = stub.Lookup(lookup_request(batch), timeout=CALL_TIMEOUT)
            assert torch.equal(codec.decode_embeddings(response), runtime.lookup(batch))
    finally:
        served.close_channels()
        assert served.stop() == 0


def test_a_sharded_block_artifact_answers_as_the_runtime_on_both_servers(server_kind, start_any, tmp_path):
    """A block table placed table-wise on one of two CPU devices (issue 43), served by the Python server and by
    embserve-server: every Lookup (weighted or not, empty bags) equals infer.load(...).lookup, bit for bit."""
    from infer.artifact.export import export
    from infer.artifact.load import load
    from infer.config import PoolingType
    from infer.features import SparseFeatures
    from infer.shard.builder import shard_model
    from infer.shard.plans import make_plan
    from tests.modules.test_blocks import any_ids, random_request
    from tests.shard.test_block_shards import PLACED, _quantized

    spec, model, _, _ = _quantized(PoolingType.MEAN)
    plan = make_plan(spec, 2, PLACED)
    artifact = export(shard_model(model, plan), tmp_path / "sharded-blocks", plan=plan)
    runtime = load(artifact)
    stub = start_any(artifact).stub()
    for seed, batch in enumerate([1, 7, 16]):
        features = SparseFeatures(runtime.feature_names, *random_request(spec, batch, any_ids, seed, seed % 2 == 1))
        response = stub.Lookup(lookup_request(features), timeout=CALL_TIMEOUT)
        assert torch.equal(codec.decode_embeddings(response), runtime.lookup(features)), server_kind
