"""TorchRec import against real torchrec: lookups equal TorchRec's quantized EBC, DLRM predictions equal
TorchRec's DLRM, checkpoints (state dict, DCP) import, every bad input is a typed error."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRM_Projection, DLRMTrain

import infer
from infer.config import DataType, ModelSpec, PoolingType, TableConfig
from infer.errors import ConfigError, RequestError, WeightsError
from infer.features import SparseFeatures
from infer.interop.torchrec import from_torchrec, load_torchrec_checkpoint, spec_from_checkpoint
from infer.modules.collection import QuantizedEmbeddingBagCollection
from tests.interop.torchrec_models import Wrapper, float_ebc, quantize_ebc, random_kjt

NUM_DENSE = 5

pytestmark = pytest.mark.filterwarnings("ignore:torch.ao.quantization is deprecated:DeprecationWarning")


def _rows(spec: ModelSpec) -> dict[str, int]:
    return {f.name: f.num_embeddings for f in spec.features}


@pytest.fixture(scope="module")
def trained():
    """A float EBC (six tables, one shared, one MEAN), TorchRec's INT8 QEBC of it, and a KJT batch."""
    model = Wrapper(float_ebc(seed=0))
    quantized = quantize_ebc(model)
    imported = from_torchrec(model)
    kjt = random_kjt(list(imported.spec.feature_names), _rows(imported.spec), batch=32)
    return model, quantized, imported, kjt


@pytest.fixture(scope="module")
def runtime(trained, tmp_path_factory):
    _, _, imported, _ = trained
    return infer.load(infer.export(imported.quantize(), tmp_path_factory.mktemp("tr") / "art"))


def test_lookup_equals_torchrec_quantized_ebc(trained, runtime):
    model, quantized, imported, kjt = trained
    expected = quantized(kjt).to_dict()
    served = runtime.lookup(SparseFeatures.from_kjt(kjt))
    for feature in imported.spec.features:
        ours = served[:, feature.column_start : feature.column_end]
        if feature.pooling == PoolingType.SUM:
            assert torch.equal(ours, expected[feature.name]), feature.name
        else:
            torch.testing.assert_close(ours, expected[feature.name], rtol=1e-6, atol=1e-6)
    # columns in the fp32 model's KeyedTensor order (TorchRec's QEBC moves MEAN tables last)
    fp32 = model(kjt)
    assert list(runtime.spec.feature_names) == fp32.keys()
    assert quantized(kjt).keys() != fp32.keys()


def test_lookup_equals_fp32_ebc_within_int8_error(trained, runtime):
    model, _, _, kjt = trained
    fp32 = model(kjt).values().detach()
    served = runtime.lookup(SparseFeatures.from_kjt(kjt))
    relative = float((served - fp32).norm() / fp32.norm())
    assert 0 < relative < 0.01


def test_imported_tables_are_the_models_weights(trained):
    model, _, imported, _ = trained
    for name, bag in model.ebc.embedding_bags.items():
        assert torch.equal(imported.weights[name], bag.weight.detach())
    assert imported.dense_arch is None and imported.spec.num_dense_features == 0
    assert [t.data_type for t in imported.spec.tables] == [DataType.INT8] * 6
    assert imported.spec.table("item").feature_names == ("item_id", "last_item")
    assert imported.spec.table("category").pooling == PoolingType.MEAN


def test_quantized_ebc_imports_its_bytes_exactly(trained):
    _, _, imported, kjt = trained
    per_table = {"city": torch.float16, "device": torch.quint4x2, "query": torch.quint2x4}
    quantized = quantize_ebc(Wrapper(float_ebc(seed=0)), per_table=per_table)
    again = from_torchrec(quantized)
    assert [again.spec.table(t).data_type for t in ("city", "device", "query", "user")] == [
        DataType.FP16,
        DataType.INT4,
        DataType.INT2,
        DataType.INT8,
    ]
    model = again.quantize()
    theirs = {}
    qebc = quantized.ebc
    for configs, tbe in zip(qebc._key_to_tables.values(), qebc._emb_modules):
        for cfg, pair in zip(configs, tbe.split_embedding_weights()):
            theirs[cfg.name] = pair
    collection = model.embeddings
    assert isinstance(collection, QuantizedEmbeddingBagCollection)
    for table, (data, scale_bias) in zip(again.spec.tables, collection.table_weights()):
        their_data, their_scale_bias = theirs[table.name]
        assert torch.equal(data, their_data), table.name
        assert (scale_bias is None) == (their_scale_bias is None)
        if scale_bias is not None:
            assert torch.equal(scale_bias, their_scale_bias), table.name
    expected = quantized(kjt).to_dict()
    pooled = model(kjt.values(), kjt.lengths().to(torch.int32), None)
    for feature in again.spec.features:
        if feature.pooling == PoolingType.SUM:
            assert torch.equal(pooled[:, feature.column_start : feature.column_end], expected[feature.name])


def test_weighted_ebc_equals_torchrec(trained):
    tables = [
        EmbeddingBagConfig(name="clicks", num_embeddings=200, embedding_dim=8, feature_names=["clicked", "liked"]),
        EmbeddingBagConfig(name="views", num_embeddings=100, embedding_dim=8, feature_names=["viewed"]),
    ]
    torch.manual_seed(3)
    model = Wrapper(EmbeddingBagCollection(tables=tables, is_weighted=True))
    imported = from_torchrec(model)
    rows = {"clicked": 200, "liked": 200, "viewed": 100}
    kjt = random_kjt(list(rows), rows, batch=16, seed=5)
    weighted = KeyedJaggedTensor.from_lengths_sync(
        keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(), weights=torch.rand(kjt.values().numel())
    )
    expected = quantize_ebc(model)(weighted).values()
    pooled = imported.quantize()(weighted.values(), weighted.lengths().to(torch.int32), weighted.weights())
    assert torch.equal(pooled, expected)


def test_quantized_table_asked_for_another_type_is_requantized(trained):
    quantized = quantize_ebc(Wrapper(float_ebc(seed=0)))
    imported = from_torchrec(quantized)
    model = imported.quantize(overrides={"user": "fp16"})
    assert model.spec.table("user").data_type == DataType.FP16
    user = dict(zip([t.name for t in model.spec.tables], model.embeddings.table_weights()))["user"][0]
    assert torch.equal(user.view(torch.float16).float(), imported.weights["user"].half().float())


def test_unsupported_modules_are_named():
    seq = EmbeddingConfig(name="seq", num_embeddings=10, embedding_dim=8, feature_names=["s"])
    ec = EmbeddingCollection(tables=[seq])
    with pytest.raises(ConfigError, match=r"'ec' is a EmbeddingCollection.*supported: torchrec"):
        from_torchrec(_Named(ec=ec))
    two = _Named(a=float_ebc(), b=float_ebc())
    with pytest.raises(ConfigError, match=r"2 EmbeddingBagCollections \(\['a', 'b'\]\)"):
        from_torchrec(two)
    with pytest.raises(ConfigError, match="holds no EmbeddingBagCollection"):
        from_torchrec(torch.nn.Linear(2, 2))
    odd = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="odd", num_embeddings=10, embedding_dim=6, feature_names=["o"])]
    )
    with pytest.raises(ConfigError, match="table 'odd'.*multiple of 4"):
        from_torchrec(odd)


class _Named(torch.nn.Module):
    def __init__(self, **modules: torch.nn.Module) -> None:
        super().__init__()
        for name, module in modules.items():
            self.add_module(name, module)


# ---------------------------------------------------------------------------------------------- DLRM


def _dlrm(kind: type, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    extra = {
        DLRM: {},
        DLRM_DCN: {"dcn_num_layers": 2, "dcn_low_rank_dim": 4},
        DLRM_Projection: {"interaction_branch1_layer_sizes": [32, 16], "interaction_branch2_layer_sizes": [32, 16]},
    }[kind]
    return kind(
        embedding_bag_collection=float_ebc(seed),
        dense_in_features=NUM_DENSE,
        dense_arch_layer_sizes=[32, 16],
        over_arch_layer_sizes=[16, 1],
        **extra,
    ).eval()


@pytest.mark.parametrize("kind", [DLRM, DLRM_DCN, DLRM_Projection], ids=lambda k: k.__name__)
def test_dlrm_predict_equals_torchrec(kind, tmp_path):
    dlrm = _dlrm(kind)
    imported = from_torchrec(dlrm)
    assert imported.spec.num_dense_features == NUM_DENSE and imported.dense_arch is not None
    runtime = infer.load(infer.export(imported.quantize(), tmp_path / "art"))
    assert runtime.has_dense
    kjt = random_kjt(list(imported.spec.feature_names), _rows(imported.spec), batch=16, seed=3)
    dense = torch.randn(16, NUM_DENSE, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = quantize_ebc(dlrm)(dense, kjt)
        fp32 = dlrm(dense, kjt)
    served = runtime.predict(SparseFeatures.from_kjt(kjt), dense)
    assert expected.shape == (16, 1) and served.shape == (16,)  # the call contract: predict returns [B]
    torch.testing.assert_close(served, expected[:, 0], rtol=1e-5, atol=1e-5)
    assert torch.equal(runtime.predict(kjt, dense), served)  # TorchRec's own input type, as it is
    assert not torch.equal(expected, fp32)  # the comparison is against the quantized model, not fp32
    # the DLRM reads features in the fp32 EBC's KeyedTensor order; so do we
    assert list(runtime.spec.feature_names) == dlrm.sparse_arch.embedding_bag_collection(kjt).keys()
    # TorchRec's training wrapper holds the same model
    assert from_torchrec(DLRMTrain(dlrm)).spec.num_dense_features == NUM_DENSE


# ---------------------------------------------------------------------------------------------- files


@pytest.fixture(scope="module")
def dlrm_and_spec():
    dlrm = _dlrm(DLRM, seed=5)
    return dlrm, from_torchrec(dlrm).spec


def test_state_dict_with_any_prefix(dlrm_and_spec, tmp_path):
    dlrm, spec = dlrm_and_spec
    path = tmp_path / "model.pt"
    torch.save(dlrm.state_dict(), path)
    assert any(k.startswith("sparse_arch.embedding_bag_collection.embedding_bags.") for k in dlrm.state_dict())
    weights = load_torchrec_checkpoint(path, spec)
    for name, bag in dlrm.sparse_arch.embedding_bag_collection.embedding_bags.items():
        assert torch.equal(weights[name], bag.weight.detach())
    # a training checkpoint {"state_dict": ..., ...} and a prefix of the user's own
    training = tmp_path / "training.pt"  # (a new file: the first one is memory-mapped by `weights`)
    torch.save({"state_dict": {f"module.tower.{k}": v for k, v in dlrm.state_dict().items()}, "step": 3}, training)
    assert torch.equal(load_torchrec_checkpoint(training, spec)["query"], weights["query"])


def test_dcp_folder_without_process_group(dlrm_and_spec, tmp_path):
    dlrm, spec = dlrm_and_spec
    assert not torch.distributed.is_initialized()
    dcp.save(dlrm.state_dict(), checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    weights = load_torchrec_checkpoint(tmp_path / "ckpt", spec)
    for name, bag in dlrm.sparse_arch.embedding_bag_collection.embedding_bags.items():
        assert torch.equal(weights[name], bag.weight.detach())
    written = spec_from_checkpoint(tmp_path / "ckpt")
    assert [(t.name, t.num_embeddings, t.embedding_dim) for t in written.tables] == [
        (t.name, t.num_embeddings, t.embedding_dim) for t in spec.tables
    ]


def test_spec_from_state_dict(dlrm_and_spec, tmp_path):
    dlrm, spec = dlrm_and_spec
    torch.save(dlrm.state_dict(), tmp_path / "model.pt")
    written = spec_from_checkpoint(tmp_path / "model.pt")
    assert written.feature_names == tuple(t.name for t in spec.tables)  # features default to table names
    assert written.num_dense_features == NUM_DENSE  # from the DLRM dense arch's first layer
    assert {t.name: (t.num_embeddings, t.embedding_dim) for t in written.tables} == {
        t.name: (t.num_embeddings, t.embedding_dim) for t in spec.tables
    }


@pytest.mark.parametrize("form", ["file", "dcp"])
def test_checkpoint_errors_name_tables_and_fix(dlrm_and_spec, tmp_path, form):
    dlrm, spec = dlrm_and_spec
    state = dict(dlrm.state_dict())
    state.pop("sparse_arch.embedding_bag_collection.embedding_bags.user.weight")
    state["sparse_arch.embedding_bag_collection.embedding_bags.extra.weight"] = torch.zeros(4, 16)
    path = tmp_path / ("ckpt.pt" if form == "file" else "ckpt")
    if form == "file":
        torch.save(state, path)
    else:
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    with pytest.raises(WeightsError, match=r"missing \['user'\], not in the spec \['extra'\].*embserve spec"):
        load_torchrec_checkpoint(path, spec)
    wrong = ModelSpec(
        tuple(
            TableConfig(t.name, t.num_embeddings + (7 if t.name == "query" else 0), t.embedding_dim, t.feature_names)
            for t in spec.tables
        )
    )
    full = dict(dlrm.state_dict())
    if form == "file":
        path = tmp_path / "full.pt"
        torch.save(full, path)
    else:
        dcp.save(full, checkpoint_id=str(tmp_path / "full"), no_dist=True)
        path = tmp_path / "full"
    with pytest.raises(WeightsError, match=r"table 'query'.*\[1000, 16\].*\[1007, 16\]"):
        load_torchrec_checkpoint(path, wrong)
    with pytest.raises(WeightsError, match="does not exist"):
        load_torchrec_checkpoint(tmp_path / "nope", spec)


# ---------------------------------------------------------------------------------------------- KJT


def test_sparse_features_from_and_to_kjt(trained):
    _, _, imported, kjt = trained
    weighted = random_kjt(list(imported.spec.feature_names), _rows(imported.spec), batch=4, seed=9)
    features = SparseFeatures.from_kjt(weighted)
    assert features.keys == tuple(weighted.keys())
    assert torch.equal(features.values, weighted.values())
    assert features.lengths.dtype == torch.int32 and torch.equal(features.lengths.long(), weighted.lengths())
    back = features.to_kjt()
    assert back.keys() == weighted.keys()
    assert torch.equal(back.values(), weighted.values()) and torch.equal(back.lengths().long(), weighted.lengths())
    with_weights = SparseFeatures(features.keys, features.values, features.lengths, torch.rand(features.num_ids()))
    again = SparseFeatures.from_kjt(with_weights.to_kjt())
    assert again.weights is not None and torch.equal(again.weights, with_weights.weights)


def _as_mapping(kjt: KeyedJaggedTensor) -> tuple[dict[str, list[list[int]]], dict[str, list[list[float]]] | None]:
    """The same batch as the mapping form ``{feature: bags}`` (and ``{feature: per-bag weights}``)."""
    jagged = kjt.to_dict()
    bags = {key: [bag.tolist() for bag in jagged[key].to_dense()] for key in kjt.keys()}
    if kjt.weights_or_none() is None:
        return bags, None
    return bags, {key: [bag.tolist() for bag in jagged[key].to_dense_weights()] for key in kjt.keys()}


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_runtime_takes_a_kjt(trained, runtime, weighted):
    """``runtime.lookup(kjt)`` / ``predict(kjt, dense)``: a KJT in another key order, weights as per-id weights;
    equal to the mapping form and, within INT8 error, to fp32 embedding_bag (issue 39 item 5)."""
    _, _, imported, _ = trained
    keys = list(reversed(imported.spec.feature_names))
    plain = random_kjt(keys, _rows(imported.spec), batch=6, seed=11)
    weights = torch.rand(plain.values().numel(), generator=torch.Generator().manual_seed(12)) if weighted else None
    kjt = KeyedJaggedTensor.from_lengths_sync(keys, plain.values(), plain.lengths(), weights)
    mapping = SparseFeatures.from_dict(*_as_mapping(kjt))
    got = runtime.lookup(kjt)
    assert torch.equal(got, runtime.lookup(mapping))
    reference = infer.FloatEmbeddingBagCollection(imported.spec, imported.weights)(mapping)
    assert float((got - reference).norm() / reference.norm()) < 0.01


def test_kjt_errors_name_the_key_and_the_fix(trained, runtime):
    _, _, imported, _ = trained
    keys = [*imported.spec.feature_names, "clicks"]
    kjt = random_kjt(keys, {**_rows(imported.spec), "clicks": 5}, batch=2)
    with pytest.raises(RequestError, match=r"unknown feature\(s\) \['clicks'\]") as caught:
        runtime.lookup(kjt)
    assert caught.value.feature == "clicks"
    with pytest.raises(RequestError, match="KeyedJaggedTensor"):
        runtime.lookup([1, 2, 3])
    with pytest.raises(RequestError, match="weights given beside a KeyedJaggedTensor"):
        SparseFeatures.of(kjt, {"clicks": [[1.0]]})


def test_variable_batch_kjt_is_refused():
    vbe = KeyedJaggedTensor(
        keys=["user_id", "item_id"],
        values=torch.tensor([1, 2, 3, 4, 5]),
        lengths=torch.tensor([1, 1, 1, 1, 1]),
        stride_per_key_per_rank=[[2], [3]],
    )
    assert vbe.variable_stride_per_key()
    with pytest.raises(RequestError, match="variable-batch"):
        SparseFeatures.from_kjt(vbe)


def test_pruned_table_is_named():
    pruned = EmbeddingBagConfig(
        name="pruned", num_embeddings=100, embedding_dim=8, feature_names=["p"], num_embeddings_post_pruning=10
    )
    with pytest.raises(ConfigError, match="table 'pruned'.*pruned"):
        from_torchrec(EmbeddingBagCollection(tables=[pruned]))
