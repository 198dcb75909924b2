"""Precision blocks of a table's rows: ranking rows by how often requests read them, and the id remap (id -> rank)
that puts the hottest rows in the first (most precise) block."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from infer.config import ModelSpec
from infer.errors import ConfigError


def rank_rows(num_rows: int, sample_ids: Any, table: str = "?") -> torch.Tensor:
    """The rows of a ``num_rows``-row table ranked hottest first: by how often ``sample_ids`` (ids seen in requests,
    1-D integers) reads them, ties and unseen rows in id order. An int64 permutation of ``[0, num_rows)``."""
    ids = np.asarray(sample_ids)
    if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise ConfigError(f"sample ids of table {table!r} must be a 1-D sequence of integer row ids")
    ids = ids.astype(np.int64, copy=False)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= num_rows):
        bad = int(ids[(ids < 0) | (ids >= num_rows)][0])
        raise ConfigError(f"sample ids of table {table!r} hold row {bad}, outside [0, {num_rows}); pass its rows")
    counts = np.bincount(ids, minlength=num_rows)
    return torch.from_numpy(np.argsort(-counts, kind="stable").astype(np.int64))


def remap_of(order: torch.Tensor) -> torch.Tensor:
    """The id remap (id -> rank, int32) of ``order`` (ids ranked hottest first)."""
    remap = torch.empty(order.numel(), dtype=torch.int32)
    remap[order.to(torch.int64)] = torch.arange(order.numel(), dtype=torch.int32)
    return remap


def block_orders(spec: ModelSpec, orders: Mapping[str, Any] | None) -> dict[str, torch.Tensor]:
    """Per block table of ``spec``, its rows ranked hottest first, checked: ``orders`` gives each block table's
    ranking (ids hottest first, a permutation of its rows; ``rank_rows`` makes one from sampled ids). The ids of
    the last (cold) block come back in id order: the block is a set, and in id order its rows are written and
    read in the table's own order."""
    orders = dict(orders or {})
    unknown = sorted(set(orders) - set(spec.block_tables))
    if unknown:
        raise ConfigError(
            f"block_orders names table(s) {unknown}, which are not held in precision blocks; the block tables are "
            f"{list(spec.block_tables)}"
        )
    out: dict[str, torch.Tensor] = {}
    for name in spec.block_tables:
        rows = spec.table(name).num_embeddings
        if name not in orders:
            raise ConfigError(
                f"table {name!r} is held in precision blocks but no ranking of its rows was given; pass "
                f"block_orders={{{name!r}: ids hottest first}} (infer.quant.blocks.rank_rows(rows, sampled_ids))"
            )
        from infer.modules.collection import rank_error

        order = torch.as_tensor(orders[name])
        error = rank_error(order, rows)
        if error is not None:
            raise ConfigError(f"block_orders of table {name!r} {error}; pass its {rows} row ids, hottest first")
        order = order.to(torch.int64)
        cold_start = rows - spec.table(name).blocks[-1].rows
        out[name] = torch.cat([order[:cold_start], torch.sort(order[cold_start:]).values])
    return out
