"""The fp32 embedding-bag collection: the training-side input and the independent test reference.

It pools with ``torch.nn.functional.embedding_bag`` only; nothing here touches fbgemm.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from infer.config import ModelSpec, PoolingType
from infer.features import SparseFeatures
from infer.weights import check_weights


class FloatEmbeddingBagCollection(torch.nn.Module):
    """fp32 pooled lookups of every feature of ``spec``; output ``[batch, spec.output_dim]``.

    MEAN pooling divides the (weighted) sum by the bag's length; an empty bag pools to zeros.
    """

    def __init__(self, spec: ModelSpec, weights: Mapping[str, torch.Tensor]) -> None:
        super().__init__()
        check_weights(spec, weights)
        self.spec = spec
        # A plain dict: table names such as "items" or "a.b" are not valid ParameterDict keys.
        self.tables: dict[str, torch.Tensor] = {t.name: weights[t.name].detach().float() for t in spec.tables}

    def forward(self, batch: SparseFeatures | Any) -> torch.Tensor:
        """``batch``: any form ``SparseFeatures.of`` takes (a mapping, a TorchRec KeyedJaggedTensor)."""
        batch = SparseFeatures.of(batch).validate(self.spec)
        num_features = len(batch.keys)
        size = batch.batch_size
        lengths = batch.lengths.to(torch.int64).view(num_features, size)
        per_feature = lengths.sum(dim=1).tolist()
        outputs = []
        start = 0
        for f, info in enumerate(self.spec.features):
            end = start + int(per_feature[f])
            ids = batch.values[start:end].to(torch.int64)
            offsets = torch.cumsum(lengths[f], 0) - lengths[f]  # start of each bag; [] for an empty batch
            psw = batch.weights[start:end] if batch.weights is not None else None
            mean = info.pooling == PoolingType.MEAN
            # embedding_bag's "mean" takes no per-id weights: a weighted mean is sum(w * x) / length.
            mode = "mean" if mean and psw is None else "sum"
            pooled = F.embedding_bag(ids, self.tables[info.table], offsets, mode=mode, per_sample_weights=psw)
            if mean and psw is not None:
                pooled = pooled / lengths[f].clamp(min=1).unsqueeze(1).to(pooled.dtype)
            outputs.append(pooled)
            start = end
        return torch.cat(outputs, dim=1)
