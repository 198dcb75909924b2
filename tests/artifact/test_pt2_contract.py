"""The call contract (issue 24) on the pt2 backend, exported the way the user did it: ``embserve export --pt2``
with a ``torch.jit.script``ed dense part (``--dense-arch dense.pt``) returning ``[B, 1]``.

The model is tests/support/pt2_models.py's unsharded pt2_spec, exported that way (compiled once per session, shared
with test_pt2, test_pt2_weights, the pt2 servers' and the C++ loader's tests): its tables hold every case the
contract's own model has (a SUM table read by two features, a MEAN FP16 table) and more, its dense part is the
contract's ``ColumnScores``. The reference is fp32 ``F.embedding_bag`` on the dequantized tables and the dense part
applied to it (``tests/support/call_contract.py``), never the program under test.
"""

from __future__ import annotations

import json

import pytest
import torch

from infer.artifact.export import export
from infer.artifact.load import load
from infer.errors import ConfigError, RequestError
from infer.features import SparseFeatures
from infer.quant.quantize import quantize
from infer.weights import random_weights
from tests.support.call_contract import (
    DOCUMENTED,
    NUM_DENSE,
    REFUSED,
    Combo,
    Reference,
    assert_matches,
    batch_of,
    contract_spec,
    dense_of,
    refused_call,
)
from tests.support.pt2_models import contract_pt2

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """``embserve export --pt2 --dense-arch dense.pt`` (TorchScript), and the reference of the same tables."""
    artifact = contract_pt2(tmp_path_factory)
    return artifact.path, Reference(artifact.spec, quantize(artifact.spec, artifact.weights))


@pytest.fixture(scope="module")
def runtime(exported):
    return load(exported[0], backend="pt2")


def test_the_scripted_dense_part_is_in_model_pt2(exported, runtime):
    manifest = json.loads((exported[0] / "manifest.json").read_text())
    assert manifest["pt2"]["dense_program"] == "dense"
    assert runtime.has_dense


@pytest.mark.parametrize("combo", DOCUMENTED, ids=repr)
def test_every_documented_dtype_matches_the_reference(runtime, exported, combo):
    _, reference = exported
    batch = batch_of(runtime.spec, combo)
    dense = dense_of()
    assert_matches(runtime.lookup(batch), reference.pooled(batch))
    assert_matches(runtime.predict(batch, dense), reference.scores(batch, dense))
    module = runtime.module
    assert_matches(module(batch.values, batch.lengths, batch.weights), reference.pooled(batch))
    assert_matches(module.predict(dense, batch.values, batch.lengths, batch.weights), reference.scores(batch, dense))
    # the program's own boundary (no request checks): int32 lengths were read as int64 bytes, weights were required
    assert_matches(module.program(batch.values, batch.lengths, batch.weights), reference.pooled(batch))


def test_predict_equals_the_torchscript_backend(runtime, exported):
    batch = batch_of(runtime.spec, Combo(torch.int32, torch.int32, False), seed=8)
    dense = dense_of(seed=5)
    scores = runtime.predict(batch, dense)
    assert scores.shape == (batch.batch_size,) and scores.dtype == torch.float32
    torch.testing.assert_close(scores, load(exported[0]).predict(batch, dense), rtol=0, atol=1e-5)


@pytest.mark.parametrize("case", REFUSED, ids=repr)
def test_undocumented_dtypes_are_refused_naming_the_tensor(runtime, case):
    dense, values, lengths, weights = refused_call(runtime.spec, case)
    with pytest.raises(RequestError) as raised:
        runtime.predict(SparseFeatures.from_tensors(runtime.spec.feature_names, values, lengths, weights), dense)
    assert case.fragment in str(raised.value)
    with pytest.raises(RequestError) as raised:
        runtime.module.predict(dense, values, lengths, weights)
    assert case.fragment in str(raised.value)
    if case.tensor != "dense_features":
        with pytest.raises(RequestError) as raised:
            runtime.module.program(values, lengths, weights)
        assert case.fragment in str(raised.value)


class DataDependentScores(torch.nn.Module):
    """A dense part torch.export cannot trace: its output's size depends on the data."""

    def forward(self, dense_features: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        return pooled[:, : int(dense_features.abs().sum()) % 3 + 1].sum(dim=1)


def test_a_dense_part_pt2_cannot_hold_is_refused_before_compiling(tmp_path):
    spec = contract_spec(DataDependentScores())
    model = quantize(spec, random_weights(spec, seed=1))
    with pytest.raises(ConfigError) as raised:
        export(model, tmp_path / "art", pt2=True)
    message = str(raised.value)
    assert "the dense part (DataDependentScores) cannot be exported with torch.export for model.pt2" in message
    assert "export without --pt2" in message
    assert not (tmp_path / "art").exists()


def test_dense_features_width_is_checked(runtime):
    batch = batch_of(runtime.spec, DOCUMENTED[0])
    with pytest.raises(RequestError, match=rf"dense_features must have shape \[6, {NUM_DENSE}\]"):
        runtime.predict(batch, torch.zeros(6, NUM_DENSE + 1))
