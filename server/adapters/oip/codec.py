"""Open Inference Protocol tensors <-> embserve batches: the tensor contract, shared by gRPC and REST.

Inputs, per feature ``f``: ``f__values`` (INT64/INT32 [N]), ``f__lengths`` (INT32/INT64 [B]) or ``f__offsets``
(INT32/INT64 [B+1]), optional ``f__weights`` (FP32 [N]); and ``dense_features`` (FP32 [B, num_dense]) for
models with a dense part. Outputs: ``embeddings`` (FP32 [B, output_dim], FP16 with ``output_fp16``)
and ``scores`` (FP32 [B]). Every batch ends in ``SparseFeatures.validate``; the checks that only
per-feature tensors need come first and use the same wording (``infer.request_rules``) wherever the
concatenated batch would have failed the same way.
"""

from __future__ import annotations

import enum
import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from infer import request_rules as rules
from infer.config import ModelSpec
from infer.errors import RequestError
from infer.features import SparseFeatures
from server.validated import RequestLayout, ValidatedBatch, accept

if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    raise ImportError("the Open Inference Protocol's raw tensors are little-endian; this host is not")

DATATYPES: dict[str, torch.dtype] = {
    "INT64": torch.int64,
    "INT32": torch.int32,
    "FP32": torch.float32,
    "FP16": torch.float16,
}
DATATYPE_OF = {dtype: name for name, dtype in DATATYPES.items()}
_WIDTH = {name: torch.empty(0, dtype=dtype).element_size() for name, dtype in DATATYPES.items()}
# the typed ``InferTensorContents`` field of each datatype (FP16 has none: it travels raw)
CONTENTS_FIELD = {"INT64": "int64_contents", "INT32": "int_contents", "FP32": "fp32_contents"}

VALUES, LENGTHS, OFFSETS, WEIGHTS = "values", "lengths", "offsets", "weights"
SEPARATOR = "__"
DENSE = "dense_features"
EMBEDDINGS = "embeddings"
SCORES = "scores"
FP16_PARAMETER = "output_fp16"

# the call contract's tensor behind each input role (offsets take the dtypes of lengths)
_CONTRACT_TENSOR = {VALUES: "values", LENGTHS: "lengths", OFFSETS: "lengths", WEIGHTS: "weights", DENSE: DENSE}
_ALLOWED = {
    role: tuple(name for name, dtype in DATATYPES.items() if rules.accepts_dtype(tensor, dtype))
    for role, tensor in _CONTRACT_TENSOR.items()
}


def refused_datatype(name: str, datatype: str) -> RequestError:
    """An input whose datatype the call contract refuses, in its words (``request_rules.dtype_error``) and the
    protocol's datatypes."""
    try:
        feature, role = _split_name(name)
    except RequestError:
        return RequestError(
            f"input {rules.clip(name)!r}: datatype {rules.clip(datatype)!r} is not supported; "
            f"use one of {sorted(DATATYPES)}"
        )
    allowed = _ALLOWED[role]
    return RequestError(
        f"input {rules.clip(name)!r}: {rules.dtype_error(_CONTRACT_TENSOR[role], rules.clip(datatype))} "
        f"(send {' or '.join(allowed)})",
        feature=None if role == DENSE else feature,
    )


class Mode(enum.Enum):
    """Which forward a request needs, chosen by the outputs it asks for."""

    LOOKUP = "lookup"
    PREDICT = "predict"
    BOTH = "both"


@dataclass(frozen=True)
class InputTensor:
    """One decoded input: its name, protocol datatype, shape and flat data."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: torch.Tensor  # 1-D, dtype DATATYPES[datatype]


@dataclass(frozen=True)
class RequestedOutput:
    name: str
    fp16: bool = False


@dataclass(frozen=True)
class Decoded:
    """A validated request: the batch (model order, dense features included) and what to compute."""

    batch: ValidatedBatch
    outputs: tuple[RequestedOutput, ...]
    mode: Mode


@dataclass(frozen=True)
class OutputTensor:
    name: str
    datatype: str
    shape: tuple[int, ...]
    data: torch.Tensor  # contiguous, dtype DATATYPES[datatype]

    def raw(self) -> bytes:
        return self.data.contiguous().numpy().tobytes()


# ------------------------------------------------------------------------------------------ tensors
def _checked_shape(name: str, datatype: str, shape: Iterable[int]) -> tuple[tuple[int, ...], int]:
    if datatype not in DATATYPES:
        raise refused_datatype(name, datatype)
    dims = tuple(shape)
    if dims and min(dims) < 0:
        raise RequestError(f"input {name!r}: shape {list(dims)} has a negative dimension")
    return dims, math.prod(dims)


def tensor_from_raw(name: str, datatype: str, shape: Iterable[int], raw: bytes | memoryview) -> InputTensor:
    """An input whose data came as raw little-endian bytes (gRPC raw_input_contents, REST binary data)."""
    dims, count = _checked_shape(name, datatype, shape)
    dtype = DATATYPES[datatype]
    width = _WIDTH[datatype]
    if len(raw) != count * width:
        raise RequestError(
            f"input {name!r}: {len(raw)} bytes of raw data for shape {list(dims)} {datatype} "
            f"(expected {count * width} bytes)"
        )
    # a writable copy: frombuffer over immutable bytes would share memory nobody may write
    data = torch.frombuffer(bytearray(raw), dtype=dtype) if count else torch.empty(0, dtype=dtype)
    return InputTensor(name, datatype, dims, data)


def tensor_from_values(name: str, datatype: str, shape: Iterable[int], values: Sequence[Any]) -> InputTensor:
    """An input whose data came as numbers (gRPC typed contents, REST JSON ``data``), row-major."""
    dims, count = _checked_shape(name, datatype, shape)
    dtype = DATATYPES[datatype]
    try:
        # inferred first: torch.tensor([1.5], dtype=torch.int32) would truncate to 1, a silently different id
        data = torch.tensor(values).reshape(-1) if len(values) else torch.empty(0, dtype=dtype)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        raise RequestError(f"input {name!r}: its data are not {datatype} numbers") from None
    if data.dtype == torch.bool or (data.is_floating_point() and not dtype.is_floating_point):
        raise RequestError(f"input {name!r}: its data are not {datatype} numbers (got {rules.dtype_name(data.dtype)})")
    try:
        data = data.to(dtype) if data.dtype == dtype or dtype.is_floating_point else _exact_integers(data, dtype)
    except ValueError:
        raise RequestError(f"input {name!r}: its data do not fit in {datatype}") from None
    if data.numel() != count:
        raise RequestError(f"input {name!r}: {data.numel()} elements for shape {list(dims)} (expected {count})")
    return InputTensor(name, datatype, dims, data)


def _exact_integers(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Integers as ``dtype``; ``ValueError`` when one does not fit (a cast would wrap it around)."""
    info = torch.iinfo(dtype)
    if data.numel() and (int(data.min()) < info.min or int(data.max()) > info.max):
        raise ValueError(dtype)
    return data.to(dtype)


# ------------------------------------------------------------------------------------------ inputs
# the input datatypes read in place (no input takes FP16)
_NUMPY: dict[str, np.dtype[Any]] = {"INT64": np.dtype("<i8"), "INT32": np.dtype("<i4"), "FP32": np.dtype("<f4")}


# name, datatype, shape, data: raw little-endian bytes (gRPC raw_input_contents) or an array (REST, decoded)
RawInput = tuple[str, str, Sequence[int], "bytes | np.ndarray"]


def _flat(data: bytes | np.ndarray, dtype: np.dtype[Any], count: int) -> np.ndarray | None:
    if isinstance(data, np.ndarray):
        return data.reshape(-1) if data.dtype == dtype and data.size == count else None
    if len(data) != count * dtype.itemsize:
        return None
    return np.frombuffer(data, dtype=dtype)


def accept_raw(tensors: Iterable[RawInput], layout: RequestLayout) -> ValidatedBatch | None:
    """The batch of inputs (name, datatype, shape, bytes or array) read in place, when ``validated.accept`` finds
    it plainly valid; None sends the request to ``decode_inputs``, which explains (or accepts) it."""
    count = layout.num_features
    values: list[np.ndarray | None] = [None] * count
    lengths: list[np.ndarray | None] = [None] * count
    offsets: list[np.ndarray | None] = [None] * count
    weights: list[np.ndarray | None] = [None] * count
    dense = None
    for name, datatype, shape, data in tensors:
        dtype = _NUMPY.get(datatype)
        array = _flat(data, dtype, math.prod(shape)) if dtype is not None else None
        if array is None:
            return None
        if name == DENSE:
            if datatype != "FP32" or len(shape) != 2 or dense is not None:
                return None
            dense = array.reshape(shape[0], shape[1])
            continue
        feature, _, role = name.rpartition(SEPARATOR)
        position = layout.feature_index.get(feature)
        if position is None or len(shape) != 1:
            return None
        slot = {VALUES: values, LENGTHS: lengths, OFFSETS: offsets, WEIGHTS: weights}.get(role)
        if slot is None or slot[position] is not None or (datatype == "FP32") != (role == WEIGHTS):
            return None
        slot[position] = array
    for position in range(count):
        feature_values, given = values[position], offsets[position]
        if feature_values is None:
            return None
        if given is not None:
            if lengths[position] is not None or not given.size or given[0] != 0 or given[-1] != feature_values.size:
                return None
            lengths[position] = np.diff(given)
        elif lengths[position] is None:
            return None
    weighted = any(w is not None for w in weights)
    return accept(layout, values, lengths, weights if weighted else None, dense)  # type: ignore[arg-type]


def _split_name(name: str) -> tuple[str, str]:
    if name == DENSE:
        return DENSE, DENSE
    feature, separator, role = name.rpartition(SEPARATOR)
    if not separator or not feature or role not in (VALUES, LENGTHS, OFFSETS, WEIGHTS):
        raise RequestError(
            f"unknown input tensor {name!r}; inputs are '<feature>__values', '<feature>__lengths' or "
            "'<feature>__offsets', '<feature>__weights' and 'dense_features'"
        )
    return feature, role


def _one_dim(tensor: InputTensor, feature: str) -> torch.Tensor:
    if len(tensor.shape) != 1:
        raise RequestError(f"input {tensor.name!r} must be 1-D, got shape {list(tensor.shape)}", feature=feature)
    return tensor.data


def _lengths_of(feature: str, roles: Mapping[str, InputTensor], num_values: int) -> torch.Tensor:
    if LENGTHS in roles and OFFSETS in roles:
        raise RequestError(
            f"feature {feature!r}: send '{feature}__lengths' or '{feature}__offsets', not both", feature=feature
        )
    if LENGTHS in roles:
        return _one_dim(roles[LENGTHS], feature).to(torch.int64)
    if OFFSETS not in roles:
        raise RequestError(
            f"feature {feature!r}: '{feature}__lengths' (or '{feature}__offsets') is missing", feature=feature
        )
    offsets = _one_dim(roles[OFFSETS], feature).to(torch.int64)
    if offsets.numel() == 0 or int(offsets[0]) != 0 or int(offsets[-1]) != num_values:
        first = int(offsets[0]) if offsets.numel() else None
        last = int(offsets[-1]) if offsets.numel() else None
        raise RequestError(
            f"feature {feature!r}: offsets must start at 0 and end at the {num_values} ids "
            f"(batch + 1 entries), got first {first} and last {last}",
            feature=feature,
        )
    lengths = offsets[1:] - offsets[:-1]
    if lengths.numel() and int(lengths.min()) < 0:
        bag = int(torch.nonzero(lengths < 0)[0])
        raise RequestError(rules.negative_length(feature, bag, int(lengths[bag])), feature=feature)
    return lengths


def decode_inputs(inputs: Sequence[InputTensor], spec: ModelSpec) -> tuple[SparseFeatures, torch.Tensor | None]:
    """Per-feature tensors -> one validated batch in the model's feature order, and the dense features."""
    by_feature: dict[str, dict[str, InputTensor]] = {}
    dense_input: InputTensor | None = None
    for tensor in inputs:
        feature, role = _split_name(tensor.name)
        if tensor.datatype not in _ALLOWED[role]:
            raise refused_datatype(tensor.name, tensor.datatype)
        if role == DENSE:
            if dense_input is not None:
                raise RequestError(f"input {DENSE!r} appears twice")
            dense_input = tensor
            continue
        roles = by_feature.setdefault(feature, {})
        if role in roles:
            raise RequestError(f"input {tensor.name!r} appears twice", feature=feature)
        roles[role] = tensor
    keys = tuple(by_feature)
    if not keys:
        raise RequestError(
            f"missing feature(s) {list(spec.feature_names)}; send '<feature>__values' and '<feature>__lengths' "
            "(or '__offsets') for every feature"
        )
    if set(keys) != set(spec.feature_names):
        # validate names the unknown or missing features, in the library's words
        empty = SparseFeatures(keys, torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int32))
        empty.validate(spec)
    values, lengths, weights = [], [], []
    for key in keys:
        roles = by_feature[key]
        if VALUES not in roles:
            raise RequestError(f"feature {key!r}: '{key}__values' is missing", feature=key)
        feature_values = _one_dim(roles[VALUES], key)
        values.append(feature_values)
        lengths.append(_lengths_of(key, roles, feature_values.numel()))
        weights.append(_one_dim(roles[WEIGHTS], key) if WEIGHTS in roles else None)
    features = _checked_batch(keys, values, lengths, weights)
    return features.validate(spec), _dense(dense_input, features.batch_size, spec)


def _checked_batch(
    keys: tuple[str, ...],
    values: list[torch.Tensor],
    lengths: list[torch.Tensor],
    weights: list[torch.Tensor | None],
) -> SparseFeatures:
    """The per-feature parts as one feature-major batch, once they line up feature by feature.

    Each feature is checked against its own tensors and named with its own counts: totals over the
    concatenation would hide a surplus in one feature and a shortfall in another (ids would slide into the
    wrong feature's bags) and name no feature. The lengths' bounds come before any sum, so none can wrap.
    """
    counts = [part.numel() for part in lengths]
    for key, count in zip(keys, counts):
        if count != counts[0]:
            raise RequestError(rules.bags_differ(key, count, keys[0], counts[0]), feature=key)
    num_ids = [part.numel() for part in values]
    total_ids = sum(num_ids)
    all_lengths = torch.cat(lengths)  # int64: no sum before the next two checks, so none can wrap
    if all_lengths.numel():
        shortest, longest = (int(x) for x in torch.aminmax(all_lengths))
        if shortest < 0 or longest > total_ids:
            for key, part in zip(keys, lengths):
                if part.numel() and int(part.min()) < 0:
                    bag = int(torch.nonzero(part < 0)[0])
                    raise RequestError(rules.negative_length(key, bag, int(part[bag])), feature=key)
            for key, part in zip(keys, lengths):
                if part.numel() and int(part.max()) > total_ids:
                    bag = int(torch.nonzero(part > total_ids)[0])
                    raise RequestError(rules.length_past_ids(key, bag, int(part[bag]), total_ids), feature=key)
    for key, part, count in zip(keys, lengths, num_ids):
        total = int(part.sum())
        if total != count:
            raise RequestError(rules.feature_lengths_sum(key, total, count), feature=key)
    weight = None
    if any(w is not None for w in weights):
        # an unweighted feature beside weighted ones counts each id once (weight 1)
        parts = [w if w is not None else torch.ones(v.numel()) for w, v in zip(weights, values)]
        for key, part, count in zip(keys, parts, num_ids):
            if part.numel() != count:
                raise RequestError(rules.feature_weights_count(key, part.numel(), count), feature=key)
        weight = torch.cat(parts)
    id_dtype = torch.int64 if any(v.dtype == torch.int64 for v in values) else torch.int32
    return SparseFeatures(keys, torch.cat([v.to(id_dtype) for v in values]), all_lengths.to(torch.int32), weight)


def _dense(tensor: InputTensor | None, batch: int, spec: ModelSpec) -> torch.Tensor | None:
    if tensor is None:
        return None
    num_dense = spec.num_dense_features
    if tensor.shape != (batch, num_dense):
        raise RequestError(f"input {DENSE!r}: " + rules.dense_shape(batch, num_dense, str(list(tensor.shape))))
    return tensor.data.view(batch, num_dense)


# ------------------------------------------------------------------------------------------ outputs
def choose_outputs(
    requested: Sequence[RequestedOutput], has_dense: bool, dense_given: bool, fp16: bool = False
) -> tuple[tuple[RequestedOutput, ...], Mode]:
    """The outputs to compute and the forward they need. None requested: embeddings (FP16 when the
    request says ``output_fp16``), plus scores when the request carries dense features."""
    known = (EMBEDDINGS, SCORES) if has_dense else (EMBEDDINGS,)
    if not requested:
        requested = [RequestedOutput(EMBEDDINGS, fp16)] + ([RequestedOutput(SCORES)] if dense_given else [])
    names = [o.name for o in requested]
    for name in names:
        if name not in known:
            hint = "" if has_dense else " (this model has no dense part: no scores)"
            raise RequestError(f"unknown output {name!r}; this model's outputs are {list(known)}{hint}")
    if len(set(names)) != len(names):
        raise RequestError(f"outputs {names} list a name twice")
    wants_scores = SCORES in names
    if wants_scores and not dense_given:
        raise RequestError(f"output {SCORES!r} needs the input {DENSE!r} (FP32 [batch, num_dense])")
    if not wants_scores:
        mode = Mode.LOOKUP
    else:
        mode = Mode.BOTH if EMBEDDINGS in names else Mode.PREDICT
    return tuple(requested), mode


def encode_outputs(
    outputs: Sequence[RequestedOutput], embeddings: torch.Tensor | None, scores: torch.Tensor | None
) -> list[OutputTensor]:
    encoded = []
    for output in outputs:
        if output.name == EMBEDDINGS:
            assert embeddings is not None
            data = embeddings.to(torch.float16) if output.fp16 else embeddings
            encoded.append(OutputTensor(EMBEDDINGS, DATATYPE_OF[data.dtype], tuple(data.shape), data.contiguous()))
        else:
            assert scores is not None
            flat = scores.reshape(-1).to(torch.float32).contiguous()
            encoded.append(OutputTensor(SCORES, "FP32", tuple(flat.shape), flat))
    return encoded


def parameter_flag(parameters: Mapping[str, Any], name: str) -> bool:
    """A boolean request/output parameter (gRPC InferParameter or a JSON value)."""
    value = parameters.get(name)
    if value is None:
        return False
    if hasattr(value, "WhichOneof"):
        kind = value.WhichOneof("parameter_choice")
        value = getattr(value, kind) if kind else False
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes")
    return bool(value)
