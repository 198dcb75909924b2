"""Both loaders check every attribute of infer/artifact/kernel_attributes.json: each one, changed in a real
exported model.pt (and the checksum rewritten, as a careless tool would), is refused by Python and by C++ with
the same typed error (ArtifactError(kind=MODEL) / ModelError) naming it, before any lookup. Parametrized over
the list itself, so the list and this test cannot drift apart; the C++ loader tries every copy in one process."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from infer.artifact.kernel_attributes import KernelAttribute, kernel_attributes
from infer.artifact.load import load
from infer.errors import ArtifactError, ArtifactErrorKind
from tests.support.artifacts import copy_artifact, rehash

LISTED = kernel_attributes()
CASES = [("tbe", a, "value") for a in LISTED.tbe] + [("holder", a, "value") for a in LISTED.holder]
CASES += [(where, a, "dtype") for where, a, _ in CASES if a.kind == "tensor"]


def _case_id(case: tuple[str, KernelAttribute, str]) -> str:
    return f"{case[1].name}-{case[2]}"


def _changed_tensor(value: torch.Tensor, attribute: KernelAttribute) -> torch.Tensor:
    """A wrong entry where the list derives the values, else a wrong length (or a non-empty tensor)."""
    if attribute.length == "empty" or value.numel() == 0:
        return torch.ones(4, dtype=value.dtype)
    if attribute.value is None:
        return value[:-1].clone()
    changed = value.clone()
    changed[-1] += 1
    return changed


def _changed(value: Any, attribute: KernelAttribute, how: str) -> Any:
    """``value`` changed so that it breaks the attribute's rule (a dtype flip, or a wrong value of its kind)."""
    if how == "dtype":
        return value.to(torch.float32)
    if attribute.kind == "tensor":
        return _changed_tensor(value, attribute)
    if attribute.kind == "int":
        return 0 if attribute.value == "positive" else value + 7
    if attribute.kind == "bool":
        return not value
    if attribute.kind == "str":
        return "meta"
    if attribute.kind == "tensor_queue":  # a queued or non-empty initial tensor would be the cache locations
        return torch.classes.fbgemm.TensorQueue(torch.ones(4, dtype=torch.int32))
    if attribute.kind == "counter":
        counter = torch.classes.fbgemm.AtomicCounter()
        counter.increment()
        return counter
    raise AssertionError(f"no way to change a {attribute.kind} attribute")


# A mapped artifact's kernels get their weight buffers from the weight files at load (model.pt holds them empty):
# the buffer's own cases are changed in model.pt of the embedded format, where the weights live.
EMBEDDED_CASES = ("weights_host",)


@pytest.fixture(scope="module")
def flipped(
    unsharded_artifact: Path,
    embedded_unsharded_artifact: Path,
    cpp_build: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Any]:
    """Per case: the tampered copy and the C++ loader's one-line verdict on it (and "pristine": the originals')."""
    from infer.artifact.fbgemm_libs import load_fbgemm

    load_fbgemm()
    root = tmp_path_factory.mktemp("flipped")
    folders = {}
    for case in CASES:
        where, attribute, how = case
        source = embedded_unsharded_artifact if attribute.name in EMBEDDED_CASES else unsharded_artifact
        copy = copy_artifact(source, root / _case_id(case))
        module = torch.jit.load(str(copy / "model.pt"))
        holder = module.embeddings
        target = holder.tbe if where == "tbe" else holder
        setattr(target, attribute.name, _changed(getattr(target, attribute.name), attribute, how))
        module.save(str(copy / "model.pt"))
        rehash(copy, "model.pt")
        folders[_case_id(case)] = copy
    names = ["pristine", "pristine_embedded", *folders]
    pristine = [str(unsharded_artifact), str(embedded_unsharded_artifact)]
    result = subprocess.run(
        [str(cpp_build / "embserve_manifest_check"), "--load", *pristine, *map(str, folders.values())],
        capture_output=True,
        text=True,
        errors="replace",
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert len(lines) == len(names), result.stdout[-2000:]
    return {"folders": folders, "cpp": dict(zip(names, lines))}


def test_both_loaders_accept_the_exported_model(flipped, unsharded_artifact, embedded_unsharded_artifact):
    """The untouched artifacts (mapped and embedded) pass every entry of the list in both loaders (so C++
    implements every rule and kind the list names: an unknown one is a ModelError there)."""
    assert flipped["cpp"]["pristine"] == "ok" and flipped["cpp"]["pristine_embedded"] == "ok"
    load(unsharded_artifact)
    load(embedded_unsharded_artifact)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_a_changed_kernel_attribute_is_refused_by_both_loaders(case, flipped):
    name = case[1].name
    cpp = flipped["cpp"][_case_id(case)]
    assert cpp.startswith("ModelError: ") and name in cpp and "kernel 0" in cpp, cpp
    with pytest.raises(ArtifactError) as info:
        load(flipped["folders"][_case_id(case)])
    assert info.value.kind == ArtifactErrorKind.MODEL
    assert name in str(info.value) and "kernel 0" in str(info.value), str(info.value)
