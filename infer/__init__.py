"""embserve's library: quantize, export and load embedding-bag models served on fbgemm's TBE kernels.

Importing ``infer`` is light: torch only. fbgemm is imported on first use of ``quantize`` or
``load``; CUDA is never initialised by the import.
"""

from __future__ import annotations

from infer.config import DataType, FeatureInfo, ModelSpec, PoolingType, TableConfig
from infer.errors import (
    ArtifactError,
    ConfigError,
    EmbserveError,
    PlanError,
    PlanErrorKind,
    RequestError,
    WeightsError,
)
from infer.export import export, load
from infer.features import SparseFeatures
from infer.quant import accuracy_report, load_checkpoint, quantize
from infer.reference import FloatEmbeddingBagCollection, random_weights
from infer.runtime import Runtime
from infer.version import __version__

__all__ = [
    "ArtifactError",
    "ConfigError",
    "DataType",
    "EmbserveError",
    "FeatureInfo",
    "ModelSpec",
    "PlanError",
    "PlanErrorKind",
    "PoolingType",
    "RequestError",
    "SparseFeatures",
    "TableConfig",
    "WeightsError",
    "__version__",
    "accuracy_report",
    "export",
    "FloatEmbeddingBagCollection",
    "load",
    "load_checkpoint",
    "quantize",
    "random_weights",
    "Runtime",
]
