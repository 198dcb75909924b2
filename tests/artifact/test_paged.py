"""Serving larger than RAM (infer/artifact/paged.py, infer/storage/prefetch.py): a batch's pages read ahead of the
kernel, and hot rows served from a resident cache in front of the mapped tables. Outputs are compared with the fp32
reference on the dequantized tables; the advice is observed in the kernel's page-cache state (``mincore``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from infer.artifact.export import export
from infer.artifact.load import load
from infer.artifact.paged import PagedModel, choose_hot_rows
from infer.errors import ConfigError
from infer.features import SparseFeatures
from infer.planner.types import ShardingType
from infer.quant.quantize import dequantized_weights, quantize
from infer.reference import FloatEmbeddingBagCollection
from infer.shard.builder import shard_model
from infer.shard.plans import make_plan
from infer.storage.prefetch import resident_pages
from infer.weights import random_weights
from tests.conftest import TinyOverArch, mixed_spec, random_batch

NUM_DENSE = 5
RW = ShardingType.ROW_WISE


@pytest.fixture(scope="module")
def model():
    spec = mixed_spec()
    torch.manual_seed(0)
    spec = spec.with_dense_arch(TinyOverArch(NUM_DENSE, spec.output_dim), NUM_DENSE)
    quantized = quantize(spec, random_weights(spec, seed=26))
    reference = FloatEmbeddingBagCollection(spec, dequantized_weights(spec, quantized))
    return spec, quantized, reference


@pytest.fixture(scope="module")
def mapped(model, tmp_path_factory) -> Path:
    spec, quantized, _ = model
    folder = tmp_path_factory.mktemp("paged") / "mapped"
    export(quantized, folder, weights="mapped")
    return folder


@pytest.fixture(scope="module")
def row_wise(model, tmp_path_factory) -> Path:
    spec, quantized, _ = model
    plan = make_plan(spec, 2, {t.name: (RW, (0, 1)) for t in spec.tables})
    folder = tmp_path_factory.mktemp("paged") / "row_wise"
    export(shard_model(quantized, plan), folder, plan=plan, weights="mapped")
    return folder


def _every_row(spec) -> dict[str, torch.Tensor]:
    return {t.name: torch.arange(t.num_embeddings) for t in spec.tables}


def _some_rows(spec) -> dict[str, torch.Tensor]:
    """About a third of each table's rows (every third one), so random batches mix hot and cold ids."""
    return {t.name: torch.arange(0, t.num_embeddings, 3) for t in spec.tables}


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weighted", [False, True])
def test_prefetch_on_and_off_give_identical_outputs(model, mapped, weighted):
    spec, _, reference = model
    plain = load(mapped, verify="none", prefetch="off")
    ahead = load(mapped, verify="none", prefetch="on")
    assert not isinstance(plain.module, PagedModel)
    assert isinstance(ahead.module, PagedModel) and ahead.module.prefetcher is not None
    for seed in range(3):
        batch = random_batch(spec, batch_size=32, weighted=weighted, seed=seed)
        expected = plain.lookup(batch)
        assert torch.equal(ahead.lookup(batch), expected)
        _close(expected, reference(batch))
    assert ahead.module.prefetcher.pages_requested > 0


@pytest.mark.parametrize("cached", [False, True])
def test_the_servers_unchecked_entry_goes_through_prefetch_and_cache(model, mapped, cached):
    """The server calls ``Runtime.lookup_unchecked`` / ``lookup_and_predict_unchecked``: a paged model must
    prefetch (pages asked for) and use its cache there too, with the fp32 reference's answer."""
    spec, _, reference = model
    runtime = load(mapped, verify="none", prefetch="on", hot_rows=_some_rows(spec) if cached else None)
    batch = random_batch(spec, batch_size=32, seed=7)
    before = runtime.module.prefetcher.pages_requested
    _close(runtime.lookup_unchecked(batch.values, batch.lengths, batch.weights), reference(batch))
    assert runtime.module.prefetcher.pages_requested > before
    dense = torch.rand(batch.batch_size, spec.num_dense_features)
    pooled, _ = runtime.lookup_and_predict_unchecked(dense, batch.values, batch.lengths, batch.weights)
    _close(pooled, reference(batch))


@pytest.mark.parametrize("hot", ["all", "none", "mixed"])
@pytest.mark.parametrize("weighted", [False, True])
def test_hot_row_cache_equals_the_fp32_reference(model, mapped, hot, weighted):
    """SUM and MEAN tables (mixed_spec has both), weighted or not, ids all hot / all cold / mixed; random_batch
    has empty bags; duplicate ids are forced into the first bags."""
    spec, _, reference = model
    if hot == "all":
        rows = _every_row(spec)
    elif hot == "mixed":
        rows = _some_rows(spec)
    else:  # rows no batch below reads: every id is cold, the cache still answers
        rows = {t.name: torch.tensor([t.num_embeddings - 1]) for t in spec.tables}
    cached = load(mapped, verify="none", prefetch="on", hot_rows=rows)
    assert cached.module.cache is not None
    for seed in range(3):
        batch = random_batch(spec, batch_size=32, weighted=weighted, seed=seed)
        values = batch.values.clone()
        if hot == "none":
            for info in spec.features:  # keep ids off the one cached row of each table
                values = torch.where(values == info.num_embeddings - 1, torch.zeros_like(values), values)
        else:
            values[: values.numel() // 4] = 3  # repeated ids, inside bags and across features
        batch = SparseFeatures(batch.keys, values, batch.lengths, batch.weights)
        _close(cached.lookup(batch), reference(batch))


def test_hot_row_cache_on_row_wise_shards_and_predict(model, row_wise):
    spec, _, reference = model
    plain = load(row_wise, verify="none", prefetch="off")
    cached = load(row_wise, verify="none", prefetch="on", hot_rows=_some_rows(spec))
    batch = random_batch(spec, batch_size=32, weighted=True, seed=7)
    _close(cached.lookup(batch), reference(batch))
    dense = torch.randn(32, NUM_DENSE, generator=torch.Generator().manual_seed(1))
    _close(cached.predict(batch, dense), plain.predict(batch, dense))


def test_hot_row_cache_reports_bad_ids_like_the_model(model, mapped):
    spec, _, _ = model
    from infer.errors import RequestError

    cached = load(mapped, verify="none", hot_rows=_some_rows(spec))
    batch = random_batch(spec, batch_size=4, seed=0)
    values = batch.values.clone()
    values[0] = 10**6
    with pytest.raises(RequestError, match="f_int8"):
        cached.lookup(SparseFeatures(batch.keys, values, batch.lengths))


@pytest.mark.parametrize(
    ("sample", "named"),
    [
        ({"no_such_table": [1, 2]}, "no_such_table"),
        ({"t_int8": [1, 1000]}, "t_int8"),
        ({"t_int4": [-1]}, "t_int4"),
        ({"t_int2": [[1, 2]]}, "t_int2"),
        ({"t_fp16": [0.5, 1.5]}, "t_fp16"),
        ({"t_fp32": "abc"}, "t_fp32"),
    ],
)
def test_bad_sample_ids_are_a_config_error_naming_the_table(model, mapped, sample, named):
    spec, _, _ = model
    with pytest.raises(ConfigError, match=named):
        choose_hot_rows(spec, sample, max_rows=4)
    with pytest.raises(ConfigError, match=named):
        load(mapped, verify="none", hot_rows=sample)


def test_choose_hot_rows_takes_the_most_frequent(model):
    spec, _, _ = model
    chosen = choose_hot_rows(spec, {"t_int8": [5, 9, 9, 7, 9, 5], "t_int4": [4, 4, 4, 4, 1]}, max_rows=3)
    assert {name: rows.tolist() for name, rows in chosen.items()} == {"t_int8": [9, 5], "t_int4": [4]}


def test_auto_prefetch_follows_the_plans_memory_tiers(model):
    import dataclasses

    from infer.artifact.paged import prefetch_wanted
    from infer.planner.types import MemoryTier

    spec, _, _ = model
    plan = make_plan(spec, 2, {t.name: (RW, (0, 1)) for t in spec.tables})
    assert all(s.tier == MemoryTier.RESIDENT for t in plan.tables for s in t.shards)
    first = plan.tables[0]
    paged_shard = dataclasses.replace(first.shards[0], tier=MemoryTier.PAGED)
    paged = dataclasses.replace(plan, tables=(dataclasses.replace(first, shards=(paged_shard, *first.shards[1:])),))
    assert not prefetch_wanted("auto", True, plan)
    assert not prefetch_wanted("auto", True, None)
    assert prefetch_wanted("auto", True, paged)
    assert not prefetch_wanted("auto", False, paged)  # embedded weights: nothing to read ahead
    assert prefetch_wanted("on", True, None) and not prefetch_wanted("off", True, paged)


def test_unknown_prefetch_mode_is_refused(mapped):
    with pytest.raises(ConfigError, match="prefetch"):
        load(mapped, verify="none", prefetch="always")


def test_prefetch_makes_a_batchs_pages_resident_after_eviction(model, tmp_path):
    """After the file's pages are dropped from the page cache, ``prefetch`` alone (no lookup) brings back the
    pages the batch reads and MADV_RANDOM shows in smaps; pages no id reads stay out."""
    from infer.config import DataType, ModelSpec, TableConfig

    spec = ModelSpec((TableConfig("big", 20000, 128, ("f",), data_type=DataType.INT8),))  # 2.6 MB, 645 pages
    folder = tmp_path / "big"
    export(quantize(spec, random_weights(spec, seed=3)), folder, weights="mapped")
    runtime = load(folder, verify="none", prefetch="on")
    paged = runtime.module
    (place,) = paged.prefetcher.regions
    table = paged.embeddings.tbe.weights_host
    weights = folder / "weights-0.bin"
    fd = os.open(weights, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages (the file was just written) are not dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    assert resident_pages(table).sum() == 0  # evicted (the file is clean and unlocked)
    ids = torch.tensor([0, 5000, 19999])
    asked = paged.prefetcher.prefetch(ids, torch.tensor([3], dtype=torch.int32))
    pages = [(place.address + int(i) * place.row_bytes) // 4096 - table.data_ptr() // 4096 for i in ids]
    assert asked == len(set(pages))
    resident = resident_pages(table)
    for page in pages:
        for _ in range(100_000):  # the reads are asynchronous: wait for each page's read (an event, not a time)
            if resident_pages(table)[page]:
                break
            os.sched_yield()
        assert resident_pages(table)[page], page
    assert resident_pages(table).sum() < resident.size // 4  # the rest was not read in
    smaps = Path("/proc/self/smaps").read_text()
    block = smaps[smaps.index(str(weights)) :].split("VmFlags:", 1)[1].splitlines()[0]
    assert "rr" in block.split()  # MADV_RANDOM
