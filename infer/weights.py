"""fp32 table weights: loading a ``{table: tensor}`` checkpoint, checking it against a spec, seeded random tables."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from infer.config import ModelSpec
from infer.errors import WeightsError


def random_weights(spec: ModelSpec, seed: int = 0, std: float = 1.0) -> dict[str, torch.Tensor]:
    """Seeded N(0, std²) fp32 weights for every table of ``spec``."""
    generator = torch.Generator().manual_seed(seed)
    return {t.name: torch.randn(t.num_embeddings, t.embedding_dim, generator=generator) * std for t in spec.tables}


def check_weights(spec: ModelSpec, weights: Mapping[str, torch.Tensor]) -> None:
    """Raise ``WeightsError`` unless ``weights`` holds one float [rows, dim] tensor per table."""
    names = [t.name for t in spec.tables]
    missing = [n for n in names if n not in weights]
    unknown = [n for n in weights if n not in names]
    if missing or unknown:
        raise WeightsError(
            f"checkpoint tables do not match the spec: missing {missing}, unknown {unknown}; the spec has {names}"
        )
    for table in spec.tables:
        weight = weights[table.name]
        if not isinstance(weight, torch.Tensor):
            raise WeightsError(f"table {table.name!r}: weight is a {type(weight).__name__}, expected a tensor")
        expected = (table.num_embeddings, table.embedding_dim)
        if tuple(weight.shape) != expected:
            raise WeightsError(
                f"table {table.name!r}: weight shape {list(weight.shape)} does not match the spec's "
                f"[num_embeddings, embedding_dim] = {list(expected)}"
            )
        if not weight.is_floating_point():
            raise WeightsError(f"table {table.name!r}: weight dtype {weight.dtype} is not floating point")


def load_tensor_file(path: Path, what: str) -> Any:
    """``torch.load`` a checkpoint safely: ``weights_only``, memory-mapped when the file allows (legacy non-zip
    files cannot be), every failure a ``WeightsError`` naming ``what`` and the file."""
    try:
        try:
            return torch.load(path, weights_only=True, mmap=True, map_location="cpu")
        except RuntimeError:
            return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as err:  # noqa: BLE001 - torch raises many types for a bad file
        raise WeightsError(f"cannot load {what} {str(path)!r}: {err}") from None


def load_checkpoint(path: str | Path, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Load ``{table_name: fp32 tensor}`` safely (``weights_only``, memory-mapped) and check it."""
    path = Path(path)
    if not path.is_file():
        raise WeightsError(f"weights checkpoint {str(path)!r} does not exist")
    data = load_tensor_file(path, "weights checkpoint")
    if not isinstance(data, Mapping):
        raise WeightsError(f"{str(path)!r} holds a {type(data).__name__}; expected a dict of table name -> tensor")
    weights = dict(data)
    check_weights(spec, weights)
    return weights
