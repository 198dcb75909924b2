"""Precision blocks in the precision planner: each table may also be held as a hot block of its most read rows in
a precise type and the rest in a small one (``TableConfig.blocks``), chosen by the same exact MILP as whole-table
types (``infer.planner.precision``).

A table's two-block option (``hot`` rows at type A, the rest at type B) costs both blocks' bytes as the kernel lays
them out plus the id remap (``REMAP_BYTES_PER_ROW`` a row, held once per feature of the table), and its error is the
measured errors mixed by the share ``h`` of the table's reads that hit the hot rows: the relative Frobenius error of
pooled bags sums the rows' squared errors over the reads, so ``error = sqrt(h * e(A)^2 + (1 - h) * e(B)^2)``. ``h``
is estimated from the sample of request ids cross-validated: rows ranked on one half of the sample, hits counted on
the other (and the reverse), so rows seen once do not count as hot. Without a sample of a table's ids, reads are
uniform over its rows and ``h`` comes from the rows themselves: the share of the table's error mass its largest rows
carry (``infer.planner.row_ranges``, handed in as ``range_shares``); with neither, blocks are not priced.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from infer.config import DataType, ModelSpec, RowBlock, TableConfig
from infer.errors import PlanError, PlanErrorKind
from infer.planner.access import AccessSample
from infer.planner.precision import DtypeOption, PrecisionChoice, TableChoices, precision_problem
from infer.planner.types import ParameterConstraints
from infer.quant.blocks import rank_rows
from infer.quant.measured_error import TableError
from infer.quant.rowwise import CPU_ROW_ALIGNMENT, TABLE_ALIGNMENT, row_bytes, table_bytes

# the id remap: one int32 rank per row
REMAP_BYTES_PER_ROW = 4
# read counts per row in table-sized arrays when the sample holds one id per this many rows or more (a scatter
# into the table's rows is then cheaper than sorting the ids)
DENSE_COUNT_ROWS_PER_ID = 2
# what ranks a block table's rows (the plan's record of each block table says which)
RANKED_BY_SAMPLE = "sample ids"
RANKED_BY_RANGES = "row ranges"
# hot-block sizes tried: the table's rows halved this many times (and never below one row)
HOT_SIZE_HALVINGS = 24
# the sampled ids a table needs to be ranked by them: ``hot_shares`` ranks on one half and counts hits on the other
MIN_RANKING_IDS = 2


def sample_order(sample: AccessSample, table: TableConfig) -> np.ndarray:
    """The table's sampled ids in request order (its features' ids one after another)."""
    parts = [np.asarray(sample.ids[f], dtype=np.int64) for f in table.feature_names if f in sample.ids]
    if len(parts) == 1:
        return parts[0]  # no copy of a one-feature table's ids
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def hot_shares(ids: np.ndarray, rows: int, hot_sizes: Sequence[int]) -> np.ndarray:
    """Per hot size ``k``: the share of reads that hit the ``k`` most read rows, estimated on reads the ranking did
    not see (ranked on even positions, hits counted on odd ones, and the reverse; averaged). 0 without ids."""
    if ids.size < MIN_RANKING_IDS:
        return np.zeros(len(hot_sizes))
    sizes = np.asarray(hot_sizes, dtype=np.int64)
    halves = read_counts(ids, rows)
    shares = np.zeros(len(sizes))
    for ranked, held_out in ((halves[0], halves[1]), (halves[1], halves[0])):
        # the ranking: most read first, ties in id order; a row the ranking never saw has no evidence and ranks
        # after every seen row, so it is never in a hot block
        order = rank_seen(ranked)
        hits = np.concatenate([[0], np.cumsum(held_out[order])])
        shares += hits[np.minimum(sizes, order.size)] / held_out.sum()
    return shares / 2


def read_counts(ids: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's reads in the even and in the odd positions of ``ids``, over a common row order (ids ascending):
    table-sized counts when the sample reads at least one id per ``DENSE_COUNT_ROWS_PER_ID`` rows (one scatter
    each, no sort; the two halves on two threads: torch's bincount lets go of the GIL, numpy's does not), else per
    distinct id (one sort of the ids with their half in the low bit)."""
    ids = np.asarray(ids, dtype=np.int64)
    if ids.size * DENSE_COUNT_ROWS_PER_ID >= rows:

        def half(parity: int) -> np.ndarray:
            return torch.bincount(torch.from_numpy(ids[parity::2]), minlength=rows).numpy()

        with ThreadPoolExecutor(2) as pool:
            even, odd = pool.map(half, (0, 1))
        return even, odd
    keys = np.sort((ids << 1) | (np.arange(ids.size, dtype=np.int64) & 1))
    odd = (keys & 1).astype(np.int64)
    starts = np.flatnonzero(np.concatenate([[True], (keys[1:] >> 1) != (keys[:-1] >> 1)]))
    in_odd = np.add.reduceat(odd, starts)
    return np.diff(np.append(starts, keys.size)) - in_odd, in_odd


def rank_seen(counts: np.ndarray) -> np.ndarray:
    """The positions of ``counts``'s nonzero entries, largest count first, ties in position order (a stable sort;
    the 16-bit radix sort numpy uses for counts that fit, which is linear)."""
    seen = np.flatnonzero(counts)
    held = counts[seen]
    top = int(held.max()) if held.size else 0
    if top < 1 << 16:
        return seen[np.argsort(np.uint16(top) - held.astype(np.uint16), kind="stable")]
    return seen[np.argsort(-held, kind="stable")]


def hot_sizes_of(rows: int) -> list[int]:
    """The hot-block sizes tried for a table of ``rows`` rows: halvings of the table, largest first."""
    sizes = sorted({max(1, rows >> j) for j in range(1, HOT_SIZE_HALVINGS + 1)} - {rows}, reverse=True)
    return sizes


def remap_bytes(table: TableConfig) -> int:
    """The id remap as the model holds it: one int32 per row, once per feature of the table."""
    return REMAP_BYTES_PER_ROW * table.num_embeddings * len(table.feature_names)


def two_block_options(table: TableConfig, sizes: Sequence[int], shares: np.ndarray, types: Sequence[DataType],
                      measured: TableError, row_alignment: int, prune: bool = True) -> list[DtypeOption]:  # fmt: skip
    """Two blocks, for every hot size ``k`` with a share ``h`` of reads and every pair of ``types`` A > B: ``k``
    rows at A, the rest at B, both blocks' bytes plus the remap, error ``sqrt(h eA^2 + (1 - h) eB^2)`` (the module
    docstring), priced as arrays; with ``prune`` only the table's own Pareto front among them becomes options."""
    rows, dim = table.num_embeddings, table.embedding_dim
    pairs = [(a, b) for a in types for b in types if a.bits > b.bits]
    seen = np.asarray(shares, dtype=np.float64) > 0
    hot = np.asarray(sizes, dtype=np.int64)[seen][:, None]
    share = np.asarray(shares, dtype=np.float64)[seen][:, None]
    if not pairs or hot.size == 0:
        return []
    row_a = np.array([row_bytes(dim, a, row_alignment) for a, _ in pairs], dtype=np.int64)[None, :]
    row_b = np.array([row_bytes(dim, b, row_alignment) for _, b in pairs], dtype=np.int64)[None, :]
    err_a = np.array([measured.error(a) for a, _ in pairs])[None, :]
    err_b = np.array([measured.error(b) for _, b in pairs])[None, :]
    # table_bytes of each block (128-byte aligned), hot size outer, pair inner
    nbytes = (-(-hot * row_a // TABLE_ALIGNMENT) - (-(rows - hot) * row_b // TABLE_ALIGNMENT)) * TABLE_ALIGNMENT
    nbytes = (nbytes + remap_bytes(table)).ravel()
    errors = np.sqrt(share * err_a**2 + (1 - share) * err_b**2).ravel()
    # a dominated option never wins the MILP (``pareto``)
    picks = np.sort(pareto_front(nbytes, errors)) if prune else np.arange(nbytes.size)
    out = []
    for i in picks.tolist():
        k, (a, b) = int(hot[i // len(pairs), 0]), pairs[i % len(pairs)]
        out.append(DtypeOption(b, int(nbytes[i]), float(errors[i]), (RowBlock(k, a), RowBlock(rows - k, b))))
    return out


def three_block_options(table: TableConfig, sizes: Sequence[int], shares: np.ndarray, types: Sequence[DataType],
                        measured: TableError, row_alignment: int) -> list[DtypeOption]:  # fmt: skip
    """The Pareto options (fewest bytes, least error) among three blocks: the ``k1`` hottest rows at type A, the
    next ``k2 - k1`` at B, the rest at C (A more precise than B, B than C), for every pair of hot sizes
    ``k1 < k2``: error ``sqrt(h1 eA^2 + (h2 - h1) eB^2 + (1 - h2) eC^2)``. Vectorised over the pairs; only the
    options on the table's own frontier become objects (a dominated option never wins the MILP)."""
    dim, rows = table.embedding_dim, table.num_embeddings
    k = np.asarray(sizes, dtype=np.int64)
    h = np.asarray(shares, dtype=np.float64)
    first, second = np.nonzero(k[:, None] < k[None, :])  # k1 = k[first] < k2 = k[second]
    if first.size == 0:
        return []
    k1, k2, h1, h2 = k[first], k[second], h[first], h[second]
    keep = h2 > h1
    k1, k2, h1, h2 = k1[keep], k2[keep], h1[keep], h2[keep]
    per_row = {d: table_bytes(1 << 20, dim, d, row_alignment) / (1 << 20) for d in types}
    bytes_all: list[np.ndarray] = []
    errors_all: list[np.ndarray] = []
    picks: list[tuple[DataType, DataType, DataType, int, int]] = []
    for a in types:
        for b in types:
            for c in types:
                if not a.bits > b.bits > c.bits:
                    continue
                # bytes up to the 128-byte alignment of each block (exact bytes are computed for the kept ones)
                approx = per_row[a] * k1 + per_row[b] * (k2 - k1) + per_row[c] * (rows - k2)
                ea, eb, ec = measured.error(a) ** 2, measured.error(b) ** 2, measured.error(c) ** 2
                error = np.sqrt(h1 * ea + (h2 - h1) * eb + np.clip(1 - h2, 0, None) * ec)
                bytes_all.append(approx)
                errors_all.append(error)
                picks.extend((a, b, c, int(x), int(y)) for x, y in zip(k1, k2))
    if not picks:
        return []
    nbytes = np.concatenate(bytes_all)
    errors = np.concatenate(errors_all)
    front = pareto_front(nbytes, errors)
    out = []
    for i in front:
        a, b, c, x, y = picks[int(i)]
        size = (
            table_bytes(x, dim, a, row_alignment)
            + table_bytes(y - x, dim, b, row_alignment)
            + table_bytes(rows - y, dim, c, row_alignment)
            + remap_bytes(table)
        )
        out.append(DtypeOption(c, size, float(errors[i]), (RowBlock(x, a), RowBlock(y - x, b), RowBlock(rows - y, c))))
    return out


def pareto_front(nbytes: np.ndarray, errors: np.ndarray) -> np.ndarray:
    """``pareto`` on arrays: the indices of the options no other beats on both bytes and error, fewest bytes first
    (ties in bytes: least error)."""
    order = np.lexsort((errors, nbytes))
    running = np.minimum.accumulate(errors[order])
    return order[np.concatenate([[True], errors[order][1:] < running[:-1]])]


def pareto(options: Sequence[DtypeOption]) -> tuple[DtypeOption, ...]:
    """The options no other beats on both bytes and error, fewest bytes first (a dominated option is never the
    unique optimum of the MILP, so dropping it keeps the exact choice exact)."""
    kept: list[DtypeOption] = []
    for option in sorted(options, key=lambda o: (o.bytes, o.error)):
        if not kept or option.error < kept[-1].error:
            kept.append(option)
    return tuple(kept)


def block_problem(
    spec: ModelSpec,
    measured: Sequence[TableError],
    sample: AccessSample | None,
    constraints: Mapping[str, ParameterConstraints] | None = None,
    row_alignment: int = CPU_ROW_ALIGNMENT,
    prune: bool = True,
    three_blocks: bool = False,
    range_shares: Mapping[str, np.ndarray] | None = None,
) -> tuple[TableChoices, ...]:
    """``precision_problem``'s tables with two-block options beside the whole-table types: every hot size of
    ``hot_sizes_of`` and every pair of allowed types (the hot one more precise); with ``three_blocks`` also the
    Pareto options of three blocks (``three_block_options``: measured at DLRM-v2's shapes they gain < 0.1 % of
    error and cost seconds of MILP, so they are off by default). ``prune``: Pareto options only. A table with no
    sampled ids takes its shares from ``range_shares`` (table -> ``h_k`` at ``hot_sizes_of``, from
    ``infer.planner.row_ranges.range_access``) when it has them; each table's ``ranking`` says which ranked it."""
    constraints = constraints or {}
    whole = precision_problem(spec, measured, constraints, sample, row_alignment)
    by_name = {m.table: m for m in measured}
    none = np.zeros(0, dtype=np.int64)
    ids_of = {t.name: sample_order(sample, t) if sample is not None else none for t in spec.tables}
    rankings = {t.name: _ranking(ids_of[t.name], t, range_shares) for t in spec.tables}
    priced = [
        t for t in spec.tables
        if constraints.get(t.name, ParameterConstraints()).data_type is None and rankings[t.name]
        and t.num_embeddings > 1
    ]  # fmt: skip
    sampled = sampled_shares([t for t in priced if rankings[t.name] == RANKED_BY_SAMPLE], ids_of)
    priced_names = {t.name for t in priced}
    problem = []
    for table, choices in zip(spec.tables, whole):
        options = list(choices.options)
        ranked = rankings[table.name]
        if table.name in priced_names:
            sizes = hot_sizes_of(table.num_embeddings)
            if ranked == RANKED_BY_SAMPLE:
                shares = sampled[table.name]
            else:
                shares = np.asarray((range_shares or {})[table.name], dtype=np.float64)
            types = [o.data_type for o in choices.options]
            options += two_block_options(table, sizes, shares, types, by_name[table.name], row_alignment, prune)
            if three_blocks:
                options += three_block_options(table, sizes, shares, types, by_name[table.name], row_alignment)
        # the whole-table types stay even when a block option dominates one: the uniform INT8/INT4 baselines the
        # stats print beside the choice are told against them (a dominated option never wins the MILP)
        kept = tuple(
            sorted(set(pareto(options)) | set(choices.options) if prune else options, key=lambda o: (o.bytes, o.error))
        )
        problem.append(TableChoices(choices.table, choices.weight, choices.declared, kept, ranked))
    return tuple(problem)


def sampled_shares(tables: Sequence[TableConfig], ids_of: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``hot_shares`` of each of ``tables`` at ``hot_sizes_of``, two tables at a time, most sampled ids first
    (numpy's sorts and torch's bincount let go of the GIL: counting a large sample is most of the planner's time)."""

    def shares(table: TableConfig) -> np.ndarray:
        return hot_shares(ids_of[table.name], table.num_embeddings, hot_sizes_of(table.num_embeddings))

    ordered = sorted(tables, key=lambda t: -ids_of[t.name].size)
    with ThreadPoolExecutor(2) as pool:
        return {t.name: s for t, s in zip(ordered, pool.map(shares, ordered))}


def _ranking(ids: np.ndarray, table: TableConfig, range_shares: Mapping[str, np.ndarray] | None) -> str:
    """What ranks the table's rows for blocks: its sampled ids (two or more), else its rows' ranges when measured,
    else nothing ("")."""
    if ids.size >= MIN_RANKING_IDS:
        return RANKED_BY_SAMPLE
    return RANKED_BY_RANGES if range_shares is not None and table.name in range_shares else ""


def apply_blocks(spec: ModelSpec, choice: PrecisionChoice) -> ModelSpec:
    """The spec with ``choice``'s types, and its blocks on the tables it holds in blocks."""
    blocks = choice.blocks or tuple(() for _ in spec.tables)
    tables = tuple(t.with_data_type(d).with_blocks(b) for t, d, b in zip(spec.tables, choice.data_types, blocks))
    return ModelSpec(tables, spec.num_dense_features, spec.dense_arch)


def block_orders_from_sample(
    spec: ModelSpec, sample: AccessSample, tables: Sequence[str] | None = None
) -> dict[str, torch.Tensor]:
    """Each block table's rows (of ``tables`` when given) ranked hottest first by the whole sample (``quantize``'s
    ``block_orders``)."""
    orders = {}
    for table in spec.tables:
        if table.blocks and (tables is None or table.name in tables):
            ids = sample.table_ids(table)
            if ids.size == 0:
                raise PlanError(
                    f"table {table.name!r} is held in precision blocks but the sample has no ids of it; sample its "
                    "features' requests",
                    PlanErrorKind.INVALID_CONSTRAINT,
                )
            orders[table.name] = rank_rows(table.num_embeddings, ids, table.name)
    return orders
