"""Export a quantized model as a self-describing TorchScript artifact, and load it back.

An artifact is a folder: ``model.pt`` (``torch.jit.script``) and ``manifest.json`` (see the README's
"Artifact format"). Export writes into a temporary sibling folder and renames it into place, so an
interrupted export never leaves a half-written artifact where a good one was.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from infer.errors import ArtifactError, ConfigError
from infer.manifest import MANIFEST_FILE, MODEL_FILE, FileEntry, Manifest
from infer.runtime import Runtime
from infer.version import __version__

logger = logging.getLogger(__name__)


def export(model: torch.nn.Module, out_dir: str | Path) -> Path:
    """Script ``model`` (from ``infer.quant.quantize``) and write the artifact to ``out_dir``.

    An existing artifact at ``out_dir`` is replaced; any other non-empty folder is left alone
    and ``ArtifactError`` is raised.
    """
    from infer.fbgemm_libs import REQUIRED_LIBRARIES, fbgemm_library_dir, fbgemm_version
    from infer.modules import EmbserveModel

    if not isinstance(model, EmbserveModel):
        raise ConfigError(f"export takes the model returned by infer.quantize(), got {type(model).__name__}")
    out_dir = Path(out_dir).absolute()
    if out_dir.exists() and (
        not out_dir.is_dir() or (any(out_dir.iterdir()) and not (out_dir / MANIFEST_FILE).exists())
    ):
        raise ArtifactError(
            f"{out_dir} exists and is not an embserve artifact; choose an empty or new folder", path=str(out_dir)
        )
    started = time.monotonic()
    try:
        scripted = torch.jit.script(model)
    except Exception as err:  # noqa: BLE001 - TorchScript reports many error types
        raise ConfigError(f"the model (or its dense_arch) cannot be scripted with torch.jit.script: {err}") from None
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        scripted.save(str(staging / MODEL_FILE))
        devices = sorted({str(b.device) for b in model.buffers()} or {"cpu"})
        manifest = Manifest(
            spec=model.spec,
            has_dense=bool(model.has_dense),
            devices=tuple(devices),
            embserve_version=__version__,
            torch_version=torch.__version__,
            fbgemm_version=fbgemm_version(),
            fbgemm_libraries=REQUIRED_LIBRARIES,
            fbgemm_library_dir=str(fbgemm_library_dir()),
            files=(FileEntry.of(staging, MODEL_FILE),),
        )
        (staging / MANIFEST_FILE).write_text(manifest.to_json(), encoding="utf-8")
        os.chmod(staging, 0o755)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.debug("exported %s in %.1fs", out_dir, time.monotonic() - started)
    return out_dir


def load(artifact_dir: str | Path) -> Runtime:
    """Verify and load an artifact; returns a ``Runtime`` with ``lookup`` and ``predict``."""
    from infer.fbgemm_libs import load_fbgemm

    folder = Path(artifact_dir)
    if not folder.is_dir():
        raise ArtifactError(f"{folder} is not a folder; pass the artifact folder written by export", path=str(folder))
    manifest = Manifest.read(folder)
    manifest.verify_files(folder)
    cuda_devices = [d for d in manifest.devices if d.startswith("cuda")]
    if cuda_devices and not torch.cuda.is_available():
        raise ArtifactError(
            f"{folder} was exported for {cuda_devices} and this host has no CUDA device; "
            "export the model for cpu to serve it here",
            path=str(folder / MANIFEST_FILE),
        )
    load_fbgemm()
    model_path = folder / manifest.model_file
    try:
        module = torch.jit.load(str(model_path))
    except Exception as err:  # noqa: BLE001 - torch raises RuntimeError and others for a bad archive
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ArtifactError(
            f"{model_path} cannot be loaded by TorchScript: {first_line}", path=str(model_path)
        ) from None
    module.eval()
    return Runtime(folder, manifest, module)
