"""``infer``'s public names that need torch, imported on first access (PEP 562's module ``__getattr__``).

``install`` puts the hooks in ``infer``'s namespace at run time, so the API reference (rendered from the source
by griffe) lists ``infer``'s names, not the hooks."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

# The names below need torch: each is imported on first access (PEP 562), so a process that only parses
# ``embserve``'s flags, or refuses them, never pays torch's import (2-3 CPU-s). ``from infer import X`` works for
# every public name.
LAZY = {
    "export": "infer.artifact.export",
    "load": "infer.artifact.load",
    "Runtime": "infer.artifact.runtime",
    "export_streaming": "infer.artifact.stream",
    "SparseFeatures": "infer.features",
    "ImportedModel": "infer.interop.torchrec",
    "from_torchrec": "infer.interop.torchrec",
    "load_torchrec_checkpoint": "infer.interop.torchrec",
    "EmbeddingPlanner": "infer.planner.planner",
    "plan_for_inference": "infer.planner.planner",
    "ComputeDevice": "infer.planner.types",
    "ParameterConstraints": "infer.planner.types",
    "ShardingPlan": "infer.planner.types",
    "ShardingType": "infer.planner.types",
    "Topology": "infer.planner.types",
    "accuracy_report": "infer.quant.accuracy",
    "quantize": "infer.quant.quantize",
    "FloatEmbeddingBagCollection": "infer.reference",
    "shard_model": "infer.shard.builder",
    "load_checkpoint": "infer.weights",
    "random_weights": "infer.weights",
}


def install(namespace: dict[str, Any]) -> None:
    """Give ``infer`` (its ``globals()``) the module ``__getattr__`` and ``__dir__`` that import ``LAZY``'s names."""

    def __getattr__(name: str) -> Any:
        module = LAZY.get(name)
        if module is not None:
            value = getattr(importlib.import_module(module), name)
        elif not name.startswith("_") and importlib.util.find_spec(f"infer.{name}") is not None:
            value = importlib.import_module(f"infer.{name}")  # ``infer.planner`` after a bare ``import infer``
        else:
            raise AttributeError(f"module 'infer' has no attribute {name!r}")
        namespace[name] = value  # imported once, then an ordinary attribute
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(LAZY))

    namespace["__getattr__"] = __getattr__
    namespace["__dir__"] = __dir__
