"""The C++ loader on a CUDA artifact: embserve_run answers as the Python runtime does, bit for bit.

On a GPU machine without gRPC C++ the whole build is the loader and its tools; ``EMBSERVE_RUN_BIN`` points at an
embserve_run built elsewhere (the GPU session script builds only that target)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from infer.artifact.cpp_io import read_responses, write_requests
from infer.artifact.export import export
from infer.artifact.load import load
from infer.features import SparseFeatures
from infer.planner.types import ComputeDevice, ShardingType
from infer.quant.quantize import quantize
from infer.shard.builder import shard_model
from infer.shard.plans import make_plan
from infer.weights import random_weights
from tests.conftest import cuda_mixed_spec
from tests.cpp.conftest import build_cpp_loader
from tests.cpp.support import run
from tests.cpp.test_cpp_loader import parity_requests


def embserve_run_binary() -> Path:
    given = os.environ.get("EMBSERVE_RUN_BIN")
    return Path(given) if given else build_cpp_loader() / "embserve_run"


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["unsharded_mapped", "unsharded_embedded", "table_wise"])
def test_embserve_run_on_a_cuda_artifact_equals_python(tmp_path, kind):
    spec = cuda_mixed_spec()
    model = quantize(spec, random_weights(spec, seed=3), device="cuda:0")
    if kind == "table_wise":
        plan = make_plan(spec, 1, {t.name: (ShardingType.TABLE_WISE, (0,)) for t in spec.tables}, ComputeDevice.CUDA)
        artifact = export(shard_model(model, plan), tmp_path / kind, plan=plan)
    else:
        artifact = export(model, tmp_path / kind, weights=kind.removeprefix("unsharded_"))
    requests = parity_requests()
    write_requests(tmp_path / "requests.bin", requests)
    result = run(embserve_run_binary(), artifact, "--requests", tmp_path / "requests.bin", "--out", tmp_path / "o")
    assert result.returncode == 0, result.stderr[-3000:]
    runtime = load(artifact)
    responses = read_responses(tmp_path / "o")
    assert len(responses) == len(requests)
    for (values, lengths, weights), response in zip(requests, responses):
        assert response.ok, response.message
        expected = runtime.lookup(SparseFeatures(runtime.feature_names, values, lengths, weights)).cpu()
        assert response.output is not None and response.output.equal(expected)
