"""A model's dense part from a file: a TorchScript module or a ``torch.export`` program taking
``(dense_features [B, num_dense_features], pooled [B, output_dim])``, checked before it is exported."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import torch
from torch import nn

from infer.config import ModelSpec, PoolingType
from infer.dense_layout import checked_layout, recorded_layout
from infer.errors import ConfigError

logger = logging.getLogger(__name__)

# Two batch sizes: a program specialised to one batch size fails the second call.
_PROBE_BATCHES = (2, 3)


def load_dense_arch(path: str | Path, spec: ModelSpec) -> nn.Module:
    """Load the dense part at ``path`` and check it against ``spec``: the pooled layout it records (written by
    ``infer.from_torchrec``: feature order, columns, pooling), then its call (``num_dense_features``, ``output_dim``).

    A TorchScript file is used as it is; a ``torch.export`` program (``.pt2``) is traced into TorchScript,
    since the artifact is a TorchScript archive. Raises ``ConfigError`` naming the file and the expected call.
    """
    path = Path(path)
    expected = (
        f"(dense_features [B, num_dense_features={spec.num_dense_features}], pooled [B, output_dim={spec.output_dim}])"
    )
    if not path.is_file():
        raise ConfigError(f"dense arch {str(path)!r} does not exist; give a TorchScript or torch.export file")
    if spec.num_dense_features <= 0:
        raise ConfigError(
            f"dense arch {str(path)!r} given but the spec declares no dense features; "
            "set num_dense_features in the spec to the width of the dense input"
        )
    module = _load(path, spec)
    # the recorded layout first: a spec in another order calls fine and answers wrong
    checked_layout(spec, module, f"dense arch {str(path)!r}")
    for batch in _PROBE_BATCHES:
        dense = torch.zeros(batch, spec.num_dense_features)
        pooled = torch.zeros(batch, spec.output_dim)
        try:
            with torch.no_grad():
                out = module(dense, pooled)
        except Exception as err:  # noqa: BLE001 - a wrong signature fails in many ways
            raise ConfigError(
                f"dense arch {str(path)!r} cannot be called as {expected}: {_last_line(err)}; "
                "check num_dense_features in the spec and the module's input sizes"
            ) from None
        if not isinstance(out, torch.Tensor) or out.dim() == 0 or out.size(0) != batch:
            shape = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ConfigError(
                f"dense arch {str(path)!r} returned {shape} for a batch of {batch}; it must return scores [B] or [B, k]"
            )
    return module


def recorded_pooling(path: str | Path) -> dict[str, PoolingType]:
    """Each table's pooling as the dense part at ``path`` records it (a TorchScript file saved from
    ``infer.from_torchrec(model).dense_arch``); empty when the file records none or is not TorchScript (the
    full check, ``load_dense_arch``, reports what is wrong with it later, in pipeline order)."""
    try:
        module = torch.jit.load(str(path), map_location="cpu")
    except Exception:  # noqa: BLE001 - not TorchScript (or unreadable): it records nothing we can read here
        return {}
    layout = recorded_layout(module)
    return layout.table_pooling() if layout is not None else {}


def _load(path: Path, spec: ModelSpec) -> nn.Module:
    try:
        return torch.jit.load(str(path), map_location="cpu")
    except Exception as script_err:  # noqa: BLE001 - not a TorchScript archive: try torch.export
        try:
            program = torch.export.load(str(path))
        except Exception:  # noqa: BLE001
            raise ConfigError(
                f"dense arch {str(path)!r} is neither a TorchScript file (torch.jit.save) nor a torch.export "
                f"program (torch.export.save): {str(script_err).splitlines()[0]}"
            ) from None
    example = (torch.zeros(_PROBE_BATCHES[0], spec.num_dense_features), torch.zeros(_PROBE_BATCHES[0], spec.output_dim))
    try:
        with torch.no_grad(), warnings.catch_warnings():
            # the program's own shape guards trace to constants; the probe calls below check other batch sizes
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            traced = torch.jit.trace(program.module(), example, check_trace=False)
    except Exception as err:  # noqa: BLE001
        raise ConfigError(
            f"dense arch {str(path)!r}: the torch.export program cannot be called with (dense_features "
            f"[B, {spec.num_dense_features}], pooled [B, {spec.output_dim}]) to convert it to TorchScript: "
            f"{_last_line(err)}; export it with a dynamic batch dimension (dynamic_shapes)"
        ) from None
    logger.info("dense arch %s: torch.export program traced to TorchScript", path)
    return traced


def _last_line(err: BaseException) -> str:
    """The line of an error that says what went wrong (TorchScript puts it last, after the stack)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__
