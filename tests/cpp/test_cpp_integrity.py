"""The C++ loader checks every TBE against the manifest's kernels, and plan.json against the manifest.

A model.pt whose kernel metadata was changed and re-saved (then re-hashed into the manifest) is a
ModelError naming the attribute; a consistent tampered plan.json is a ManifestError. Never a signal.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.cpp.support import assert_clean_failure, run
from tests.support.artifacts import copy_artifact, rehash


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
        (
            "weights_short",
            "unsharded",
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


def test_tampered_kernels_are_model_errors(embserve_run, unsharded_artifact, sharded_artifact, tmp_path):
    artifacts = {"unsharded": unsharded_artifact, "sharded": sharded_artifact}
    folders = []
    for name, which, kernel, tamper, fragment in CASES:
        copy = copy_artifact(artifacts[which], tmp_path / name)
        module = torch.jit.load(str(copy / "model.pt"))
        tamper(_tbe(module, kernel))
        module.save(str(copy / "model.pt"))
        rehash(copy, "model.pt")
        folders.append((name, copy, fragment))

    def one(item: tuple[str, Path, str]):  # type: ignore[no-untyped-def]
        return item, run(embserve_run, item[1], timeout=120)

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(one, folders))
    failures = []
    for (name, _, fragment), result in results:
        try:
            assert_clean_failure(result, "embserve_run: ModelError: ", fragment, "kernel")
        except AssertionError as err:
            failures.append(f"{name}: {err}")
    assert not failures, "\n".join(failures)


PLAN_EDITS: dict[str, tuple[Callable[[dict[str, Any]], Any], str]] = {
    "moved_shard": (lambda plan: plan["tables"][0]["shards"][0].update(device=2), "on rank 0"),
    "rows": (lambda plan: plan["tables"][1]["shards"][0].update(num_rows=7), "on rank 0"),
    "world_size": (
        lambda plan: plan["topology"].update(world_size=4, local_world_size=4, device_memory=[1 << 30] * 4),
        "topology.world_size is 4",
    ),
    "dtype": (lambda plan: plan["tables"][1].update(data_type="fp16"), '"fp16"'),
    "missing_table": (lambda plan: plan.update(tables=plan["tables"][:-1]), "plans 4 tables"),
    "type": (lambda plan: plan["tables"][0]["shards"][0].update(num_rows="7"), "num_rows must be an integer"),
    "unknown_key": (lambda plan: plan.update(extra=1), "unknown key 'extra'"),
}


@pytest.mark.parametrize("edit", sorted(PLAN_EDITS))
def test_a_consistent_tampered_plan_is_a_manifest_error(edit, embserve_run, sharded_artifact, tmp_path):
    change, fragment = PLAN_EDITS[edit]
    copy = copy_artifact(sharded_artifact, tmp_path)
    plan = json.loads((copy / "plan.json").read_text())
    change(plan)
    (copy / "plan.json").write_text(json.dumps(plan))
    rehash(copy, "plan.json")
    assert_clean_failure(run(embserve_run, copy), "embserve_run: ManifestError: ", "plan.json", fragment)
