"""Model configuration: embedding tables, the features that read them, and an optional dense part.

Configs are frozen and validated when constructed, so a bad spec fails at the line that built it,
with the table's name in the message.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infer.errors import ConfigError

if TYPE_CHECKING:
    import torch

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")

# Rows beyond 2**31 would overflow the kernel's int32 offsets within one table.
MAX_ROWS = 2**31 - 1
MAX_DIM = 2048


class PoolingType(enum.Enum):
    SUM = "sum"
    MEAN = "mean"


class DataType(enum.Enum):
    """Storage type of a table's rows in the served model."""

    FP32 = "fp32"
    FP16 = "fp16"
    INT8 = "int8"
    INT4 = "int4"
    INT2 = "int2"

    @property
    def bits(self) -> int:
        return {"fp32": 32, "fp16": 16, "int8": 8, "int4": 4, "int2": 2}[self.value]

    @property
    def is_integer(self) -> bool:
        return self in (DataType.INT8, DataType.INT4, DataType.INT2)

    @classmethod
    def parse(cls, value: str | DataType) -> DataType:
        if isinstance(value, DataType):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            choices = ", ".join(d.value for d in cls)
            raise ConfigError(f"unknown data type {value!r}; use one of {choices}") from None


def _parse_pooling(value: str | PoolingType, table: str) -> PoolingType:
    if isinstance(value, PoolingType):
        return value
    try:
        return PoolingType(str(value).lower())
    except ValueError:
        raise ConfigError(f"table {table!r}: unknown pooling {value!r}; use 'sum' or 'mean'") from None


@dataclass(frozen=True)
class RowBlock:
    """One block of a table held in precision blocks: ``rows`` rows stored in ``data_type``. A table's blocks are
    ranked, hottest first: which ids fall in which block is data (the id remap the model and artifact carry), the
    config states only the sizes and types."""

    rows: int
    data_type: DataType

    def to_dict(self) -> dict[str, Any]:
        return {"rows": self.rows, "data_type": self.data_type.value}


def stores_dim(data_type: DataType, dim: int) -> bool:
    """fbgemm stores rows of ``dim`` values in ``data_type`` (every dim is a multiple of 4): INT2 rows also need an
    even number of bytes (fbgemm's quantizer refuses others: "ncols needs to be multiple of 2 Bytes")."""
    return data_type != DataType.INT2 or dim % 8 == 0


def _parse_blocks(value: Any, table: str, num_embeddings: int) -> tuple[RowBlock, ...]:
    """``blocks`` as RowBlocks (accepting ``RowBlock``, ``(rows, dtype)`` pairs or ``{"rows", "data_type"}``
    objects); ``ConfigError`` naming the table unless every block has rows and together they cover the table."""
    if value is None:
        return ()
    if isinstance(value, (str, Mapping)) or not isinstance(value, Sequence):
        raise ConfigError(f"table {table!r}: blocks must be a list of (rows, data_type), got {value!r}")
    blocks: list[RowBlock] = []
    for i, raw in enumerate(value):
        if isinstance(raw, RowBlock):
            rows, dtype = raw.rows, raw.data_type
        elif isinstance(raw, Mapping) and set(raw) == {"rows", "data_type"}:
            rows, dtype = raw["rows"], raw["data_type"]
        elif isinstance(raw, Sequence) and not isinstance(raw, str) and len(raw) == 2:
            rows, dtype = raw
        else:
            raise ConfigError(
                f"table {table!r}: blocks[{i}] = {raw!r}; write a block as (rows, data_type) or "
                '{"rows": N, "data_type": "int8"}'
            )
        if isinstance(rows, bool) or not isinstance(rows, int) or rows <= 0:
            raise ConfigError(f"table {table!r}: blocks[{i}] rows must be a positive int, got {rows!r}")
        try:
            blocks.append(RowBlock(rows, DataType.parse(dtype)))
        except ConfigError as err:
            raise ConfigError(f"table {table!r}: blocks[{i}]: {err}") from None
    if len(blocks) == 1:
        raise ConfigError(
            f"table {table!r}: one block is the whole table in one type; set data_type={blocks[0].data_type.value!r} "
            "instead, or state two blocks or more"
        )
    # blocks are the kernel's levels (``infer.modules.collection.kernel_features``): a few, each in int32 rows
    if len(blocks) > 7 or any(b.rows >= 1 << 28 for b in blocks[:-1]):
        raise ConfigError(
            f"table {table!r}: {len(blocks)} blocks; a table holds at most 7 blocks, each but the last (cold) one "
            "under 2**28 rows"
        )
    total = sum(b.rows for b in blocks)
    if blocks and total != num_embeddings:
        raise ConfigError(
            f"table {table!r}: blocks hold {total} rows but the table has {num_embeddings}; make the blocks' rows "
            "add up to num_embeddings"
        )
    return tuple(blocks)


@dataclass(frozen=True)
class TableConfig:
    """One embedding table and the features that look it up.

    Several features may share a table; each produces its own pooled output columns.
    ``pooling_stated=False`` marks a pooling nobody has stated (a spec written from a state dict, which does
    not record it: ``"pooling": null`` in JSON); ``pooling`` is then a placeholder that planning may use
    (bytes do not depend on it) and export refuses (``ModelSpec.require_stated_pooling``).

    ``blocks`` (optional) holds the table in precision blocks: ranked row blocks, hottest first, each in its own
    type (e.g. ``((4096, "int8"), (rows - 4096, "int4"))``); the rows' ranking is given to ``quantize``. A table
    with blocks ignores ``data_type``.
    """

    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: tuple[str, ...]
    pooling: PoolingType = PoolingType.SUM
    data_type: DataType = DataType.INT8
    pooling_stated: bool = True
    blocks: tuple[RowBlock, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ConfigError(
                f"table name {self.name!r} is invalid; use letters, digits, '_', '.', '-' "
                "and start with a letter or '_'"
            )
        for attr, upper in (("num_embeddings", MAX_ROWS), ("embedding_dim", MAX_DIM)):
            value = getattr(self, attr)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"table {self.name!r}: {attr} must be a positive int, got {value!r}")
            if value > upper:
                raise ConfigError(f"table {self.name!r}: {attr}={value} exceeds the maximum {upper}")
        if self.embedding_dim % 4 != 0:
            raise ConfigError(
                f"table {self.name!r}: embedding_dim={self.embedding_dim} must be a multiple of 4 "
                "(the TBE kernel packs INT2/INT4 rows to whole bytes); pad the table"
            )
        names = self.feature_names
        if isinstance(names, str):
            names = (names,)
        names = tuple(names)
        if not names:
            raise ConfigError(f"table {self.name!r}: feature_names is empty; name at least one feature")
        for feature in names:
            if not isinstance(feature, str) or not _NAME.match(feature):
                raise ConfigError(f"table {self.name!r}: feature name {feature!r} is invalid")
        if len(set(names)) != len(names):
            raise ConfigError(f"table {self.name!r}: feature_names {list(names)} has duplicates")
        object.__setattr__(self, "feature_names", names)
        object.__setattr__(self, "pooling", _parse_pooling(self.pooling, self.name))
        try:
            object.__setattr__(self, "data_type", DataType.parse(self.data_type))
        except ConfigError as err:
            raise ConfigError(f"table {self.name!r}: {err}") from None
        object.__setattr__(self, "blocks", _parse_blocks(self.blocks, self.name, self.num_embeddings))
        for block in self.stored_blocks:
            if not stores_dim(block.data_type, self.embedding_dim):
                raise ConfigError(
                    f"table {self.name!r}: embedding_dim={self.embedding_dim} cannot be stored as "
                    + f"{block.data_type.value} (fbgemm packs four int2 values a byte and needs an even number of "
                    + "bytes a row: a multiple of 8); store it as int4, or pad the table to a multiple of 8"
                )

    def with_data_type(self, data_type: DataType | str) -> TableConfig:
        return dataclasses.replace(self, data_type=DataType.parse(data_type))

    def with_pooling(self, pooling: PoolingType | str) -> TableConfig:
        """A copy whose pooling is stated: ``pooling``."""
        return dataclasses.replace(self, pooling=_parse_pooling(pooling, self.name), pooling_stated=True)

    @property
    def stored_blocks(self) -> tuple[RowBlock, ...]:
        """The row blocks the kernel holds: ``blocks``, or the whole table in ``data_type``."""
        return self.blocks or (RowBlock(self.num_embeddings, self.data_type),)

    def with_blocks(self, blocks: Sequence[Any]) -> TableConfig:
        """A copy held in ``blocks`` (ranked (rows, data_type) pairs; empty: one type again)."""
        return dataclasses.replace(self, blocks=tuple(blocks))

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "name": self.name,
            "num_embeddings": self.num_embeddings,
            "embedding_dim": self.embedding_dim,
            "feature_names": list(self.feature_names),
            "pooling": self.pooling.value if self.pooling_stated else None,
            "data_type": self.data_type.value,
        }
        if self.blocks:
            data["blocks"] = [b.to_dict() for b in self.blocks]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TableConfig:
        known = {"name", "num_embeddings", "embedding_dim", "feature_names", "pooling", "data_type", "blocks"}
        name = data.get("name", "?")
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"table {name!r}: unknown keys {sorted(unknown)}; known keys are {sorted(known)}")
        missing = {"name", "num_embeddings", "embedding_dim", "feature_names"} - set(data)
        if missing:
            raise ConfigError(f"table {name!r}: missing keys {sorted(missing)}")
        # "pooling": null is a pooling nobody has stated yet (``embserve spec`` writes it); absent means sum
        pooling = data.get("pooling", "sum")
        return cls(
            name=data["name"],
            num_embeddings=data["num_embeddings"],
            embedding_dim=data["embedding_dim"],
            feature_names=tuple(data["feature_names"]),
            pooling=PoolingType.SUM if pooling is None else pooling,
            data_type=data.get("data_type", "int8"),
            pooling_stated=pooling is not None,
            blocks=data.get("blocks") or (),
        )


@dataclass(frozen=True)
class FeatureInfo:
    """Where one input feature reads from and where its pooled output lands."""

    name: str
    table: str
    num_embeddings: int
    embedding_dim: int
    pooling: PoolingType
    column_start: int

    @property
    def column_end(self) -> int:
        return self.column_start + self.embedding_dim


@dataclass(frozen=True)
class ModelSpec:
    """The tables of a model, in order, plus an optional dense part.

    The input feature order is the tables' order, then each table's ``feature_names`` order.
    ``dense_arch`` is a scriptable ``nn.Module`` mapping ``(dense_features [B, num_dense_features],
    pooled [B, output_dim])`` to scores; it is not part of the JSON form (the artifact carries it).
    """

    tables: tuple[TableConfig, ...]
    num_dense_features: int = 0
    dense_arch: torch.nn.Module | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        tables = tuple(self.tables)
        if not tables:
            raise ConfigError("model spec has no tables; add at least one TableConfig")
        for table in tables:
            if not isinstance(table, TableConfig):
                raise ConfigError(f"model spec tables must be TableConfig, got {type(table).__name__}")
        seen_tables: set[str] = set()
        owner: dict[str, str] = {}
        for table in tables:
            if table.name in seen_tables:
                raise ConfigError(f"table {table.name!r} appears twice in the model spec; rename one")
            seen_tables.add(table.name)
            for feature in table.feature_names:
                if feature in owner:
                    raise ConfigError(
                        f"feature {feature!r} is read by tables {owner[feature]!r} and {table.name!r}; "
                        "a feature reads exactly one table (list several features on one table to share it)"
                    )
                owner[feature] = table.name
        object.__setattr__(self, "tables", tables)
        n_dense = self.num_dense_features
        if isinstance(n_dense, bool) or not isinstance(n_dense, int) or n_dense < 0:
            raise ConfigError(f"num_dense_features must be a non-negative int, got {n_dense!r}")
        if self.dense_arch is not None and n_dense == 0:
            raise ConfigError("a dense_arch needs num_dense_features > 0 (the width of the dense input)")

    @property
    def feature_names(self) -> tuple[str, ...]:
        return tuple(f for t in self.tables for f in t.feature_names)

    @property
    def features(self) -> tuple[FeatureInfo, ...]:
        infos: list[FeatureInfo] = []
        column = 0
        for table in self.tables:
            for feature in table.feature_names:
                infos.append(
                    FeatureInfo(feature, table.name, table.num_embeddings, table.embedding_dim, table.pooling, column)
                )
                column += table.embedding_dim
        return tuple(infos)

    @property
    def output_dim(self) -> int:
        return sum(t.embedding_dim * len(t.feature_names) for t in self.tables)

    @property
    def block_tables(self) -> tuple[str, ...]:
        """The tables held in precision blocks, in order."""
        return tuple(t.name for t in self.tables if t.blocks)

    def table(self, name: str) -> TableConfig:
        for table in self.tables:
            if table.name == name:
                return table
        raise ConfigError(f"unknown table {name!r}; the spec has {[t.name for t in self.tables]}")

    def with_data_types(
        self, default: DataType | str | None = None, overrides: Mapping[str, DataType | str] | None = None
    ) -> ModelSpec:
        """A copy with every table's data type set to ``default`` (when given), then ``overrides`` by name."""
        overrides = dict(overrides or {})
        names = {t.name for t in self.tables}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ConfigError(f"data type override for unknown table(s) {unknown}; the spec has {sorted(names)}")
        tables = []
        for table in self.tables:
            dtype = overrides.get(table.name, default if default is not None else table.data_type)
            try:
                tables.append(table.with_data_type(dtype))
            except ConfigError as err:
                raise ConfigError(f"table {table.name!r}: {err}") from None
        return ModelSpec(tuple(tables), self.num_dense_features, self.dense_arch)

    @property
    def unstated_pooling(self) -> tuple[str, ...]:
        """The tables whose pooling nobody has stated (``"pooling": null``), in order."""
        return tuple(t.name for t in self.tables if not t.pooling_stated)

    def with_pooling(self, pooling: Mapping[str, PoolingType | str]) -> ModelSpec:
        """A copy with the pooling of the tables named in ``pooling`` stated."""
        unknown = sorted(set(pooling) - {t.name for t in self.tables})
        if unknown:
            raise ConfigError(f"pooling for unknown table(s) {unknown}; the spec has {[t.name for t in self.tables]}")
        tables = tuple(t.with_pooling(pooling[t.name]) if t.name in pooling else t for t in self.tables)
        return ModelSpec(tables, self.num_dense_features, self.dense_arch)

    def require_stated_pooling(self, fix: str | None = None) -> None:
        """``ConfigError`` naming every table whose pooling nobody has stated: serving it summed when the model
        was trained with MEAN (or the reverse) answers wrong without any error. ``fix`` says how to state it."""
        unstated = self.unstated_pooling
        if not unstated:
            return
        fix = fix or (
            f"state it: spec.with_pooling({{{unstated[0]!r}: 'mean', ...}}), TableConfig(..., pooling=...), or "
            '"pooling": "sum" or "mean" in the spec JSON'
        )
        raise ConfigError(
            f'the pooling of table(s) {list(unstated)} is not stated ("pooling": null: it was not read from a '
            "model; a state dict does not record it), and serving a MEAN-trained table summed (or the reverse) "
            f"answers wrong without an error; {fix}"
        )

    def with_dense_arch(self, dense_arch: torch.nn.Module | None, num_dense_features: int) -> ModelSpec:
        return ModelSpec(self.tables, num_dense_features, dense_arch)

    def to_dict(self) -> dict[str, Any]:
        return {"tables": [t.to_dict() for t in self.tables], "num_dense_features": self.num_dense_features}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelSpec:
        if not isinstance(data, Mapping) or "tables" not in data:
            raise ConfigError("a model spec is a JSON object with a 'tables' list")
        unknown = set(data) - {"tables", "num_dense_features"}
        if unknown:
            raise ConfigError(
                f"model spec: unknown keys {sorted(unknown)}; known keys are 'tables', 'num_dense_features'"
            )
        raw_tables = data["tables"]
        if not isinstance(raw_tables, Sequence) or isinstance(raw_tables, str):
            raise ConfigError("'tables' must be a list of table objects")
        for i, raw in enumerate(raw_tables):
            if not isinstance(raw, Mapping):
                raise ConfigError(
                    f"tables[{i}] must be an object with name, num_embeddings, embedding_dim, feature_names"
                )
        tables = tuple(TableConfig.from_dict(t) for t in raw_tables)
        return cls(tables, data.get("num_dense_features", 0))

    @classmethod
    def from_json(cls, text: str) -> ModelSpec:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(f"model spec is not valid JSON: {err}") from None
        return cls.from_dict(data)

    @classmethod
    def load(cls, path: str | Path) -> ModelSpec:
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as err:
            raise ConfigError(f"cannot read model spec {str(path)!r}: {err.strerror}") from None
        return cls.from_json(text)
