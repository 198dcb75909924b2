"""A loaded artifact: validated lookups and predictions on the scripted model."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from infer import request_rules as rules
from infer.artifact.kernels import kernel_holders
from infer.artifact.manifest import Manifest
from infer.errors import ArtifactError, ArtifactErrorKind, ConfigError, RequestError
from infer.features import SparseFeatures, check_dense_features
from infer.request_rules import REQUEST_ERROR_PREFIX

_SCRIPT_REQUEST_ERROR = re.compile(re.escape(REQUEST_ERROR_PREFIX) + "(.*)")

# False: a model on CPU runs through TorchScript's optimizing executor too (bench/warmup.py compares the two)
PLAIN_EXECUTION_ON_CPU = True


class PhaseClock:
    """Seconds spent in each named phase of a load or a warm-up, in the order they first ran: ``mark(phase)``
    charges the time since the previous mark (or the start) to ``phase``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._started = self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now

    @property
    def total(self) -> float:
        return self._last - self._started


class Runtime:
    """An exported model loaded for serving. Safe to call from several threads."""

    def __init__(self, path: Path, manifest: Manifest, module: Any, backend: str = "torchscript") -> None:
        """``module``: the scripted model (``backend="torchscript"``) or anything with the same
        ``__call__(values, lengths, weights)`` and ``predict(dense, values, lengths, weights)``
        (``infer.artifact.formats.onnx_runtime.OnnxModule`` for ``backend="onnxruntime"``)."""
        self.path = path
        self.manifest = manifest
        self.spec = manifest.spec
        self.module = module
        self.backend = backend
        self.threads = 1
        self.load_bytes = 0  # bytes of the artifact's files read and verified by ``load``
        self.load_seconds = 0.0  # how long ``load`` took, checks included
        self.load_phases: dict[str, float] = {}  # of which each phase (``infer.artifact.load``), in seconds
        self.library_seconds = 0.0  # of which loading fbgemm's libraries (the first load of a process)
        # TorchScript's optimizing executor re-plans each method of a newly loaded model on its first calls: ~0.3 s
        # of CPU per call for three calls per method (a 2-shard DLRM: 3.6 s of CPU to warm up, 4-8 s of swap delay
        # on a busy 2-core host). On CPU, where torch fuses nothing, the plan it arrives at runs no faster than the
        # unoptimized one (bench/warmup.py), so a model whose kernels are all on CPU runs unoptimized: its first
        # call of each method is its whole warm-up. CUDA models keep the optimizer (TorchScript fuses on GPUs).
        self.plain_execution = PLAIN_EXECUTION_ON_CPU and all(k.device == "cpu" for k in manifest.kernels)

    @property
    def cpu_devices(self) -> int:
        """Kernels running on CPU cores (each CPU shard is one), 0 for a CUDA model."""
        return len([k for k in self.manifest.kernels if k.device == "cpu"])

    def thread_budget(self, workers: int = 1) -> int:
        """Threads each CPU kernel may split a batch over: the cores shared by ``workers`` concurrent
        forwards of all the CPU kernels (at least 1)."""
        return max(1, (os.cpu_count() or 1) // (max(1, self.cpu_devices) * max(1, workers)))

    def set_threads(self, threads: int) -> None:
        """Let every CPU kernel split a batch over up to ``threads`` example ranges (1: one call per kernel)."""
        if threads < 1:
            raise ConfigError(f"threads must be >= 1, got {threads}")
        for holder in kernel_holders(self.module):
            holder.threads = threads
        self.threads = threads

    @property
    def feature_names(self) -> tuple[str, ...]:
        return self.spec.feature_names

    @property
    def output_dim(self) -> int:
        return self.spec.output_dim

    @property
    def has_dense(self) -> bool:
        """The model has a dense part and this backend runs it (a lookups-only model.pt2 does not)."""
        return self.manifest.has_dense and bool(getattr(self.module, "has_dense", True))

    def _features(self, batch: SparseFeatures | Mapping[str, Any]) -> SparseFeatures:
        return SparseFeatures.of(batch).validate(self.spec)

    def lookup(self, batch: SparseFeatures | Mapping[str, Any]) -> torch.Tensor:
        """Pooled embeddings ``[batch, output_dim]`` fp32, columns per feature in input order. ``batch``: a
        ``SparseFeatures``, a mapping ``{feature: bags}`` or a TorchRec ``KeyedJaggedTensor``
        (``SparseFeatures.of``; a KJT's weights are the per-id weights)."""
        features = self._features(batch)
        with torch.inference_mode():
            return self._call(self.module.forward, features.values, features.lengths, features.weights).cpu()

    def predict(self, batch: SparseFeatures | Mapping[str, Any], dense_features: torch.Tensor) -> torch.Tensor:
        """Scores float32 ``[batch]`` of the dense part for ``dense_features`` float32 ``[batch, num_dense_features]``
        and ``batch`` (every backend: the call contract, ``infer.request_rules``)."""
        if not self.has_dense:
            raise RequestError(rules.NO_DENSE_PART)
        features = self._features(batch)
        dense = check_dense_features(dense_features, features.batch_size, self.spec.num_dense_features)
        with torch.inference_mode():
            scores = self._call(self.module.predict, dense, features.values, features.lengths, features.weights)
        return self.scores(scores.cpu(), features.batch_size)

    def lookup_unchecked(
        self, values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None
    ) -> torch.Tensor:
        """``lookup`` of a batch the caller validated already (``SparseFeatures.validate``: model feature order,
        ids in range), in the tensors the kernel takes: the model's own request checks are skipped where the
        backend has an unchecked entry (a TorchScript model exported by this version); others check again."""
        method = getattr(self.module, "lookup_unchecked", None) or self.module  # else the checked call
        with torch.inference_mode():
            return self._call(method, values, lengths, weights).cpu()

    def lookup_and_predict_unchecked(
        self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pooled embeddings and float32 scores ``[batch]`` of one forward of a validated batch
        (``lookup_unchecked``)."""
        method = getattr(self.module, "lookup_and_predict_unchecked", None) or self.module.lookup_and_predict
        with torch.inference_mode():
            pooled, scores = self._call_pair(method, dense, values, lengths, weights)
        pooled = pooled.cpu()
        return pooled, self.scores(scores.cpu(), pooled.shape[0])

    def scores(self, out: torch.Tensor, batch: int) -> torch.Tensor:
        """``out`` of a backend's predict as the call contract returns it: float32 ``[batch]`` (an artifact
        exported before the contract may still give ``[batch, 1]``); anything else is the model's fault."""
        try:
            return rules.scores_of(out, batch)
        except ValueError as err:
            raise ArtifactError(
                f"{self.path}: {err}; re-export the artifact", path=str(self.path), kind=ArtifactErrorKind.MODEL
            ) from None

    def _call_pair(self, method: Any, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        pair: tuple[torch.Tensor, torch.Tensor] = self._call(method, *args)  # type: ignore[assignment]
        return pair

    def _call(self, method: Any, *args: Any) -> torch.Tensor:
        try:
            if not self.plain_execution:
                return method(*args)
            # the executor's setting is per thread: this call's (and only this call's) methods run unoptimized
            with torch.jit.optimized_execution(False):
                return method(*args)
        except (torch.jit.Error, RuntimeError) as err:  # RuntimeError: a forked device's error, via its future
            found = _SCRIPT_REQUEST_ERROR.findall(str(err))
            if found:
                raise RequestError(found[-1].strip()) from None
            raise
