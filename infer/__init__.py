"""embserve's library: plan, quantize, shard, export and load embedding-bag models served on fbgemm's TBE kernels.

The flow, one room each: ``infer.planner`` (where tables go) -> ``infer.quant`` (fp32 -> TBE rows) ->
``infer.shard`` (plan -> sharded model) -> ``infer.artifact`` (export, verified load, runtime).
Importing ``infer`` is light: the config, errors and version eagerly; every name that needs torch (and numpy) on
first access, so ``embserve``'s flag parsing and refusals run without torch. fbgemm is imported on first use of
``quantize`` or ``load``; CUDA is never initialised by the import; the server (``server``) is never imported.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from infer.artifact.export import export
    from infer.artifact.load import load
    from infer.artifact.runtime import Runtime
    from infer.artifact.stream import export_streaming
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

if TYPE_CHECKING:
    from infer.features import SparseFeatures
    from infer.interop.torchrec import ImportedModel, from_torchrec, load_torchrec_checkpoint
    from infer.planner.planner import EmbeddingPlanner, plan_for_inference
    from infer.planner.types import ComputeDevice, ParameterConstraints, ShardingPlan, ShardingType, Topology
    from infer.quant.accuracy import accuracy_report
    from infer.quant.quantize import quantize
    from infer.reference import FloatEmbeddingBagCollection
    from infer.shard.builder import shard_model
from infer.version import __version__

if TYPE_CHECKING:
    from infer.weights import load_checkpoint, random_weights

# Every name but the config's, the errors and the version needs torch: infer._lazy imports each on first access
# (PEP 562), so a process that only parses embserve's flags or refuses them never imports torch (2-3 CPU-s);
# ``from infer import NAME`` works for every public name.
import_module("infer._lazy").install(globals())

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
