"""Streaming export: tables read from a ``TableSource``, quantized and written chunk by chunk straight into a
mapped artifact's weight files, so memory does not grow with the model.

The layout is known before any row is read: the kernels the spec (and plan) build and each table's page-aligned
place in its weight file (``infer.artifact.mapped.place_weights``, as an in-memory mapped export places them).
Each table (or shard) is read in row chunks, encoded by the one row codec (``infer.quant.rowwise.encode_rows``)
and written at its offset while the checksums are computed (``infer.storage.writer``); the scripted model is built
with unallocated weight buffers (``make_tbe(allocate=False)``). The files are byte for byte those of
``export(quantize(...), weights="mapped")``.

A table held in precision blocks (``TableConfig.blocks``) is one piece per block, and its remap is known before a
row is read: the ranking (``block_orders``) says which ids each block holds, so the model file's remap and the
manifest's sha256 are those of the in-memory export. A precise block holds its rows in ranking order: its ids are
read in increasing order, in spans of at most a chunk (from one wanted id to the last wanted id within a chunk of
it), encoded in the block's type and put at their ranks in the block's buffer, written once gathered (memory: the
block's encoded rows, the hot few percent of the table, beside one fp32 chunk). The cold block holds every other
row in id order: the table is read chunk by chunk and its cold rows written as they come, in order.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from infer.artifact.export import check_dense_part, output_folder, staged, write_manifest
from infer.artifact.formats.torchscript import save_structure, script_model
from infer.artifact.kernels import Kernel, expected_kernels, model_tbes
from infer.artifact.manifest import MAPPED_FORMAT_VERSION, FileEntry
from infer.artifact.mapped import mark_weights, place_weights, strip_weights
from infer.config import DataType, ModelSpec, TableConfig
from infer.dense_layout import checked_layout
from infer.errors import ConfigError, WeightsError
from infer.modules.collection import EmbserveModel, QuantizedEmbeddingBagCollection
from infer.planner.types import ShardingPlan
from infer.quant.blocks import block_orders as checked_block_orders
from infer.quant.blocks import remap_of
from infer.quant.quantize import ProgressFn, check_finite
from infer.quant.rowwise import encode_rows, row_bytes, table_bytes
from infer.shard.builder import device_layouts, shard_structure
from infer.storage import checksums
from infer.storage.memory import PeakAnonymous, memory_use
from infer.storage.sources import TableSource, check_source
from infer.storage.writer import FileDigests, StreamingFileWriter

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 64 << 20  # fp32 bytes read per chunk: big enough for fast quantizing, small beside RAM
FP32_BYTES = 4


@dataclass(frozen=True)
class Piece:
    """One table (or shard) of a weight file: rows ``row_offset ..`` and columns ``col_offset ..`` of ``table``,
    written from byte ``offset`` of the file in the kernel's row layout."""

    label: str  # the table's name, or the shard's (``<table>@<shard>``)
    table: TableConfig
    offset: int
    row_offset: int
    num_rows: int
    col_offset: int
    num_cols: int
    row_alignment: int
    data_type: DataType  # the table's, or its block's
    block: int = -1  # a block table's block (index into ``table.blocks``, hottest first); -1: the whole table (shard)


@dataclass(frozen=True)
class StreamedExport:
    """What a streaming export wrote and what it cost: the artifact, the tables (or shards) and rows written, the
    weight files' bytes, the wall time, and the process's peak resident set (VmHWM, over its whole life) and
    peak anonymous resident set (sampled as each chunk is encoded), beside its anonymous resident set when the
    export started (what the process held before: torch, fbgemm, the caller's data)."""

    path: Path
    tables: int
    rows: int
    weight_bytes: int
    seconds: float
    peak_rss_bytes: int
    peak_rss_anon_bytes: int
    start_rss_anon_bytes: int


def export_streaming(
    spec: ModelSpec,
    source: TableSource,
    out_dir: str | Path,
    plan: ShardingPlan | None = None,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    progress: ProgressFn | None = None,
    block_orders: Mapping[str, Any] | None = None,
) -> StreamedExport:
    """Export ``spec``'s tables from ``source`` (``infer.storage.sources``) as a mapped artifact at ``out_dir``,
    unsharded or sharded by a one-host CPU ``plan``, reading ``chunk_bytes`` of fp32 rows at a time. The spec's
    data types (and dense part) are used as ``quantize`` uses them; ``progress(table, rows_done, rows)`` is called
    after every chunk, and a line per table (rows/s) and a summary are logged. A table held in precision blocks
    needs its rows ranked hottest first in ``block_orders``, as ``quantize`` does (unsharded only)."""
    if chunk_bytes < 1:
        raise ConfigError(f"chunk_bytes must be positive, got {chunk_bytes}")
    spec.require_stated_pooling()
    if plan is not None and spec.block_tables:
        raise ConfigError(
            f"table {spec.block_tables[0]!r} is held in precision blocks, which a streamed sharded export does not "
            "write yet; export the sharded model in memory (infer.export), or stream it unsharded"
        )
    orders = checked_block_orders(spec, block_orders)
    if plan is not None:
        _check_streamable(plan)
    check_source(spec, source)
    out_dir = output_folder(out_dir)
    model = structure_model(spec, plan)
    for name, order in orders.items():
        model.embeddings.set_block_remap(name, remap_of(order))  # type: ignore[operator]
    dense_expects = checked_layout(spec, model.dense_arch if model.has_dense else None)
    if model.has_dense:
        check_dense_part(model)
    started = time.monotonic()
    peak = PeakAnonymous()
    scripted = script_model(model)
    devices = ("cpu",)
    kernels = place_weights(expected_kernels(spec, plan, devices))
    pieces = weight_pieces(spec, plan, kernels)
    sizes = _file_sizes(kernels)
    with staged(out_dir) as staging:
        weight_files = []
        for name, file_pieces in pieces.items():
            path = staging / name
            path.parent.mkdir(parents=True, exist_ok=True)
            digests = _write_file(path, file_pieces, sizes[name], source, chunk_bytes, progress, peak, orders)
            weight_files.append(_file_entry(name, digests))
        strip_weights(model_tbes(scripted), kernels)
        mark_weights(scripted, attached=False)
        files = save_structure(staging, scripted, weight_files, plan)
        write_manifest(staging, model, plan, files, kernels, dense_expects, MAPPED_FORMAT_VERSION)
    peak.sample()
    done = StreamedExport(
        path=out_dir,
        tables=sum(piece.block <= 0 for p in pieces.values() for piece in p),  # a block table once
        rows=sum(piece.num_rows for p in pieces.values() for piece in p),
        weight_bytes=sum(sizes.values()),
        seconds=time.monotonic() - started,
        peak_rss_bytes=memory_use().peak_rss,
        peak_rss_anon_bytes=peak.peak,
        start_rss_anon_bytes=peak.start,
    )
    logger.info(
        "exported %s: %d tables, %d rows, %.2f GB of weights in %.1fs (%.0f rows/s); peak RSS %.2f GB, "
        "peak anonymous RSS %.2f GB (%.2f GB at the start)",
        out_dir,
        done.tables,
        done.rows,
        done.weight_bytes / 1e9,
        done.seconds,
        done.rows / max(done.seconds, 1e-9),
        done.peak_rss_bytes / 1e9,
        done.peak_rss_anon_bytes / 1e9,
        done.start_rss_anon_bytes / 1e9,
    )
    return done


def structure_model(spec: ModelSpec, plan: ShardingPlan | None) -> EmbserveModel:
    """The CPU model of ``spec`` (sharded by ``plan``) with its weight buffers unallocated."""
    if plan is not None:
        return shard_structure(spec, plan)
    return EmbserveModel(spec, QuantizedEmbeddingBagCollection(spec, "cpu", allocate=False), spec.dense_arch)


def _check_streamable(plan: ShardingPlan) -> None:
    topology = plan.topology
    if topology.is_cuda:
        raise ConfigError(
            "a streaming export writes CPU kernels' weights to mapped files, and this plan places tables on CUDA "
            "devices (their weights live in model.pt): quantize, shard_model and export in memory instead"
        )
    if topology.local_world_size < topology.world_size:
        raise ConfigError(
            f"a streaming export writes one host's artifact, and this plan spans "
            f"{topology.world_size // topology.local_world_size} hosts: quantize and export_hosts in memory instead"
        )


def weight_pieces(spec: ModelSpec, plan: ShardingPlan | None, kernels: list[Kernel]) -> dict[str, list[Piece]]:
    """Every weight file's distinct tables (or shards) in file order: the kernels' (``place_weights``) tables at
    their places; kernels that share rows (CPU replicas) share the piece."""
    if plan is None:
        # one piece per kernel table: a block table's blocks in order (``tbe_tables``), hottest first
        blocks = [
            [
                (f"{t.name}.block{j}" if t.blocks else t.name, t, 0, b.rows, 0, t.embedding_dim, b.data_type, j)
                if t.blocks
                else (t.name, t, 0, t.num_embeddings, 0, t.embedding_dim, t.data_type, -1)
                for t in spec.tables
                for j, b in enumerate(t.stored_blocks)
            ]
        ]
    else:
        blocks = [
            [
                (name, table, shard.row_offset, shard.num_rows, shard.col_offset, shard.num_cols, table.data_type, -1)
                for (name, _, _, _), (table, shard) in zip(layout.tables, layout.sources)
            ]
            for layout in device_layouts(spec, plan)
        ]
    by_file: dict[str, dict[int, Piece]] = {}
    for kernel, kernel_blocks in zip(kernels, blocks):
        assert kernel.weights is not None and kernel.shared is not None  # place_weights placed every CPU kernel
        placed = by_file.setdefault(kernel.weights.file, {})
        for start, (label, table, row_offset, rows, col_offset, cols, data_type, block) in zip(
            kernel.shared.table_offsets, kernel_blocks
        ):
            offset = kernel.weights.offset + start
            placed.setdefault(
                offset,
                Piece(label, table, offset, row_offset, rows, col_offset, cols, kernel.row_alignment, data_type, block),
            )
    return {name: [placed[offset] for offset in sorted(placed)] for name, placed in by_file.items()}


def _file_sizes(kernels: list[Kernel]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for kernel in kernels:
        if kernel.weights is not None and kernel.shared is not None:
            end = kernel.weights.offset + kernel.shared.total_bytes
            sizes[kernel.weights.file] = max(sizes.get(kernel.weights.file, 0), end)
    return sizes


def _write_file(
    path: Path,
    pieces: list[Piece],
    size: int,
    source: TableSource,
    chunk_bytes: int,
    progress: ProgressFn | None,
    peak: PeakAnonymous,
    orders: Mapping[str, torch.Tensor],
) -> FileDigests:
    with StreamingFileWriter(path, checksums.WEIGHTS_CHUNK_BYTES) as writer:
        for piece in pieces:
            if piece.block < 0:
                _write_piece(writer, piece, source, chunk_bytes, progress, peak)
            elif piece.block < len(piece.table.blocks) - 1:
                _write_precise_block(writer, piece, orders[piece.table.name], source, chunk_bytes, progress, peak)
            else:
                _write_cold_block(writer, piece, orders[piece.table.name], source, chunk_bytes, progress, peak)
        return writer.finish(size)


def _write_piece(
    writer: StreamingFileWriter,
    piece: Piece,
    source: TableSource,
    chunk_bytes: int,
    progress: ProgressFn | None,
    peak: PeakAnonymous,
) -> None:
    """Read, encode and queue one piece's rows chunk by chunk (its table padding is the writer's zeros)."""
    table = piece.table
    stride = row_bytes(piece.num_cols, piece.data_type, piece.row_alignment)
    step = _chunk_rows(table, chunk_bytes)
    end = piece.row_offset + piece.num_rows
    started = time.monotonic()
    with torch.no_grad():
        for start in range(piece.row_offset, end, step):
            stop = min(start + step, end)
            rows = _read_chunk(source, table, start, stop)
            encoded = encode_rows(rows, piece.data_type, piece.row_alignment, piece.col_offset, piece.num_cols)
            peak.sample()
            writer.write_at(piece.offset + (start - piece.row_offset) * stride, encoded)
            del rows, encoded
            if progress is not None:
                progress(piece.label, stop - piece.row_offset, piece.num_rows)
    _log_piece(piece, started)


def _chunk_rows(table: TableConfig, chunk_bytes: int) -> int:
    """Rows of ``table`` in one chunk of ``chunk_bytes`` fp32 bytes (at least one)."""
    return max(1, chunk_bytes // (table.embedding_dim * FP32_BYTES))


def _log_piece(piece: Piece, started: float) -> None:
    seconds = time.monotonic() - started
    logger.info(
        "table %s: %d rows (%s, %.1f MB) in %.2fs, %.0f rows/s",
        piece.label,
        piece.num_rows,
        piece.data_type.value,
        table_bytes(piece.num_rows, piece.num_cols, piece.data_type, piece.row_alignment) / 1e6,
        seconds,
        piece.num_rows / max(seconds, 1e-9),
    )


def _block_ids(piece: Piece, order: torch.Tensor) -> torch.Tensor:
    """The ids ``piece``'s block holds, in its row order (``block_orders``: precise blocks ranked, the cold block in
    id order)."""
    start = sum(block.rows for block in piece.table.blocks[: piece.block])
    return order[start : start + piece.num_rows]


def _write_precise_block(
    writer: StreamingFileWriter,
    piece: Piece,
    order: torch.Tensor,
    source: TableSource,
    chunk_bytes: int,
    progress: ProgressFn | None,
    peak: PeakAnonymous,
) -> None:
    """Gather a precise block's rows (ids in ranking order) from ``source`` in increasing id order, a span of at
    most a chunk at a time (from the next wanted id to the last wanted id within a chunk of it: a sparse block reads
    its rows alone, a dense one whole chunks), encode them and put each at its rank in the block's buffer; then queue
    the block."""
    table = piece.table
    ids, rank_in_block = torch.sort(_block_ids(piece, order))
    stride = row_bytes(piece.num_cols, piece.data_type, piece.row_alignment)
    block = torch.empty(piece.num_rows, stride, dtype=torch.uint8)
    step = _chunk_rows(table, chunk_bytes)
    started = time.monotonic()
    first = 0
    with torch.no_grad():
        while first < ids.numel():
            start = int(ids[first])
            last = first + int(torch.searchsorted(ids[first:], start + step))  # ids before ``last`` lie in the span
            stop = int(ids[last - 1]) + 1
            rows = _read_chunk(source, table, start, stop)[ids[first:last] - start]
            block[rank_in_block[first:last]] = encode_rows(
                rows, piece.data_type, piece.row_alignment, 0, table.embedding_dim
            )
            peak.sample()
            del rows
            first = last
            if progress is not None:
                progress(piece.label, first, piece.num_rows)
    writer.write_at(piece.offset, block)
    _log_piece(piece, started)


def _write_cold_block(
    writer: StreamingFileWriter,
    piece: Piece,
    order: torch.Tensor,
    source: TableSource,
    chunk_bytes: int,
    progress: ProgressFn | None,
    peak: PeakAnonymous,
) -> None:
    """Read the table chunk by chunk and queue its cold rows (every row the precise blocks do not hold) in id
    order, each chunk's right after the previous one's."""
    table = piece.table
    ids = _block_ids(piece, order)
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):  # what the cold rows' places below rest on
        raise AssertionError(f"table {table.name!r}: block_orders must give the cold block's ids in id order")
    stride = row_bytes(piece.num_cols, piece.data_type, piece.row_alignment)
    step = _chunk_rows(table, chunk_bytes)
    started = time.monotonic()
    written = 0
    with torch.no_grad():
        for start in range(0, table.num_embeddings, step):
            stop = min(start + step, table.num_embeddings)
            end = int(torch.searchsorted(ids, stop))
            if end == written:
                continue  # every row of the chunk is precise
            rows = _read_chunk(source, table, start, stop)[ids[written:end] - start]
            encoded = encode_rows(rows, piece.data_type, piece.row_alignment, 0, table.embedding_dim)
            peak.sample()
            writer.write_at(piece.offset + written * stride, encoded)
            del rows, encoded
            written = end
            if progress is not None:
                progress(piece.label, written, piece.num_rows)
    _log_piece(piece, started)


def _read_chunk(source: TableSource, table: TableConfig, start: int, stop: int) -> torch.Tensor:
    """Rows ``start .. stop`` of ``table`` from ``source``: ``WeightsError`` naming the table and rows unless they
    are a floating point ``[stop - start, dim]`` tensor of finite values."""
    rows = source.read_rows(table.name, start, stop)
    expected = [stop - start, table.embedding_dim]
    if not isinstance(rows, torch.Tensor) or list(rows.shape) != expected or not rows.is_floating_point():
        found = f"{rows.dtype} {list(rows.shape)}" if isinstance(rows, torch.Tensor) else type(rows).__name__
        raise WeightsError(
            f"table {table.name!r}: {source.origin} returned rows {start}..{stop} as {found}; expected a floating "
            f"point tensor of shape {expected}"
        )
    rows = rows.detach().cpu()
    check_finite(table.name, rows, start)
    return rows


def _file_entry(name: str, digests: FileDigests) -> FileEntry:
    chunks = checksums.Chunks(digests.chunk_bytes, digests.chunk_sha256) if checksums.chunked(digests.size) else None
    return FileEntry(name, digests.size, digests.sha256, chunks)
