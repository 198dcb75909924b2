"""The list of kernel attributes (infer/artifact/kernel_attributes.json) is complete and implemented: it names
exactly the attributes fbgemm's scripted TBE reads on its way to the kernel, and every attribute the module
around a kernel cuts requests with; every rule and kind it names has a Python implementation. (The C++ side:
tests/cpp/test_cpp_kernel_attributes.py loads the same artifact there, which evaluates every entry.)"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import torch

from infer.artifact import kernel_attributes as listed
from infer.artifact.kernels import kernel_holders

RUNNER_METHODS = ("run_kernel", "run_chunk", "chunks_for")  # infer.modules.tbe.KernelRunner: cuts a request


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from infer.artifact.export import export
    from infer.artifact.fbgemm_libs import load_fbgemm
    from infer.quant.quantize import quantize
    from infer.weights import random_weights
    from tests.conftest import mixed_spec

    spec = mixed_spec()
    path = export(quantize(spec, random_weights(spec, seed=3)), tmp_path_factory.mktemp("kernels") / "a")
    load_fbgemm()
    return torch.jit.load(str(Path(path) / "model.pt"))


def _self_reads(module: Any, methods: tuple[str, ...]) -> tuple[set[str], set[str]]:
    """The attributes ``methods`` of a scripted module read from ``self`` (in every branch), and the methods of
    ``self`` they call."""
    attributes: set[str] = set()
    called: set[str] = set()
    for method in methods:
        graph = module._c._get_method(method).graph
        self_value = next(iter(graph.inputs()))
        for node in graph.findAllNodes("prim::GetAttr"):
            if next(iter(node.inputs())) == self_value:
                attributes.add(node.s("name"))
        for node in graph.findAllNodes("prim::CallMethod"):
            if next(iter(node.inputs())) == self_value:
                called.add(node.s("name"))
    return attributes, called


def test_the_list_names_exactly_what_the_kernel_reads(loaded):
    """Every attribute the scripted TBE's forward reads before and for the kernel call is in the list, and the list
    names nothing else: a future fbgemm attribute cannot slip by, a stale entry cannot stay."""
    tbe = loaded.embeddings.tbe
    reads, called = _self_reads(tbe, ("forward", "_forward_impl"))
    assert {a.name for a in listed.kernel_attributes().tbe} == reads
    assert called - {"_forward_impl"} == set(listed.kernel_attributes().tbe_guarded_methods)


def test_the_list_names_what_the_kernel_runner_reads(loaded):
    """The module around a kernel cuts a request into example ranges from its own attributes: all in the list."""
    holder = kernel_holders(loaded)[0]
    reads, _ = _self_reads(holder, RUNNER_METHODS)
    assert {a.name for a in listed.kernel_attributes().holder} == reads - {"tbe"}
    assert listed.kernel_attributes().holder_present_if in reads


def test_python_implements_every_rule_and_kind_the_list_names():
    data = json.loads(resources.files("infer.artifact").joinpath(listed.LIST_FILE).read_text(encoding="utf-8"))
    assert set(data["rules"]["length"]) == set(listed.LENGTH_RULES)
    assert set(data["rules"]["value"]) == set(listed.VALUE_RULES)
    entries = data["tbe"] + data["holder"]["attributes"]
    assert {e["kind"] for e in entries} <= set(listed._CHECKS)
    for entry in entries:
        assert entry.get("length", "features") in listed.LENGTH_RULES, entry
        assert entry.get("value", "empty") in listed.VALUE_RULES, entry
        assert entry["kind"] != "tensor" or (entry["dtype"] in listed.DTYPES and "length" in entry), entry
