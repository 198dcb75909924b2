"""The pt2 backend behind both servers: ``embserve serve`` of a runtime loaded with ``backend="pt2"`` and
``embserve-server --backend pt2`` (the C++ loader's AOTInductor backend). Lookups and predictions over embserve.v1
and the Open Inference Protocol equal the in-process ``infer.load(dir, backend="pt2")`` bit for bit, alone and
merged with concurrent calls; an artifact without model.pt2 is refused at start naming the fix.

The model is tests/support/pt2_models.py's unsharded pt2_spec (INT8/INT4/INT2/FP16/FP32, SUM and MEAN, a dense
part), compiled once per session.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from infer.artifact.load import load
from infer.artifact.runtime import Runtime
from server.client import EmbserveClient
from tests.conftest import random_batch
from tests.server.native_support import SERVER_KINDS, native_binary, start_kind
from tests.server.oip_support import client, requested, triton_inputs
from tests.server.support import CALL_TIMEOUT
from tests.support.pt2_models import NUM_DENSE, compiled_pt2


@pytest.fixture(scope="module")
def pt2_model(tmp_path_factory) -> tuple[Any, Path]:
    return compiled_pt2(tmp_path_factory, "unsharded")


@pytest.fixture(scope="module")
def reference(pt2_model) -> Runtime:
    """The in-process pt2 runtime of the same folder: what every answer must equal."""
    return load(pt2_model[1], backend="pt2")


@pytest.fixture(scope="module", params=SERVER_KINDS)
def pt2_server(request, loop_thread, pt2_model) -> Iterator[Any]:
    """A server of each kind running model.pt2, shared by the module's tests (they only send requests)."""
    served = start_kind(request.param, loop_thread, pt2_model[1], backend="pt2", max_delay_us=2000)
    yield served
    served.close_channels()
    served.stop(grace=1.0)


def _dense(batch_size: int, seed: int) -> torch.Tensor:
    return torch.randn(batch_size, NUM_DENSE, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_embserve_v1_lookups_and_predictions_equal_the_pt2_runtime(pt2_server, pt2_model, reference, weighted):
    spec = pt2_model[0]
    for seed, batch_size in ((1, 1), (2, 7), (3, 64)):
        batch = random_batch(spec, batch_size=batch_size, weighted=weighted, seed=seed)
        dense = _dense(batch_size, seed)
        with EmbserveClient(pt2_server.address, timeout=CALL_TIMEOUT) as v1:
            assert torch.equal(v1.lookup(batch), reference.lookup(batch))
            assert torch.equal(v1.predict(batch, dense), reference.predict(batch, dense))


def test_oip_infer_equals_the_pt2_runtime(pt2_server, pt2_model, reference):
    spec = pt2_model[0]
    batch = random_batch(spec, batch_size=16, weighted=True, seed=9)
    dense = _dense(16, 9)
    with client("grpc", pt2_server.address) as c:
        result = c.infer(
            "unsharded", triton_inputs("grpc", batch, dense), outputs=requested("grpc", "embeddings", "scores")
        )
    assert torch.equal(torch.from_numpy(np.array(result.as_numpy("embeddings"))), reference.lookup(batch))
    assert torch.equal(torch.from_numpy(np.array(result.as_numpy("scores"))), reference.predict(batch, dense))


def test_concurrent_calls_merged_into_one_forward_each_get_the_runtimes_rows(pt2_server, pt2_model, reference):
    spec = pt2_model[0]
    batches = [random_batch(spec, batch_size=1 + i % 6, weighted=i % 2 == 0, seed=100 + i) for i in range(48)]

    def call(index: int) -> bool:
        with EmbserveClient(pt2_server.address, timeout=CALL_TIMEOUT) as v1:
            return torch.equal(v1.lookup(batches[index]), reference.lookup(batches[index]))

    with ThreadPoolExecutor(max_workers=12) as pool:
        assert all(pool.map(call, range(len(batches))))


def test_the_native_server_refuses_pt2_for_an_artifact_without_model_pt2(dense_artifact):
    completed = subprocess.run(
        [native_binary(), str(dense_artifact), "--backend", "pt2", "--host", "127.0.0.1", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 1, completed.stderr
    assert "has no 'pt2' entry" in completed.stderr and "embserve export --pt2" in completed.stderr
