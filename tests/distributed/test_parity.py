"""Served outputs of 2 and 3 "hosts" (processes on 127.0.0.1, gloo) against the single-process sharded model:
bit-equal for table- and column-wise plans, within 1e-6 x magnitude for row-wise and mixed ones; weights,
MEAN, empty bags and the dense part included."""

from __future__ import annotations

import pytest
import torch

from infer.shard.builder import shard_model
from infer.shard.hosts import shard_host
from tests.conftest import random_batch
from tests.distributed.conftest import KINDS, NUM_DENSE, host_plan, run_group
from tests.distributed.group_worker import COMBINES


def _batches(spec):
    batches = []
    for seed in range(4):
        batch = random_batch(spec, batch_size=5 + 7 * seed, max_len=6, weighted=seed % 2 == 1, seed=100 + seed)
        if seed == 2:  # every bag empty: the output is zeros, MEAN included (no division by zero)
            batch = random_batch(spec, batch_size=3, max_len=0, seed=7)
        dense = torch.randn(batch.batch_size, NUM_DENSE, generator=torch.Generator().manual_seed(seed))
        batches.append(
            {"keys": list(batch.keys), "values": batch.values, "lengths": batch.lengths, "weights": batch.weights,
             "dense": dense}
        )  # fmt: skip
    return batches


def _close(got: torch.Tensor, want: torch.Tensor, exact: bool) -> bool:
    if exact:
        return torch.equal(got, want)
    return bool((got - want).abs().max() <= 1e-6 * max(1.0, float(want.abs().max())))


@pytest.mark.parametrize("hosts", [2, 3])
def test_served_outputs_match_one_process(hosts, host_artifacts, quantized, tmp_path):
    spec = quantized.spec
    batches = _batches(spec)
    torch.save(batches, tmp_path / "batches.pt")
    artifacts = {kind: str(host_artifacts[(hosts, kind)]) for kind in KINDS}
    job = {"artifacts": artifacts, "batches": str(tmp_path / "batches.pt"), "out": str(tmp_path / "out.pt"),
           "timeout_s": 60}  # fmt: skip
    run_group(job, hosts, tmp_path)
    results = torch.load(tmp_path / "out.pt")
    for kind in KINDS:
        plan = host_plan(spec, kind, hosts, 2 if (hosts, kind) == (2, "mixed") else 1)
        reference = shard_model(quantized, plan)
        exact = kind == "column"
        for combine in COMBINES:
            for index, (batch, (pooled, scores)) in enumerate(zip(batches, results[(kind, combine)])):
                with torch.inference_mode():
                    want = reference(batch["values"], batch["lengths"], batch["weights"])
                    dense = batch["dense"]
                    want_scores = reference.predict(dense, batch["values"], batch["lengths"], batch["weights"])
                assert pooled.shape == want.shape and (float(want.abs().max()) > 0) == (batch["values"].numel() > 0)
                assert _close(pooled, want, exact), (kind, combine, index, float((pooled - want).abs().max()))
                assert _close(scores, want_scores, exact), (kind, combine, index)


def test_host_parts_sum_to_the_model_in_one_process(quantized):
    """The partial outputs themselves: each host's columns filled, zeros elsewhere, summing to the model."""
    spec = quantized.spec
    plan = host_plan(spec, "table", 3)
    batch = random_batch(spec, batch_size=8, weighted=True, seed=3)
    with torch.inference_mode():
        parts = [shard_host(quantized, plan, h)(batch.values, batch.lengths, batch.weights) for h in range(3)]
        want = quantized(batch.values, batch.lengths, batch.weights)
    filled = [(p != 0).any(0) for p in parts]
    assert not (filled[0] & filled[1]).any() and not (filled[1] & filled[2]).any()
    total = sum(parts)
    for f in spec.features:  # MEAN not divided yet: the full sums
        if f.pooling.value == "mean":
            assert not torch.equal(total[:, f.column_start : f.column_end], want[:, f.column_start : f.column_end])
