"""Planner value types: topology defaults, byte parsing, constraints files."""

from __future__ import annotations

import json

import pytest

from infer.config import ModelSpec, TableConfig
from infer.errors import PlanError, PlanErrorKind
from infer.planner import constants as C
from infer.planner.types import ComputeDevice, ParameterConstraints, ShardingType, Topology, load_constraints
from infer.planner.utils import parse_bytes


def test_parse_bytes():
    assert parse_bytes("80GB") == 80 * 1024**3
    assert parse_bytes("512 MiB") == 512 * 1024**2
    assert parse_bytes("1.5TB") == int(1.5 * 1024**4)
    assert parse_bytes(1234) == 1234
    assert parse_bytes("1234") == 1234
    with pytest.raises(PlanError) as info:
        parse_bytes("lots")
    assert info.value.kind == PlanErrorKind.INVALID_TOPOLOGY


def test_topology_defaults_per_kind():
    cuda = Topology(4)
    assert cuda.device_memory == (C.CUDA_DEVICE_MEMORY,) * 4
    assert cuda.hbm_bandwidth == C.CUDA_HBM_BANDWIDTH and cuda.row_alignment == 16
    assert cuda.local_world_size == 4 and cuda.device_name(3) == "cuda:3"
    cpu = Topology(2, ComputeDevice.CPU)
    assert cpu.row_alignment == 1 and cpu.device_name(1) == "cpu:1"
    assert Topology(3, device_memory=(5,)).device_memory == (5, 5, 5)
    assert Topology.from_dict(cuda.to_dict()) == cuda


def test_topology_rejects_nonsense():
    for bad in (
        lambda: Topology(0),
        lambda: Topology(2, device_memory=(1, 2, 3)),
        lambda: Topology(4, local_world_size=3),
        lambda: Topology(2, hbm_bandwidth=-1.0),
    ):
        with pytest.raises(PlanError) as info:
            bad()
        assert info.value.kind == PlanErrorKind.INVALID_TOPOLOGY


def test_detect_describes_this_host():
    topo = Topology.detect()
    assert topo.world_size >= 1 and all(m > 0 for m in topo.device_memory)


def test_constraints_file(tmp_path):
    spec = ModelSpec((TableConfig("t", 10, 4, ("f",)),))
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"t": {"sharding_types": ["row_wise"], "batch_size": 64, "data_type": "int4"}}))
    constraints = load_constraints(path, spec)
    assert constraints["t"].sharding_types == (ShardingType.ROW_WISE,) and constraints["t"].batch_size == 64
    assert ParameterConstraints.from_dict(constraints["t"].to_dict()) == constraints["t"]
    path.write_text(json.dumps({"nope": {}}))
    with pytest.raises(PlanError, match="nope"):
        load_constraints(path, spec)
    path.write_text(json.dumps({"t": {"shards": 3}}))
    with pytest.raises(PlanError, match="unknown keys") as info:
        load_constraints(path, spec)
    assert info.value.kind == PlanErrorKind.INVALID_CONSTRAINT
