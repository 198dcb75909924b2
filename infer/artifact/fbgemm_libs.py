"""Lazy access to fbgemm_gpu: the import itself, and the shared libraries an exported model needs.

Nothing else in ``infer`` imports fbgemm at module level, so ``import infer`` stays light.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from pathlib import Path
from types import ModuleType

from infer.errors import ArtifactError, ArtifactErrorKind

# Operator libraries a scripted TBE inference model calls into, in load order. A C++ host must
# dlopen these (RTLD_GLOBAL) before torch::jit::load; their own dependencies resolve via $ORIGIN.
REQUIRED_LIBRARIES: tuple[str, ...] = (
    "fbgemm_gpu_tbe_common.so",
    "fbgemm_gpu_tbe_cache.so",
    "fbgemm_gpu_tbe_training_forward.so",
    "fbgemm_gpu_tbe_inference.so",
    "fbgemm_gpu_py.so",
)


def load_fbgemm() -> ModuleType:
    """Import fbgemm_gpu (registering its operators) or explain how to install it."""
    try:
        return importlib.import_module("fbgemm_gpu")
    except ImportError as err:
        raise ArtifactError(
            f"fbgemm_gpu is not importable ({err}); install fbgemm-gpu-cpu==1.8.0 (CPU hosts) "
            "or fbgemm-gpu==1.8.0 (CUDA hosts) next to torch 2.13.0",
            kind=ArtifactErrorKind.LIBRARY,
        ) from None


def fbgemm_version() -> str:
    for dist in ("fbgemm-gpu-cpu", "fbgemm-gpu", "fbgemm_gpu_cpu", "fbgemm_gpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def fbgemm_library_dir() -> Path:
    module = load_fbgemm()
    return Path(module.__file__ or "").resolve().parent


def required_library_paths() -> list[Path]:
    folder = fbgemm_library_dir()
    missing = [name for name in REQUIRED_LIBRARIES if not (folder / name).is_file()]
    if missing:
        raise ArtifactError(
            f"fbgemm_gpu at {folder} lacks operator libraries {missing}; reinstall it", kind=ArtifactErrorKind.LIBRARY
        )
    return [folder / name for name in REQUIRED_LIBRARIES]
