"""Helpers of the Open Inference Protocol tests: embserve batches as tritonclient inputs, one client per protocol."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from infer.features import SparseFeatures
from tests.support.bad_requests import CORPUS_SPEC, BadRequest

PROTOCOLS = ("grpc", "http")


@dataclass(frozen=True)
class FeatureParts:
    name: str
    values: torch.Tensor
    lengths: torch.Tensor
    weights: torch.Tensor | None


def split_features(features: SparseFeatures) -> list[FeatureParts]:
    """A feature-major batch as one (values, lengths, weights) per feature, in the batch's key order."""
    batch = features.batch_size
    parts, position = [], 0
    for index, key in enumerate(features.keys):
        lengths = features.lengths[index * batch : (index + 1) * batch]
        count = int(lengths.sum())
        weights = features.weights[position : position + count] if features.weights is not None else None
        parts.append(FeatureParts(key, features.values[position : position + count], lengths, weights))
        position += count
    return parts


def triton_module(protocol: str) -> Any:
    if protocol == "grpc":
        import tritonclient.grpc as module
    else:
        import tritonclient.http as module
    return module


def make_input(protocol: str, name: str, array: np.ndarray, binary: bool = True) -> Any:
    module = triton_module(protocol)
    datatype = {np.dtype(np.int64): "INT64", np.dtype(np.int32): "INT32", np.dtype(np.float32): "FP32"}[array.dtype]
    tensor = module.InferInput(name, list(array.shape), datatype)
    if protocol == "http":
        tensor.set_data_from_numpy(array, binary_data=binary)
    else:
        tensor.set_data_from_numpy(array)
    return tensor


def triton_inputs(
    protocol: str,
    features: SparseFeatures,
    dense: torch.Tensor | None = None,
    offsets: bool = False,
    binary: bool = True,
) -> list[Any]:
    """tritonclient InferInputs of a batch: ``<f>__values``, ``<f>__lengths`` (or ``__offsets``), ``__weights``."""
    inputs = []
    for part in split_features(features):
        inputs.append(make_input(protocol, f"{part.name}__values", part.values.numpy(), binary))
        if offsets:
            ends = torch.cumsum(part.lengths.to(torch.int64), 0)
            offs = torch.cat([torch.zeros(1, dtype=torch.int64), ends]).to(torch.int32)
            inputs.append(make_input(protocol, f"{part.name}__offsets", offs.numpy(), binary))
        else:
            inputs.append(make_input(protocol, f"{part.name}__lengths", part.lengths.numpy(), binary))
        if part.weights is not None:
            inputs.append(make_input(protocol, f"{part.name}__weights", part.weights.numpy(), binary))
    if dense is not None:
        inputs.append(make_input(protocol, "dense_features", dense.numpy(), binary))
    return inputs


def requested(protocol: str, *names: str, binary: bool = True) -> list[Any]:
    module = triton_module(protocol)
    if protocol == "grpc":
        return [module.InferRequestedOutput(name) for name in names]
    return [module.InferRequestedOutput(name, binary) for name in names]


def client(protocol: str, address: str, **kwargs: Any) -> Any:
    return triton_module(protocol).InferenceServerClient(address, **kwargs)


def corpus_inputs(protocol: str, case: BadRequest) -> list[Any]:
    """A corpus case (feature-major values/lengths/weights) as per-feature tensors.

    Lengths go to the features in equal chunks (the first feature takes the larger one), ids follow
    the non-negative lengths of each feature and the last feature takes what is left over (or falls
    short); weights are split like the ids. So every inconsistency of the case stays in the request.
    """
    keys = CORPUS_SPEC.feature_names
    chunk = -(-case.lengths.numel() // len(keys))
    inputs, position, weight_position = [], 0, 0
    for index, key in enumerate(keys):
        lengths = case.lengths[index * chunk : (index + 1) * chunk]
        last = index == len(keys) - 1
        count = int(lengths.to(torch.int64).clamp(min=0).sum())
        values = case.values[position:] if last else case.values[position : position + count]
        position += values.numel()
        inputs.append(make_input(protocol, f"{key}__values", values.numpy()))
        inputs.append(make_input(protocol, f"{key}__lengths", lengths.numpy()))
        if case.weights is not None:
            end = None if last else weight_position + count
            weights = case.weights[weight_position:end]
            weight_position += weights.numel()
            inputs.append(make_input(protocol, f"{key}__weights", weights.numpy()))
    return inputs
