"""``Runtime``: a model whose kernels are all on CPU runs its TorchScript methods unoptimized (its first call is
its warm-up) and answers as the optimizing executor and the independent reference do; the caller's own executor
setting is left as it was."""

from __future__ import annotations

import threading

import pytest
import torch

from infer import ComputeDevice, Topology, plan_for_inference, shard_model
from infer.artifact.export import export
from infer.artifact.load import load
from infer.quant.quantize import quantize
from infer.weights import random_weights
from tests.conftest import random_batch
from tests.support.call_contract import NUM_DENSE, Reference, assert_matches, contract_spec


@pytest.mark.parametrize("shards", [1, 2], ids=["unsharded", "2_cpu_shards"])
def test_a_cpu_model_runs_unoptimized_and_answers_as_the_optimizer_and_the_reference(tmp_path, shards):
    spec = contract_spec()
    model = quantize(spec, random_weights(spec, seed=41))
    if shards == 1:
        path = export(model, tmp_path / "model")
    else:
        plan = plan_for_inference(spec, Topology(shards, ComputeDevice.CPU))
        path = export(shard_model(model, plan), tmp_path / "model", plan=plan)
    reference = Reference(spec, model)
    plain, optimized = load(path), load(path)
    assert plain.plain_execution
    optimized.plain_execution = False  # the old way: TorchScript's optimizing executor (settles after 3 calls)
    for seed in range(5):
        batch = random_batch(spec, 6 + seed, max_len=5, weighted=seed % 2 == 1, seed=seed)
        dense = torch.randn(batch.batch_size, NUM_DENSE, generator=torch.Generator().manual_seed(seed))
        pooled, scores = plain.lookup(batch), plain.predict(batch, dense)
        assert_matches(pooled, reference.pooled(batch))
        assert_matches(scores, reference.scores(batch, dense))
        assert torch.equal(pooled, optimized.lookup(batch))
        torch.testing.assert_close(scores, optimized.predict(batch, dense), rtol=1e-6, atol=1e-6)
        valid = batch.validate(spec)
        both = plain.lookup_and_predict_unchecked(dense, valid.values, valid.lengths, valid.weights)
        assert torch.equal(both[0], pooled) and torch.equal(both[1], scores)
    assert torch._C._get_graph_executor_optimize()  # this thread's setting, as it was


def test_the_callers_executor_setting_is_left_alone(tmp_path):
    spec = contract_spec()
    runtime = load(export(quantize(spec, random_weights(spec, seed=42)), tmp_path / "model"))
    batch = random_batch(spec, 4, seed=1)
    seen = []

    def call(optimize: bool) -> None:
        with torch.jit.optimized_execution(optimize):
            runtime.lookup(batch)
            seen.append((optimize, torch._C._get_graph_executor_optimize()))

    for optimize in (True, False):
        thread = threading.Thread(target=call, args=(optimize,))
        thread.start()
        thread.join(60)
    assert seen == [(True, True), (False, False)]
