"""The pooled layout a dense part was built against: which feature's pooled embedding it reads from which
columns, pooled how. It travels with the dense module (a string attribute, kept by ``torch.jit.save``/``load``)
and into the artifact's manifest (``dense.expects``); a spec that lays the columns out otherwise is refused.

A dense part cannot see its input's meaning, only its columns: a spec listing the tables in another order, or
pooling a table otherwise, than the model was trained with serves wrong scores without any error. Recording
the layout where the dense part is made (``infer.from_torchrec``) lets export check it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from infer.config import ModelSpec, PoolingType
from infer.errors import ConfigError

logger = logging.getLogger(__name__)

# The dense module's attribute holding the layout as JSON (a str attribute survives torch.jit.script/save/load).
LAYOUT_ATTRIBUTE = "embserve_pooled_layout"


@dataclass(frozen=True)
class PooledColumns:
    """One feature's pooled embedding as the dense part reads it: columns ``[column_start, column_end)``."""

    name: str
    table: str
    pooling: PoolingType
    column_start: int
    column_end: int

    @property
    def dim(self) -> int:
        return self.column_end - self.column_start

    @property
    def columns(self) -> str:
        return f"{self.column_start}:{self.column_end}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "table": self.table,
            "pooling": self.pooling.value,
            "column_start": self.column_start,
            "column_end": self.column_end,
        }


@dataclass(frozen=True)
class PooledLayout:
    """The pooled input a dense part expects, feature by feature in column order."""

    features: tuple[PooledColumns, ...]

    @classmethod
    def of_spec(cls, spec: ModelSpec) -> PooledLayout:
        """The layout ``spec`` produces: its features in input order, with their tables, pooling and columns."""
        return cls(
            tuple(PooledColumns(f.name, f.table, f.pooling, f.column_start, f.column_end) for f in spec.features)
        )

    def to_dict(self) -> dict[str, Any]:
        return {"features": [f.to_dict() for f in self.features]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PooledLayout:
        """A layout from its JSON form (the manifest's schema has checked the types)."""
        return cls(
            tuple(
                PooledColumns(
                    str(f["name"]),
                    str(f["table"]),
                    PoolingType(f["pooling"]),
                    int(f["column_start"]),
                    int(f["column_end"]),
                )
                for f in data["features"]
            )
        )

    def mismatches(self, spec: ModelSpec) -> list[str]:
        """What ``spec`` lays out otherwise than this layout, one phrase per difference (empty: they agree)."""
        given = PooledLayout.of_spec(spec)
        problems = _table_differences(self.features, given.features)
        problems += _feature_differences(self.features, given.features)
        if not problems and given != self:
            problems.append(_order_difference(self.features, given.features))
        return problems

    def check(self, spec: ModelSpec, source: str) -> None:
        """Raise ``ConfigError`` naming every difference unless ``spec`` lays out the pooled columns as recorded."""
        problems = self.mismatches(spec)
        if problems:
            raise ConfigError(
                f"{source} was trained on another pooled layout than the spec gives it: {'; '.join(problems)}. "
                f"Fix the spec: list its tables and features in this order, with this pooling: {self.describe()} "
                "(or take the spec from the model: infer.from_torchrec)"
            )

    def table_pooling(self) -> dict[str, PoolingType]:
        """Each table's pooling as the model was trained with it."""
        return {f.table: f.pooling for f in self.features}

    def describe(self) -> str:
        """``table(pooling): feature, feature; ...`` in column order: the spec to write."""
        tables: dict[str, list[PooledColumns]] = {}
        for feature in self.features:
            tables.setdefault(feature.table, []).append(feature)
        return "; ".join(
            f"{table}({features[0].pooling.value}): {', '.join(f.name for f in features)}"
            for table, features in tables.items()
        )


def record_layout(module: Any, layout: PooledLayout) -> None:
    """Record on the dense ``module`` the layout it was built against (kept when it is scripted and saved)."""
    setattr(module, LAYOUT_ATTRIBUTE, json.dumps(layout.to_dict(), separators=(",", ":")))


def recorded_layout(module: Any) -> PooledLayout | None:
    """The layout recorded on a dense module (a Python, scripted or loaded one), or None when it records none."""
    text = getattr(module, LAYOUT_ATTRIBUTE, None) if module is not None else None
    if not isinstance(text, str):
        return None
    try:
        return PooledLayout.from_dict(json.loads(text))
    except (ValueError, KeyError, TypeError) as err:
        raise ConfigError(
            f"the dense part's recorded pooled layout ({LAYOUT_ATTRIBUTE}) is unreadable ({err}); "
            "write it again from the trained model (infer.from_torchrec)"
        ) from None


def checked_layout(spec: ModelSpec, dense_arch: Any, source: str = "the dense part") -> PooledLayout | None:
    """The layout ``dense_arch`` records, after checking ``spec`` against it; None when it records none."""
    layout = recorded_layout(dense_arch)
    if layout is None:
        if dense_arch is not None:
            logger.info("%s records no pooled layout: its columns are taken to follow the spec's order", source)
        return None
    layout.check(spec, source)
    return layout


def _table_differences(expected: Sequence[PooledColumns], given: Sequence[PooledColumns]) -> list[str]:
    """Pooling and dim per table, and tables one side lacks."""
    want = {f.table: f for f in expected}
    have = {f.table: f for f in given}
    problems = []
    for table, feature in want.items():
        other = have.get(table)
        if other is None:
            problems.append(f"table {table!r} is not in the spec")
            continue
        if other.pooling != feature.pooling:
            problems.append(
                f"table {table!r} is pooled {feature.pooling.value} in the trained model, "
                f"{other.pooling.value} in the spec"
            )
        if other.dim != feature.dim:
            problems.append(f"table {table!r} has dim {feature.dim} in the trained model, {other.dim} in the spec")
    problems += [f"table {table!r} is in the spec but not in the trained model" for table in have if table not in want]
    return problems


def _feature_differences(expected: Sequence[PooledColumns], given: Sequence[PooledColumns]) -> list[str]:
    """Features one side lacks, and features that read another table."""
    want = {f.name: f for f in expected}
    have = {f.name: f for f in given}
    problems = []
    for name, feature in want.items():
        other = have.get(name)
        if other is None:
            problems.append(f"feature {name!r} (table {feature.table!r}) is not in the spec")
        elif other.table != feature.table:
            problems.append(
                f"feature {name!r} reads table {feature.table!r} in the trained model, {other.table!r} in the spec"
            )
    problems += [
        f"feature {name!r} (table {f.table!r}) is in the spec but not in the trained model"
        for name, f in have.items()
        if name not in want
    ]
    return problems


def _order_difference(expected: Sequence[PooledColumns], given: Sequence[PooledColumns]) -> str:
    """Same tables and features, other columns: the order differs. Names every feature that moved."""
    columns = {f.name: f.columns for f in given}
    moved = [
        f"feature {f.name!r} (table {f.table!r}) is read from columns {f.columns}, "
        f"the spec puts it at {columns[f.name]}"
        for f in expected
        if columns[f.name] != f.columns
    ]
    tables = list(dict.fromkeys(f.table for f in expected))
    spec_tables = list(dict.fromkeys(f.table for f in given))
    if tables != spec_tables:
        order = f"the trained model reads tables {tables}, the spec lists {spec_tables}"
    else:
        order = (
            f"the trained model reads features {[f.name for f in expected]}, the spec lists {[f.name for f in given]}"
        )
    return f"order: {order} ({'; '.join(moved)})"
