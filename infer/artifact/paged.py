"""Serving a mapped artifact larger than RAM: the loaded model wrapped so that a batch's pages are read ahead of
the kernel (``infer.storage.prefetch``) and hot rows are served from a small resident table in front of the
mapped ones.

The hot-row cache is a resident TBE (same row codec, the rows' bytes copied from the mapping) holding the rows
chosen for each cached table. A batch's ids are split once: a hot id goes to the cache (as its slot), every other
id to the model as before; the cache pools SUM and its sums are added to the model's columns (a MEAN feature's
column is the model's mean of the cold ids times their count, plus the hot sum, over the full bag length). RAM then
holds the hot rows themselves rather than the 4 KiB pages around them.

The wrapper keeps the model's calling convention (``model(values, lengths, weights)``, ``predict``,
``lookup_and_predict``, ``score``), so ``Runtime`` and the server call it unchanged; a model without either
feature is never wrapped and pays nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from infer.artifact.kernels import Kernel, kernel_holders
from infer.config import DataType, ModelSpec, PoolingType
from infer.errors import ConfigError
from infer.planner.types import MemoryTier, ShardingPlan
from infer.quant.rowwise import row_bytes, unpadded_row_bytes
from infer.storage.prefetch import MADV_DONTNEED, Prefetcher, RowRegion, advise

logger = logging.getLogger(__name__)

PREFETCH_MODES = ("auto", "on", "off")
FILL_ROWS = 16384  # hot rows copied per piece at load
READ_ROW_BLOCK = 1  # infer.modules.sharded.READ_ROW_BLOCK (that module imports fbgemm-facing code; not here)


@dataclass(frozen=True)
class TablePlace:
    """One place a feature's rows are read from: its region in memory, the rows' bytes there (``[rows,
    row_bytes]`` view of the mapping) and the table's columns and data type."""

    region: RowRegion
    rows: torch.Tensor
    dim: int
    data_type: DataType


def table_places(module: Any, kernels: Sequence[Kernel]) -> list[TablePlace]:
    """Where every feature's ids are read from, in the mapped weight buffers of a loaded model's kernels (the
    unsharded collection, or each device's shards: row blocks, column slices, replicas sharing one buffer)."""
    places: dict[RowRegion, TablePlace] = {}
    for holder, kernel in zip(kernel_holders(module), kernels):
        if kernel.weights is None or kernel.shared is None:
            continue
        if getattr(holder, "has_blocks", False):
            # a kernel of precision blocks reads its rows at remapped positions, level by level: request ids name
            # no page of it, so nothing is read ahead there
            continue
        buffer = holder.tbe.weights_host
        local = len(kernel.feature_table_map)
        features = list(getattr(holder, "lf_feature", range(local)))
        kinds = list(getattr(holder, "lf_kind", [0] * local))
        lows = list(getattr(holder, "lf_lo", [0] * local))
        highs = list(getattr(holder, "lf_hi", [0] * local))
        for i, t in enumerate(kernel.feature_table_map):
            table = kernel.tables[t]
            size = row_bytes(table.dim, table.data_type, kernel.row_alignment)
            lo, hi = (lows[i], highs[i]) if kinds[i] == READ_ROW_BLOCK else (0, table.rows)
            start = kernel.shared.table_offsets[t]
            rows = buffer[start : start + table.rows * size].view(table.rows, size)
            region = RowRegion(int(features[i]), rows.data_ptr(), size, lo, lo + table.rows if hi == 0 else hi)
            places.setdefault(region, TablePlace(region, rows, table.dim, table.data_type))
    return list(places.values())


def check_prefetch_mode(mode: str) -> str:
    if mode not in PREFETCH_MODES:
        raise ConfigError(f"unknown prefetch mode {mode!r}; choose one of {list(PREFETCH_MODES)}")
    return mode


def prefetch_wanted(mode: str, mapped: bool, plan: ShardingPlan | None) -> bool:
    """Whether to read batches' pages ahead: ``on``, ``off``, or ``auto`` (on when the artifact is mapped and its
    plan puts a shard in the paged tier)."""
    check_prefetch_mode(mode)
    if not mapped or mode == "off":
        return False
    if mode == "on":
        return True
    return plan is not None and any(s.tier == MemoryTier.PAGED for t in plan.tables for s in t.shards)


# ------------------------------------------------------------------------------------------------ hot rows


def choose_hot_rows(spec: ModelSpec, sample_ids: Mapping[str, Any], max_rows: int) -> dict[str, torch.Tensor]:
    """The ``max_rows`` rows read most often in ``sample_ids`` (table name -> ids seen in requests, any 1-D
    integer sequence), over all its tables together; per table, most frequent first. Ids are checked against
    their table."""
    if max_rows < 1:
        raise ConfigError(f"max_rows must be >= 1, got {max_rows}")
    names: list[np.ndarray] = []
    rows: list[np.ndarray] = []
    counts: list[np.ndarray] = []
    for name, ids in sample_ids.items():
        table = _table(spec, name, "sample_ids")
        seen = _row_ids(table.name, table.num_embeddings, ids, "sample_ids")
        unique, count = np.unique(seen.numpy(), return_counts=True)
        names.append(np.full(unique.size, len(rows)))
        rows.append(unique)
        counts.append(count)
    if not rows:
        return {}
    which, row, count = np.concatenate(names), np.concatenate(rows), np.concatenate(counts)
    order = np.argsort(-count, kind="stable")[:max_rows]
    tables = list(sample_ids)
    return {
        tables[t]: torch.from_numpy(row[order[which[order] == t]].astype(np.int64))
        for t in sorted(set(which[order].tolist()))
    }


def hot_rows_from_sample(spec: ModelSpec, path: str | Path, max_rows: int) -> dict[str, torch.Tensor]:
    """``choose_hot_rows`` of a file of sampled request ids (``embserve serve|run --hot-rows-sample FILE``): JSON
    ``{feature: [ids]}`` or an ``.npz`` of one int array per feature, the planner's ``--sample-ids`` format read
    by ``infer.planner.access.load_sample_ids`` (a table's features share its rows). ``ConfigError`` naming the
    file, the feature and its table, and the fix, for an unreadable file, ids outside a table or no ids."""
    from infer.errors import PlanError
    from infer.planner.access import load_sample_ids

    try:
        sample = load_sample_ids(path, spec)
    except PlanError as err:
        raise ConfigError(f"hot-row sample: {err}") from None
    by_table = {t.name: sample.table_ids(t) for t in spec.tables}
    by_table = {name: ids for name, ids in by_table.items() if ids.size}
    if not by_table:
        raise ConfigError(
            f"hot-row sample {str(path)!r} holds no ids of the model's features {list(spec.feature_names)[:20]}; "
            "write the ids seen in requests per feature"
        )
    return choose_hot_rows(spec, by_table, max_rows)


def _table(spec: ModelSpec, name: str, what: str) -> Any:
    for table in spec.tables:
        if table.name == name:
            return table
    names = [t.name for t in spec.tables]
    raise ConfigError(f"{what} names table {name!r}, which the model does not have; its tables are {names[:20]}")


def _row_ids(table: str, rows: int, ids: Any, what: str) -> torch.Tensor:
    try:
        tensor = torch.as_tensor(ids)
    except (TypeError, ValueError, RuntimeError):
        raise ConfigError(f"{what} of table {table!r} is not a sequence of row ids; pass a 1-D list of ints") from None
    if tensor.dim() != 1 or tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
        raise ConfigError(
            f"{what} of table {table!r} must be a 1-D sequence of integer row ids, got {tensor.dtype} of shape "
            f"{list(tensor.shape)}"
        )
    tensor = tensor.to(torch.int64)
    if tensor.numel() and (int(tensor.min()) < 0 or int(tensor.max()) >= rows):
        bad = int(tensor[(tensor < 0) | (tensor >= rows)][0])
        raise ConfigError(f"{what} of table {table!r} has row {bad}, outside [0, {rows}); pass rows of that table")
    return tensor


class HotRowCache:
    """A resident TBE holding ``hot_rows`` (table name -> row ids) of the mapped tables, copied from ``places``,
    and the split of a batch's ids between it and the model."""

    def __init__(self, spec: ModelSpec, hot_rows: Mapping[str, Any], places: Sequence[TablePlace]) -> None:
        from infer.modules.tbe import make_tbe

        self.spec = spec
        self.num_features = len(spec.features)
        table_index = {t.name: i for i, t in enumerate(spec.tables)}
        hot: dict[str, torch.Tensor] = {}
        for name, ids in hot_rows.items():
            table = _table(spec, name, "hot_rows")
            rows = torch.unique(_row_ids(table.name, table.num_embeddings, ids, "hot_rows"))  # sorted
            if rows.numel():
                hot[name] = rows
        self.tables = [t.name for t in spec.tables if t.name in hot]
        self.hot = [hot[name] for name in self.tables]
        self.hot_numpy = [rows.numpy() for rows in self.hot]
        self.features = [f for f, info in enumerate(spec.features) if info.table in hot]
        self.feature_slot = {f: self.tables.index(spec.features[f].table) for f in self.features}
        self.mean = [spec.features[f].pooling == PoolingType.MEAN for f in self.features]
        self.columns = [(spec.features[f].column_start, spec.features[f].embedding_dim) for f in self.features]
        if not self.tables:
            raise ConfigError("hot_rows names no rows; pass at least one table with rows to cache")
        specs = []
        for name, rows in zip(self.tables, self.hot):
            table = spec.tables[table_index[name]]
            specs.append((name, int(rows.numel()), table.embedding_dim, table.data_type))
        self.tbe: Any = make_tbe(specs, [self.feature_slot[f] for f in self.features], torch.device("cpu"))
        self._fill(places)
        host = cast(torch.Tensor, self.tbe.weights_host)
        self.weight_bytes = host.numel()

    def _fill(self, places: Sequence[TablePlace]) -> None:
        """Copy each hot row's bytes from the mapping into the cache's table (the kernel's own row codec)."""
        weights = self.tbe.weights_host
        reader = Prefetcher([p.region for p in places], self.num_features)
        for slot, (name, rows) in enumerate(zip(self.tables, self.hot)):
            feature = next(f for f in self.features if self.feature_slot[f] == slot)
            info = self.spec.features[feature]
            full = [p for p in places if p.region.feature == feature and p.dim == info.embedding_dim]
            if not full or sum(p.region.hi - p.region.lo for p in full) < info.num_embeddings:
                raise ConfigError(
                    f"hot_rows: table {name!r} is not held whole-width in mapped weight files (column-wise shards, "
                    "or an embedded artifact); cache only tables of a mapped artifact that are not split by columns"
                )
            data_type = full[0].data_type
            width = unpadded_row_bytes(info.embedding_dim, data_type)
            size = row_bytes(info.embedding_dim, data_type, int(self.tbe.row_alignment))
            start = int(self.tbe.weights_physical_offsets[slot])
            target = weights[start : start + rows.numel() * size].view(rows.numel(), size)
            for place in full:
                inside = torch.nonzero((rows >= place.region.lo) & (rows < place.region.hi)).flatten()
                # in pieces, each piece's pages asked for ahead: a copy faulting one page at a time would read
                # at the disk's depth-1 rate (and a budget smaller than all the pages would evict them first)
                for piece in torch.split(inside, FILL_ROWS):
                    wanted = rows[piece]
                    reader.ask_rows(place.region, wanted.numpy())
                    target[piece, :width] = place.rows[wanted - place.region.lo, :width]
                # the copy mapped the hot rows' pages into this process: unmap them (they stay in the page cache,
                # reclaimable like any page the kernels do not read), so they do not count as resident here
                advise(
                    place.region.address, (place.region.hi - place.region.lo) * place.region.row_bytes, MADV_DONTNEED
                )

    def split(self, values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None) -> tuple[Any, Any]:
        """``(model's ids, lengths, weights)`` and ``(cache's slots, lengths, weights)`` of a validated batch (numpy
        throughout: torch's small ops wait on its intra-op pool, ~2 ms a call on a busy 2-core host)."""
        batch = lengths.numel() // self.num_features
        ids = values.numpy()
        bag_lengths = lengths.numpy()
        per_feature = bag_lengths.reshape(self.num_features, batch).sum(1)
        starts = np.concatenate(([0], np.cumsum(per_feature)))
        hit = np.zeros(ids.size, dtype=bool)
        slots = []
        for f in self.features:
            feature_ids = ids[starts[f] : starts[f + 1]]
            hot = self.hot_numpy[self.feature_slot[f]]
            position = np.minimum(np.searchsorted(hot, feature_ids), hot.size - 1)
            found = hot[position] == feature_ids
            hit[starts[f] : starts[f + 1]] = found
            slots.append(position[found])
        bag = np.repeat(np.arange(bag_lengths.size), bag_lengths)
        hot_lengths = np.bincount(bag[hit], minlength=bag_lengths.size).astype(bag_lengths.dtype)
        cold = ~hit
        cold_lengths = torch.from_numpy(bag_lengths - hot_lengths)
        hit_t, cold_t = torch.from_numpy(hit), torch.from_numpy(cold)
        model_input = (torch.from_numpy(ids[cold]), cold_lengths, weights[cold_t] if weights is not None else None)
        cache_lengths = torch.from_numpy(hot_lengths.reshape(self.num_features, batch)[self.features].reshape(-1))
        cache_input = (
            torch.from_numpy(np.concatenate(slots)),
            cache_lengths,
            weights[hit_t] if weights is not None else None,
        )
        return model_input, cache_input

    def add(self, out: torch.Tensor, lengths: torch.Tensor, cold_lengths: torch.Tensor, cache_input: Any) -> None:
        """Add the cache's pooled rows into the model's output ``out`` (MEAN features re-weighed by bag lengths)."""
        slots, cache_lengths, weights = cache_input
        if slots.numel() == 0:
            return
        from infer.modules.tbe import bag_offsets

        pooled = self.tbe(slots, bag_offsets(cache_lengths, slots), weights)
        batch = out.size(0)
        full = lengths.view(self.num_features, batch)
        cold = cold_lengths.view(self.num_features, batch)
        column = 0
        for f, mean, (start, dim) in zip(self.features, self.mean, self.columns):
            hot_sum = pooled[:, column : column + dim]
            target = out[:, start : start + dim]
            if mean:
                total = target * cold[f].unsqueeze(1).to(out.dtype) + hot_sum
                target.copy_(total / full[f].clamp(min=1).unsqueeze(1).to(out.dtype))
            else:
                target.add_(hot_sum)
            column += dim


class PagedModel:
    """A loaded model with prefetch and/or a hot-row cache in front of its kernels; same calls as the model."""

    def __init__(self, module: Any, prefetcher: Prefetcher | None, cache: HotRowCache | None) -> None:
        self.module = module
        self.prefetcher = prefetcher
        self.cache = cache

    def __getattr__(self, name: str) -> Any:  # the model's other attributes (embeddings, has_dense, ...)
        return getattr(self.module, name)

    def __call__(self, values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None = None) -> Any:
        return self.forward(values, lengths, weights)

    def forward(self, values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None = None) -> Any:
        if self.cache is None:
            self._prefetch(values, lengths)
            return self.module.forward(values, lengths, weights)
        self.module.embeddings.validate(values, lengths, weights)  # the split needs a well-formed batch
        return self._cached(values, lengths, weights)

    def _cached(self, values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None) -> Any:
        """A validated batch split between the cache and the model; the model's share (cut from that batch, so
        well formed too) goes to its unchecked entry: the batch is validated once."""
        assert self.cache is not None
        (cold_values, cold_lengths, cold_weights), cache_input = self.cache.split(values, lengths, weights)
        self._prefetch(cold_values, cold_lengths)
        out = self._model_entry()(cold_values, cold_lengths, cold_weights)
        self.cache.add(out, lengths, cold_lengths, cache_input)
        return out

    def _model_entry(self) -> Callable[..., Any]:
        """The model's entry for validated batches (artifacts from before ``lookup_unchecked``: ``forward``)."""
        return getattr(self.module, "lookup_unchecked", None) or self.module.forward

    def lookup_unchecked(self, values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None = None) -> Any:
        """The server's entry for a batch it validated already (``Runtime.lookup_unchecked``): through the
        prefetch and the cache as ``forward``; without a cache, the model's unchecked entry after the prefetch.
        (Without this method ``__getattr__`` would hand out the model's own entry and skip both.)"""
        if self.cache is not None:
            return self._cached(values, lengths, weights)
        self._prefetch(values, lengths)
        return self._model_entry()(values, lengths, weights)

    def lookup_and_predict_unchecked(
        self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None = None
    ) -> Any:
        return self._scored(self.lookup_unchecked, dense, values, lengths, weights)

    def _prefetch(self, values: torch.Tensor, lengths: torch.Tensor) -> None:
        if self.prefetcher is None:
            return
        try:
            self.prefetcher.prefetch(values, lengths)
        except (RuntimeError, ValueError, IndexError):  # a malformed batch: the model's checks will say why
            pass

    def predict(
        self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None = None
    ) -> Any:
        return self.lookup_and_predict(dense, values, lengths, weights)[1]

    def lookup_and_predict(
        self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None = None
    ) -> Any:
        return self._scored(self.forward, dense, values, lengths, weights)

    def _scored(
        self,
        lookup: Callable[..., Any],
        dense: torch.Tensor,
        values: torch.Tensor,
        lengths: torch.Tensor,
        weights: torch.Tensor | None,
    ) -> Any:
        """(pooled, scores): ``lookup``'s pooled embeddings through the model's dense part."""
        if not self.module.has_dense:  # the model's own refusal, before any lookup
            return self.module.lookup_and_predict(dense, values, lengths, weights)
        pooled = lookup(values, lengths, weights)
        return pooled, self.module.score(dense, pooled)


def page_model(
    module: Any,
    spec: ModelSpec,
    kernels: Sequence[Kernel],
    prefetch: bool,
    hot_rows: Mapping[str, Any] | None,
    threads: int = 16,
) -> Any:
    """``module`` itself when neither is asked for, else wrapped: pages read ahead (``MADV_RANDOM`` on the
    mappings, ``MADV_WILLNEED`` per batch) and/or ``hot_rows`` served from a resident cache."""
    if not prefetch and not hot_rows:
        return module
    if hot_rows and spec.block_tables:
        # a block kernel reads rows at remapped positions (table_places skips it); its precise blocks already are
        # the resident hot rows
        raise ConfigError(
            f"hot_rows does not serve a model with tables in precision blocks ({list(spec.block_tables)}): their "
            "hottest rows are already held in the precise blocks; load it without hot_rows (--hot-rows)"
        )
    places = table_places(module, kernels)
    if hot_rows and not places:
        raise ConfigError(
            "hot_rows needs a mapped artifact (export with weights='mapped'); this one embeds its weights"
        )
    prefetcher = None
    if prefetch and places:
        prefetcher = Prefetcher([p.region for p in places], len(spec.features), threads)
        prefetcher.advise_random()
    cache = HotRowCache(spec, hot_rows, places) if hot_rows else None
    if cache is not None:
        logger.info(
            "hot-row cache: %d rows of %d tables, %d bytes",
            sum(h.numel() for h in cache.hot),
            len(cache.hot),
            cache.weight_bytes,
        )
    return PagedModel(module, prefetcher, cache)
