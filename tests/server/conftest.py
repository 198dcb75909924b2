"""Fixtures of the server tests: real servers on 127.0.0.1 (port 0), each on a background asyncio loop.

Every server is ``server.app.create_server`` on one event loop that runs in a daemon thread for the
whole session; tests talk to it with ordinary blocking gRPC clients. Expected values always come from
an in-process ``Runtime`` loaded separately from the same artifact, never from a server.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from infer.artifact.export import export
from infer.artifact.load import load
from infer.artifact.runtime import Runtime
from infer.quant.quantize import quantize
from infer.weights import random_weights
from tests.conftest import TinyOverArch, mixed_spec
from tests.server.native_support import SERVER_KINDS, start_kind
from tests.server.support import NUM_DENSE, GatedModule, LoopThread, Served, gated_runtime, local_config


@pytest.fixture(scope="session")
def spec():
    return mixed_spec()


@pytest.fixture(scope="session")
def dense_artifact(tmp_path_factory, spec) -> Path:
    """The mixed-dtype model with a small dense part (Predict works)."""
    torch.manual_seed(0)
    dense_spec = spec.with_dense_arch(TinyOverArch(NUM_DENSE, spec.output_dim), NUM_DENSE)
    model = quantize(dense_spec, random_weights(dense_spec, seed=5))
    return export(model, tmp_path_factory.mktemp("server-art") / "dense")


@pytest.fixture(scope="session")
def sparse_artifact(tmp_path_factory, spec) -> Path:
    """The mixed-dtype model without a dense part (Predict is FAILED_PRECONDITION)."""
    model = quantize(spec, random_weights(spec, seed=7))
    return export(model, tmp_path_factory.mktemp("server-art") / "sparse")


@pytest.fixture(scope="session")
def dense_runtime(dense_artifact) -> Runtime:
    """In-process reference: a separate load of the artifact the servers serve."""
    return load(dense_artifact)


@pytest.fixture(scope="session")
def sparse_runtime(sparse_artifact) -> Runtime:
    return load(sparse_artifact)


@pytest.fixture(scope="session")
def loop_thread() -> Iterator[LoopThread]:
    loop = LoopThread()
    yield loop
    loop.close()


@pytest.fixture
def start_server(loop_thread) -> Iterator[Callable[..., Served]]:
    """``start_server(artifact_or_runtime, **config)`` -> a started server, stopped at teardown."""
    started: list[Served] = []

    def start(artifact: Path | Runtime, **overrides: Any) -> Served:
        served = Served.start(loop_thread, artifact, local_config(**overrides))
        started.append(served)
        return served

    yield start
    for served in started:
        served.close_channels()
        served.stop(grace=1.0)


@pytest.fixture(scope="module")
def dense_server(loop_thread, dense_artifact) -> Iterator[Served]:
    """A shared server of the dense model for tests that only send requests."""
    served = Served.start(loop_thread, dense_artifact, local_config(max_delay_us=500))
    yield served
    served.close_channels()
    served.stop(grace=1.0)


@pytest.fixture
def gated(start_server, dense_artifact) -> Iterator[tuple[Runtime, GatedModule]]:
    """A runtime of the dense artifact whose forwards wait at a gate; the gate opens before teardown.

    Depends on ``start_server`` so that the gate opens before any server using it stops.
    """
    runtime, gate = gated_runtime(dense_artifact)
    yield runtime, gate
    gate.release()


@pytest.fixture(params=SERVER_KINDS)
def server_kind(request) -> str:
    """Each test that takes it runs against both servers: the Python one and embserve-server."""
    return request.param


@pytest.fixture
def start_any(server_kind, loop_thread) -> Iterator[Callable[..., Any]]:
    """``start_any(artifact, **config)`` -> a started server of ``server_kind``, stopped at teardown."""
    started: list[Any] = []

    def start(artifact: Path, **config: Any) -> Any:
        served = start_kind(server_kind, loop_thread, artifact, **config)
        started.append(served)
        return served

    yield start
    for served in started:
        served.close_channels()
        served.stop(grace=1.0)


@pytest.fixture(scope="module", params=SERVER_KINDS)
def dense_server_of_each_kind(request, loop_thread, dense_artifact) -> Iterator[Any]:
    """The dense model on each server in turn (a module's ``dense_server`` when its tests run on both)."""
    served = start_kind(request.param, loop_thread, dense_artifact, max_delay_us=500)
    yield served
    served.close_channels()
    served.stop(grace=1.0)
