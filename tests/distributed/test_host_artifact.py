"""Multi-host artifacts on disk: manifest and schema, what a host verifies and loads, and what refuses."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from infer.artifact.hosts import export_hosts, load_host_part
from infer.artifact.load import load
from infer.artifact.manifest import Manifest
from infer.artifact.schema import validate
from infer.cli import main
from infer.config import ModelSpec, PoolingType, TableConfig
from infer.errors import ArtifactError, ArtifactErrorKind, ConfigError
from infer.planner.types import ShardingType
from infer.shard.hosts import num_hosts
from infer.shard.plans import make_plan
from infer.weights import random_weights
from tests.support.artifacts import copy_artifact, edit_manifest


@pytest.fixture(scope="module")
def two_hosts(host_artifacts):
    return host_artifacts[(2, "column")]


def test_manifest_lists_one_part_per_host(two_hosts):
    data = json.loads((two_hosts / "manifest.json").read_text())
    assert data["hosts"] == {"count": 2, "devices_per_host": 1, "parts": ["hosts/0/model.pt", "hosts/1/model.pt"]}
    assert data["model_file"] == "hosts/0/model.pt" and data["sharding"]["world_size"] == 2
    parts = [f"hosts/{h}/{name}" for h in (0, 1) for name in ("model.pt", "weights-0.bin")]  # mapped: the default
    assert sorted(data["files"]) == [*parts, "plan.json"]
    assert sorted({k["rank"] for k in data["kernels"]}) == [0, 1]
    assert Manifest.from_dict(data).to_dict() == data


def test_whole_load_refused_with_the_torchrun_line(two_hosts):
    with pytest.raises(ArtifactError) as info:
        load(two_hosts)
    assert info.value.kind == ArtifactErrorKind.MODEL
    assert "torchrun --nnodes 2 --nproc-per-node 1" in str(info.value) and "load_host_part" in str(info.value)


def test_a_host_reads_only_the_shared_files_and_its_part(two_hosts, tmp_path):
    """Host 1's part corrupted: host 0 still loads (it never reads it); host 1 is refused with CHECKSUM."""
    artifact = copy_artifact(two_hosts, tmp_path)
    part = artifact / "hosts" / "1" / "model.pt"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    assert load_host_part(artifact, 0).host == 0
    with pytest.raises(ArtifactError) as info:
        load_host_part(artifact, 1)
    assert info.value.kind == ArtifactErrorKind.CHECKSUM and "hosts/1/model.pt" in str(info.value)
    part.unlink()  # a host's copy of the artifact may lack the other hosts' parts
    assert load_host_part(artifact, 0).part_bytes > 0


def test_host_outside_the_artifact_and_one_host_artifacts_are_refused(two_hosts, tmp_path):
    with pytest.raises(ArtifactError, match="outside the artifact's 2 hosts"):
        load_host_part(two_hosts, 2)
    spec = ModelSpec((TableConfig("t", 50, 8, ("f",)),))
    from infer.artifact.export import export
    from infer.quant.quantize import quantize

    one = export(quantize(spec, random_weights(spec)), tmp_path / "one")
    with pytest.raises(ArtifactError, match="one-host artifact"):
        load_host_part(one, 0)
    with pytest.raises(ConfigError, match="one host"):
        export_hosts(quantize(spec, random_weights(spec)), tmp_path / "x", make_plan(spec, 1, {}))


@pytest.mark.parametrize(
    "name, ok",
    [
        ("hosts/0/model.pt", True),
        ("hosts/4095/model.pt", True),
        ("plan.json", True),
        ("hosts/01/model.pt", False),
        ("hosts/x/model.pt", False),
        ("hosts/0/../model.pt", False),
        ("hosts/0/sub/model.pt", False),
        ("hosts//model.pt", False),
        ("host/0/model.pt", False),
        ("../model.pt", False),
        ("/hosts/0/model.pt", False),
    ],
)
def test_schema_file_names_allow_exactly_host_paths(two_hosts, name, ok):
    data = json.loads((two_hosts / "manifest.json").read_text())
    data["files"][name] = {"bytes": 1, "sha256": "0" * 64}
    if ok:
        validate(data, "manifest", "manifest.json")
    else:
        with pytest.raises(ArtifactError) as info:
            validate(data, "manifest", "manifest.json")
        assert info.value.kind == ArtifactErrorKind.MANIFEST


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m["hosts"].update(parts=["hosts/1/model.pt", "hosts/0/model.pt"]), "lies under hosts/0/"),
        (lambda m: m["hosts"].update(count=3), "hosts.count is 3"),
        (lambda m: m["hosts"].update(devices_per_host=2), "need a plan of 4 devices"),
        (lambda m: m["files"].pop("hosts/1/model.pt"), "no checksum for hosts/1/model.pt"),
        (lambda m: m.update(model_file="plan.json"), "host 0's part"),
    ],
)
def test_inconsistent_host_manifests_are_refused(two_hosts, tmp_path, edit, message):
    artifact = copy_artifact(two_hosts, tmp_path)
    edit_manifest(artifact, edit)
    with pytest.raises(ArtifactError, match=message):
        load_host_part(artifact, 0)


def test_cli_export_for_hosts(tmp_path, capsys):
    spec = ModelSpec(
        (
            TableConfig("users", 500, 32, ("user",)),
            TableConfig("items", 300, 16, ("item", "clicked"), PoolingType.MEAN),
            TableConfig("ads", 400, 16, ("ad",)),
        )
    )
    (tmp_path / "spec.json").write_text(spec.to_json())
    torch.save(random_weights(spec), tmp_path / "ckpt.pt")
    args = ["export", "--spec", str(tmp_path / "spec.json"), "--weights", str(tmp_path / "ckpt.pt")]
    assert main([*args, "--out", str(tmp_path / "art"), "--hosts", "2", "--devices-per-host", "2"]) == 0
    assert "2 hosts x 2 devices" in capsys.readouterr().out
    parts = [load_host_part(tmp_path / "art", host) for host in (0, 1)]
    assert num_hosts(parts[0].plan) == 2 and parts[0].plan.topology.local_world_size == 2
    assert main([*args, "--out", str(tmp_path / "bad"), "--hosts", "2", "--world-size", "4"]) == 2
    assert "not both" in capsys.readouterr().err
    # the parts together are the one-process model (no process group needed to check it)
    from infer.features import SparseFeatures
    from infer.quant.quantize import quantize
    from infer.shard.hosts import finish_partial

    batch = SparseFeatures.random(spec, batch_size=6, ids_per_bag=3, seed=1)
    with torch.inference_mode():
        summed = sum(p.module(batch.values, batch.lengths, batch.weights) for p in parts)
        want = quantize(spec, torch.load(tmp_path / "ckpt.pt"))(batch.values, batch.lengths, batch.weights)
    got = finish_partial(spec, copy.copy(summed), batch.lengths)
    assert (got - want).abs().max() <= 1e-6 * float(want.abs().max())


def test_a_host_without_shards_exports_and_contributes_zeros(tmp_path):
    """More hosts than tables: the idle hosts' parts load (no kernels) and their partial outputs are zeros."""
    import dataclasses

    from infer.features import SparseFeatures
    from infer.planner.types import ComputeDevice, Topology
    from infer.quant.quantize import quantize

    spec = ModelSpec((TableConfig("t", 50, 8, ("f",)),))
    model = quantize(spec, random_weights(spec))
    plan = make_plan(spec, 3, {"t": (ShardingType.TABLE_WISE, (1,))})
    plan = dataclasses.replace(plan, topology=Topology(3, ComputeDevice.CPU, local_world_size=1))
    parts = [load_host_part(export_hosts(model, tmp_path / "art", plan), host) for host in range(3)]
    batch = SparseFeatures.random(spec, batch_size=3, ids_per_bag=2, seed=0)
    with torch.inference_mode():
        outputs = [p.module(batch.values, batch.lengths, batch.weights) for p in parts]
        want = model(batch.values, batch.lengths, batch.weights)
    assert not outputs[0].any() and not outputs[2].any()
    assert torch.equal(outputs[0] + outputs[1] + outputs[2], want)


def test_inspect_names_the_hosts_and_serve_outside_torchrun_says_how(two_hosts, capsys, monkeypatch):
    from infer.errors import EmbserveError
    from server.group.leader import GroupConfig
    from server.group.serve import serve_distributed

    assert main(["inspect", str(two_hosts)]) == 0
    assert "2 hosts x 1 devices" in capsys.readouterr().out
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    from server.app import ServerConfig

    with pytest.raises(EmbserveError, match="torchrun --nnodes H --nproc-per-node 1"):
        serve_distributed(two_hosts, ServerConfig(), GroupConfig())


def test_cli_export_with_replicas(tmp_path, capsys):
    """``--hosts 3 --replicas 2``: plan.json records 2 replicas and every table lies on 2 distinct hosts of the
    ring; ``--replicas 4`` on 3 hosts and ``--replicas 2`` without ``--hosts`` are refused naming the flag."""
    spec = ModelSpec(tuple(TableConfig(f"t{i}", 300 + 50 * i, 16, (f"f{i}",)) for i in range(4)))
    (tmp_path / "spec.json").write_text(spec.to_json())
    torch.save(random_weights(spec), tmp_path / "ckpt.pt")
    args = ["export", "--spec", str(tmp_path / "spec.json"), "--weights", str(tmp_path / "ckpt.pt")]
    assert main([*args, "--out", str(tmp_path / "art"), "--hosts", "3", "--replicas", "2"]) == 0
    plan = load_host_part(tmp_path / "art", 0).plan
    assert plan.replicas == 2 and json.loads((tmp_path / "art" / "plan.json").read_text())["replicas"] == 2
    for table in plan.tables:
        own = {shard.device for shard in table.shards}  # one device per host: device = host
        holders = own | {(host + 1) % 3 for host in own}  # the next host of the ring holds a replica
        assert len(holders) >= 2, table
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "art")]) == 0
    assert "every table on 2 hosts (--replicas 2" in capsys.readouterr().out
    assert main([*args, "--out", str(tmp_path / "bad"), "--hosts", "3", "--replicas", "4"]) == 2
    assert "--replicas 4" in capsys.readouterr().err
    assert main([*args, "--out", str(tmp_path / "bad2"), "--replicas", "2"]) == 2
    assert "--replicas 2" in capsys.readouterr().err
