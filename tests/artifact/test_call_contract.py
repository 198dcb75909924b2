"""The call contract (issue 24) on the TorchScript and onnxruntime backends, the scripted model called directly
(what C++ and any TorchScript host call), export's check of the dense part, and ``embserve run``.

Every documented dtype combination (values int64/int32 x lengths int32/int64 x weights float32/absent) is
compared with the fp32 reference (``F.embedding_bag`` on the dequantized tables, the dense part on that); every
undocumented dtype is refused with a typed error naming the tensor. ``predict`` is float32 ``[B]`` though the
dense part returns ``[B, 1]``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from infer.artifact.export import export
from infer.artifact.load import load
from infer.cli import main
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
    Refused,
    assert_matches,
    batch_of,
    contract_spec,
    dense_of,
    refused_call,
)

BACKENDS = ("torchscript", "onnxruntime")


@pytest.fixture(scope="module")
def contract_model():
    spec = contract_spec()
    return spec, quantize(spec, random_weights(spec, seed=2))


@pytest.fixture(scope="module")
def exported(contract_model, tmp_path_factory):
    """One artifact (model.pt + model.onnx) of the contract's model, and its reference."""
    spec, model = contract_model
    path = export(model, tmp_path_factory.mktemp("contract") / "art", onnx=True)
    return path, Reference(spec, model)


@pytest.fixture(scope="module")
def embedded(contract_model, tmp_path_factory):
    """The same model with every weight inside model.pt (format_version 2): what a bare TorchScript host loads
    alone. A mapped artifact's model.pt holds its kernels' weights empty (a loader hands them the weight files)."""
    _, model = contract_model
    return export(model, tmp_path_factory.mktemp("contract") / "embedded", weights="embedded")


@pytest.fixture(scope="module")
def runtimes(exported):
    path, _ = exported
    return {backend: load(path, backend=backend) for backend in BACKENDS}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("combo", DOCUMENTED, ids=repr)
def test_every_documented_dtype_matches_the_reference(runtimes, exported, backend, combo):
    _, reference = exported
    runtime = runtimes[backend]
    batch = batch_of(runtime.spec, combo)
    dense = dense_of()
    assert_matches(runtime.lookup(batch), reference.pooled(batch))
    scores = runtime.predict(batch, dense)
    assert_matches(scores, reference.scores(batch, dense))  # float32 [B], from a dense part returning [B, 1]
    # the module itself (what the server calls), with plain tensors
    module = runtime.module
    assert_matches(module(batch.values, batch.lengths, batch.weights), reference.pooled(batch))
    assert_matches(module.predict(dense, batch.values, batch.lengths, batch.weights), reference.scores(batch, dense))


@pytest.mark.parametrize("combo", DOCUMENTED, ids=repr)
def test_the_scripted_model_alone_follows_the_contract(exported, embedded, combo):
    """model.pt in a bare ``torch.jit.load``, as any TorchScript host calls it: no embserve Python."""
    _, reference = exported
    scripted = torch.jit.load(str(embedded / "model.pt"))
    batch = batch_of(reference.spec, combo)
    dense = dense_of()
    assert_matches(scripted(batch.values, batch.lengths, batch.weights), reference.pooled(batch))
    assert_matches(scripted.predict(dense, batch.values, batch.lengths, batch.weights), reference.scores(batch, dense))
    pooled, scores = scripted.lookup_and_predict(dense, batch.values, batch.lengths, batch.weights)
    assert_matches(pooled, reference.pooled(batch))
    assert_matches(scores, reference.scores(batch, dense))


def test_predict_agrees_across_backends(runtimes, exported):
    _, reference = exported
    batch = batch_of(reference.spec, Combo(torch.int32, torch.int64, False), seed=9)
    dense = dense_of(seed=10)
    scores = [runtimes[backend].predict(batch, dense) for backend in BACKENDS]
    for got in scores:
        assert got.shape == (batch.batch_size,) and got.dtype == torch.float32
    torch.testing.assert_close(scores[0], scores[1], rtol=0, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", REFUSED, ids=repr)
def test_undocumented_dtypes_are_refused_naming_the_tensor(runtimes, backend, case):
    runtime = runtimes[backend]
    dense, values, lengths, weights = refused_call(runtime.spec, case)
    with pytest.raises(RequestError) as raised:
        runtime.predict(SparseFeatures.from_tensors(runtime.spec.feature_names, values, lengths, weights), dense)
    assert case.fragment in str(raised.value)
    if backend == "onnxruntime":  # the module the server calls (the scripted one: the test below)
        with pytest.raises(RequestError) as raised:
            runtime.module.predict(dense, values, lengths, weights)
        assert case.fragment in str(raised.value)
        if case.tensor != "dense_features":
            with pytest.raises(RequestError) as raised:
                runtime.module(values, lengths, weights)
            assert case.fragment in str(raised.value)


@pytest.mark.parametrize("case", REFUSED, ids=repr)
def test_the_scripted_model_alone_refuses_them_too(exported, embedded, case: Refused):
    _, reference = exported
    scripted = torch.jit.load(str(embedded / "model.pt"))
    dense, values, lengths, weights = refused_call(reference.spec, case)
    with pytest.raises(torch.jit.Error) as raised:
        scripted.predict(dense, values, lengths, weights)
    assert "embserve.RequestError: " + case.fragment in str(raised.value)


class PairScores(torch.nn.Module):
    """Two scores per example: not what predict returns."""

    def __init__(self, num_dense: int, pooled_dim: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(num_dense + pooled_dim, 2)

    def forward(self, dense_features: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.cat([dense_features, pooled], dim=1))


class CountScores(torch.nn.Module):
    """Integer "scores"."""

    def forward(self, dense_features: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        return (pooled > 0).sum(dim=1)


@pytest.mark.parametrize(
    ("dense_arch", "got"),
    [(PairScores(NUM_DENSE, 32), "float32 [2, 2]"), (CountScores(), "int64 [2]")],
    ids=["two_columns", "integers"],
)
def test_export_refuses_a_dense_part_that_returns_no_scores(dense_arch, got, tmp_path):
    spec = contract_spec(dense_arch)
    model = quantize(spec, random_weights(spec, seed=2))
    with pytest.raises(ConfigError) as raised:
        export(model, tmp_path / "art")
    message = str(raised.value)
    assert f"the dense part returned {got} for a batch of 2" in message
    assert "must return floating-point [B] or [B, 1]" in message
    assert not (tmp_path / "art").exists()


def test_embserve_run_on_a_dense_part_returning_a_column(exported, capsys):
    path, _ = exported
    assert main(["run", str(path), "--batch-size", "4", "--iterations", "1"]) == 0
    assert "predict: scores [4]" in capsys.readouterr().out


def test_embserve_run_on_a_torchrec_dlrm_artifact(tmp_path, capsys):
    """The user's trip: a TorchRec DLRM (its over arch returns [B, 1]) imported, exported, then `embserve run`."""
    pytest.importorskip("torchrec")
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.models.dlrm import DLRM

    import infer

    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(name=f"t{i}", num_embeddings=40, embedding_dim=8, feature_names=[f"f{i}"]) for i in range(3)
    ]
    dlrm = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables),
        dense_in_features=4,
        dense_arch_layer_sizes=[16, 8],
        over_arch_layer_sizes=[8, 1],
    ).eval()
    path = infer.export(infer.from_torchrec(dlrm).quantize(), tmp_path / "dlrm")
    assert main(["run", str(path), "--batch-size", "5", "--iterations", "1"]) == 0
    assert "predict: scores [5]" in capsys.readouterr().out


def test_embserve_run_on_a_dense_part_returning_scores(tmp_path, capsys):
    """The demo's kind of dense part (scores [B]), on a small model."""
    from infer.demo import DemoOverArch

    spec = contract_spec(DemoOverArch(NUM_DENSE, 32))
    path = export(quantize(spec, random_weights(spec, seed=1)), tmp_path / "art")
    assert main(["run", str(Path(path)), "--batch-size", "3", "--iterations", "1"]) == 0
    assert "predict: scores [3]" in capsys.readouterr().out


def test_the_onnx_graph_itself_returns_one_score_per_example(exported):
    """model.onnx in a bare onnxruntime session (any ONNX host, no embserve): scores [B] float32."""
    import numpy as np
    import onnxruntime

    path, reference = exported
    batch = batch_of(reference.spec, Combo(torch.int64, torch.int32, False))
    dense = dense_of()
    session = onnxruntime.InferenceSession(str(path / "model.onnx"), providers=["CPUExecutionProvider"])
    feeds = {"values": batch.values.numpy(), "lengths": batch.lengths.numpy(), "dense_features": dense.numpy()}
    (scores,) = session.run(["scores"], feeds)
    assert scores.shape == (batch.batch_size,) and scores.dtype == np.float32
    assert_matches(torch.from_numpy(scores), reference.scores(batch, dense))
