"""Streaming export of tables held in precision blocks (infer/artifact/stream.py): the precise blocks gathered from
the source in ranking order and the cold block streamed in id order give the in-memory export's weight files, remaps
and manifest byte for byte; the streamed artifact serves fp32 ``embedding_bag`` over the table dequantized block by
block; the source is read a chunk at a time, never whole."""

from __future__ import annotations

import filecmp
import json
from pathlib import Path

import pytest
import torch

from infer.artifact.export import export
from infer.artifact.load import load
from infer.artifact.stream import export_streaming
from infer.config import ModelSpec, PoolingType
from infer.errors import ConfigError
from infer.quant.blocks import block_orders, rank_rows
from infer.quant.quantize import quantize
from infer.shard.plans import make_plan
from infer.storage.sources import CallableSource, TensorsSource
from infer.weights import random_weights
from tests.modules.test_blocks import any_ids, batch_of, block_spec, random_request, reference, reference_tables

# 3 rows of the 16-wide table a chunk, 6 of the 8-wide: spans and chunks end inside every block
SMALL_CHUNK = 200


def _orders(spec: ModelSpec, hot_low: bool, seed: int) -> dict[str, torch.Tensor]:
    """Rankings from a sample: ``hot_low`` reads low ids most (a precise block's ids dense: whole chunks), else
    ids spread over the table (sparse: rows read alone)."""
    generator = torch.Generator().manual_seed(seed)
    orders = {}
    for t in spec.tables:
        if t.blocks:
            rows = t.num_embeddings
            ids = torch.randint(0, rows // 4 if hot_low else rows, (rows,), generator=generator)
            orders[t.name] = rank_rows(rows, ids.numpy(), t.name)
    return orders


def _in_pieces_of_7(table: torch.Tensor):  # type: ignore[no-untyped-def]
    def rows(start: int, end: int):  # type: ignore[no-untyped-def]
        return (table[i : min(i + 7, end)] for i in range(start, end, 7))

    return rows


@pytest.fixture(scope="module", params=[PoolingType.SUM, PoolingType.MEAN], ids=["sum", "mean"])
def blocked(request, tmp_path_factory):  # type: ignore[no-untyped-def]
    spec = block_spec(request.param)
    weights = random_weights(spec, seed=11)
    orders = _orders(spec, hot_low=False, seed=4)
    expected = export(quantize(spec, weights, block_orders=orders), tmp_path_factory.mktemp("mem") / "a")
    return spec, weights, orders, expected


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def _remaps(folder: Path) -> dict[str, torch.Tensor]:
    embeddings = torch.jit.load(str(folder / "model.pt")).embeddings
    return {"block_lookup": embeddings.block_lookup, "offsets": embeddings.block_lookup_offsets}


def _assert_same_artifact(streamed: Path, expected: Path) -> None:
    got, want = _manifest(streamed), _manifest(expected)
    weights = {name: entry for name, entry in got["files"].items() if name.startswith("weights-")}
    assert weights and weights == {n: e for n, e in want["files"].items() if n.startswith("weights-")}
    for name in weights:
        assert filecmp.cmp(streamed / name, expected / name, shallow=False)
    assert got["block_remaps"] == want["block_remaps"] and set(got["block_remaps"]) == {"blocked", "two"}
    assert got["kernels"] == want["kernels"]
    held, wanted = _remaps(streamed), _remaps(expected)
    assert all(torch.equal(held[k], wanted[k]) for k in held)


@pytest.mark.parametrize("chunk", [SMALL_CHUNK, 1 << 20], ids=["small_chunks", "one_chunk"])
@pytest.mark.parametrize("source_kind", ["tensors", "callable"])
def test_streamed_blocks_equal_the_in_memory_export_byte_for_byte(blocked, tmp_path, source_kind, chunk):
    spec, weights, orders, expected = blocked
    source = (
        TensorsSource(weights)
        if source_kind == "tensors"
        else CallableSource(spec, {name: _in_pieces_of_7(table) for name, table in weights.items()})
    )
    done = export_streaming(spec, source, tmp_path / "s", chunk_bytes=chunk, block_orders=orders)
    _assert_same_artifact(done.path, expected)
    assert (done.tables, done.rows) == (3, 200 + 50 + 64)


def test_dense_hot_ids_stream_byte_for_byte_too(blocked, tmp_path):
    spec, weights, _, _ = blocked
    orders = _orders(spec, hot_low=True, seed=9)
    expected = export(quantize(spec, weights, block_orders=orders), tmp_path / "m")
    done = export_streaming(spec, TensorsSource(weights), tmp_path / "s", chunk_bytes=SMALL_CHUNK, block_orders=orders)
    _assert_same_artifact(done.path, expected)


def _pick_blocks(orders, blocks_of):  # type: ignore[no-untyped-def]
    """Ids of a block table drawn from the blocks ``blocks_of(table)`` (a slice of its blocks) only."""

    def pick(table, n, generator):  # type: ignore[no-untyped-def]
        if not table.blocks:
            return any_ids(table, n, generator)
        starts = [0]
        for b in table.blocks:
            starts.append(starts[-1] + b.rows)
        chosen = blocks_of(table)
        ids = orders[table.name][starts[chosen.start or 0] : starts[chosen.stop]]
        return ids[torch.randint(0, ids.numel(), (n,), generator=generator)]

    return pick


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("which", ["any", "all_hot", "all_cold", "empty_bags"])
def test_the_streamed_artifact_serves_fp32_embedding_bag_over_its_blocks(blocked, tmp_path_factory, which, weighted):
    spec, weights, orders, _ = blocked
    folder = tmp_path_factory.getbasetemp() / f"served-{spec.tables[0].pooling.value}"
    if not folder.exists():
        export_streaming(spec, TensorsSource(weights), folder, chunk_bytes=SMALL_CHUNK, block_orders=orders)
    runtime = load(folder)
    tables = reference_tables(spec, weights, orders)
    batch = 23
    if which == "empty_bags":
        values, lengths, bag_weights = batch_of(
            spec, [[]] * len(spec.features), [[0] * batch] * len(spec.features), weighted, 3
        )
    else:
        pick = {
            "any": any_ids,
            "all_hot": _pick_blocks(orders, lambda t: slice(0, len(t.blocks) - 1)),
            "all_cold": _pick_blocks(orders, lambda t: slice(len(t.blocks) - 1, len(t.blocks))),
        }[which]
        values, lengths, bag_weights = random_request(spec, batch, pick, 5, weighted)
    served = runtime.module(values, lengths.to(torch.int32), bag_weights)
    expected = reference(spec, tables, values, lengths, bag_weights)
    torch.testing.assert_close(served, expected, rtol=1e-5, atol=1e-5)
    if which == "empty_bags":
        assert torch.equal(served, torch.zeros(batch, spec.output_dim))


class CountingSource(TensorsSource):
    """The tables, recording every row range asked for."""

    def __init__(self, tables) -> None:  # type: ignore[no-untyped-def]
        super().__init__(tables)
        self.reads: list[tuple[str, int, int]] = []

    def read_rows(self, name: str, start: int, end: int) -> torch.Tensor:
        self.reads.append((name, start, end))
        return super().read_rows(name, start, end)


@pytest.mark.parametrize("hot_low", [False, True], ids=["sparse_hot", "dense_hot"])
def test_the_source_is_read_a_chunk_at_a_time_never_whole(blocked, tmp_path, hot_low):
    spec, weights, _, _ = blocked
    orders = _orders(spec, hot_low, seed=2)
    source = CountingSource(weights)
    export_streaming(spec, source, tmp_path / "s", chunk_bytes=SMALL_CHUNK, block_orders=orders)
    for table in spec.tables:
        reads = [(start, end) for name, start, end in source.reads if name == table.name]
        chunk_rows = SMALL_CHUNK // (4 * table.embedding_dim)
        assert reads and max(end - start for start, end in reads) <= chunk_rows
        # a block table: its precise blocks' spans, then one pass for the cold block; at most twice its rows
        read = sum(end - start for start, end in reads)
        assert (
            read == table.num_embeddings
            if not table.blocks
            else table.num_embeddings < read <= 2 * table.num_embeddings
        )
    if hot_low:  # dense hot ids share spans: fewer reads than hot rows
        hot = spec.table("blocked").num_embeddings - spec.table("blocked").blocks[-1].rows
        spans = [r for r in source.reads if r[0] == "blocked"]
        assert len(spans) < hot + (200 // 3 + 1)


def test_block_tables_need_their_ranking_and_refuse_a_plan(blocked, tmp_path):
    spec, weights, orders, _ = blocked
    with pytest.raises(ConfigError, match="'blocked'.*no ranking.*block_orders"):
        export_streaming(spec, TensorsSource(weights), tmp_path / "a", block_orders={"two": orders["two"]})
    bad = dict(orders, two=torch.zeros(64, dtype=torch.int64))
    with pytest.raises(ConfigError, match="block_orders of table 'two'"):
        export_streaming(spec, TensorsSource(weights), tmp_path / "a", block_orders=bad)
    plan = make_plan(spec, 2, {})
    with pytest.raises(ConfigError, match="'blocked'.*streamed sharded export.*in memory"):
        export_streaming(spec, TensorsSource(weights), tmp_path / "a", plan, block_orders=orders)
    assert not (tmp_path / "a").exists()
    # the ranking's checked form is what streams: the cold block in id order
    assert torch.equal(block_orders(spec, orders)["two"][8:], torch.sort(orders["two"][8:]).values)
