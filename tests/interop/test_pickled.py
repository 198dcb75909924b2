"""``infer.interop.pickled``: a pickled TorchRec module's tables read as data, against TorchRec's own configs."""

from __future__ import annotations

import torch

from infer.interop.pickled import read_pickled_model
from tests.interop.torchrec_models import float_ebc, six_tables


def test_a_pickled_collection_gives_its_configs_in_order(tmp_path):
    torch.save(float_ebc(seed=1), tmp_path / "ebc.pt")
    model = read_pickled_model(tmp_path / "ebc.pt")
    assert model is not None and model.root == "torchrec.modules.embedding_modules.EmbeddingBagCollection"
    assert model.num_dense_features == 0  # not a DLRM
    assert [(t.name, t.num_embeddings, t.embedding_dim, t.feature_names, t.pooling) for t in model.tables] == [
        (c.name, c.num_embeddings, c.embedding_dim, tuple(c.feature_names), c.pooling.name) for c in six_tables()
    ]


def test_files_without_configs_give_none(tmp_path):
    torch.save(float_ebc(seed=1).state_dict(), tmp_path / "state.pt")
    torch.save(torch.nn.Linear(2, 2), tmp_path / "linear.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a zip")
    for name in ("state.pt", "linear.pt", "junk.pt"):
        assert read_pickled_model(tmp_path / name) is None
