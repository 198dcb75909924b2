"""How often rows are read: a sample of request ids per feature (``--sample-ids FILE``), or uniform rows.

The planner uses it twice: memory tiers keep the bytes read most often per byte resident, and the precision
planner weighs each table's error by how often it is read (and measures it on the rows that are read).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from infer.config import ModelSpec, TableConfig
from infer.errors import PlanError, PlanErrorKind


@dataclass(frozen=True, eq=False)
class AccessSample:
    """Ids seen per feature in a sample of requests (int64 arrays, checked against the spec's row counts)."""

    ids: Mapping[str, np.ndarray]
    source: str = "sample ids"
    _by_table: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    def table_ids(self, table: TableConfig) -> np.ndarray:
        """Every sampled id of the table's features, sorted (a table's features share its rows)."""
        cached = self._by_table.get(table.name)
        if cached is None:
            parts = [self.ids[f] for f in table.feature_names if f in self.ids]
            cached = np.sort(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)
            self._by_table[table.name] = cached
        return cached

    def reads(self, table: TableConfig, row_offset: int = 0, num_rows: int | None = None) -> int:
        """Sampled reads of rows ``[row_offset, row_offset + num_rows)`` of the table."""
        ids = self.table_ids(table)
        end = table.num_embeddings if num_rows is None else row_offset + num_rows
        return int(np.searchsorted(ids, end, "left") - np.searchsorted(ids, row_offset, "left"))


def load_sample_ids(path: str | os.PathLike[str], spec: ModelSpec) -> AccessSample:
    """Read ``{feature_name: [id, ...]}`` from JSON, or one array per feature name from ``.npz``.

    Unknown features and ids outside a table are a ``PlanError(INVALID_CONSTRAINT)`` naming the feature;
    features left out are read uniformly.
    """
    path = Path(path)
    try:
        if path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as archive:
                raw: dict[str, object] = {name: archive[name] for name in archive.files}
        else:
            raw = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise PlanError(
            f"cannot read sample ids {str(path)!r}: {err}; write JSON {{feature: [ids]}} or an .npz of one "
            "int array per feature",
            PlanErrorKind.INVALID_CONSTRAINT,
        ) from None
    if not isinstance(raw, dict):
        raise PlanError(
            f"sample ids {str(path)!r}: expected an object {{feature_name: [ids]}}", PlanErrorKind.INVALID_CONSTRAINT
        )
    return sample_from_ids(raw, spec, source=f"sample ids {path.name}")


def sample_from_ids(raw: Mapping[str, object], spec: ModelSpec, source: str = "sample ids") -> AccessSample:
    """An ``AccessSample`` from ids per feature (lists or arrays), checked against the spec."""
    rows = {f.name: f.num_embeddings for f in spec.features}
    tables = {f.name: f.table for f in spec.features}
    ids: dict[str, np.ndarray] = {}
    for feature, values in raw.items():
        if feature not in rows:
            raise PlanError(
                f"{source}: unknown feature {feature!r}; the spec's features are {sorted(rows)}",
                PlanErrorKind.INVALID_CONSTRAINT,
            )
        try:
            array = np.asarray(values).reshape(-1)
        except (TypeError, ValueError):
            array = np.zeros(1, dtype=np.float64)
        if array.size and array.dtype.kind not in "iu":
            raise PlanError(f"{source}: feature {feature!r}: ids must be integers", PlanErrorKind.INVALID_CONSTRAINT)
        array = array.astype(np.int64)
        if array.size and (array.min() < 0 or array.max() >= rows[feature]):
            raise PlanError(
                f"{source}: feature {feature!r} has ids outside [0, {rows[feature]}) (the rows of its table "
                f"{tables[feature]!r}); fix the sample",
                PlanErrorKind.INVALID_CONSTRAINT,
            )
        ids[feature] = array
    return AccessSample(ids, source)
