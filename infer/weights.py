"""fp32 table weights: loading a ``{table: tensor}`` checkpoint, checking it against a spec, seeded random tables."""

from __future__ import annotations

import pickle
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from infer.config import ModelSpec
from infer.errors import WeightsError

# A table's weight in any TorchRec state dict: DLRM's ``sparse_arch.embedding_bag_collection.`` prefix,
# DMP's stripped wrapper, a user's own module path: only the tail is fixed.
TORCHREC_TABLE_KEY = re.compile(r"(?:^|\.)embedding_bags\.(?P<table>.+)\.weight$")
# Terminal colour codes: torch's weights-only unpickler puts them in its message.
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# What torch's weights-only unpickler says when the file holds a pickled object, not tensors.
_PICKLED_CLASS = re.compile(r"Unsupported global: GLOBAL (?P<cls>[\w.]+)")


def random_weights(spec: ModelSpec, seed: int = 0, std: float = 1.0) -> dict[str, torch.Tensor]:
    """Seeded N(0, std²) fp32 weights for every table of ``spec``."""
    generator = torch.Generator().manual_seed(seed)
    return {t.name: torch.randn(t.num_embeddings, t.embedding_dim, generator=generator) * std for t in spec.tables}


def check_weights(spec: ModelSpec, weights: Mapping[str, torch.Tensor]) -> None:
    """Raise ``WeightsError`` unless ``weights`` holds one float [rows, dim] tensor per table."""
    check_table_names(spec, list(weights))
    for table in spec.tables:
        weight = weights[table.name]
        if not isinstance(weight, torch.Tensor):
            raise WeightsError(f"table {table.name!r}: weight is a {type(weight).__name__}, expected a tensor")
        check_table_shape(table.name, (table.num_embeddings, table.embedding_dim), tuple(weight.shape), weight.dtype)


def check_table_names(spec: ModelSpec, names: Sequence[str]) -> None:
    """Raise ``WeightsError`` unless ``names`` (a checkpoint's tables) are exactly the spec's tables."""
    expected = [t.name for t in spec.tables]
    missing = [n for n in expected if n not in names]
    unknown = [n for n in names if n not in expected]
    if missing or unknown:
        raise WeightsError(
            f"checkpoint tables do not match the spec: {table_mismatch(missing, unknown)}; the spec has {expected}"
        )


def check_table_shape(name: str, expected: tuple[int, int], shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Raise ``WeightsError`` unless a table's stored weight is floating point of the spec's shape."""
    if shape != expected:
        raise WeightsError(
            f"table {name!r}: weight shape {list(shape)} does not match the spec's "
            f"[num_embeddings, embedding_dim] = {list(expected)}"
        )
    if not dtype.is_floating_point:
        raise WeightsError(f"table {name!r}: weight dtype {dtype} is not floating point")


def table_mismatch(missing: Sequence[str], unknown: Sequence[str]) -> str:
    """``missing [...], not in the spec [...]`` with the empty part left out (one wording for every checkpoint)."""
    parts = [f"missing {list(missing)}"] if missing else []
    parts += [f"not in the spec {list(unknown)}"] if unknown else []
    return ", ".join(parts)


def load_tensor_file(path: Path, what: str) -> Any:
    """``torch.load`` a checkpoint safely: ``weights_only``, memory-mapped when the file allows (legacy non-zip
    files cannot be), every failure a ``WeightsError`` naming ``what`` and the file."""
    try:
        try:
            return torch.load(path, weights_only=True, mmap=True, map_location="cpu")
        except RuntimeError:
            return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as err:
        raise WeightsError(_pickled_object_message(path, what, _plain(err))) from None
    except Exception as err:  # noqa: BLE001 - torch raises many types for a bad file
        raise WeightsError(f"cannot load {what} {str(path)!r}: {_plain(err).splitlines()[0]}") from None


def _plain(err: BaseException) -> str:
    """An error's text without terminal colour codes."""
    return _ANSI.sub("", str(err)).strip() or type(err).__name__


def _pickled_object_message(path: Path, what: str, detail: str) -> str:
    """A file the weights-only loader refuses holds pickled objects (``torch.save(model)``), not tensors."""
    found = _PICKLED_CLASS.search(detail)
    holds = f"a pickled {found['cls']} object" if found else "pickled Python objects"
    return (
        f"cannot load {what} {str(path)!r}: it holds {holds} (torch.save(model)?), not a state dict; embserve "
        "reads a state dict (a dict of tensors) or a DCP folder and never runs pickled code: save one with "
        "torch.save(model.state_dict(), path)"
    )


def load_checkpoint(path: str | Path, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Load ``{table_name: fp32 tensor}`` safely (``weights_only``, memory-mapped) and check it."""
    path = Path(path)
    if not path.is_file():
        raise WeightsError(f"weights checkpoint {str(path)!r} does not exist")
    data = load_tensor_file(path, "weights checkpoint")
    if not isinstance(data, Mapping):
        raise WeightsError(f"{str(path)!r} holds a {type(data).__name__}; expected a dict of table name -> tensor")
    weights = dict(data)
    refuse_torchrec_keys(path, spec, weights)
    check_weights(spec, weights)
    return weights


def refuse_torchrec_keys(path: Path, spec: ModelSpec, keys: Iterable[Any]) -> None:
    """A TorchRec state dict (``...embedding_bags.<table>.weight`` keys) is read by the TorchRec importer: say so."""
    names = {t.name for t in spec.tables}
    keys = list(keys)
    if names <= set(keys):
        return
    torchrec_keys = [key for key in keys if TORCHREC_TABLE_KEY.search(str(key))]
    if torchrec_keys:
        raise WeightsError(
            f"{str(path)!r} is a TorchRec state dict (keys like {torchrec_keys[0]!r}), not a "
            "{table_name: tensor} checkpoint; pass it with --from-torchrec instead of --weights "
            "(Python: infer.load_torchrec_checkpoint(path, spec))"
        )
