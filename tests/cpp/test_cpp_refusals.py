"""Artifacts the C++ loader must refuse, saying what they are and what to do, with the kind Python's load gives:
a multi-host artifact (ModelError: its parts hold one host's shards each; how to serve it), one host's part folder
(ManifestError: it has no manifest, it is host h's part), and a mapped artifact whose model file still carries a
mapped kernel's weights (ModelError naming the file, the kernel and the weight file, the same words as Python)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from infer.artifact.export import export
from infer.artifact.hosts import export_hosts
from infer.artifact.load import load
from infer.errors import ArtifactError, ArtifactErrorKind
from infer.quant.quantize import quantize
from infer.weights import random_weights
from tests.conftest import mixed_spec
from tests.cpp.support import assert_clean_failure, run
from tests.support.artifacts import copy_artifact, save_weights_in_model, shrink_table_in_manifest


@pytest.fixture(scope="module")
def model():
    spec = mixed_spec()
    torch.manual_seed(3)
    return spec, quantize(spec, random_weights(spec, seed=33))


@pytest.fixture(scope="module")
def two_hosts(model, tmp_path_factory) -> Path:
    from tests.distributed.conftest import host_plan

    spec, quantized = model
    plan = host_plan(spec, "table", hosts=2, devices_per_host=1)
    return export_hosts(quantized, tmp_path_factory.mktemp("cpp_hosts") / "art", plan)


def _cpp_verdicts(cpp_build: Path, *folders: Path) -> list[str]:
    result = subprocess.run(
        [str(cpp_build / "embserve_manifest_check"), "--load", *map(str, folders)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.splitlines()


def _python_error(artifact: Path) -> ArtifactError:
    with pytest.raises(ArtifactError) as caught:
        load(artifact)
    return caught.value


def test_a_multi_host_artifact_is_refused_as_one_saying_how_to_serve_it(two_hosts, cpp_build, embserve_run):
    assert _python_error(two_hosts).kind is ArtifactErrorKind.MODEL
    line = assert_clean_failure(
        run(embserve_run, two_hosts),
        "embserve_run: ModelError: ",
        f"{two_hosts} is a multi-host artifact (2 hosts x 1 devices): its model_file hosts/0/model.pt is host 0's part",
        "the C++ loader serves one-host artifacts",
        f"torchrun --nnodes 2 --nproc-per-node 1 --rdzv-endpoint HOST0:PORT -m infer.cli serve {two_hosts}",
    )
    assert "outside the artifact" not in line
    (verdict,) = _cpp_verdicts(cpp_build, two_hosts)
    assert verdict.startswith("ModelError: ") and "is a multi-host artifact" in verdict


@pytest.mark.parametrize("host", [0, 1])
def test_a_host_parts_folder_is_refused_as_that_hosts_part(two_hosts, embserve_run, host):
    part = two_hosts / "hosts" / str(host)
    assert (part / "model.pt").is_file() and not (part / "manifest.json").exists()
    assert_clean_failure(
        run(embserve_run, part),
        "embserve_run: ManifestError: ",
        f"{part} is host {host}'s part of the multi-host artifact {two_hosts}",
        f"torchrun --nnodes 2 --nproc-per-node 1 --rdzv-endpoint HOST0:PORT -m infer.cli serve {two_hosts}",
    )


def test_a_folder_without_a_manifest_elsewhere_is_still_not_an_artifact(tmp_path, embserve_run):
    (tmp_path / "hosts" / "1").mkdir(parents=True)  # no multi-host manifest above it
    assert_clean_failure(
        run(embserve_run, tmp_path / "hosts" / "1"), "embserve_run: ManifestError: ", "is not an embserve artifact"
    )


def test_a_model_file_that_carries_a_mapped_kernels_weights_is_refused_with_pythons_words(
    model, cpp_build, embserve_run, tmp_path
):
    _, quantized = model
    artifact = export(quantized, tmp_path / "art")
    resaved = save_weights_in_model(artifact, tmp_path / "resaved")
    python = _python_error(resaved)
    assert python.kind is ArtifactErrorKind.MODEL
    carried = (resaved / "weights-0.bin").stat().st_size
    expected = (
        f"{resaved / 'model.pt'} carries {carried} bytes of weights for kernel 0, but the manifest maps them from "
        "weights-0.bin; re-export the artifact (embserve export / infer.export)"
    )
    assert str(python) == expected
    for verify in ("full", "none"):
        assert_clean_failure(run(embserve_run, resaved, "--verify", verify), f"embserve_run: ModelError: {expected}")
    assert _cpp_verdicts(cpp_build, artifact, resaved) == ["ok", f"ModelError: {expected}"]


def test_a_row_count_edited_in_the_manifest_is_refused_with_pythons_words(model, cpp_build, embserve_run, tmp_path):
    """The table, the manifest's rows and the plan's shard, as Python says them (no object dump; issue 39 item 6)."""
    from infer.planner.types import ShardingType
    from infer.shard.builder import shard_model
    from infer.shard.plans import make_plan

    spec, quantized = model
    plan = make_plan(spec, 2, {"t_int8": (ShardingType.COLUMN_WISE, (0, 1))})
    artifact = export(shard_model(quantized, plan), tmp_path / "sharded", plan=plan)
    edited = copy_artifact(artifact, tmp_path / "edited")
    shrink_table_in_manifest(edited, "t_int8", 999)
    words = (
        "table 't_int8': the shard on device 0 (rows [0, 1000), columns [0, 32)) lies outside the table's "
        "999 rows x 64 columns"
    )
    assert words in str(_python_error(edited))
    assert_clean_failure(run(embserve_run, edited), "embserve_run: ManifestError: ", words)


def test_an_artifact_without_its_manifest_is_named_as_one_with_pythons_words(model, embserve_run, tmp_path):
    _, quantized = model
    artifact = export(quantized, tmp_path / "art")
    (artifact / "manifest.json").unlink()
    python = str(_python_error(artifact))
    assert python == (
        f"{artifact / 'manifest.json'} is missing: {artifact} holds an artifact's files (model.pt, weights-0.bin) but "
        "not its manifest, which export writes last; the export did not finish or manifest.json was removed: "
        "re-export the artifact"
    )
    assert_clean_failure(run(embserve_run, artifact), f"embserve_run: ManifestError: {python}")
