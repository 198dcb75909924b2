"""``model.pt2`` takes its tables from the artifact's mapped weight files (AOTInductor user-managed constants).

The reference is fp32 ``F.embedding_bag`` on the dequantized tables (``tests.support.call_contract.Reference``),
never the program. "No copy" is observed, not timed: rewriting the weight file under a loaded program changes its
lookups, and anonymous memory after a load does not grow with the tables (two table sizes, fresh processes).
The unsharded and sharded models are the ones test_pt2 compiles (``compiled_pt2``: once per session, across
xdist workers), the embedded one is tests/cpp/test_cpp_pt2.py's (``embedded_pt2``: the bad-request corpus's model);
only ``large`` compiles for this file alone: its bigger table is what the size tests compare and what "a package
from another export" loads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from infer.artifact.export import export
from infer.artifact.fbgemm_libs import load_fbgemm
from infer.artifact.formats.pt2_program import WEIGHT_CONSTANTS_KEY
from infer.artifact.load import load
from infer.config import DataType, ModelSpec
from infer.errors import ArtifactError, ArtifactErrorKind
from infer.quant.quantize import quantize
from infer.weights import random_weights
from tests.conftest import random_batch
from tests.support.artifacts import copy_artifact, damage_file, edit_manifest, rehash
from tests.support.call_contract import Reference, assert_matches
from tests.support.pt2_models import PT2_SEED, compiled_pt2, embedded_pt2

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


LARGE_ROWS = 300_000  # t_int8's rows in ``large``: 300x pt2_spec's, ~20 MB more of INT8 rows


def _shared(tmp_path_factory, kind: str):  # type: ignore[no-untyped-def]
    """(spec, reference, artifact path) of ``compiled_pt2(kind)``: mapped weight files (export's default), compiled
    once per session with test_pt2 and the C++ loader's pt2 tests (tests/support/pt2_models.py)."""
    spec, path = compiled_pt2(tmp_path_factory, kind)
    return spec, Reference(spec, quantize(spec, random_weights(spec, seed=PT2_SEED))), path


@pytest.fixture(scope="module")
def small(tmp_path_factory):  # type: ignore[no-untyped-def]
    """pt2_spec unsharded with its dense part (compared with ``large``): SUM and MEAN features over INT8, INT4 and
    FP16 tables, INT2 and FP32 ones, one table read by two features."""
    return _shared(tmp_path_factory, "unsharded")


@pytest.fixture(scope="module", params=["unsharded", "sharded"])
def mapped(request, tmp_path_factory):  # type: ignore[no-untyped-def]
    """``small``, or pt2_spec on four CPU devices: one table's columns split, tables replicated (each replica a
    slice of the batch), the rest table-wise (``mixed_sharding``)."""
    if request.param == "unsharded":
        return request.getfixturevalue("small")
    return _shared(tmp_path_factory, "mixed_sharding")


@pytest.fixture(scope="module")
def large(small, tmp_path_factory):  # type: ignore[no-untyped-def]
    """``small`` with a 300x bigger t_int8 (everything else alike, the dense part too): compiled here alone, through
    ``export`` with the dense part a plain module (``small`` came through the CLI, scripted)."""
    small_spec = small[0]
    tables = tuple(replace(t, num_embeddings=LARGE_ROWS) if t.name == "t_int8" else t for t in small_spec.tables)
    spec = ModelSpec(tables).with_dense_arch(small_spec.dense_arch, small_spec.num_dense_features)
    model = quantize(spec, random_weights(spec, seed=PT2_SEED))
    return spec, Reference(spec, model), export(model, tmp_path_factory.mktemp("pt2w_large") / "large", pt2=True)


def _batches(spec: ModelSpec):  # type: ignore[no-untyped-def]
    return [
        random_batch(spec, 1, max_len=9, seed=1),
        random_batch(spec, 257, max_len=12, seed=2),
        random_batch(spec, 300, max_len=12, weighted=True, seed=3),
        random_batch(spec, 64, max_len=12, weighted=True, seed=4, id_dtype=torch.int32),
    ]


def _weight_files(path: Path) -> list[Path]:
    return sorted(path.glob("weights-*.bin"))


def test_lookups_equal_the_fp32_reference_with_the_mapped_weights(mapped):
    spec, reference, path = mapped
    runtime = load(path, backend="pt2")
    assert runtime.backend == "pt2"
    assert len(runtime.module.mappings) == len(_weight_files(path)) >= 1  # the program reads the weight files
    for batch in _batches(spec):
        assert_matches(runtime.lookup(batch), reference.pooled(batch))


def test_the_package_names_one_mapped_buffer_per_kernel(mapped):
    """The lookup program's metadata names a constant and its size for each kernel's weight buffer: the sizes
    the manifest maps."""
    _, _, path = mapped
    from torch._C._aoti import AOTIModelPackageLoader

    load_fbgemm()
    program = AOTIModelPackageLoader(str(path / "model.pt2"), "model", False, 1, -1)
    entries = [item.split("=") for item in program.get_metadata()[WEIGHT_CONSTANTS_KEY].split(",")]
    kernels = json.loads((path / "manifest.json").read_text())["kernels"]
    assert [int(size) for _, size in entries] == [k["weights"]["bytes"] for k in kernels]
    assert {name for name, _ in entries} <= set(program.get_constant_fqns())


@pytest.mark.parametrize("batch_size", [1, 4096])
def test_a_bare_load_of_the_package_raises_naming_embserve_loaders(mapped, batch_size):
    """What torch documents for an AOTInductor package, ``torch._inductor.aoti_load_package(path / "model.pt2")``
    and a call with the program's documented inputs, raises (a mapped artifact's package lacks its tables: it
    would read past their 64-byte stand-ins), telling the user to load the artifact through embserve."""
    spec, reference, path = mapped
    load_fbgemm()  # the program calls fbgemm's operators: a bare user imports fbgemm_gpu
    program = torch._inductor.aoti_load_package(str(path / "model.pt2"))
    batch = random_batch(spec, batch_size, max_len=9, seed=batch_size)
    values, lengths = batch.values.to(torch.int64), batch.lengths.to(torch.int64)  # the documented dtypes
    with pytest.raises(RuntimeError) as err:
        program(values, lengths, torch.ones(values.numel()))
    message = str(err.value)
    assert "infer.load(folder, backend='pt2')" in message and "embserve::Model::load" in message, message
    assert "weight files" in message, message
    # the artifact still loads and looks up through embserve in the same process
    assert_matches(load(path, backend="pt2").lookup(batch), reference.pooled(batch))


def test_package_size_does_not_grow_with_the_tables(small, large):
    """model.pt2 of a 300x bigger table is about the same size: the tables are in weights-0.bin only."""
    _, _, small_path = small
    _, _, large_path = large
    table_growth = (large_path / "weights-0.bin").stat().st_size - (small_path / "weights-0.bin").stat().st_size
    package_growth = (large_path / "model.pt2").stat().st_size - (small_path / "model.pt2").stat().st_size
    assert table_growth > 18_000_000
    assert package_growth < 0.01 * table_growth, (package_growth, table_growth)
    assert (large_path / "model.pt2").stat().st_size < table_growth


def test_a_plain_module_dense_part_predicts_as_the_reference(large):
    """The dense program compiled from the module itself (no TorchScript conversion): predict equals the fp32
    reference and the TorchScript artifact of the same export, within fp32 rounding (bit-equal is not promised: a
    batch of 257 here differs from TorchScript in the last bits of some scores)."""
    spec, reference, path = large
    runtime, scripted = load(path, backend="pt2"), load(path)
    assert runtime.has_dense
    generator = torch.Generator().manual_seed(12)
    for batch in _batches(spec):
        dense = torch.randn(batch.batch_size, spec.num_dense_features, generator=generator)
        scores = runtime.predict(batch, dense)
        assert_matches(scores, reference.scores(batch, dense))
        torch.testing.assert_close(scores, scripted.predict(batch, dense), rtol=0, atol=1e-5)


def test_the_program_reads_the_mapping_not_a_copy(mapped, tmp_path):
    """Rewriting the weight file in place (same inode: a private read-only mapping sees it) changes the loaded
    program's lookups: it reads the mapped pages. Zeroed INT8/INT4/FP16 rows (scale and bias 0) pool to 0."""
    spec, reference, path = mapped
    copy = copy_artifact(path, tmp_path)
    runtime = load(copy, backend="pt2")
    batch = random_batch(spec, 32, max_len=8, seed=9)
    assert_matches(runtime.lookup(batch), reference.pooled(batch))
    assert float(reference.pooled(batch).abs().sum()) > 0
    for file in _weight_files(copy):
        with open(file, "r+b") as handle:  # in place: the mapping stays on this inode
            handle.write(bytes(file.stat().st_size))
    assert torch.equal(runtime.lookup(batch), torch.zeros(32, spec.output_dim))


@pytest.mark.parametrize("damage", ["flipped_byte", "truncated"])
def test_a_damaged_weight_file_is_a_checksum_error_before_the_program_gets_it(mapped, tmp_path, damage):
    _, _, path = mapped
    copy = copy_artifact(path, tmp_path)
    target = _weight_files(copy)[-1]
    damage_file(target, damage)
    with pytest.raises(ArtifactError) as err:
        load(copy, backend="pt2")
    assert err.value.kind == ArtifactErrorKind.CHECKSUM
    assert target.name in str(err.value)
    if damage == "truncated":  # sizes are checked before mapping, whatever the verify mode
        with pytest.raises(ArtifactError) as err:
            load(copy, backend="pt2", verify="none")
        assert err.value.kind == ArtifactErrorKind.CHECKSUM and target.name in str(err.value)


def test_a_package_from_another_export_is_refused_naming_the_file(mapped, tmp_path, large):
    """model.pt2 of another mapped export (compiled for weight buffers of other sizes), re-hashed into the
    manifest, is a MODEL error naming model.pt2 and the fix, never a program run over the wrong buffers."""
    _, _, path = mapped
    _, _, other = large
    copy = copy_artifact(path, tmp_path)
    (copy / "model.pt2").write_bytes((other / "model.pt2").read_bytes())
    rehash(copy, "model.pt2")
    with pytest.raises(ArtifactError) as err:
        load(copy, backend="pt2")
    assert err.value.kind == ArtifactErrorKind.MODEL
    assert "model.pt2" in str(err.value) and "Re-export" in str(err.value)


def test_an_embedded_artifact_keeps_the_tables_in_its_package(tmp_path_factory):
    """An artifact without weight files (``weights="embedded"``, as every pt2 package was before) compiles its
    tables into model.pt2 and loads as before (the corpus's model, compiled once with the C++ loader's tests)."""
    spec, path = embedded_pt2(tmp_path_factory)
    reference = Reference(spec, quantize(spec, random_weights(spec, seed=PT2_SEED)))
    assert not _weight_files(path)
    runtime = load(path, backend="pt2")
    assert runtime.module.mappings == ()
    for batch in _batches(spec):
        assert_matches(runtime.lookup(batch), reference.pooled(batch))
    table_bytes = sum(t.num_embeddings * (t.embedding_dim + 4) for t in spec.tables if t.data_type == DataType.INT8)
    assert (path / "model.pt2").stat().st_size > table_bytes  # the INT8 tables' rows are inside
    # it holds its tables, so a bare load (torch._inductor.aoti_load_package) runs it as torch documents
    load_fbgemm()
    program = torch._inductor.aoti_load_package(str(path / "model.pt2"))
    batch = random_batch(spec, 300, max_len=12, seed=7)
    values, lengths = batch.values.to(torch.int64), batch.lengths.to(torch.int64)
    assert_matches(program(values, lengths, torch.ones(values.numel())), reference.pooled(batch))


LOAD_AND_REPORT = textwrap.dedent(
    """
    import json, sys
    import torch
    from infer.artifact.fbgemm_libs import load_fbgemm
    from infer.artifact.load import load
    from infer.features import SparseFeatures
    from infer.storage.memory import memory_use

    def status():
        use = memory_use()
        return {"RssAnon": use.rss_anon, "RssFile": use.rss_file}

    load_fbgemm()
    before = status()
    runtime = load(sys.argv[1], backend="pt2")
    spec = runtime.manifest.spec
    rows = spec.features[0].num_embeddings
    # 8192 ids spread over the big table (the same request size for both tables): < 4 KiB apart, every page read
    ids = torch.linspace(0, rows - 1, 8192).to(torch.int64)
    lengths = torch.zeros(len(spec.features), dtype=torch.int32)
    lengths[0] = ids.numel()
    runtime.lookup(SparseFeatures(spec.feature_names, ids, lengths))
    after = status()
    print(json.dumps({key: after[key] - before[key] for key in after}))
    """
)


def _load_in_fresh_process(path: Path) -> dict[str, int]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", LOAD_AND_REPORT, str(path)], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report: dict[str, int] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


def test_anonymous_memory_after_a_load_does_not_grow_with_the_tables(small, large):
    """After a load and a lookup that reads every page of the big table, a 300x bigger table adds under 10 % of
    its bytes to anonymous memory (a copy would add all of them), and its pages are file-backed (RssFile)."""
    _, _, path = small
    _, _, large_path = large
    table_growth = (large_path / "weights-0.bin").stat().st_size - (path / "weights-0.bin").stat().st_size
    small = _load_in_fresh_process(path)
    big = _load_in_fresh_process(large_path)
    assert big["RssAnon"] - small["RssAnon"] < 0.1 * table_growth, (small, big, table_growth)
    assert big["RssFile"] - small["RssFile"] > 0.5 * table_growth, (small, big, table_growth)


@pytest.mark.parametrize("claim", ["package", None])
def test_a_manifest_that_says_the_package_holds_the_tables_is_refused(mapped, tmp_path, claim):
    """pt2.tables is the manifest's word on where model.pt2's tables are: "weight_files" for a mapped export. A
    manifest that says "package" (or, written before the key, nothing) beside a package that lacks its tables is
    a MODEL error, never a program run on its stand-ins. (A loader that does not know the key refuses the
    manifest: the schema allows no unknown keys.)"""
    _, _, path = mapped
    assert json.loads((path / "manifest.json").read_text())["pt2"]["tables"] == "weight_files"
    copy = copy_artifact(path, tmp_path)
    edit_manifest(copy, lambda m: m["pt2"].update(tables=claim) if claim else m["pt2"].pop("tables"))
    with pytest.raises(ArtifactError) as err:
        load(copy, backend="pt2")
    assert err.value.kind == ArtifactErrorKind.MODEL
    assert "model.pt2" in str(err.value) and "pt2.tables" in str(err.value) and "Re-export" in str(err.value)
