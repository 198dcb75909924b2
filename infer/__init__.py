"""embserve's library: quantize, export and load embedding-bag models served on fbgemm's TBE kernels.

Importing ``infer`` is light: torch only. fbgemm is imported on first use of ``quantize``,
``export`` or ``load``; CUDA is never initialised by the import.
"""

from __future__ import annotations

from typing import Any

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
from infer.features import SparseFeatures
from infer.version import __version__

_LAZY = {
    "quantize": "infer.quant",
    "accuracy_report": "infer.quant",
    "load_checkpoint": "infer.quant",
    "export": "infer.export",
    "load": "infer.export",
    "Runtime": "infer.runtime",
    "FloatEmbeddingBagCollection": "infer.reference",
    "random_weights": "infer.reference",
}

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
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'infer' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
