"""Where a streaming export reads fp32 tables from, one row range at a time: a ``TableSource``.

Four sources: a dict of tensors (a ``torch.save`` checkpoint loaded memory-mapped, or tensors already in memory),
safetensors files (``safe_open`` reads one slice of one tensor at a time), a DCP folder (read one table at a time:
DCP stores each saved block as one record), and a Python callable per table that returns row chunks on demand
(synthetic tables, custom stores). ``open_source`` picks one by what a path is. The exporter checks every chunk
it is given (shape, floating point, finite), so a source only reads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from infer.config import ModelSpec
from infer.errors import WeightsError

logger = logging.getLogger(__name__)

SAFETENSORS_SUFFIX = ".safetensors"
DCP_METADATA = ".metadata"

# rows(start, end) -> the fp32 rows start .. end of one table: one tensor, or consecutive chunks of it
RowsFn = Callable[[int, int], "torch.Tensor | Iterable[torch.Tensor]"]


class TableSource(Protocol):
    """A store of fp32 tables read row range by row range."""

    origin: str  # names the source in messages (a path, "the callable source")

    def names(self) -> Sequence[str]:
        """The tables the source holds."""
        ...

    def table_info(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        """A table's stored shape and dtype (checked against the spec before any row is read)."""
        ...

    def read_rows(self, name: str, start: int, end: int) -> torch.Tensor:
        """Rows ``start .. end`` of table ``name`` (float; any float dtype)."""
        ...


class TensorsSource:
    """Tables held as tensors: a ``torch.save`` checkpoint loaded with ``mmap=True`` (its rows are read from the
    file as they are sliced), or tensors in memory."""

    def __init__(self, tables: Mapping[str, torch.Tensor], origin: str = "the tensors") -> None:
        self.tables = dict(tables)
        self.origin = origin

    def names(self) -> Sequence[str]:
        return list(self.tables)

    def table_info(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        return tuple(self.tables[name].shape), self.tables[name].dtype

    def read_rows(self, name: str, start: int, end: int) -> torch.Tensor:
        return self.tables[name][start:end]


class SafetensorsSource:
    """Tables in one or more safetensors files, read one row range at a time (``safe_open(...).get_slice``);
    ``keys`` maps a table to its tensor's name when it is not the table's own name."""

    def __init__(self, paths: str | Path | Sequence[str | Path], keys: Mapping[str, str] | None = None) -> None:
        try:
            from safetensors import safe_open
        except ImportError:
            raise WeightsError(
                "reading safetensors files needs the safetensors package: pip install 'embserve[safetensors]'"
            ) from None
        files = [Path(paths)] if isinstance(paths, (str, Path)) else [Path(p) for p in paths]
        self.origin = ", ".join(repr(str(path)) for path in files)
        self._slices: dict[str, Any] = {}
        self._handles = []
        for path in files:
            if not path.is_file():
                raise WeightsError(f"safetensors file {str(path)!r} does not exist")
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as err:  # noqa: BLE001 - safetensors raises its own error types for a bad header
                raise WeightsError(f"cannot read safetensors file {str(path)!r}: {err}") from None
            self._handles.append(handle)
            for key in handle.keys():
                if key in self._slices:
                    raise WeightsError(f"tensor {key!r} is in more than one of the safetensors files {self.origin}")
                self._slices[key] = handle.get_slice(key)
        self._keys = dict(keys) if keys is not None else {key: key for key in self._slices}

    def names(self) -> Sequence[str]:
        return list(self._keys)

    def table_info(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        from safetensors.torch import _getdtype

        piece = self._slices[self._keys[name]]
        return tuple(piece.get_shape()), _getdtype(piece.get_dtype())

    def read_rows(self, name: str, start: int, end: int) -> torch.Tensor:
        rows: torch.Tensor = self._slices[self._keys[name]][start:end]
        return rows

    def keys(self) -> list[str]:
        """Every tensor name in the files."""
        return list(self._slices)


class DcpSource:
    """Tables in a torch.distributed.checkpoint folder, read one table at a time without a process group (DCP
    stores each saved block as one serialized record, so a table is read whole; memory holds one table).
    ``keys`` maps a table to its entry when it is not the table's own name (TorchRec state dicts)."""

    def __init__(self, path: str | Path, keys: Mapping[str, str] | None = None) -> None:
        from infer.interop.torchrec import dcp_tensors

        self.path = Path(path)
        self.origin = repr(str(self.path))
        self._stored = dcp_tensors(self.path)
        self._keys = dict(keys) if keys is not None else {key: key for key in self._stored}
        self._cached: tuple[str, torch.Tensor] | None = None

    def names(self) -> Sequence[str]:
        return list(self._keys)

    def table_info(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        return self._stored[self._keys[name]]

    def read_rows(self, name: str, start: int, end: int) -> torch.Tensor:
        from infer.interop.torchrec import read_dcp_tensors

        if self._cached is None or self._cached[0] != name:
            self._cached = None  # release the previous table before reading the next
            key = self._keys[name]
            logger.info("reading table %s from DCP checkpoint %s", name, self.path)
            self._cached = (name, read_dcp_tensors(self.path, {key: self._stored[key]})[key])
        return self._cached[1][start:end]

    def keys(self) -> list[str]:
        """Every tensor entry of the checkpoint."""
        return list(self._stored)


class CallableSource:
    """Tables made on demand: ``rows[table](start, end)`` returns rows ``start .. end`` (a tensor, or consecutive
    chunks of them); the exporter asks for at most one chunk of rows at a time. Shapes are the spec's."""

    def __init__(self, spec: ModelSpec, rows: Mapping[str, RowsFn]) -> None:
        self.origin = "the callable source"
        self._rows = dict(rows)
        self._shapes = {t.name: (t.num_embeddings, t.embedding_dim) for t in spec.tables}

    def names(self) -> Sequence[str]:
        return list(self._rows)

    def table_info(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        return self._shapes.get(name, (0, 0)), torch.float32

    def read_rows(self, name: str, start: int, end: int) -> torch.Tensor:
        made = self._rows[name](start, end)
        if isinstance(made, torch.Tensor):
            return made
        chunks = list(made)
        if not all(isinstance(chunk, torch.Tensor) for chunk in chunks):
            kinds = sorted({type(chunk).__name__ for chunk in chunks})
            raise WeightsError(f"table {name!r}: {self.origin} yielded {kinds}, expected tensors of rows")
        return torch.cat(chunks) if chunks else torch.empty(0)


def check_source(spec: ModelSpec, source: TableSource) -> None:
    """Raise ``WeightsError`` (naming the source) unless it holds exactly the spec's tables, each floating point
    [num_embeddings, embedding_dim]."""
    from infer.weights import check_table_names, check_table_shape

    try:
        check_table_names(spec, list(source.names()))
        for table in spec.tables:
            shape, dtype = source.table_info(table.name)
            check_table_shape(table.name, (table.num_embeddings, table.embedding_dim), shape, dtype)
    except WeightsError as err:
        raise WeightsError(f"{source.origin}: {err}") from None


def open_source(path: str | Path, spec: ModelSpec, torchrec: bool = False) -> TableSource:
    """The source a path holds: a DCP folder, a ``.safetensors`` file, or else a ``torch.save`` checkpoint
    (memory-mapped). Tensors are named like the spec's tables, or (``torchrec=True``) matched on TorchRec's
    ``embedding_bags.<table>.weight`` keys, whatever their prefix. The source is checked against ``spec``."""
    from infer.interop.torchrec import dcp_tensors, load_torchrec_checkpoint
    from infer.weights import load_checkpoint

    path = Path(path)
    source: TableSource
    if path.is_dir():
        if not (path / DCP_METADATA).is_file():
            raise WeightsError(f"{str(path)!r} is a folder but not a DCP checkpoint (it has no {DCP_METADATA} file)")
        source = DcpSource(path, _table_keys(path, spec, torchrec, list(dcp_tensors(path))))
    elif path.suffix == SAFETENSORS_SUFFIX:
        source = SafetensorsSource(path, _table_keys(path, spec, torchrec, SafetensorsSource(path).keys()))
    elif torchrec:
        source = TensorsSource(load_torchrec_checkpoint(path, spec), repr(str(path)))
    else:
        source = TensorsSource(load_checkpoint(path, spec), repr(str(path)))
    check_source(spec, source)
    return source


def _table_keys(path: Path, spec: ModelSpec, torchrec: bool, keys: list[str]) -> dict[str, str] | None:
    """Table -> tensor name: TorchRec's keys matched (``torchrec``), else the tables' own names (None; a TorchRec
    checkpoint given as plain tables is refused, naming the option to use)."""
    from infer.interop.torchrec import match_tables
    from infer.weights import refuse_torchrec_keys

    if torchrec:
        return match_tables(keys, spec, str(path))
    refuse_torchrec_keys(path, spec, keys)
    return None


def read_tables(source: TableSource, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Every table of ``spec`` whole, for an in-memory export (a ``TensorsSource``'s tensors as they are: a
    memory-mapped checkpoint stays mapped)."""
    if isinstance(source, TensorsSource):
        return {t.name: source.tables[t.name] for t in spec.tables}
    return {t.name: source.read_rows(t.name, 0, t.num_embeddings) for t in spec.tables}
