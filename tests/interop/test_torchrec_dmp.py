"""A 2-process gloo DistributedModelParallel DLRM (row-wise and table-wise tables): the model, its sharded
state_dict() (ShardedTensor or DTensor values) and a DCP save of it all import to the unsharded model's
weights, bit for bit."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from infer.config import ModelSpec
from infer.interop.torchrec import load_torchrec_checkpoint
from tests.interop.torchrec_models import float_ebc

WORKER = Path(__file__).with_name("dmp_worker.py")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


KINDS = ("sharded_tensor", "dtensor")


@pytest.fixture(scope="module")
def dmp_runs(tmp_path_factory):
    """Run the two ranks once for both kinds (the type of the sharded state dict's values): each kind's DMP model
    writes into its own folder."""
    out = tmp_path_factory.mktemp("dmp")
    env = {**os.environ, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    env["MASTER_PORT"] = str(_free_port())
    workers = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(out), *KINDS],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    logs = []
    for worker in workers:
        try:
            logs.append(worker.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for other in workers:
                other.kill()
            raise
    for worker, log in zip(workers, logs):
        assert worker.returncode == 0, log[-4000:]
    return out


@pytest.fixture(params=KINDS)
def dmp_outputs(request, dmp_runs):
    """The outputs of the DMP model whose sharded state dict holds ``request.param`` values."""
    return dmp_runs / request.param


@pytest.mark.slow
def test_dmp_model_state_dict_and_dcp_import_the_unsharded_weights(dmp_outputs):
    reference = {name: bag.weight.detach() for name, bag in float_ebc(seed=0).embedding_bags.items()}
    spec = ModelSpec.load(dmp_outputs / "spec.json")
    assert [t.name for t in spec.tables] == list(reference)
    for rank in range(2):  # every rank gets the full tables
        for source in ("from_model", "from_state_dict"):
            weights = torch.load(dmp_outputs / f"{source}_rank{rank}.pt", weights_only=True)
            assert set(weights) == set(reference)
            for name, expected in reference.items():
                assert torch.equal(weights[name], expected), (source, rank, name)
    from_dcp = load_torchrec_checkpoint(dmp_outputs / "dcp", spec)  # this process has no process group
    for name, expected in reference.items():
        assert torch.equal(from_dcp[name], expected), ("dcp", name)


@pytest.mark.slow
def test_dense_part_of_a_sharded_dlrm(dmp_outputs):
    for rank in range(2):
        outputs = torch.load(dmp_outputs / f"dense_rank{rank}.pt", weights_only=True)
        assert outputs["ours"].shape == outputs["theirs"].shape == (8, 1)
        torch.testing.assert_close(outputs["ours"], outputs["theirs"], rtol=1e-5, atol=1e-6)
