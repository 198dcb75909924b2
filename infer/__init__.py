"""embserve's library: plan, quantize, shard, export and load embedding-bag models served on fbgemm's TBE kernels.

The flow, one room each: ``infer.planner`` (where tables go) -> ``infer.quant`` (fp32 -> TBE rows) ->
``infer.shard`` (plan -> sharded model) -> ``infer.artifact`` (export, verified load, runtime).
Importing ``infer`` is light: the config, errors and version eagerly; every name that needs torch (and numpy) on
first access, so ``embserve``'s flag parsing and refusals run without torch. fbgemm is imported on first use of
``quantize`` or ``load``; CUDA is never initialised by the import; the server (``server``) is never imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from infer.config import DataType, FeatureInfo, ModelSpec, PoolingType, TableConfig
from infer.errors import (
    ArtifactError,
    ArtifactErrorKind,
    ConfigError,
    EmbserveError,
    FileFormatError,
    PlanError,
    PlanErrorKind,
    RequestError,
    WeightsError,
)
from infer.version import __version__

# The names below need torch: each is imported on first access (PEP 562), so a process that only parses
# ``embserve``'s flags, or refuses them, never pays torch's import (2-3 CPU-s). ``from infer import X`` works for
# every public name.
_LAZY = {
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

if TYPE_CHECKING:
    from infer.artifact.export import export
    from infer.artifact.load import load
    from infer.artifact.runtime import Runtime
    from infer.artifact.stream import export_streaming
    from infer.features import SparseFeatures
    from infer.interop.torchrec import ImportedModel, from_torchrec, load_torchrec_checkpoint
    from infer.planner.planner import EmbeddingPlanner, plan_for_inference
    from infer.planner.types import ComputeDevice, ParameterConstraints, ShardingPlan, ShardingType, Topology
    from infer.quant.accuracy import accuracy_report
    from infer.quant.quantize import quantize
    from infer.reference import FloatEmbeddingBagCollection
    from infer.shard.builder import shard_model
    from infer.weights import load_checkpoint, random_weights


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'infer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "ArtifactError",
    "ArtifactErrorKind",
    "ComputeDevice",
    "ConfigError",
    "DataType",
    "EmbeddingPlanner",
    "EmbserveError",
    "FeatureInfo",
    "FileFormatError",
    "FloatEmbeddingBagCollection",
    "ImportedModel",
    "ModelSpec",
    "ParameterConstraints",
    "PlanError",
    "PlanErrorKind",
    "PoolingType",
    "RequestError",
    "Runtime",
    "ShardingPlan",
    "ShardingType",
    "SparseFeatures",
    "TableConfig",
    "Topology",
    "WeightsError",
    "__version__",
    "accuracy_report",
    "export",
    "export_streaming",
    "from_torchrec",
    "load",
    "load_checkpoint",
    "load_torchrec_checkpoint",
    "plan_for_inference",
    "quantize",
    "random_weights",
    "shard_model",
]
