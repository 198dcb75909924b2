"""Small TorchRec models for the interop tests and the DMP worker: built with real torchrec, seeded."""

from __future__ import annotations

import torch
import torch.ao.quantization as tq
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEmbeddingBagCollection
from torchrec.quant.embedding_modules import QuantConfig


def six_tables() -> list[EmbeddingBagConfig]:
    """Six tables as in the issue: one shared by two features, one MEAN, mixed shapes."""
    return [
        EmbeddingBagConfig(name="user", num_embeddings=400, embedding_dim=16, feature_names=["user_id"]),
        EmbeddingBagConfig(name="item", num_embeddings=300, embedding_dim=16, feature_names=["item_id", "last_item"]),
        EmbeddingBagConfig(
            name="category",
            num_embeddings=50,
            embedding_dim=16,
            feature_names=["category_id"],
            pooling=PoolingType.MEAN,
        ),
        EmbeddingBagConfig(name="city", num_embeddings=120, embedding_dim=16, feature_names=["city_id"]),
        EmbeddingBagConfig(name="device", num_embeddings=20, embedding_dim=16, feature_names=["device_id"]),
        EmbeddingBagConfig(name="query", num_embeddings=1000, embedding_dim=16, feature_names=["query_id"]),
    ]


def float_ebc(seed: int = 0, tables: list[EmbeddingBagConfig] | None = None) -> EmbeddingBagCollection:
    torch.manual_seed(seed)
    ebc = EmbeddingBagCollection(tables=tables or six_tables())
    with torch.no_grad():
        for bag in ebc.embedding_bags.values():
            bag.weight.normal_()  # N(0, 1): wide enough to exercise every INT8 code
    return ebc


class Wrapper(torch.nn.Module):
    def __init__(self, ebc: torch.nn.Module) -> None:
        super().__init__()
        self.ebc = ebc

    def forward(self, kjt: KeyedJaggedTensor):  # noqa: ANN201
        return self.ebc(kjt)


def quantize_ebc(module: torch.nn.Module, per_table: dict[str, torch.dtype] | None = None) -> torch.nn.Module:
    """TorchRec's own INT8 quantization (``quantize_dynamic``), FP16 for the tables in ``per_table``."""
    qconfig = QuantConfig(
        activation=tq.PlaceholderObserver.with_args(dtype=torch.float),
        weight=tq.PlaceholderObserver.with_args(dtype=torch.qint8),
        per_table_weight_dtype=per_table,
    )
    return tq.quantize_dynamic(
        module,
        qconfig_spec={EmbeddingBagCollection: qconfig},
        mapping={EmbeddingBagCollection: QuantEmbeddingBagCollection},
        inplace=False,
    )


def random_kjt(keys: list[str], rows: dict[str, int], batch: int = 8, max_len: int = 5, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len + 1, (len(keys) * batch,), generator=generator)
    lengths[::7] = 0
    values = torch.cat(
        [
            torch.randint(0, rows[key], (int(n),), generator=generator)
            for key, n in zip(keys, lengths.view(len(keys), batch).sum(1).tolist())
        ]
    )
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths)
