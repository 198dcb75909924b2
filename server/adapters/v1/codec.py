"""Wire <-> tensors: decode requests into validated ``SparseFeatures``, encode pooled outputs.

Both request forms end in the same validation as the library (``SparseFeatures.validate``), so a
bad request is a ``RequestError`` naming the feature before any kernel runs.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch

from infer import request_rules as rules
from infer.config import ModelSpec
from infer.errors import RequestError
from infer.features import SparseFeatures
from server.proto import inference_pb2 as pb
from server.validated import RequestLayout, ValidatedBatch, accept

if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    raise ImportError("embserve's packed wire format is little-endian; this host is not")

_ID_WIDTH = {pb.ID_TYPE_INT64: (8, torch.int64), pb.ID_TYPE_INT32: (4, torch.int32)}
_ID_NUMPY: dict[int, np.dtype[Any]] = {pb.ID_TYPE_INT64: np.dtype("<i8"), pb.ID_TYPE_INT32: np.dtype("<i4")}


def decode_batch(
    message: pb.SparseFeatures, dense: bytes | None, layout: RequestLayout, spec: ModelSpec
) -> ValidatedBatch:
    """A request's sparse part (and ``dense``: the Predict's dense_features bytes), validated once: the packed
    form in the model's feature order is read in place (``validated.accept``); anything else, or anything it
    does not plainly accept, takes ``decode_sparse``, which names what is wrong."""
    fast = _accept_packed(message, dense, layout)
    if fast is not None:
        return fast
    features = decode_sparse(message, spec)
    dense_features = None if dense is None else decode_dense(dense, features.batch_size, spec.num_dense_features)
    return ValidatedBatch.of_features(features, dense_features)


def _accept_packed(message: pb.SparseFeatures, dense: bytes | None, layout: RequestLayout) -> ValidatedBatch | None:
    if message.WhichOneof("form") != "packed":
        return None
    packed = message.packed
    id_dtype = _ID_NUMPY.get(packed.id_type)
    if id_dtype is None or tuple(packed.feature_order) != layout.feature_names:
        return None
    ids, lengths, weights = packed.ids, packed.lengths, packed.weights
    if len(ids) % id_dtype.itemsize or len(lengths) % 4 or len(weights) % 4:
        return None
    dense_array = None
    if dense is not None:
        if len(dense) % 4 or not layout.num_dense_features or (len(dense) // 4) % layout.num_dense_features:
            return None
        dense_array = np.frombuffer(dense, dtype="<f4").reshape(-1, layout.num_dense_features)
    return accept(
        layout,
        [np.frombuffer(ids, dtype=id_dtype)],
        [np.frombuffer(lengths, dtype="<i4")],
        [np.frombuffer(weights, dtype="<f4")] if weights else None,
        dense_array,
    )


def _array(data: bytes, dtype: torch.dtype, width: int, what: str) -> torch.Tensor:
    if len(data) % width:
        raise RequestError(f"{what} has {len(data)} bytes, not a multiple of {width} ({dtype} values)")
    if not data:
        return torch.empty(0, dtype=dtype)
    # a writable copy: frombuffer over immutable bytes would share memory the caller cannot write
    return torch.frombuffer(bytearray(data), dtype=dtype)


def decode_sparse(message: pb.SparseFeatures, spec: ModelSpec) -> SparseFeatures:
    """A request's sparse part, validated and in the model's feature order."""
    form = message.WhichOneof("form")
    if form == "packed":
        packed = message.packed
        if packed.id_type not in _ID_WIDTH:
            raise RequestError(f"unknown id_type {packed.id_type}; use ID_TYPE_INT64 or ID_TYPE_INT32")
        width, id_dtype = _ID_WIDTH[packed.id_type]
        keys = tuple(packed.feature_order)
        if not keys:
            raise RequestError("packed.feature_order is empty; list the features of `lengths` in order")
        features = SparseFeatures(
            keys,
            _array(packed.ids, id_dtype, width, "packed.ids"),
            _array(packed.lengths, torch.int32, 4, "packed.lengths"),
            _array(packed.weights, torch.float32, 4, "packed.weights") if packed.weights else None,
        )
    elif form == "typed":
        typed = message.typed.features
        if not typed:
            raise RequestError("typed.features is empty")
        keys = tuple(typed)
        first = len(typed[keys[0]].lengths)
        for key in keys:
            if len(typed[key].lengths) != first:
                bags = len(typed[key].lengths)
                raise RequestError(rules.bags_differ(rules.clip(key), bags, rules.clip(keys[0]), first), feature=key)
        weighted = any(len(typed[k].weights) for k in keys)
        for key in keys:
            # per feature: in the concatenation, a surplus in one feature and a shortfall in another
            # would cancel out and shift ids (or weights) into the wrong feature's bags
            bags = typed[key]
            num_ids, total = len(bags.ids), sum(bags.lengths)
            if total != num_ids and min(bags.lengths, default=0) >= 0:  # validate names a negative length
                raise RequestError(rules.feature_lengths_sum(rules.clip(key), total, num_ids), feature=key)
            if weighted and len(bags.weights) != num_ids:
                raise RequestError(
                    rules.feature_weights_count(rules.clip(key), len(bags.weights), num_ids) + " (or weight none)",
                    feature=key,
                )
        features = SparseFeatures(
            keys,
            torch.cat([torch.tensor(typed[k].ids, dtype=torch.int64) for k in keys]),
            torch.cat([torch.tensor(typed[k].lengths, dtype=torch.int32) for k in keys]),
            torch.cat([torch.tensor(typed[k].weights, dtype=torch.float32) for k in keys]) if weighted else None,
        )
    else:
        raise RequestError("request carries no sparse features (set sparse.typed or sparse.packed)")
    return features.validate(spec)


def decode_dense(data: bytes, batch_size: int, num_dense: int) -> torch.Tensor:
    dense = _array(data, torch.float32, 4, "dense_features")
    if dense.numel() != batch_size * num_dense:
        raise RequestError(
            f"dense_features holds {dense.numel()} floats; expected batch {batch_size} x {num_dense} features"
        )
    return dense.view(batch_size, num_dense)


def column_ranges(spec: ModelSpec) -> list[pb.ColumnRange]:
    return [pb.ColumnRange(feature=f.name, start=f.column_start, end=f.column_end) for f in spec.features]


def encode_embeddings(pooled: torch.Tensor, output_type: int) -> bytes:
    if output_type == pb.OUTPUT_TYPE_FP16:
        return pooled.to(torch.float16).contiguous().numpy().tobytes()
    if output_type != pb.OUTPUT_TYPE_FP32:
        raise RequestError(f"unknown output_type {output_type}; use OUTPUT_TYPE_FP32 or OUTPUT_TYPE_FP16")
    return pooled.contiguous().numpy().tobytes()


_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def encode_packed(features: SparseFeatures) -> pb.SparseFeatures:
    """The packed wire form of a batch (what the client sends).

    Ids go as int32 whenever they fit (tables have fewer than 2**31 rows, so valid ids always do):
    half the bytes of int64 on the wire, and the kernel takes int32 ids as they are.
    """
    values = features.values
    if values.dtype == torch.int64 and values.numel():
        low, high = torch.aminmax(values)
        if _INT32_MIN <= int(low) and int(high) <= _INT32_MAX:
            values = values.to(torch.int32)
    id_type = pb.ID_TYPE_INT32 if values.dtype == torch.int32 else pb.ID_TYPE_INT64
    packed = pb.PackedFeatures(
        feature_order=list(features.keys),
        lengths=_int32_lengths(features.lengths).contiguous().numpy().tobytes(),
        ids=values.contiguous().numpy().tobytes(),
        id_type=id_type,
        weights=features.weights.contiguous().numpy().tobytes() if features.weights is not None else b"",
    )
    return pb.SparseFeatures(packed=packed)


def _int32_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """Lengths as the packed form carries them (int32); an int64 length beyond int32 is refused, not wrapped
    around into a plausible one."""
    if lengths.dtype == torch.int64 and lengths.numel():
        low, high = (int(x) for x in torch.aminmax(lengths))
        if low < _INT32_MIN or high > _INT32_MAX:
            raise RequestError(
                rules.dtype_error("lengths", f"int64 values in [{low}, {high}]")
                + "; the packed form carries int32 lengths and no bag is that long"
            )
    return lengths.to(torch.int32)


def encode_typed(features: SparseFeatures) -> pb.SparseFeatures:
    """The typed wire form of a batch (friendlier, slower)."""
    typed = pb.TypedFeatures()
    batch = features.batch_size
    lengths = features.lengths.tolist()
    values = features.values.tolist()
    weights = features.weights.tolist() if features.weights is not None else None
    position = 0
    for f, key in enumerate(features.keys):
        bag_lengths = lengths[f * batch : (f + 1) * batch]
        count = sum(bag_lengths)
        entry = typed.features[key]
        entry.lengths.extend(bag_lengths)
        entry.ids.extend(values[position : position + count])
        if weights is not None:
            entry.weights.extend(weights[position : position + count])
        position += count
    return pb.SparseFeatures(typed=typed)


def decode_embeddings(response: pb.LookupResponse) -> torch.Tensor:
    """The pooled output of a response as a float32 tensor ``[batch, dim]``."""
    dtype = torch.float16 if response.output_type == pb.OUTPUT_TYPE_FP16 else torch.float32
    flat = torch.frombuffer(bytearray(response.embeddings), dtype=dtype) if response.embeddings else torch.empty(0)
    return flat.view(response.batch_size, response.dim).to(torch.float32)
