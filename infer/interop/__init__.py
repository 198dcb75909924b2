"""Interop with training frameworks: TorchRec models, state dicts and DCP checkpoints (torchrec imported lazily)."""

from infer.interop.torchrec import (
    ImportedModel,
    QuantizedRows,
    from_torchrec,
    load_torchrec_checkpoint,
    spec_from_checkpoint,
)

__all__ = ["ImportedModel", "QuantizedRows", "from_torchrec", "load_torchrec_checkpoint", "spec_from_checkpoint"]
