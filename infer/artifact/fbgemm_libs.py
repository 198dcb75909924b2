"""Lazy access to fbgemm_gpu: the import itself, and the shared libraries an exported model needs.

Nothing else in ``infer`` imports fbgemm at module level, so ``import infer`` stays light.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import threading
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


# False: ``load_operators`` imports the whole package instead (bench/warmup.py compares the two)
OPERATORS_ONLY = True
_operators_loaded = False
_operators_lock = threading.Lock()


def _not_installed(why: object) -> ArtifactError:
    return ArtifactError(
        f"fbgemm_gpu is not importable ({why}); install fbgemm-gpu-cpu==1.8.0 (CPU hosts) "
        "or fbgemm-gpu==1.8.0 (CUDA hosts) next to torch 2.13.0",
        kind=ArtifactErrorKind.LIBRARY,
    )


def load_fbgemm() -> ModuleType:
    """Import fbgemm_gpu (registering its operators) or explain how to install it."""
    try:
        return importlib.import_module("fbgemm_gpu")
    except ImportError as err:
        raise _not_installed(err) from None


def load_operators() -> None:
    """Register the operators a scripted model calls (``REQUIRED_LIBRARIES``, as a C++ host loads them) without
    importing the fbgemm_gpu package: its Python half (sparse_ops and what it imports: sympy, torch.export, the
    decompositions) took 0.5 s of CPU (1.7 s on a busy 2-core host) against 0.01 s for the libraries, and a
    TorchScript model needs none of it. Loading a library twice (a later ``import fbgemm_gpu``) is harmless."""
    global _operators_loaded
    if _operators_loaded:
        return
    if not OPERATORS_ONLY:
        load_fbgemm()
        return
    import torch

    with _operators_lock:
        if _operators_loaded:
            return
        for path in required_library_paths():
            try:
                torch.ops.load_library(str(path))
            except OSError as err:
                raise ArtifactError(
                    f"fbgemm's operator library {path} does not load ({err}); reinstall fbgemm-gpu-cpu==1.8.0 "
                    "(CPU hosts) or fbgemm-gpu==1.8.0 (CUDA hosts) next to torch 2.13.0",
                    kind=ArtifactErrorKind.LIBRARY,
                ) from None
        _operators_loaded = True


def fbgemm_version() -> str:
    for dist in ("fbgemm-gpu-cpu", "fbgemm-gpu", "fbgemm_gpu_cpu", "fbgemm_gpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def fbgemm_library_dir() -> Path:
    """The installed fbgemm_gpu package's folder, which holds its libraries (found without importing it)."""
    try:
        found = importlib.util.find_spec("fbgemm_gpu")
    except (ImportError, ValueError) as err:
        raise _not_installed(err) from None
    locations = list(found.submodule_search_locations or []) if found is not None else []
    if not locations:
        raise _not_installed("no package named fbgemm_gpu")
    return Path(locations[0]).resolve()


def required_library_paths() -> list[Path]:
    folder = fbgemm_library_dir()
    missing = [name for name in REQUIRED_LIBRARIES if not (folder / name).is_file()]
    if missing:
        raise ArtifactError(
            f"fbgemm_gpu at {folder} lacks operator libraries {missing}; reinstall it", kind=ArtifactErrorKind.LIBRARY
        )
    return [folder / name for name in REQUIRED_LIBRARIES]
