"""The C++ loader checks every TBE against the manifest's kernels, and plan.json against the manifest.

A model.pt whose kernel metadata was changed and re-saved (then re-hashed into the manifest) is a
ModelError naming the attribute; a consistent tampered plan.json is a ManifestError. Never a signal.
"""

from __future__ import annotations

import json
import random
import zipfile
from collections.abc import Callable
from copy import deepcopy
from typing import Any

import pytest
import torch

from infer.artifact.cpp_io import write_requests
from tests.conftest import mixed_spec, random_batch
from tests.cpp.support import assert_clean_failure, assert_same_as_one_folder_run, load_each, run
from tests.support.artifacts import copy_artifact, rehash, rewrite_zip_entry, tamper_row_bucketing


def _tbe(module: Any, kernel: int) -> Any:
    return module.embeddings.tbe if kernel < 0 else getattr(module.embeddings.shards, str(kernel)).tbe


def _changed(tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    off = tensor.clone()
    off[-1] += 1
    return [("value", off), ("shorter", tensor[:-1].clone()), ("dtype", tensor.to(torch.float32))]


Tamper = Callable[[Any], Any]


def _cases() -> list[tuple[str, str, int, Tamper, str]]:
    """(case id, artifact kind, kernel index or -1, tamper(tbe), fragment of the error)."""
    cases: list[tuple[str, str, int, Tamper, str]] = []
    for which, kernel in (("unsharded", -1), ("sharded", 1)):
        for attribute in ("D_offsets", "weights_offsets", "rows_per_table", "weights_tys", "weights_placements"):
            for how in ("value", "shorter", "dtype"):

                def tamper(tbe: Any, attribute: str = attribute, how: str = how) -> None:
                    setattr(tbe, attribute, dict(_changed(getattr(tbe, attribute)))[how])

                cases.append((f"{which}-{attribute}-{how}", which, kernel, tamper, attribute))
    cases += [
        ("bounds_check_none", "unsharded", -1, lambda tbe: setattr(tbe, "bounds_check_mode_int", 3), "bounds_check"),
        (  # the weight buffer inside model.pt: the embedded format (a mapped kernel's is its file's, checked by size)
            "weights_short",
            "embedded",
            -1,
            lambda tbe: setattr(tbe, "weights_host", tbe.weights_host[:-128]),
            "weights_host",
        ),
        (
            "index_remapping",
            "unsharded",
            -1,
            lambda tbe: setattr(tbe, "index_remappings_array", torch.zeros(4, dtype=torch.int32)),
            "index_remappings_array",
        ),
        ("total_D", "sharded", 0, lambda tbe: setattr(tbe, "total_D", 1 << 20), "total_D"),
        ("max_int8_D", "sharded", 0, lambda tbe: setattr(tbe, "max_int8_D", 4), "max_int8_D"),
    ]
    return cases


CASES = _cases()


def test_tampered_kernels_are_model_errors(
    embserve_run, unsharded_artifact, sharded_artifact, embedded_unsharded_artifact, tmp_path
):
    artifacts = {"unsharded": unsharded_artifact, "sharded": sharded_artifact, "embedded": embedded_unsharded_artifact}
    # torch.jit.load is most of the setup's CPU: load each artifact's model once, tamper a deep copy per case
    loaded = {which: torch.jit.load(str(artifact / "model.pt")) for which, artifact in artifacts.items()}
    folders = []
    for name, which, kernel, tamper, fragment in CASES:
        copy = copy_artifact(artifacts[which], tmp_path / name)
        module = deepcopy(loaded[which])
        tamper(_tbe(module, kernel))
        module.save(str(copy / "model.pt"))
        rehash(copy, "model.pt")
        folders.append((name, copy, fragment))

    # one process loads every copy (a start per copy is ~0.3 CPU-s of libtorch); a one-folder run of the first shows
    # the words are the real stderr line and status
    outcomes = load_each(embserve_run, [copy for _, copy, _ in folders], timeout=300)
    failures = []
    for name, copy, fragment in folders:
        outcome = outcomes[copy]
        if not (outcome.startswith("ModelError: ") and fragment in outcome and "kernel" in outcome):
            failures.append(f"{name}: {outcome}")
    assert not failures, "\n".join(failures)
    assert_same_as_one_folder_run(embserve_run, folders[0][1], outcomes[folders[0][1]])


PLAN_EDITS: dict[str, tuple[Callable[[dict[str, Any]], Any], str]] = {
    "moved_shard": (lambda plan: plan["tables"][0]["shards"][0].update(device=2), "'kernels' disagree"),
    "rows": (lambda plan: plan["tables"][1]["shards"][0].update(num_rows=7), "do not cover"),
    "world_size": (
        lambda plan: plan["topology"].update(world_size=4, local_world_size=4, device_memory=[1 << 30] * 4),
        "plans 4 devices",
    ),
    "dtype": (lambda plan: plan["tables"][1].update(data_type="fp16"), "plan says fp16"),
    "missing_table": (lambda plan: plan.update(tables=plan["tables"][:-1]), "the plan's tables are not the model's"),
    "type": (lambda plan: plan["tables"][0]["shards"][0].update(num_rows="7"), "num_rows must be an integer"),
    "unknown_key": (lambda plan: plan.update(extra=1), "unknown key 'extra'"),
}


@pytest.fixture(scope="module")
def tampered_plans(embserve_run, sharded_artifact, tmp_path_factory) -> dict[str, str]:  # type: ignore[no-untyped-def]
    """Each PLAN_EDITS case's copy loaded in one embserve_run --load-each: its outcome line."""
    root = tmp_path_factory.mktemp("plans")
    copies = {}
    for edit, (change, _) in PLAN_EDITS.items():
        copy = copy_artifact(sharded_artifact, root / edit)
        plan = json.loads((copy / "plan.json").read_text())
        change(plan)
        (copy / "plan.json").write_text(json.dumps(plan))
        rehash(copy, "plan.json")
        copies[edit] = copy
    outcomes = load_each(embserve_run, list(copies.values()))
    first = sorted(copies)[0]  # one real one-folder run: its stderr line and status are the batched words
    assert_same_as_one_folder_run(embserve_run, copies[first], outcomes[copies[first]])
    return {edit: outcomes[copy] for edit, copy in copies.items()}


@pytest.mark.parametrize("edit", sorted(PLAN_EDITS))
def test_a_consistent_tampered_plan_is_a_manifest_error(edit, tampered_plans):
    outcome = tampered_plans[edit]
    assert outcome.startswith("ManifestError: "), outcome
    assert "plan.json" in outcome and PLAN_EDITS[edit][1] in outcome, outcome


@pytest.mark.parametrize("which", ["unsharded", "sharded"])
def test_byte_flips_in_small_tensors_never_crash_embserve_run(
    which, embserve_run, unsharded_artifact, sharded_artifact, tmp_path
):
    """Flip a bit in one of model.pt's small tensor records (where the kernels' metadata lives), rewrite
    the zip and the checksum, then load and run a request: an answer or a one-line error, never a signal (every
    copy in one embserve_run --load-each)."""
    artifact = unsharded_artifact if which == "unsharded" else sharded_artifact
    with zipfile.ZipFile(artifact / "model.pt") as archive:
        small = [i.filename for i in archive.infolist() if "/data/" in i.filename and 0 < i.file_size <= 256]
        records = {name: archive.read(name) for name in small}
    batch = random_batch(mixed_spec(), batch_size=4, seed=2)
    write_requests(tmp_path / "r.bin", [(batch.values, batch.lengths, None)])
    rng = random.Random(7 if which == "unsharded" else 8)
    copies = []
    for case in range(16):
        name = rng.choice(small)
        data = bytearray(records[name])
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        copy = copy_artifact(artifact, tmp_path / f"c{case}")
        rewrite_zip_entry(copy / "model.pt", name, bytes(data))
        rehash(copy, "model.pt")
        copies.append(copy)

    # one process loads every copy and answers the request (a start per copy is ~0.3 CPU-s of libtorch); a crash
    # fails load_each naming the last folder answered
    outcomes = load_each(embserve_run, copies, "--requests", tmp_path / "r.bin", timeout=300)
    kinds = {copy: outcome.split(":")[0] for copy, outcome in outcomes.items() if outcome != "ok"}
    assert "ModelError" in kinds.values(), outcomes  # the flips do reach the kernel checks
    first = next(copy for copy, kind in kinds.items() if kind == "ModelError")
    assert_same_as_one_folder_run(embserve_run, first, outcomes[first])


def test_a_tampered_kernel_holder_is_a_model_error(embserve_run, unsharded_artifact, tmp_path):
    """The batch-parallel runner's attributes steer how a request is sliced: a feature count that cannot slice
    (the list's rule for range_features: at least 1, since a block table's ranges count the model's features) is
    caught."""
    copy = copy_artifact(unsharded_artifact, tmp_path)
    module = torch.jit.load(str(copy / "model.pt"))
    module.embeddings.range_features = 0
    module.save(str(copy / "model.pt"))
    rehash(copy, "model.pt")
    assert_clean_failure(run(embserve_run, copy), "ModelError", "kernel 0 (embeddings)", "range_features is 0")


ROUTING = ["lf_lo", "lf_out_col", "row_block_hi", "lf_local_col", "copy_width", "min_rows"]


@pytest.fixture(scope="module")
def changed_routing(embserve_run, sharded_artifact, tmp_path_factory) -> dict[str, str]:  # type: ignore[no-untyped-def]
    """Each ROUTING attribute changed on rank 1 (a copy each), all loaded in one embserve_run --load-each."""
    root = tmp_path_factory.mktemp("routing")
    loaded = torch.jit.load(str(sharded_artifact / "model.pt"))
    copies = {}
    for attribute in ROUTING:
        copy = copy_artifact(sharded_artifact, root / attribute)
        module = deepcopy(loaded)
        shard = getattr(module.embeddings.shards, "1")  # rank 1 holds column-, row-wise and replicated shards
        value = getattr(shard, attribute)
        if isinstance(value, list):
            value = list(value)
            if value:
                value[-1] += 3
            else:  # a one-host CPU plan's row-wise shards are views: no row blocks to route, so one is added
                value.append(3)
        else:
            value += 3
        setattr(shard, attribute, value)
        module.save(str(copy / "model.pt"))
        rehash(copy, "model.pt")
        copies[attribute] = copy
    outcomes = load_each(embserve_run, list(copies.values()))
    return {attribute: outcomes[copy] for attribute, copy in copies.items()}


@pytest.mark.parametrize("attribute", ROUTING)
def test_changed_routing_is_a_model_error(attribute, changed_routing):
    """A device's routing (row blocks, output columns, the copies derived from them) comes from the plan;
    a changed one is refused at load, before it can steer a slice or a copy. (The one-folder runs of
    test_a_tampered_kernel_holder_is_a_model_error and test_changed_row_bucketing_is_a_model_error check the real
    stderr line of a ModelError.)"""
    outcome = changed_routing[attribute]
    assert outcome.startswith("ModelError: "), outcome
    assert "kernel 1 (embeddings.shards.1)" in outcome and attribute in outcome, outcome


@pytest.mark.parametrize("where,attribute", [("embeddings", "rw_positions"), ("embeddings.shards.1", "rw_slot")])
def test_changed_row_bucketing_is_a_model_error(where, attribute, embserve_run, sharded_artifact, tmp_path):
    """The collection's one-call row-wise bucketing (block boundaries per device, each device's slots) follows
    from the plan's row blocks; a changed one is refused at load, before it sorts ids into the wrong block."""
    copy = tamper_row_bucketing(sharded_artifact, tmp_path, where, attribute)
    assert_clean_failure(run(embserve_run, copy), "ModelError", "row-wise bucketing", attribute)


@pytest.mark.parametrize("storage", ["shared_storage", "weights"])
def test_shared_replica_storage_is_checked_against_the_plan(
    storage, embserve_run, sharded_artifact, embedded_sharded_artifact, tmp_path
):
    """CPU replicas point into one weight buffer (manifest kernels' shared_storage, derived from the plan; in a
    mapped artifact their `weights` in one file): the C++ loader derives the same layout from plan.json, so an
    edited offset is refused before any read."""
    artifact = embedded_sharded_artifact if storage == "shared_storage" else sharded_artifact
    manifest = json.loads((artifact / "manifest.json").read_text())
    shared = [kernel.get(storage) for kernel in manifest["kernels"]]
    assert all(s is not None for s in shared) and len({s["bytes"] for s in shared}) == 1
    copy = copy_artifact(artifact, tmp_path)
    manifest["kernels"][1][storage]["table_offsets"][0] += 128
    (copy / "manifest.json").write_text(json.dumps(manifest))
    assert_clean_failure(run(embserve_run, copy), "ManifestError", "'kernels' disagree with the plan")
