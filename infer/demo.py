"""The built-in demo model: eight tables of mixed size, dtype and pooling, with a small MLP over-arch."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from infer.config import DataType, ModelSpec, PoolingType, TableConfig

NUM_DENSE_FEATURES = 13

DEMO_TABLES: tuple[TableConfig, ...] = (
    TableConfig("user_id", 1_000_000, 64, ("user_id",)),
    TableConfig("item_id", 500_000, 128, ("item_id", "last_clicked_item")),
    TableConfig("ad_id", 300_000, 256, ("ad_id",), data_type=DataType.INT4),
    TableConfig("query_token", 200_000, 64, ("query_tokens",), PoolingType.MEAN, DataType.FP16),
    TableConfig("publisher", 50_000, 128, ("publisher",)),
    TableConfig("city", 10_000, 32, ("city",)),
    TableConfig("device_type", 2_000, 32, ("device_type",), PoolingType.MEAN),
    TableConfig("category", 1_000, 32, ("item_category",), PoolingType.MEAN),
)


class DemoOverArch(nn.Module):
    """DLRM-style: a bottom MLP on the dense features, concatenated with the pooled embeddings, then a top MLP."""

    def __init__(self, num_dense_features: int, pooled_dim: int, hidden: int = 64) -> None:
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(num_dense_features, hidden), nn.ReLU())
        self.top = nn.Sequential(nn.Linear(hidden + pooled_dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, dense_features: Tensor, pooled: Tensor) -> Tensor:
        bottom = self.bottom(dense_features)
        return torch.sigmoid(self.top(torch.cat([bottom, pooled], dim=1))).squeeze(1)


def demo_spec(seed: int = 0) -> ModelSpec:
    """The demo model's spec, with a seeded over-arch as its dense part."""
    tables = DEMO_TABLES
    pooled_dim = sum(t.embedding_dim * len(t.feature_names) for t in tables)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        arch = DemoOverArch(NUM_DENSE_FEATURES, pooled_dim).eval()
    return ModelSpec(tables, NUM_DENSE_FEATURES, arch)
