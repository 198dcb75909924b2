"""Mapped weights (infer/artifact/mapped.py, infer/storage/): each CPU weight buffer in a page-aligned file of the
artifact, mapped read-only at load and handed to the kernels; its checksums, sizes and manifest entries checked."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import stat
import zipfile
from pathlib import Path

import pytest
import torch

from infer.artifact.export import export
from infer.artifact.hosts import export_hosts, load_host_part
from infer.artifact.kernels import model_tbes
from infer.artifact.load import load
from infer.cli import main
from infer.errors import ArtifactError, ArtifactErrorKind, ConfigError
from infer.planner.types import ShardingType
from infer.quant.quantize import dequantized_weights, quantize
from infer.reference import FloatEmbeddingBagCollection
from infer.shard.builder import shard_model
from infer.shard.plans import make_plan
from infer.storage import checksums as verify
from infer.weights import random_weights
from tests.conftest import TinyOverArch, mixed_spec, random_batch
from tests.support.artifacts import copy_artifact, edit_manifest

PAGE = 4096
CHUNK = 4096
TW, RW, CW, REP = ShardingType.TABLE_WISE, ShardingType.ROW_WISE, ShardingType.COLUMN_WISE, ShardingType.REPLICATED
NUM_DENSE = 5
PLANS = {
    "unsharded": None,
    "table_wise": {"t_int8": (TW, (0,)), "t_int4": (TW, (1,)), "t_int2": (TW, (0,)), "t_fp16": (TW, (1,))},
    "row_wise": {name: (RW, (0, 1)) for name in ("t_int8", "t_int4", "t_int2", "t_fp16", "t_fp32")},
    "column_wise": {"t_int8": (CW, (0, 1)), "t_int4": (CW, (1, 0)), "t_int2": (TW, (1,))},
    "replicated": {name: (REP, (0, 1)) for name in ("t_int8", "t_int4", "t_int2", "t_fp16", "t_fp32")},
    "mixed": {"t_int8": (RW, (0, 1)), "t_int4": (CW, (1, 0)), "t_int2": (TW, (1,)), "t_fp16": (REP, (0, 1))},
}
# plans whose kernels share one weight buffer (and file): replicas, and row-/column-wise views of a table
SHARED_BUFFER = ("unsharded", "replicated", "row_wise", "column_wise", "mixed")


@pytest.fixture(scope="module")
def quantized():
    spec = mixed_spec()
    torch.manual_seed(0)
    spec = spec.with_dense_arch(TinyOverArch(NUM_DENSE, spec.output_dim), NUM_DENSE)
    return spec, quantize(spec, random_weights(spec, seed=26))


def _export_both(spec, model, plan_layout, folder: Path) -> tuple[Path, Path, torch.nn.Module]:
    """The model (sharded by ``plan_layout``) exported embedded and mapped; chunks small enough to have several."""
    plan = make_plan(spec, 2, plan_layout, column_unit=8) if plan_layout is not None else None
    exported = shard_model(model, plan) if plan is not None else model
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(verify, "WEIGHTS_CHUNK_BYTES", CHUNK)
        patch.setattr(verify, "CHUNKED_MIN_BYTES", 0)
        embedded = export(exported, folder / "embedded", plan=plan, weights="embedded")
        mapped = export(exported, folder / "mapped", plan=plan, weights="mapped")
    return embedded, mapped, exported


@pytest.fixture(scope="module")
def export_plan(quantized, tmp_path_factory):
    """Each plan's two exports, made once when first asked for (by `artifacts` or by a test over every plan)."""
    spec, model = quantized

    @functools.cache
    def exported(plan_kind: str) -> tuple[Path, Path, torch.nn.Module]:
        return _export_both(spec, model, PLANS[plan_kind], tmp_path_factory.mktemp(f"mapped_{plan_kind}"))

    return exported


@pytest.fixture(scope="module", params=list(PLANS))
def artifacts(request, export_plan):
    embedded, mapped, exported = export_plan(request.param)
    return request.param, embedded, mapped, exported


@pytest.fixture(scope="module")
def unsharded(quantized, tmp_path_factory):
    spec, model = quantized
    return _export_both(spec, model, None, tmp_path_factory.mktemp("unsharded"))[1]


def _mapped_ranges(path: Path) -> list[tuple[int, int, str]]:
    """(start, end, permissions) of this process's mappings of ``path``."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(path.resolve()):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end, fields[1]))
    return ranges


def test_lookups_and_predict_equal_the_embedded_artifact_and_the_fp32_reference(quantized, artifacts):
    spec, model = quantized
    kind, embedded, mapped, _ = artifacts
    reference = FloatEmbeddingBagCollection(spec, dequantized_weights(spec, model))
    runtime, baseline = load(mapped), load(embedded)
    for seed, weighted in ((0, False), (1, True)):
        batch = random_batch(spec, 13, max_len=7, weighted=weighted, seed=seed)
        pooled = runtime.lookup(batch)
        assert torch.equal(pooled, baseline.lookup(batch)), kind
        expected = reference(batch)
        assert float((pooled - expected).abs().max()) <= 1e-5 * max(float(expected.abs().max()), 1.0)
        dense = torch.randn(13, NUM_DENSE, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            expected_scores = spec.dense_arch(dense, expected)
        assert torch.allclose(runtime.predict(batch, dense), expected_scores, atol=1e-4)


def test_each_cpu_buffer_is_one_file_of_page_aligned_tables_holding_the_kernel_rows(artifacts):
    kind, _, mapped, exported = artifacts
    manifest = json.loads((mapped / "manifest.json").read_text())
    assert manifest["format_version"] == 3
    files = sorted(name for name in manifest["files"] if name.startswith("weights-"))
    # CPU replicas and row-/column-wise views share one buffer (and file); otherwise every kernel has its own
    assert files == (["weights-0.bin"] if kind in SHARED_BUFFER else ["weights-0.bin", "weights-1.bin"])
    for kernel, tbe in zip(manifest["kernels"], model_tbes(exported)):
        place = kernel["weights"]
        assert "shared_storage" not in kernel and place["offset"] % PAGE == 0
        data = (mapped / place["file"]).read_bytes()
        eager = tbe.weights_host.numpy().tobytes()
        for table, start, eager_start in zip(
            kernel["tables"], place["table_offsets"], [int(o) for o in tbe.weights_physical_offsets]
        ):
            assert start % PAGE == 0
            rows, _ = tbe.split_embedding_weights(split_scale_shifts=False)[kernel["tables"].index(table)]
            size = rows.numel()
            # the file holds the kernel's own rows (its row layout and alignment), moved to a page boundary
            assert data[start : start + size] == eager[eager_start : eager_start + size]


def test_the_weight_files_hold_every_row_once(quantized, artifacts, unsharded):
    """On one CPU host a plan's shards of a table (row blocks, column slices, replicas) are views of the one
    table: the artifact's weight files hold each table's rows once, at one place, and a plan whose kernels share
    one file has the unsharded model's file, byte for byte."""
    spec, _ = quantized
    kind, _, mapped, _ = artifacts
    manifest = json.loads((mapped / "manifest.json").read_text())
    places = {(k["weights"]["file"], start) for k in manifest["kernels"] for start in k["weights"]["table_offsets"]}
    assert len(places) == len(spec.tables)
    placed = sorted((t["rows"], t["dim"], t["data_type"]) for k in manifest["kernels"] for t in k["tables"])
    assert sorted(set(placed)) == sorted((t.num_embeddings, t.embedding_dim, t.data_type.value) for t in spec.tables)
    sizes = [(mapped / name).stat().st_size for name in manifest["files"] if name.startswith("weights-")]
    whole = [(unsharded / name).stat().st_size for name in os.listdir(unsharded) if name.startswith("weights-")]
    if kind in SHARED_BUFFER:
        assert sizes == whole
        assert (mapped / "weights-0.bin").read_bytes() == (unsharded / "weights-0.bin").read_bytes()
    else:  # table-wise: each file's tables page-aligned, its last one unpadded
        assert whole[0] - PAGE * len(sizes) < sum(sizes) <= whole[0]


def test_model_file_keeps_structure_only(artifacts):
    _, embedded, mapped, exported = artifacts
    module = torch.jit.load(str(mapped / "model.pt"))
    manifest = json.loads((mapped / "manifest.json").read_text())
    for tbe, kernel in zip(model_tbes(module), manifest["kernels"]):
        assert tbe.weights_host.numel() == 0
        assert tbe.host_size == kernel["weights"]["bytes"]
        assert list(tbe.weights_physical_offsets) == kernel["weights"]["table_offsets"]
    buffers = {tbe.weights_host.data_ptr(): tbe.weights_host.numel() for tbe in model_tbes(exported)}
    # the embedded model.pt stores each weight buffer once; the mapped one stores none of them
    assert _tensor_bytes(embedded / "model.pt") - _tensor_bytes(mapped / "model.pt") == sum(buffers.values())


def _tensor_bytes(model: Path) -> int:
    """Bytes of the tensor storages saved in a TorchScript archive (its ``data/`` entries)."""
    with zipfile.ZipFile(model) as archive:
        return sum(info.file_size for info in archive.infolist() if "/data/" in info.filename)


def test_loaded_weights_are_a_read_only_private_mapping_of_the_file_not_a_copy(artifacts):
    kind, _, mapped, _ = artifacts
    runtime = load(mapped)
    for kernel, tbe in zip(runtime.manifest.kernels, model_tbes(runtime.module)):
        assert kernel.weights is not None
        ranges = _mapped_ranges(mapped / kernel.weights.file)
        pointer = tbe.weights_host.data_ptr()
        inside = [r for r in ranges if r[0] <= pointer and pointer + tbe.weights_host.numel() <= r[1]]
        assert inside, (kind, ranges)
        assert inside[0][2].endswith("p")  # MAP_PRIVATE: a write could never reach the file
    if kind == "replicated":  # both kernels read one mapping
        pointers = {tbe.weights_host.data_ptr() for tbe in model_tbes(runtime.module)}
        assert len(pointers) == 1


def test_a_read_only_artifact_loads_and_its_files_are_never_written(unsharded, tmp_path):
    artifact = copy_artifact(unsharded, tmp_path)
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in artifact.iterdir()}
    for path in [artifact, *artifact.iterdir()]:
        path.chmod(path.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    try:
        runtime = load(artifact)
        spec = runtime.spec
        runtime.lookup(random_batch(spec, 64, max_len=20, seed=3))
        runtime.predict(random_batch(spec, 4, seed=4), torch.randn(4, NUM_DENSE))
        del runtime
        assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in artifact.iterdir()} == before
    finally:
        for path in [artifact, *artifact.iterdir()]:
            path.chmod(path.stat().st_mode | stat.S_IWUSR)


def _weights_file(artifact: Path) -> Path:
    return artifact / "weights-0.bin"


def test_a_flipped_byte_names_the_file_and_its_chunk(unsharded, tmp_path):
    artifact = copy_artifact(unsharded, tmp_path)
    path = _weights_file(artifact)
    data = bytearray(path.read_bytes())
    offset = 3 * CHUNK + 17
    data[offset] ^= 0x5A
    path.write_bytes(bytes(data))
    with pytest.raises(ArtifactError) as info:
        load(artifact)
    assert info.value.kind == ArtifactErrorKind.CHECKSUM and info.value.path == str(path)
    assert f"bytes {3 * CHUNK}-{4 * CHUNK - 1}" in str(info.value) and "weights-0.bin" in str(info.value)
    # verify="none" checks sizes only: the same artifact loads (what a trusted, verified volume may choose)
    assert load(artifact, verify="none").manifest.mapped


@pytest.mark.parametrize("verify_mode", ["full", "none"])
def test_a_truncated_weights_file_is_a_typed_error_never_a_crash(unsharded, tmp_path, verify_mode):
    artifact = copy_artifact(unsharded, tmp_path)
    path = _weights_file(artifact)
    size = path.stat().st_size
    os.truncate(path, size - PAGE)
    with pytest.raises(ArtifactError) as info:
        load(artifact, verify=verify_mode)
    assert info.value.kind == ArtifactErrorKind.CHECKSUM and info.value.path == str(path)
    assert f"is {size - PAGE} bytes but the manifest says {size}" in str(info.value)


@pytest.mark.parametrize("verify_mode", ["full", "none"])
def test_a_wrong_size_in_the_manifest_names_the_file(unsharded, tmp_path, verify_mode):
    artifact = copy_artifact(unsharded, tmp_path)
    size = _weights_file(artifact).stat().st_size
    edit_manifest(artifact, lambda d: d["files"]["weights-0.bin"].update(bytes=size + PAGE))
    with pytest.raises(ArtifactError) as info:
        load(artifact, verify=verify_mode)
    assert info.value.kind == ArtifactErrorKind.CHECKSUM and "weights-0.bin" in str(info.value)
    assert f"is {size} bytes but the manifest says {size + PAGE}" in str(info.value)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda k: k["weights"].update(bytes=k["weights"]["bytes"] - 1), "'kernels' disagrees"),
        (lambda k: k["weights"].update(offset=PAGE), "do not lie page-aligned inside weights-0.bin"),
        (lambda k: k["weights"].update(offset=1), "do not lie page-aligned inside weights-0.bin"),
        (lambda k: k["weights"].update(table_offsets=[o + 128 for o in k["weights"]["table_offsets"]]), "disagrees"),
        (lambda k: k["weights"].update(file="weights-7.bin"), "no checksum for weights-7.bin"),
        (lambda k: k.update(shared_storage={"bytes": 1, "table_offsets": [0]}), "both 'weights' and 'shared_storage'"),
        (lambda k: k.pop("weights"), "format_version 3 keeps each CPU kernel's weights"),
    ],
    ids=["bytes", "offset_past_end", "offset_unaligned", "table_offsets", "unlisted_file", "both_keys", "missing"],
)
def test_a_kernel_weights_entry_that_disagrees_is_refused_before_mapping(unsharded, tmp_path, edit, message):
    artifact = copy_artifact(unsharded, tmp_path)
    edit_manifest(artifact, lambda d: edit(d["kernels"][0]))
    with pytest.raises(ArtifactError, match="manifest.json") as info:
        load(artifact)
    assert message in str(info.value)


def test_weights_entries_need_format_version_3(unsharded, tmp_path):
    artifact = copy_artifact(unsharded, tmp_path)
    edit_manifest(artifact, lambda d: d.update(format_version=2))
    with pytest.raises(ArtifactError, match="needs format_version 3"):
        load(artifact)


def test_unknown_weights_format_and_verify_mode_are_config_errors(quantized, unsharded, tmp_path):
    _, model = quantized
    with pytest.raises(ConfigError, match="unknown weights format 'zip'"):
        export(model, tmp_path / "x", weights="zip")
    with pytest.raises(ConfigError, match="unknown verify mode 'some'"):
        load(unsharded, verify="some")


def test_multi_host_parts_map_their_own_files(quantized, tmp_path):
    from tests.distributed.conftest import host_plan

    spec, model = quantized
    plan = host_plan(spec, "mixed", hosts=2, devices_per_host=2)
    embedded = export_hosts(model, tmp_path / "embedded", plan)
    mapped = export_hosts(model, tmp_path / "mapped", plan, weights="mapped")
    files = sorted(json.loads((mapped / "manifest.json").read_text())["files"])
    assert [f for f in files if "weights-" in f] == [f"hosts/{h}/weights-{n}.bin" for h in (0, 1) for n in (0, 1)]
    batch = random_batch(spec, 9, seed=5)
    for host in (0, 1):
        part, baseline = load_host_part(mapped, host), load_host_part(embedded, host)
        for tbe, kernel in zip(model_tbes(part.module), [k for k in part.manifest.kernels if k.rank // 2 == host]):
            assert kernel.weights is not None and kernel.weights.file.startswith(f"hosts/{host}/")
            pointer = tbe.weights_host.data_ptr()
            assert any(lo <= pointer < hi for lo, hi, _ in _mapped_ranges(mapped / kernel.weights.file))
        with torch.no_grad():
            got = part.module(batch.values, batch.lengths, batch.weights)
            want = baseline.module(batch.values, batch.lengths, batch.weights)
        assert torch.equal(got, want)


def test_cli_exports_mapped_and_prints_load_and_verify_rates(unsharded, tmp_path, capsys):
    assert main(["run", str(unsharded), "--verify", "none", "--iterations", "1", "--batch-size", "8"]) == 0
    printed = capsys.readouterr().out
    assert "sizes checked, checksums not verified" in printed and "GB/s, no checksums" in printed
    assert main(["run", str(unsharded), "--iterations", "1", "--batch-size", "8"]) == 0
    assert "GB/s, checksums included" in capsys.readouterr().out
    assert main(["inspect", str(unsharded), "--verify"]) == 0
    printed = capsys.readouterr().out
    assert "weights-0.bin" in printed and "checksums verified: 2 files" in printed and "GB/s" in printed
    spec = mixed_spec()
    (tmp_path / "spec.json").write_text(spec.to_json())
    torch.save(random_weights(spec), tmp_path / "ckpt.pt")
    out = tmp_path / "art"
    code = main(
        ["export", "--spec", str(tmp_path / "spec.json"), "--weights", str(tmp_path / "ckpt.pt"), "--out", str(out),
         "--weights-format", "mapped"]
    )  # fmt: skip
    assert code == 0
    data = json.loads((out / "manifest.json").read_text())
    assert data["format_version"] == 3 and "weights-0.bin" in data["files"]
    assert hashlib.sha256((out / "weights-0.bin").read_bytes()).hexdigest() == data["files"]["weights-0.bin"]["sha256"]


def test_a_bare_torchscript_load_of_a_mapped_model_refuses_to_run(export_plan):
    """A mapped model.pt loaded without embserve's loader has empty weight buffers: a call raises an error
    that says how to load it (a fresh process, so a crash would show as a signal, not take pytest down)."""
    # one interpreter for every plan's two files (each start imports torch and fbgemm, 3-7 s): one line per file
    script = (
        "import sys, torch, fbgemm_gpu\n"
        "values, lengths = torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int32)\n"
        "for path in sys.argv[1:]:\n"
        "    model = torch.jit.load(path)\n"
        "    try:\n"
        "        model(values, lengths, None)\n"
        "    except Exception as err:  # torch.jit.Error\n"
        "        print('refused:', ' '.join(str(err).split()), flush=True)\n"
        "        continue\n"
        "    print('ran', flush=True)\n"
    )
    import subprocess
    import sys

    batch_of = len(mixed_spec().features)  # an empty batch of one example per feature
    script = script.replace("torch.zeros(0, dtype=torch.int32)", f"torch.zeros({batch_of}, dtype=torch.int32)")
    kinds = list(PLANS)
    files = [str(export_plan(kind)[index] / "model.pt") for kind in kinds for index in (1, 0)]  # mapped, embedded
    done = subprocess.run([sys.executable, "-c", script, *files], capture_output=True, text=True)
    assert done.returncode == 0, (done.stdout, done.stderr[-2000:])
    lines = done.stdout.splitlines()
    assert len(lines) == len(files), (done.stdout, done.stderr[-2000:])
    for kind, refused, ran in zip(kinds, lines[::2], lines[1::2], strict=True):
        assert refused.startswith("refused:"), (kind, refused, done.stderr[-2000:])
        assert "weight files beside it" in refused and "infer.load" in refused, (kind, refused)
        assert ran == "ran", (kind, ran, done.stderr[-2000:])
        # embserve's loader attaches the weights and the same file runs
        mapped = export_plan(kind)[1]
        assert load(mapped).lookup({f.name: [[]] for f in mixed_spec().features}).shape[0] == 1, kind
