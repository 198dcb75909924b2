"""The onnxruntime backend: an artifact's ``model.onnx`` run by onnxruntime behind the same ``Runtime`` API.

``OnnxModule`` stands where the scripted model stands: ``module(values, lengths, weights)`` and
``module.predict(dense_features, values, lengths, weights)`` validate the request with the same rules
(``SparseFeatures.validate``, the ``request_rules`` wording) and raise ``RequestError`` before
onnxruntime sees it, then return torch tensors. Nothing here imports fbgemm: a host serves the ONNX
model with torch, onnx's runtime and embserve alone.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from infer import request_rules as rules
from infer.artifact.manifest import Manifest
from infer.artifact.runtime import Runtime
from infer.config import ModelSpec
from infer.errors import ArtifactError, ArtifactErrorKind, RequestError
from infer.features import SparseFeatures, check_dense_features

logger = logging.getLogger(__name__)

BACKEND = "onnxruntime"


class OnnxModule:
    """A module-like wrapper of one onnxruntime session (thread-safe: sessions run concurrently)."""

    def __init__(self, session: Any, spec: ModelSpec, has_dense: bool) -> None:
        self.session = session
        self.spec = spec
        self.has_dense = has_dense

    def _feeds(self, values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None) -> dict[str, Any]:
        features = SparseFeatures.from_tensors(self.spec.feature_names, values, lengths, weights).validate(self.spec)
        feeds: dict[str, Any] = {
            "values": features.values.to(torch.int64).contiguous().cpu().numpy(),
            "lengths": features.lengths.to(torch.int32).contiguous().cpu().numpy(),
        }
        if features.weights is not None:
            feeds["weights"] = features.weights.contiguous().cpu().numpy()
        return feeds

    def forward(self, values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """Pooled embeddings ``[batch, output_dim]`` fp32 (validated first)."""
        feeds = self._feeds(values, lengths, weights)
        if self.has_dense:  # the graph computes scores too; a lookup feeds zeros (the dense part is small)
            batch = feeds["lengths"].size // len(self.spec.features)
            feeds["dense_features"] = np.zeros((batch, self.spec.num_dense_features), dtype=np.float32)
        return torch.from_numpy(self.session.run(["embeddings"], feeds)[0])

    __call__ = forward

    def predict(
        self,
        dense_features: torch.Tensor,
        values: torch.Tensor,
        lengths: torch.Tensor,
        weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Scores of the dense part float32 ``[batch]`` (validated first)."""
        return self.lookup_and_predict(dense_features, values, lengths, weights)[1]

    def lookup_and_predict(
        self,
        dense_features: torch.Tensor,
        values: torch.Tensor,
        lengths: torch.Tensor,
        weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pooled embeddings ``[batch, output_dim]`` and scores ``[batch]`` of one graph run."""
        if not self.has_dense:
            raise RequestError(rules.NO_DENSE_PART)
        feeds = self._feeds(values, lengths, weights)
        batch = feeds["lengths"].size // len(self.spec.features)
        dense = check_dense_features(dense_features, batch, self.spec.num_dense_features)
        feeds["dense_features"] = dense.cpu().numpy()
        pooled, scores = self.session.run(["embeddings", "scores"], feeds)
        return torch.from_numpy(pooled), rules.scores_of(torch.from_numpy(np.asarray(scores)), batch)


def load_onnx(folder: Path, manifest: Manifest, intra_op_threads: int | None = None) -> Runtime:
    """The ``Runtime`` of an already verified artifact (manifest read, checksums checked) on onnxruntime."""
    entry = manifest.onnx
    if entry is None:
        raise ArtifactError(
            f"{folder} has no ONNX model; re-export it with infer.export(..., onnx=True) or `embserve export --onnx`",
            path=str(folder),
            kind=ArtifactErrorKind.MODEL,
        )
    try:
        import onnxruntime as ort
    except ImportError as err:
        raise ArtifactError(
            f"onnxruntime is not importable ({err}); install the extra: pip install 'embserve[onnx]'",
            kind=ArtifactErrorKind.LIBRARY,
        ) from None
    options = ort.SessionOptions()
    options.log_severity_level = 3  # the overridable `weights` initializer draws a warning on every load
    # Idle intra-op threads sleep instead of spinning: a server runs several forwards at once and a
    # host shares its cores (bench: 2 spinning threads ran 1.6x slower than 2 sleeping ones on a busy host).
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if intra_op_threads:
        options.intra_op_num_threads = intra_op_threads
    model_path = folder / entry.model_file
    try:
        session = ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
    except Exception as err:  # noqa: BLE001 - onnxruntime raises its own error types for a bad model
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ArtifactError(
            f"{model_path} cannot be loaded by onnxruntime {ort.__version__}: {first_line}",
            path=str(model_path),
            kind=ArtifactErrorKind.MODEL,
        ) from None
    logger.debug("onnxruntime %s loaded %s", ort.__version__, model_path)
    return Runtime(folder, manifest, OnnxModule(session, manifest.spec, manifest.has_dense), backend=BACKEND)
