"""The backends ``load`` runs an artifact on; torch-free, so ``embserve``'s parser offers them without torch."""

from __future__ import annotations

BACKENDS = ("torchscript", "onnxruntime", "pt2")
