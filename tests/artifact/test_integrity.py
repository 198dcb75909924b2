"""A loaded model is checked down to its kernels' buffers, and plan.json against the model, before any lookup.

The tampering here is what a careless tool or a corrupted copy does: change the model or the plan, then
re-hash it into the manifest. The loader must answer ArtifactError, never crash at the first lookup.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

from infer.artifact.export import export
from infer.artifact.kernels import DERIVED_ROUTING
from infer.artifact.load import load
from infer.errors import ArtifactError, ArtifactErrorKind
from infer.planner.types import ShardingType
from infer.quant.quantize import quantize
from infer.shard.builder import shard_model
from infer.shard.plans import make_plan
from infer.weights import random_weights
from tests.conftest import mixed_spec, random_batch
from tests.support.artifacts import (
    copy_artifact,
    rehash,
    rewrite_zip_entry,
    shrink_table_in_manifest,
    tamper_row_bucketing,
)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> dict[str, Path]:
    spec = mixed_spec()
    model = quantize(spec, random_weights(spec, seed=31))
    folder = tmp_path_factory.mktemp("integrity")
    plan = make_plan(spec, 2, {"t_int4": (ShardingType.ROW_WISE, (0, 1)), "t_int8": (ShardingType.COLUMN_WISE, (0, 1))})
    return {
        "unsharded": export(model, folder / "unsharded"),
        "sharded": export(shard_model(model, plan), folder / "sharded", plan=plan),
    }


def _tampered(artifact: Path, tmp_path: Path, kernel: int, attribute: str, value: torch.Tensor) -> Path:
    copy = copy_artifact(artifact, tmp_path)
    module = torch.jit.load(str(copy / "model.pt"))
    embeddings = module.embeddings
    tbe = embeddings.tbe if kernel < 0 else getattr(embeddings.shards, str(kernel)).tbe
    setattr(tbe, attribute, value)
    module.save(str(copy / "model.pt"))
    rehash(copy, "model.pt")
    return copy


def _wrong_values(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The same tensor with one value off, and one of another length."""
    off = tensor.clone()
    off[-1] += 1
    return [off, tensor[:-1].clone()]


@pytest.mark.parametrize("attribute", ["D_offsets", "weights_offsets", "rows_per_table", "weights_tys"])
@pytest.mark.parametrize("which", ["unsharded", "sharded"])
def test_changed_kernel_metadata_is_a_model_error(artifacts, tmp_path, attribute, which):
    artifact = artifacts[which]
    original = getattr(load(artifact).module.embeddings.tbe if which == "unsharded" else None, attribute, None)
    if original is None:
        original = getattr(getattr(load(artifact).module.embeddings.shards, "1").tbe, attribute)
    for index, value in enumerate(_wrong_values(original)):
        copy = _tampered(artifact, tmp_path / f"{index}", -1 if which == "unsharded" else 1, attribute, value)
        with pytest.raises(ArtifactError, match=attribute) as info:
            load(copy)
        assert info.value.kind == ArtifactErrorKind.MODEL


def test_a_weaker_bounds_check_is_a_model_error(artifacts, tmp_path):
    copy = copy_artifact(artifacts["unsharded"], tmp_path)
    module = torch.jit.load(str(copy / "model.pt"))
    module.embeddings.tbe.bounds_check_mode_int = 3  # NONE: bad ids would read outside the table
    module.save(str(copy / "model.pt"))
    rehash(copy, "model.pt")
    with pytest.raises(ArtifactError, match="bounds_check_mode_int is 3") as info:
        load(copy)
    assert info.value.kind == ArtifactErrorKind.MODEL


@pytest.mark.parametrize(
    "edit, fragment",
    [
        (lambda plan: plan["tables"][0]["shards"][0].update(device=1), "kernels"),  # a shard moved to the other rank
        (lambda plan: plan["tables"][0]["shards"][0].update(num_rows=7), "cover"),  # rows no longer cover the table
        (
            lambda plan: plan["topology"].update(world_size=3, local_world_size=3, device_memory=[1 << 30] * 3),
            "3 devices",
        ),
        (lambda plan: plan["tables"][1].update(data_type="fp16"), "fp16"),
        (lambda plan: plan.update(tables=plan["tables"][:-1]), "tables"),
        (lambda plan: plan["tables"][0]["shards"][0].update(num_rows="7"), "integer"),
    ],
    ids=["moved_shard", "rows", "world_size", "dtype", "missing_table", "type"],
)
def test_a_consistent_tampered_plan_is_an_artifact_error(artifacts, tmp_path, edit, fragment):
    copy = copy_artifact(artifacts["sharded"], tmp_path)
    plan = json.loads((copy / "plan.json").read_text())
    edit(plan)
    (copy / "plan.json").write_text(json.dumps(plan))
    rehash(copy, "plan.json")
    with pytest.raises(ArtifactError, match=fragment):
        load(copy)


def test_a_row_count_edited_in_the_manifest_names_the_table_and_both_counts(artifacts, tmp_path):
    """The refusal names the table, the manifest's rows and the plan's shard (the rows export wrote), not a
    ``Shard(...)`` object dump (issue 39 item 6)."""
    copy = copy_artifact(artifacts["sharded"], tmp_path)
    shrink_table_in_manifest(copy, "t_int8", 999)
    with pytest.raises(ArtifactError) as caught:
        load(copy)
    message = str(caught.value)
    assert (
        "plan.json does not fit the tables of manifest.json: table 't_int8': the shard on device 0 (rows [0, 1000), "
        "columns [0, 32)) lies outside the table's 999 rows x 64 columns" in message
    )
    assert "re-export" in message and "Shard(" not in message and "MemoryTier" not in message


def test_byte_flips_in_small_tensors_never_crash_the_process(artifacts, tmp_path):
    """Flip bytes in the archive's small tensor records (the kernels' metadata lives there), rewrite the zip
    and the checksum, then load and look up in a child process: every outcome is an ArtifactError or an
    answer, never a signal."""
    artifact = artifacts["sharded"]
    with zipfile.ZipFile(artifact / "model.pt") as archive:
        small = [i.filename for i in archive.infolist() if "/data/" in i.filename and 0 < i.file_size <= 256]
        records = {name: archive.read(name) for name in small}
    rng = random.Random(5)
    cases = []
    for case in range(24):
        name = rng.choice(small)
        data = bytearray(records[name])
        position = rng.randrange(len(data))
        data[position] ^= 1 << rng.randrange(8)
        copy = copy_artifact(artifact, tmp_path / f"c{case}")
        rewrite_zip_entry(copy / "model.pt", name, bytes(data))
        rehash(copy, "model.pt")
        cases.append(str(copy))
    batch = random_batch(mixed_spec(), batch_size=8, seed=2)
    torch.save((batch.keys, batch.values, batch.lengths), tmp_path / "batch.pt")
    script = textwrap.dedent(
        f"""
        import sys, torch, infer
        keys, values, lengths = torch.load({str(tmp_path / "batch.pt")!r})
        for path in {cases!r}:
            try:
                infer.load(path).lookup(infer.SparseFeatures(keys, values, lengths))
                print("answered", flush=True)
            except infer.ArtifactError as err:
                print("ArtifactError", err.kind.name, flush=True)
            except infer.RequestError:
                print("RequestError", flush=True)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    outcomes = result.stdout.split("\n")
    assert len([line for line in outcomes if line]) == len(cases)
    assert any(line.startswith("ArtifactError") for line in outcomes)


@pytest.mark.parametrize("attribute", ["lf_lo", "lf_out_col", "row_block_hi", *DERIVED_ROUTING])
def test_changed_routing_is_a_model_error(artifacts, tmp_path, attribute):
    """A device's routing (row blocks, output columns, and the columns, id limits and copies derived from them)
    comes from the plan; a changed one is refused at load."""
    copy = copy_artifact(artifacts["sharded"], tmp_path)
    module = torch.jit.load(str(copy / "model.pt"))
    shard = getattr(module.embeddings.shards, "0")
    value = getattr(shard, attribute)
    if isinstance(value, list):
        value = list(value) + ["x" if value and isinstance(value[0], str) else 3]  # one entry more
    else:
        value = not value if isinstance(value, bool) else value + 3
    setattr(shard, attribute, value)
    module.save(str(copy / "model.pt"))
    rehash(copy, "model.pt")
    with pytest.raises(ArtifactError, match=attribute) as info:
        load(copy)
    assert info.value.kind == ArtifactErrorKind.MODEL


@pytest.mark.parametrize("where,attribute", [("embeddings", "rw_positions"), ("embeddings.shards.0", "rw_slot")])
def test_changed_row_bucketing_is_a_model_error(artifacts, tmp_path, where, attribute):
    """The collection's one-call row-wise bucketing (block boundaries per device, each device's slots) follows
    from the plan's row blocks; a changed one is refused at load, before it can sort ids into the wrong block."""
    copy = tamper_row_bucketing(artifacts["sharded"], tmp_path, where, attribute)
    with pytest.raises(ArtifactError) as info:
        load(copy)
    assert info.value.kind == ArtifactErrorKind.MODEL
    assert "row-wise" in str(info.value)
